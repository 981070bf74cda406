"""OpenAI response and stream-chunk dicts, in the exact shapes the official clients parse."""

from __future__ import annotations

import math
from typing import Any, Callable

import paxserve
from paxserve.outputs import Logprob

# OpenAI clients expect a string here (or no field at all), never null.
SYSTEM_FINGERPRINT = f"fp_paxserve_{paxserve.__version__}"

# JSON has no -inf; vLLM sends this floor instead.
_LOGPROB_FLOOR = -9999.0


def _lp(value: float) -> float:
    return value if math.isfinite(value) else _LOGPROB_FLOOR


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, details: bool = True) -> dict[str, Any]:
    """OpenAI's usage object; `cached_tokens` are prompt tokens served from the prefix cache, reported
    as `prompt_tokens_details` with `details` (vLLM: only under --enable-prompt-tokens-details)."""
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens} if details else None}


def _token_str(token_id: int, lp: Logprob, as_ids: bool = False) -> str:
    """The token as text, or as "token_id:{id}" (vLLM's return_tokens_as_token_ids, and a token
    without text)."""
    return lp.decoded_token if lp.decoded_token is not None and not as_ids else f"token_id:{token_id}"


def completion_logprobs(entries: list[dict[int, Logprob] | None], token_ids: list[int], text_offset: int,
                        decode: Callable[[int], str] | None = None, as_ids: bool = False) -> dict[str, Any]:
    """The legacy completions format: tokens, token_logprobs, top_logprobs (dicts), text_offset. An
    entry of None (the first echoed prompt token: nothing precedes it) has null logprobs, as in
    OpenAI's echo; its text comes from `decode`."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        if entry is None:
            text = decode(token_id) if decode is not None and not as_ids else f"token_id:{token_id}"
            tokens.append(text)
            token_logprobs.append(None)
            top.append(None)
        else:
            sampled = entry[token_id]
            text = _token_str(token_id, sampled, as_ids)
            tokens.append(text)
            token_logprobs.append(_lp(sampled.logprob))
            ranked = sorted(entry.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0))
            top.append({_token_str(t, lp, as_ids): _lp(lp.logprob) for t, lp in ranked})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def vllm_prompt_logprobs(entries: list[dict[int, Logprob] | None] | None) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs` field: per prompt token, null or {token id: {logprob, rank, decoded_token}}."""
    if entries is None:
        return None
    return [None if e is None else {str(t): {"logprob": _lp(lp.logprob), "rank": lp.rank,
                                             "decoded_token": lp.decoded_token} for t, lp in e.items()}
            for e in entries]


def _chat_token(token_id: int, lp: Logprob, as_ids: bool = False) -> dict[str, Any]:
    text = _token_str(token_id, lp, as_ids)
    return {"token": text, "logprob": _lp(lp.logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(entries: list[dict[int, Logprob]], token_ids: list[int], top_k: int,
                  as_ids: bool = False, chosen: list[int] | None = None) -> dict[str, Any]:
    """`chosen`: vLLM's logprob_token_ids, listed (in their order) instead of the top `top_k`."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        item = _chat_token(token_id, entry[token_id], as_ids)
        if chosen:
            alternatives = [(t, entry[t]) for t in chosen if t in entry]
        else:
            alternatives = sorted((kv for kv in entry.items() if kv[1].rank is not None and
                                   (top_k < 0 or kv[1].rank <= top_k)), key=lambda kv: kv[1].rank)
        item["top_logprobs"] = [_chat_token(t, lp, as_ids) for t, lp in alternatives]
        content.append(item)
    return {"content": content}


def completion_choice(index: int, text: str, logprobs: dict | None, finish_reason: str | None,
                      stop_reason: int | str | None = None, prompt_logprobs: list | None = None) -> dict[str, Any]:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
              "stop_reason": stop_reason}
    if prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs
    return choice


def chat_choice(index: int, message: dict[str, Any], logprobs: dict | None, finish_reason: str | None,
                stop_reason: int | str | None = None) -> dict[str, Any]:
    """`message` as ChatOutputParsers.message builds it (content, reasoning, tool_calls)."""
    if message.get("tool_calls") and finish_reason == "stop":
        finish_reason = "tool_calls"
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def chat_chunk_choice(index: int, delta: dict[str, Any], logprobs: dict | None, finish_reason: str | None,
                      stop_reason: int | str | None = None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def response(kind: str, request_id: str, created: int, model: str, choices: list[dict],
             usage_: dict[str, Any] | None, chunk: bool = False, with_usage: bool = True) -> dict[str, Any]:
    """A whole response (chunk=False) or one stream chunk, for kind "completion" or "chat". Chunks
    carry a `usage` field (null until the last) only when the client asked for usage."""
    if kind == "chat":
        obj = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        obj = "text_completion"
    out: dict[str, Any] = {"id": request_id, "object": obj, "created": created, "model": model, "choices": choices}
    out["system_fingerprint"] = SYSTEM_FINGERPRINT
    if not chunk or with_usage:
        out["usage"] = usage_
    return out
