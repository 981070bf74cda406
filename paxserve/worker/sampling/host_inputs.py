"""Host side of sampling: per-row numpy inputs for the on-device sampler, the rows of its persistent
state, and unpacking its output.

Numpy only (no JAX), so the scheduler/engine host path and its tests stay instant.

Nothing here is a compile key. Every sampler feature is runtime data of fixed shape, so one compiled
step per (tokens, sequences, block-table width) bucket serves any mix of greedy and sampled rows,
top-k/top-p/min-p, penalties, logit bias, min_tokens, logprobs and structured outputs:

- Per-step rows ([S] each): temperature, filters, seeds, steps, penalty strengths, whether the row
  wants logprobs, whether its token is kept, and which row of the sampler state it reads.
- The token bitmask ([S, ceil(V/32)] packed words; bit t of word t//32 allows token t), all ones for
  free rows, filled by each row's structured-output matcher; a step without constrained rows sends
  none (the runner keeps an all-ones one on the device).
- Per-request state that does not change every step (a request's output-token counts, the prompt's
  token set, its logit bias, the ids min_tokens holds back) lives on the device in `SamplerState`,
  one row per running request that needs it; it is written once when the request starts running
  (`StateWrites`) and the step itself counts each kept token, so no per-step input grows with the
  output's length. Row 0 is the null row: all zeros, which leaves a row's logits untouched.
- The output is always [S, PACKED_WIDTH]: the token, then its logprob and the top MAX_LOGPROBS ids
  and logprobs (zeros when no row asked). The host keeps what each request asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from paxserve.sampling_params import MAX_LOGPROBS, SamplingParams

# Below this a temperature is numerically greedy (vLLM uses the same epsilon); dividing by it
# would only overflow.
GREEDY_TEMPERATURE = 1e-5
# Columns of the sampler's packed output: the token id, its logprob, MAX_LOGPROBS top ids and their
# logprobs. Fixed, so asking for logprobs compiles nothing.
PACKED_WIDTH = 2 + 2 * MAX_LOGPROBS
# A verifying step's draft grid where a sequence proposed nothing: never equal to a sample.
NO_DRAFT = -1


@dataclass(slots=True)
class SamplingRow:
    """One sequence's sampling inputs for this step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    seed: int  # per-sequence generator seed chosen by the engine
    eos_token_ids: tuple[int, ...]
    # Structured outputs: the llguidance matcher that fills this row's token bitmask (None: free).
    matcher: Any = None
    # The sampler-state row holding this request's counts, prompt set, bias and held-back ids; 0 for
    # a request that needs none (see `needs_state`).
    state_row: int = 0
    # Whether this step's token is kept (a decode, or the last chunk of a prompt): only then does it
    # count towards the request's penalties.
    keep: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.seed, (int, np.integer)) or not 0 <= int(self.seed) < 2**64:
            raise ValueError(f"SamplingRow.seed={self.seed!r} must be an integer in [0, 2**64)")
        if any(t < 0 for t in self.eos_token_ids):
            raise ValueError(f"SamplingRow.eos_token_ids={self.eos_token_ids!r} must be token ids >= 0")
        if self.state_row < 0:
            raise ValueError(f"SamplingRow.state_row={self.state_row} must be >= 0 (0: no sampler state)")


