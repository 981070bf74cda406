"""Incremental detokenization for streaming, with stop-string detection.

Each generated token goes through `tokenizers.DecodeStream` (Rust), which returns the text a token
completes and nothing while a multi-byte character is still incomplete: 3.8 µs of host time a token
here against 12.6 µs for decoding a window twice in Python (benchmarks/detokenize.py, RESULTS.md).
Stop strings and their hold-back sit on top. Two things a stream cannot do are done by decoding a short window of recent ids
(the text rendered last, then the pending ids): the text of an answer cut inside a character
(`finish`, as a full decode renders it), and a stop string completed before an incomplete character
in the same token. A tokenizer without a Rust backend, or one that cleans up spaces after decoding
(`clean_up_tokenization_spaces`, which a stream does not apply), decodes the window at every step.
"""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream

from paxserve.sampling_params import SamplingParams

# Prompt tokens kept as left context for the first output token, so it renders as it would after the
# prompt (e.g. a leading space that some decoders drop from the first token of a sequence).
NUM_PROMPT_CONTEXT_TOKENS = 5

# What a decoder yields for bytes that are not (yet) a complete UTF-8 character.
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text, step by step.

    `update()` feeds new ids and reports a matched stop string. `output_text` is the text so far;
    `get_delta()` returns the part not returned before and never returns text that later changes.
    A `tokenizer` of None (a checkpoint served from token ids only) yields no text and allows no
    stop strings.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if tokenizer is None and params.stop_strings:
            raise ValueError("stop strings need a tokenizer, but this model was loaded without one")
        self._tokenizer = tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        self._stops = params.stop_strings
        self._include_stop = params.include_stop_str_in_output
        # As in vLLM, stop strings only count once more than min_tokens tokens have been generated.
        self._min_tokens = params.min_tokens
        self._num_output_tokens = 0
        # Only the prompt's tail is kept: token ids are the context window, then every output id.
        self._token_ids = self._prompt_context(list(prompt_token_ids[-NUM_PROMPT_CONTEXT_TOKENS:]))
        # _token_ids[_prefix_offset:_read_offset] is already rendered; ids past _read_offset are not.
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self._text = ""
        self._num_emitted = 0
        self._finished = False
        self._stop_reason: str | None = None
        self._backend = _stream_backend(tokenizer)
        self._stream = (None if self._backend is None else
                        DecodeStream(ids=list(self._token_ids), skip_special_tokens=self._skip_special_tokens))

    def _prompt_context(self, tail: list[int]) -> list[int]:
        # A prompt cut in the middle of a UTF-8 character would swallow the output's first bytes into
        # the prompt's text; without context the output decodes exactly as it would on its own.
        if self._tokenizer is None or not tail or self._decode(tail).endswith(_REPLACEMENT):
            return []
        return tail

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    @property
    def output_text(self) -> str:
        return self._text

    @property
    def emitted_text(self) -> str:
        """All the text `get_delta()` has returned so far (the final text once finished)."""
        return self._text[:self._num_emitted]

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended the request, or None."""
        return self._stop_reason

    def update(self, new_token_ids: list[int]) -> str | None:
        """Feeds newly generated ids; returns the stop string they completed, else None."""
        if self._finished:
            raise RuntimeError("update() after the request finished (a stop string matched or finish() was called)")
        if self._tokenizer is None or not new_token_ids:
            return None
        if self._stream is not None:
            return self._update_stream(new_token_ids)
        self._num_output_tokens += len(new_token_ids)
        self._token_ids.extend(new_token_ids)
        new_text = self._pending_text()
        if new_text.endswith(_REPLACEMENT):
            # The last character may still be incomplete: keep its tokens pending, but a stop string
            # already complete before it must stop the request now.
            return self._check_stop(new_text.rstrip(_REPLACEMENT), commit=False)
        if not new_text:
            # Nothing rendered (e.g. a skipped special token): keep the window so its left context stays.
            return None
        self._advance()
        return self._check_stop(new_text, commit=True)

    def _update_stream(self, new_token_ids: list[int]) -> str | None:
        # One token at a time: a stop string completes at the token that completes it.
        for token in new_token_ids:
            self._num_output_tokens += 1
            self._token_ids.append(token)
            piece = self._stream.step(self._backend, token)
            if piece is None:
                # An incomplete character (or a skipped special token): a stop string already complete
                # before it must stop the request now.
                if self._stops and (pending := self._pending_text()).endswith(_REPLACEMENT):
                    if stop := self._check_stop(pending.rstrip(_REPLACEMENT), commit=False):
                        return stop
                continue
            self._advance()
            if stop := self._check_stop(piece, commit=True):
                return stop
        return None

    def finish(self) -> None:
        """The request ended for another reason (length, eos, abort): render and release everything."""
        if self._finished:
            return
        if self._tokenizer is not None and self._read_offset < len(self._token_ids):
            # Whatever is still incomplete is final now; render it as a full decode would.
            new_text = self._pending_text()
            self._advance()
            self._check_stop(new_text, commit=True)
        self._finished = True

    def get_delta(self) -> str:
        """Text not returned by earlier calls that can no longer change."""
        end = len(self._text) if self._finished else len(self._text) - self._num_held_back()
        delta = self._text[self._num_emitted:end]
        self._num_emitted = max(self._num_emitted, end)
        return delta

    def _pending_text(self) -> str:
        prefix = self._decode(self._token_ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._token_ids[self._prefix_offset:])
        return full[len(prefix):]

    def _advance(self) -> None:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)

    def _check_stop(self, new_text: str, commit: bool) -> str | None:
        """Appends `new_text` when `commit` (or when a stop string in it ends the request)."""
        old_len = len(self._text)
        text = self._text + new_text
        match = self._find_stop(text, old_len) if self._num_output_tokens > self._min_tokens else None
        if match is None:
            if commit:
                self._text = text
            return None
        stop, start = match
        self._text = text[:start + len(stop)] if self._include_stop else text[:start]
        self._finished = True
        self._stop_reason = stop
        return stop

    def _find_stop(self, text: str, old_len: int) -> tuple[str, int] | None:
        """The stop string that completes first in `text[old_len:]`, with its start index.

        Earlier text was searched already, so a new match must end past `old_len`. "First" means the
        earliest end (ties: the earliest start), which is where a character-by-character stream would
        have stopped, so the result does not depend on how the text was split into tokens.
        """
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = text.find(stop, max(0, old_len - len(stop) + 1))
            if start < 0:
                continue
            candidate = (start + len(stop), start, stop)
            if best is None or candidate < best:
                best = candidate
        return None if best is None else (best[2], best[1])

    def _num_held_back(self) -> int:
        """Length of the longest tail of the text that could still be the start of a stop string.

        Only prefix lengths whose last character equals the text's last character are tried, so
        ordinary text costs a few `rfind`s per stop string rather than one comparison per length."""
        if not self._stops or self._include_stop or not self._text:
            return 0
        text, last, best = self._text, self._text[-1], 0
        for stop in self._stops:
            end = min(len(stop) - 1, len(text))
            pos = stop.rfind(last, 0, end)
            while pos + 1 > best:  # pos == -1 ends it
                if text.endswith(stop[:pos + 1]):
                    best = pos + 1
                    break
                pos = stop.rfind(last, 0, pos)
        return best


def _stream_backend(tokenizer: Any) -> Any | None:
    """The Rust tokenizer a DecodeStream decodes with, when its text is what `tokenizer.decode` gives."""
    if tokenizer is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return getattr(tokenizer, "backend_tokenizer", None)
