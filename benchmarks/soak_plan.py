"""The soak's requests: what each one asks (a seeded ShareGPT-like mix of endpoints, streaming, n,
logprobs, ignore_eos and deliberate cuts) and what a correct answer to it must look like."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from workload import SHAREGPT_MEAN_INPUT, SHAREGPT_MEAN_OUTPUT, clip_lengths, lognormal_lengths, random_prompts

P_CHAT, P_NO_STREAM, P_N2, P_LOGPROBS, P_IGNORE_EOS, P_CUT_BY_EVENTS = 0.5, 0.15, 0.1, 0.15, 0.5, 0.5
CHAT_MARGIN = 64  # context left for the chat template (words are about 1-2 tokens each; prompts use len // 2)
MIN_CUT_DELAY = 0.001
WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or one had by "
         "word but not what all were we when your can said there use an each which she do how their if will up "
         "other about out many then them these so some her would make like him into time has look two more go "
         "see number no way could people my than first water been call who its now find long down day did get "
         "come made may part").split()


@dataclass
class Plan:
    """One request: its body and what the answer must look like."""
    chat: bool
    body: dict[str, Any]
    n: int
    max_tokens: int
    ignore_eos: bool
    logprobs: bool
    cut: str = ""  # "" (none), "timeout" or "events"
    cut_after: float = 0.0  # seconds (timeout) or a number of SSE events


def make_plan(rng: np.random.Generator, *, model: str, max_model_len: int, max_tokens: int, vocab_size: int,
              disconnect_prob: float, max_cut_delay: float) -> Plan:
    chat = bool(rng.random() < P_CHAT)
    room = max(2, max_model_len - (min(CHAT_MARGIN, max_model_len // 2) if chat else 0))
    [(num_in, num_out)] = clip_lengths(lognormal_lengths(rng, 1, SHAREGPT_MEAN_INPUT),
                                       lognormal_lengths(rng, 1, SHAREGPT_MEAN_OUTPUT), room)
    num_out = min(num_out, max_tokens)
    n = 2 if rng.random() < P_N2 else 1
    stream = bool(rng.random() >= P_NO_STREAM)
    logprobs = bool(rng.random() < P_LOGPROBS)
    ignore_eos = bool(rng.random() < P_IGNORE_EOS)
    body: dict[str, Any] = {"model": model, "max_tokens": num_out, "n": n, "stream": stream, "ignore_eos": ignore_eos,
                            "temperature": 0.8 if n > 1 else 0.0}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if chat:
        body["messages"] = [{"role": "user", "content": " ".join(rng.choice(WORDS, max(1, num_in // 2)))}]
        if logprobs:
            body.update(logprobs=True, top_logprobs=2)
    else:
        body["prompt"] = random_prompts([num_in], vocab_size, seed=int(rng.integers(2**31)))[0]
        if logprobs:
            body["logprobs"] = 2
    plan = Plan(chat, body, n, num_out, ignore_eos, logprobs)
    if rng.random() < disconnect_prob:
        if stream and rng.random() < P_CUT_BY_EVENTS:
            plan.cut, plan.cut_after = "events", int(rng.integers(1, num_out + 1))
        else:
            plan.cut = "timeout"
            plan.cut_after = float(math.exp(rng.uniform(math.log(MIN_CUT_DELAY), math.log(max_cut_delay))))
    return plan


def absorb(choices: list[dict], finishes: dict[int, str], logprob_counts: dict[int, int], chat: bool) -> None:
    """Note each choice's finish_reason and how many tokens its logprobs cover (a chunk or a whole answer)."""
    for c in choices:
        i = int(c.get("index", 0))
        if c.get("finish_reason"):
            finishes[i] = c["finish_reason"]
        lp = c.get("logprobs")
        if lp:
            logprob_counts[i] = logprob_counts.get(i, 0) + len((lp.get("content") if chat else lp.get("tokens")) or [])


def check_answer(plan: Plan, finishes: dict[int, str], logprob_counts: dict[int, int], usage: dict | None,
                 max_model_len: int) -> tuple[str, int]:
    """("", completion tokens) for a correct finished answer, else (what is wrong, tokens)."""
    if not usage or "completion_tokens" not in usage:
        return "no usage in the answer", 0
    tokens = int(usage["completion_tokens"])
    missing = [i for i in range(plan.n) if not finishes.get(i)]
    if missing:
        return f"choices {missing} of {plan.n} ended without a finish_reason", tokens
    each = min(plan.max_tokens, max_model_len - int(usage.get("prompt_tokens", 0)))
    if plan.ignore_eos:
        if tokens != plan.n * each:
            return f"wrong token count: {tokens} completion tokens, asked {plan.n} x {each} with ignore_eos", tokens
        if any(finishes[i] != "length" for i in range(plan.n)):
            return f"finish_reason {sorted(finishes.values())} with ignore_eos (expected length)", tokens
        lps = [logprob_counts.get(i, 0) for i in range(plan.n)]
        if plan.logprobs and any(k != each for k in lps):
            return f"wrong logprobs count: {lps} tokens with logprobs, expected {each} per choice", tokens
    elif not 0 <= tokens <= plan.n * plan.max_tokens:
        return f"wrong token count: {tokens} completion tokens, asked at most {plan.n} x {plan.max_tokens}", tokens
    return "", tokens