@dataclass(slots=True)
class SamplingInputs:
    """Padded per-row arrays ([S] unless noted). Padding rows are greedy with nothing else."""

    temperature: np.ndarray  # f32; 0 = greedy
    top_k: np.ndarray  # i32; 0 = off, else in [1, vocab)
    top_p: np.ndarray  # f32; 1 = off
    min_p: np.ndarray  # f32; 0 = off
    seed: np.ndarray  # u32 [S, 2]: (high, low) words of the 64-bit seed = threefry key data
    step: np.ndarray  # i32; tokens generated so far
    min_tokens: np.ndarray  # i32
    presence_penalty: np.ndarray  # f32
    frequency_penalty: np.ndarray  # f32
    repetition_penalty: np.ndarray  # f32
    logprobs: np.ndarray  # bool; the row wants logprobs
    state_row: np.ndarray  # i32; its row of the sampler state, 0 = none
    batch_row: np.ndarray  # i32; its persistent-batch row (0 = padding): where its kept token is remembered
    keep: np.ndarray  # bool; its token is kept (counted for penalties)
    # i32 [S, ceil(V/32)]: bit t of word t//32 set = token t allowed; None = every token (no row is
    # constrained), which the runner sends as a device array it keeps.
    allowed_token_bitmask: np.ndarray | None
    num_rows: int  # real (unpadded) rows; host only
    vocab_size: int  # host only: the bitmask's width when it is None
    # A verifying step (speculative decoding): i32 [S], the proposal each row's sample is compared
    # with (NO_DRAFT: none, a sequence's last row); a sequence's rows are consecutive, 1 + d of them.
    draft_tokens: np.ndarray | None = None
    # i32 [S, k]: the proposals before each row in its sequence (-1 after them), for penalties.
    earlier_drafts: np.ndarray | None = None
    # i32 [S, MAX_LOGPROBS]: the tokens whose logprobs a row reports instead of its top ones
    # (logprob_token_ids, -1 after them; all -1: the top ones); None when no row has any, which the
    # runner sends as a device array it keeps.
    logprob_ids: np.ndarray | None = None
    # bool [S]: the row wants more top logprobs than the columns hold (or all): the runner copies its
    # whole log-softmax row too (`SampledTokens.wide`); None when no row does.
    wide_logprobs: np.ndarray | None = None

    def __post_init__(self) -> None:
        s = self.temperature.shape[0]
        if not 0 < self.num_rows <= s:
            raise ValueError(f"SamplingInputs.num_rows={self.num_rows} must be in [1, {s}]")
        if self.seed.shape != (s, 2) or self.seed.dtype != np.uint32:
            raise ValueError(f"SamplingInputs.seed must be uint32 [{s}, 2], got {self.seed.dtype} {self.seed.shape}")
        if self.allowed_token_bitmask is not None and self.allowed_token_bitmask.shape[0] != s:
            raise ValueError(f"SamplingInputs.allowed_token_bitmask has {self.allowed_token_bitmask.shape[0]} rows, "
                             f"expected {s}")


@dataclass(slots=True)
class StateWrites:
    """Whole rows of the sampler state to (re)write before a step: one per request that starts
    running and needs state. K is padded to a power of two with rows that point past the state
    (the device drops them), so the write compiles once per power of two, never per request."""

    rows: np.ndarray  # i32 [K]
    counts: np.ndarray  # i32 [K, V]: how often each token is in the output so far
    prompt_mask: np.ndarray  # i32 [K, W]: bit set = token in the prompt
    bias: np.ndarray  # f32 [K, V]: logit_bias, dense
    suppress_mask: np.ndarray  # i32 [K, W]: bit set = held back while step < min_tokens

    def __post_init__(self) -> None:
        k = self.rows.shape[0]
        for name in ("counts", "prompt_mask", "bias", "suppress_mask"):
            if getattr(self, name).shape[0] != k:
                raise ValueError(f"StateWrites.{name} has {getattr(self, name).shape[0]} rows, expected {k}")


@dataclass(slots=True)
class ConstrainedRows:
    """The structured-output rows of a step, as plain data: their step rows and bitmask words
    (filled by their matchers on the host); every other row allows every token. In a verifying
    step a row has one word row per sampled position (`positions`: 0 for its next token, j for the
    one after its first j proposals)."""

    rows: np.ndarray  # i32 [K]
    words: np.ndarray  # i32 [K, ceil(V/32)]
    positions: np.ndarray | None = None  # i32 [K]; None: all 0

    def __post_init__(self) -> None:
        if self.words.ndim != 2 or self.words.shape[0] != self.rows.shape[0]:
            raise ValueError(f"ConstrainedRows: {self.rows.shape[0]} rows but words of shape {self.words.shape}")

    def bitmask(self, num_rows: int, first_rows: list[int] | None = None) -> np.ndarray:
        """The step's whole [num_rows, ceil(V/32)] bitmask: these rows' words, all ones elsewhere.
        `first_rows`: a verifying step's first sampler row of each step row."""
        bitmask = np.full((num_rows, self.words.shape[1]), -1, np.int32)
        rows = self.rows if first_rows is None else np.asarray(first_rows, np.int32)[self.rows]
        if self.positions is not None:
            rows = rows + self.positions
        bitmask[rows] = self.words
        return bitmask


