"""Host side of sampling: per-row numpy inputs for the on-device sampler, and unpacking its output.

Numpy only (no JAX), so the scheduler/engine host path and its tests stay instant. The arrays are
padded to the step's row bucket; the static fields choose which compiled sampler variant runs.

Static variants (each multiplies the number of compiled programs, so the set stays small):

- `all_greedy` / `use_top_k_top_p`: three sampling modes. All rows greedy (no random draw at all),
  some rows sampled without filters, or some row using top-k/top-p/min-p. Greedy rows never force
  the filter path: their top_k/top_p/min_p are neutralised here.
- `use_penalties`: some row has a repetition/presence/frequency penalty.
- `num_logprobs`: 0 (no row wants logprobs), else the batch max bucketed to 1, 5 or 20.

That is at most 3 x 2 x 4 = 24 combinations per row bucket. Structured outputs add none: every
step carries a token bitmask ([S, ceil(vocab/32)] packed int32 words, bit t of word t//32 allows
token t) as runtime data, all ones for free rows, so constrained and free rows share one program. Array widths are shapes, hence also
compile keys, so they are bucketed too: 1 when unused, else a power of two >= `MIN_WIDTH`. Token
histories are only filled for rows that use penalties, and suppress ids only for rows still under
`min_tokens`, so in steady state (no penalties, min_tokens passed) every width is 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from paxserve.sampling_params import SamplingParams

LOGPROB_BUCKETS = (1, 5, 20)
MIN_WIDTH = 16
# Below this a temperature is numerically greedy (vLLM uses the same epsilon); dividing by it
# would only overflow.
GREEDY_TEMPERATURE = 1e-5
PAD_ID = -1


@dataclass(slots=True)
class SamplingRow:
    """One sequence's sampling state for this step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    seed: int  # per-sequence generator seed chosen by the engine
    eos_token_ids: tuple[int, ...]
    # Structured outputs: the llguidance matcher that fills this row's token bitmask (None: free).
    matcher: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.seed, (int, np.integer)) or not 0 <= int(self.seed) < 2**64:
            raise ValueError(f"SamplingRow.seed={self.seed!r} must be an integer in [0, 2**64)")
        if any(t < 0 for t in self.eos_token_ids):
            raise ValueError(f"SamplingRow.eos_token_ids={self.eos_token_ids!r} must be token ids >= 0")


@dataclass(slots=True)
class SamplingInputs:
    """Padded per-row arrays ([S] unless noted) plus the static flags of the compiled variant."""

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
    output_token_ids: np.ndarray  # i32 [S, Lo], PAD_ID padded; filled only for rows with penalties
    prompt_token_ids: np.ndarray  # i32 [S, Lp], PAD_ID padded; filled only for rows with penalties
    logit_bias_ids: np.ndarray  # i32 [S, Lb], PAD_ID padded
    logit_bias_values: np.ndarray  # f32 [S, Lb]
    suppress_ids: np.ndarray  # i32 [S, Ls]: ids set to -inf while step < min_tokens
    allowed_token_bitmask: np.ndarray  # i32 [S, ceil(V/32)]: bit t of word t//32 set = token t allowed
    all_greedy: bool
    use_top_k_top_p: bool
    use_penalties: bool
    num_logprobs: int
    num_rows: int  # real (unpadded) rows; host only

    def __post_init__(self) -> None:
        s = self.temperature.shape[0]
        if not 0 < self.num_rows <= s:
            raise ValueError(f"SamplingInputs.num_rows={self.num_rows} must be in [1, {s}]")
        if self.seed.shape != (s, 2) or self.seed.dtype != np.uint32:
            raise ValueError(f"SamplingInputs.seed must be uint32 [{s}, 2], got {self.seed.dtype} {self.seed.shape}")
        if self.all_greedy and self.use_top_k_top_p:
            raise ValueError("SamplingInputs: all_greedy and use_top_k_top_p exclude each other")
        for name in ("output_token_ids", "prompt_token_ids", "logit_bias_ids", "logit_bias_values", "suppress_ids",
                     "allowed_token_bitmask"):
            if getattr(self, name).shape[0] != s:
                raise ValueError(f"SamplingInputs.{name} has {getattr(self, name).shape[0]} rows, expected {s}")

    @property
    def packed_width(self) -> int:
        return packed_width(self.num_logprobs)


@dataclass(slots=True)
class SampledTokens:
    """One step's results for the real rows. Logprobs are of the raw model logits."""

    token_ids: list[int]
    sampled_logprobs: np.ndarray | None  # f32 [N]
    top_token_ids: np.ndarray | None  # i32 [N, num_logprobs], most likely first
    top_logprobs: np.ndarray | None  # f32 [N, num_logprobs]


def packed_width(num_logprobs: int) -> int:
    """Columns of the sampler's packed output: the token, then (when asked) its logprob and the
    top ids and their logprobs."""
    return 1 if num_logprobs == 0 else 2 + 2 * num_logprobs


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def bucket_width(n: int) -> int:
    return 1 if n == 0 else max(MIN_WIDTH, 1 << (n - 1).bit_length())


def bucket_logprobs(n: int | None) -> int:
    if n is None:
        return 0
    return next((b for b in LOGPROB_BUCKETS if b >= n), n)


