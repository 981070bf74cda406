"""Host side of prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`): which positions of a step
score which prompt token, the per-step device inputs, and the per-request buffer they fill.

Numpy only (no JAX), so the scheduler and the request stay JAX-free. Position j's logits score
token j + 1, so prompt token i (i >= 1) is scored by position i - 1 and token 0 has no entry. A
prompt split over several steps (chunked prefill) contributes each chunk's positions; the last
position of one chunk scores the first token of the next, which the host passes in as the target
(it is not among the step's input ids). After a preemption the request recomputes from token 0:
positions already filled are skipped, so no entry is lost or duplicated.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from paxserve.sampling_params import MAX_LOGPROBS


# Columns per position of the device's packed output: the actual token's logprob, its rank, the
# MAX_LOGPROBS top ids and their logprobs. Always the most a request may ask for, so the width is no
# compile key; the buffer keeps what its request asked for.
PROMPT_PACKED_WIDTH = 2 + 2 * MAX_LOGPROBS


@dataclass(slots=True)
class PromptLogprobsBuffer:
    """One request's prompt logprobs as they are collected. Row i - 1 holds prompt token i's."""

    num_prompt_tokens: int
    num_top: int  # alternatives the request asked for (SamplingParams.prompt_logprobs)
    logprobs: np.ndarray  # f32 [P - 1]
    ranks: np.ndarray  # i32 [P - 1]; 1 = most likely, exact
    top_token_ids: np.ndarray  # i32 [P - 1, num_top], most likely first
    top_logprobs: np.ndarray  # f32 [P - 1, num_top]
    num_filled: int = 0  # prompt tokens 1..num_filled have their entry
    sent: bool = False  # handed to the output processor already

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 1:
            raise ValueError(f"PromptLogprobsBuffer.num_prompt_tokens must be >= 1, got {self.num_prompt_tokens}")
        if not 0 <= self.num_filled <= self.num_prompt_tokens - 1:
            raise ValueError(f"PromptLogprobsBuffer.num_filled={self.num_filled} must be in "
                             f"[0, {self.num_prompt_tokens - 1}]")

    @classmethod
    def empty(cls, num_prompt_tokens: int, num_top: int) -> PromptLogprobsBuffer:
        n = max(num_prompt_tokens - 1, 0)
        return cls(num_prompt_tokens, num_top, np.zeros(n, np.float32), np.zeros(n, np.int32),
                   np.zeros((n, num_top), np.int32), np.zeros((n, num_top), np.float32))

    @property
    def complete(self) -> bool:
        return self.num_filled == self.num_prompt_tokens - 1

    def positions_needed(self, start: int, num_new: int) -> tuple[int, int]:
        """The positions [lo, hi) of a chunk feeding positions [start, start + num_new) whose logits
        score a prompt token without an entry yet (lo == hi: none)."""
        lo = max(start, self.num_filled)
        hi = min(start + num_new, self.num_prompt_tokens - 1)
        return lo, max(lo, hi)

    def fill(self, lo: int, rows: np.ndarray) -> None:
        """Store the packed device rows of positions [lo, lo + len(rows)) (columns as in
        `PROMPT_PACKED_WIDTH`); they must continue exactly where the buffer stands."""
        if lo != self.num_filled or lo + len(rows) > self.num_prompt_tokens - 1:
            raise ValueError(f"prompt logprob rows for positions [{lo}, {lo + len(rows)}) do not continue the "
                             f"{self.num_filled} filled of {self.num_prompt_tokens - 1}")
        w = (rows.shape[1] - 2) // 2
        k, hi = self.num_top, lo + len(rows)
        self.logprobs[lo:hi] = rows[:, 0]
        self.ranks[lo:hi] = rows[:, 1].astype(np.int32)
        self.top_token_ids[lo:hi] = rows[:, 2 : 2 + k].astype(np.int32)
        self.top_logprobs[lo:hi] = rows[:, 2 + w : 2 + w + k]
        self.num_filled = hi


@dataclass(slots=True)
class PromptLogprobsInputs:
    """Per-step device inputs of the prompt-logprobs step variant."""

    targets: np.ndarray  # i32 [T]: the token each flat position's logits score (0 where unused)
    # Per scheduled row: (flat index of position lo, lo, hi), or None when the row needs nothing.
    spans: list[tuple[int, int, int] | None]

    def __post_init__(self) -> None:
        if self.targets.ndim != 1 or self.targets.dtype != np.int32:
            raise ValueError(f"PromptLogprobsInputs.targets must be int32 [T], got {self.targets.dtype} "
                             f"{self.targets.shape}")

    def padded(self, num_tokens_padded: int) -> PromptLogprobsInputs:
        """The same inputs over the step's padded token count (padding positions score token 0)."""
        extra = num_tokens_padded - self.targets.shape[0]
        if extra < 0:
            raise ValueError(f"prompt logprob targets cover {self.targets.shape[0]} positions, more than the "
                             f"step's {num_tokens_padded}")
        return PromptLogprobsInputs(np.pad(self.targets, (0, extra)), self.spans)


def build_prompt_logprobs_inputs(
    chunks: list[tuple[PromptLogprobsBuffer | None, list[int], int, int]], num_tokens_padded: int
) -> PromptLogprobsInputs | None:
    """`chunks`: per scheduled row (its buffer or None, its prompt ids, first position fed, tokens
    fed), in batch order. None when no row needs a prompt logprob this step, so such steps run the
    plain program and pay nothing."""
    targets = np.zeros(num_tokens_padded, np.int32)
    spans: list[tuple[int, int, int] | None] = []
    flat = 0
    for buffer, prompt_ids, start, num_new in chunks:
        span = None
        if buffer is not None:
            lo, hi = buffer.positions_needed(start, num_new)
            if hi > lo:
                at = flat + lo - start
                targets[at : at + hi - lo] = prompt_ids[lo + 1 : hi + 1]
                span = (at, lo, hi)
        spans.append(span)
        flat += num_new
    if all(span is None for span in spans):
        return None
    return PromptLogprobsInputs(targets, spans)


def fill_prompt_logprobs(buffers: list[PromptLogprobsBuffer | None], inputs: PromptLogprobsInputs,
                         rows: np.ndarray) -> None:
    """Hand each row's span of the step's packed [T, W] output to its buffer."""
    for buffer, span in zip(buffers, inputs.spans, strict=True):
        if buffer is not None and span is not None:
            at, lo, hi = span
            buffer.fill(lo, rows[at : at + hi - lo])