def constrained_rows(matchers: list[tuple[int, Any, Sequence[int]]], vocab_size: int) -> ConstrainedRows | None:
    """Each (step row, llguidance matcher, proposals the row verifies) entry's bitmask words: at its
    next token, then after each proposal (the matcher is advanced through them and rolled back).
    None when no row is constrained."""
    if not matchers:
        return None
    from llguidance.numpy import fill_next_token_bitmask

    rows, positions = [], []
    for row, _, drafts in matchers:
        rows += [row] * (1 + len(drafts))
        positions += range(1 + len(drafts))
    words = np.full((len(rows), bitmask_width(vocab_size)), -1, np.int32)
    at = 0
    for _, matcher, drafts in matchers:
        fill_next_token_bitmask(matcher, words, at)
        consumed = 0
        # Proposals were cut to what the grammar accepts; after one that ends it, nothing more
        # is kept (the request finishes there), so those rows stay all-ones.
        for j, token in enumerate(drafts):
            if not matcher.consume_token(token):
                break
            consumed += 1
            if matcher.is_stopped():
                break
            fill_next_token_bitmask(matcher, words, at + j + 1)
        if consumed and not matcher.rollback(consumed):
            raise RuntimeError(f"structured output: the grammar could not take back {consumed} proposed tokens")
        at += 1 + len(drafts)
    return ConstrainedRows(np.array(rows, np.int32), words, np.array(positions, np.int32))


@dataclass(slots=True)
class SampledTokens:
    """One step's results for the real rows. Logprobs are of the raw model logits; the top columns
    are always MAX_LOGPROBS wide (zeros when no row of the step asked)."""

    token_ids: list[int]
    sampled_logprobs: np.ndarray  # f32 [N]
    top_token_ids: np.ndarray  # i32 [N, MAX_LOGPROBS], most likely first
    top_logprobs: np.ndarray  # f32 [N, MAX_LOGPROBS]
    # Each step row's kept tokens (set by the model runner): its one token, or after verifying
    # proposals the accepted ones and the token after them. Token t of row i is sampler row
    # first_rows[i] + t (row i + t when the step verified nothing).
    row_tokens: list[list[int]] | None = None
    first_rows: list[int] | None = None
    # Sampler row -> its whole log-softmax row (f32 [V]), for rows that asked for more top logprobs
    # than the columns hold (SamplingInputs.wide_logprobs).
    wide: dict[int, np.ndarray] | None = None

    def first_row(self, row: int) -> int:
        return row if self.first_rows is None else self.first_rows[row]


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def token_bits(ids: list[int] | tuple[int, ...], vocab_size: int) -> np.ndarray:
    """The set `ids` as packed int32 words, bit t of word t//32 (the token bitmask's layout)."""
    bits = np.zeros(bitmask_width(vocab_size) * 32, bool)
    bits[np.asarray(ids, np.int64)] = True
    return np.packbits(bits, bitorder="little").view("<i4")


def suppressed_ids(params: SamplingParams, eos_token_ids: tuple[int, ...]) -> tuple[int, ...]:
    """Ids min_tokens holds back: the EOS ids (unless ignore_eos) and the stop token ids."""
    if params.min_tokens == 0:
        return ()
    return tuple(dict.fromkeys((() if params.ignore_eos else eos_token_ids) + tuple(params.stop_token_ids or ())))


def needs_state(params: SamplingParams, eos_token_ids: tuple[int, ...]) -> bool:
    """Whether a request needs a row of the sampler state: penalties, a logit bias (allowed_token_ids
    is one: -inf for every other token), or ids that min_tokens holds back."""
    return (params.uses_penalties or bool(params.logit_bias) or params.allowed_token_ids is not None
            or bool(suppressed_ids(params, eos_token_ids)))