def _fill(lists: list[list[int]] | list[list[float]], num_rows: int, dtype: type, pad: float) -> np.ndarray:
    out = np.full((num_rows, bucket_width(max(map(len, lists), default=0))), pad, dtype)
    for i, values in enumerate(lists):
        out[i, : len(values)] = values
    return out


def build_sampling_inputs(rows: list[SamplingRow], num_rows_padded: int, vocab_size: int) -> SamplingInputs:
    """Per-row sampler inputs for `rows`, padded to `num_rows_padded`. Padding rows are greedy with
    no penalties, bias or suppression."""
    if not rows:
        raise ValueError("build_sampling_inputs needs at least one row")
    if num_rows_padded < len(rows):
        raise ValueError(f"num_rows_padded={num_rows_padded} is smaller than the {len(rows)} rows")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    s = num_rows_padded

    def col(dtype: type, pad: float) -> np.ndarray:
        return np.full(s, pad, dtype)

    temperature, top_k, top_p, min_p = col(np.float32, 0), col(np.int32, 0), col(np.float32, 1), col(np.float32, 0)
    step, min_tokens = col(np.int32, 0), col(np.int32, 0)
    presence, frequency, repetition = col(np.float32, 0), col(np.float32, 0), col(np.float32, 1)
    seed = np.zeros((s, 2), np.uint32)
    bitmask = np.full((s, bitmask_width(vocab_size)), -1, np.int32)
    outputs: list[list[int]] = []
    prompts: list[list[int]] = []
    bias_ids: list[list[int]] = []
    bias_values: list[list[float]] = []
    suppress: list[list[int]] = []
    max_logprobs: int | None = None
    for i, row in enumerate(rows):
        p = row.params
        seed[i] = (int(row.seed) >> 32, int(row.seed) & 0xFFFFFFFF)
        step[i] = len(row.output_token_ids)
        min_tokens[i] = p.min_tokens
        if p.temperature >= GREEDY_TEMPERATURE:
            temperature[i] = p.temperature
            # top_k >= vocab keeps everything, so it is "off" and must not force the filter path.
            top_k[i] = p.top_k if 0 < p.top_k < vocab_size else 0
            top_p[i] = p.top_p
            min_p[i] = p.min_p
        if p.uses_penalties:
            presence[i], frequency[i], repetition[i] = p.presence_penalty, p.frequency_penalty, p.repetition_penalty
        outputs.append(row.output_token_ids if p.uses_penalties else [])
        prompts.append(row.prompt_token_ids if p.uses_penalties else [])
        bias = p.logit_bias or {}
        bias_ids.append(list(bias))
        bias_values.append([float(v) for v in bias.values()])
        ids: list[int] = []
        if len(row.output_token_ids) < p.min_tokens:
            ids = list(dict.fromkeys((() if p.ignore_eos else row.eos_token_ids) + tuple(p.stop_token_ids or ())))
        suppress.append(ids)
        if p.logprobs is not None:
            max_logprobs = max(max_logprobs or 0, p.logprobs)
        if row.matcher is not None:  # llguidance writes the row's words in place
            from llguidance.numpy import fill_next_token_bitmask

            fill_next_token_bitmask(row.matcher, bitmask, i)
    sampled = temperature > 0
    return SamplingInputs(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, step=step,
        min_tokens=min_tokens, presence_penalty=presence, frequency_penalty=frequency,
        repetition_penalty=repetition,
        output_token_ids=_fill(outputs, s, np.int32, PAD_ID),
        prompt_token_ids=_fill(prompts, s, np.int32, PAD_ID),
        logit_bias_ids=_fill(bias_ids, s, np.int32, PAD_ID),
        logit_bias_values=_fill(bias_values, s, np.float32, 0.0),
        suppress_ids=_fill(suppress, s, np.int32, PAD_ID),
        allowed_token_bitmask=bitmask,
        all_greedy=not sampled.any(),
        use_top_k_top_p=bool(((top_k > 0) | (top_p < 1) | (min_p > 0)).any()),
        use_penalties=any(r.params.uses_penalties for r in rows),
        num_logprobs=bucket_logprobs(max_logprobs),
        num_rows=len(rows),
    )


def unpack(packed: np.ndarray, num_rows: int, num_logprobs: int) -> SampledTokens:
    """Split the sampler's packed [S, W] float32 output into the first `num_rows` rows' results."""
    if packed.ndim != 2 or packed.shape[1] != packed_width(num_logprobs):
        raise ValueError(f"packed has shape {packed.shape}, expected [S, {packed_width(num_logprobs)}]")
    if not 0 <= num_rows <= packed.shape[0]:
        raise ValueError(f"num_rows={num_rows} must be in [0, {packed.shape[0]}]")
    rows = np.asarray(packed[:num_rows], np.float32)
    token_ids = rows[:, 0].astype(np.int64).tolist()
    if num_logprobs == 0:
        return SampledTokens(token_ids, None, None, None)
    k = num_logprobs
    return SampledTokens(
        token_ids=token_ids,
        sampled_logprobs=rows[:, 1].copy(),
        top_token_ids=rows[:, 2 : 2 + k].astype(np.int32),
        top_logprobs=rows[:, 2 + k : 2 + 2 * k].copy(),
    )