def build_state_writes(rows: list[tuple[int, SamplingRow]], num_state_rows: int, vocab_size: int) -> StateWrites:
    """The state rows of requests that start running: `rows` pairs each one's state row with its
    sampling row. Its counts are rebuilt from its output so far, so a preempted request resumes
    with the same penalties."""
    if not rows:
        raise ValueError("build_state_writes needs at least one row")
    k = 1 << (len(rows) - 1).bit_length()
    w = bitmask_width(vocab_size)
    out = StateWrites(rows=np.full(k, num_state_rows, np.int32), counts=np.zeros((k, vocab_size), np.int32),
                      prompt_mask=np.zeros((k, w), np.int32), bias=np.zeros((k, vocab_size), np.float32),
                      suppress_mask=np.zeros((k, w), np.int32))
    for i, (state_row, row) in enumerate(rows):
        if not 0 < state_row < num_state_rows:
            raise ValueError(f"state row {state_row} must be in [1, {num_state_rows})")
        out.rows[i] = state_row
        if row.output_token_ids:
            out.counts[i] = np.bincount(row.output_token_ids, minlength=vocab_size)
        if row.params.uses_penalties:
            out.prompt_mask[i] = token_bits(row.prompt_token_ids, vocab_size)
        if row.params.allowed_token_ids is not None:
            out.bias[i] = -np.inf
            out.bias[i, row.params.allowed_token_ids] = 0.0
        for token, value in (row.params.logit_bias or {}).items():
            out.bias[i, token] += value
        held = suppressed_ids(row.params, row.eos_token_ids)
        if held:
            out.suppress_mask[i] = token_bits(held, vocab_size)
    return out


class SamplingColumns:
    """Each row's sampling parameters in preallocated arrays (the persistent batch's sampling rows):
    set once when a request starts running, gathered by index each step, so a step costs numpy
    gathers rather than a Python pass over every request's parameters. Row 0 stays neutral (greedy
    and nothing else): padding rows read it."""

    def __init__(self, num_rows: int, vocab_size: int) -> None:
        if num_rows < 1 or vocab_size < 1:
            raise ValueError(f"SamplingColumns needs num_rows >= 1 and vocab_size >= 1, got {num_rows}, {vocab_size}")
        self.vocab_size = vocab_size
        self.temperature = np.zeros(num_rows, np.float32)
        self.top_k = np.zeros(num_rows, np.int32)
        self.top_p = np.ones(num_rows, np.float32)
        self.min_p = np.zeros(num_rows, np.float32)
        self.seed = np.zeros((num_rows, 2), np.uint32)
        self.min_tokens = np.zeros(num_rows, np.int32)
        self.presence_penalty = np.zeros(num_rows, np.float32)
        self.frequency_penalty = np.zeros(num_rows, np.float32)
        self.repetition_penalty = np.ones(num_rows, np.float32)
        self.logprobs = np.zeros(num_rows, bool)
        self.state_row = np.zeros(num_rows, np.int32)
        self.logprob_ids = np.full((num_rows, MAX_LOGPROBS), -1, np.int32)  # -1 first: the row has none
        self.wide_logprobs = np.zeros(num_rows, bool)

    def set_row(self, row: int, params: SamplingParams, seed: int, state_row: int) -> None:
        """Every column of `row` from a request's parameters (a new request overwrites all of them)."""
        if row == 0:
            raise ValueError("SamplingColumns: row 0 is the neutral padding row")
        if params.uses_penalties and state_row == 0:
            raise ValueError(f"row {row} uses penalties but has no sampler-state row")
        sampled = params.temperature >= GREEDY_TEMPERATURE
        self.temperature[row] = params.temperature if sampled else 0.0
        # Greedy rows never force the filter path; top_k >= vocab keeps everything, so it is off too.
        self.top_k[row] = params.top_k if sampled and 0 < params.top_k < self.vocab_size else 0
        self.top_p[row] = params.top_p if sampled else 1.0
        self.min_p[row] = params.min_p if sampled else 0.0
        self.seed[row] = (int(seed) >> 32, int(seed) & 0xFFFFFFFF)
        self.min_tokens[row] = params.min_tokens
        penalised = params.uses_penalties
        self.presence_penalty[row] = params.presence_penalty if penalised else 0.0
        self.frequency_penalty[row] = params.frequency_penalty if penalised else 0.0
        self.repetition_penalty[row] = params.repetition_penalty if penalised else 1.0
        self.logprobs[row] = params.wants_logprobs
        self.state_row[row] = state_row
        ids = params.logprob_token_ids or ()
        self.logprob_ids[row] = -1
        self.logprob_ids[row, :len(ids)] = ids
        self.wide_logprobs[row] = params.wide_logprobs

    def gather(self, rows: np.ndarray, step: np.ndarray, keep: np.ndarray, num_rows: int,
               bitmask: np.ndarray | None = None) -> SamplingInputs:
        """The step's inputs: `rows` [S] the column row of each step row (0 for padding), `step` [S]
        tokens generated so far, `keep` [S] whether the row's token is kept; `bitmask` None when no
        row is constrained."""
        return SamplingInputs(
            temperature=self.temperature[rows], top_k=self.top_k[rows], top_p=self.top_p[rows],
            min_p=self.min_p[rows], seed=self.seed[rows], step=step.astype(np.int32),
            min_tokens=self.min_tokens[rows], presence_penalty=self.presence_penalty[rows],
            frequency_penalty=self.frequency_penalty[rows], repetition_penalty=self.repetition_penalty[rows],
            logprobs=self.logprobs[rows], state_row=self.state_row[rows], batch_row=rows.astype(np.int32),
            keep=keep.astype(bool),
            allowed_token_bitmask=bitmask, num_rows=num_rows, vocab_size=self.vocab_size,
            logprob_ids=self.logprob_ids[rows] if (self.logprob_ids[rows, 0] >= 0).any() else None,
            wide_logprobs=self.wide_logprobs[rows] if self.wide_logprobs[rows].any() else None,
        )


def build_sampling_inputs(rows: list[SamplingRow], num_rows_padded: int, vocab_size: int) -> SamplingInputs:
    """Per-row sampler inputs for a list of rows (tests, warm-up, tools), padded to
    `num_rows_padded`: the same columns the engine's persistent batch gathers from. Padding rows
    are greedy with no state (so no penalties, bias or suppression) and keep nothing."""
    if not rows:
        raise ValueError("build_sampling_inputs needs at least one row")
    if num_rows_padded < len(rows):
        raise ValueError(f"num_rows_padded={num_rows_padded} is smaller than the {len(rows)} rows")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    n, s = len(rows), num_rows_padded
    columns = SamplingColumns(n + 1, vocab_size)
    index, step, keep = np.zeros(s, np.int32), np.zeros(s, np.int32), np.zeros(s, bool)
    for i, row in enumerate(rows):
        columns.set_row(i + 1, row.params, row.seed, row.state_row)
        index[i], step[i], keep[i] = i + 1, len(row.output_token_ids), row.keep
    constrained = constrained_rows([(i, r.matcher, ()) for i, r in enumerate(rows) if r.matcher is not None],
                                   vocab_size)
    return columns.gather(index, step, keep, n, None if constrained is None else constrained.bitmask(s))


def unpack(packed: np.ndarray, num_rows: int) -> SampledTokens:
    """Split the sampler's packed [S, PACKED_WIDTH] float32 output into the first `num_rows` rows'
    results."""
    if packed.ndim != 2 or packed.shape[1] != PACKED_WIDTH:
        raise ValueError(f"packed has shape {packed.shape}, expected [S, {PACKED_WIDTH}]")
    if not 0 <= num_rows <= packed.shape[0]:
        raise ValueError(f"num_rows={num_rows} must be in [0, {packed.shape[0]}]")
    rows = np.asarray(packed[:num_rows], np.float32)
    k = MAX_LOGPROBS
    return SampledTokens(
        token_ids=rows[:, 0].astype(np.int64).tolist(),
        sampled_logprobs=rows[:, 1].copy(),
        top_token_ids=rows[:, 2 : 2 + k].astype(np.int32),
        top_logprobs=rows[:, 2 + k : 2 + 2 * k].copy(),
    )
