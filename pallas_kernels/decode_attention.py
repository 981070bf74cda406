"""Decode-only paged attention (one new token per sequence) as a Pallas (Triton) kernel with split-K.

A pure-decode step is the memory-bound case: every sequence streams its whole K/V once for a single
query token. With few sequences or long contexts, one program per (sequence, KV head) leaves most of
the GPU idle, so this kernel also splits each context into `num_splits` key ranges ("flash
decoding"): grid (sequence, KV head, split). Each program computes, for the G query heads of its KV
head (the group padded to at least the 16 rows a tensor-core dot needs), an unnormalised float32
accumulator, running max and running sum over its key range; a small `jnp` combine step rescales
and sums the splits. Key ranges past a sequence's context are empty and cost one early exit; K/V
loads are masked to the context, so unused pages (even NaN) are never read.

Semantics: sequence s's token sits at position `context_lens[s] - 1` (its K/V already written) and
attends to all cached positions (with a sliding window W: the last W); ALiBi adds
`slope[h] * (key position - query position)` before the scale; `soft_cap` applies
`cap * tanh(score / cap)`; sequences with context length 0 (padding) give zeros. The window is a
run-time scalar input (one compiled kernel for every layer of a scan) and the slopes an [H] input;
neither is in the kernel when not given.
`paged_decode_attention_reference` beside it states the same contract through the ragged reference.

The engine runs it on pure-decode steps (its "decode" programs, through `dispatch.attention` with
`AttentionBackend.pure_decode`); mixed steps run `ragged_paged_attention`. On one H200 it took
0.24-0.73x the ragged kernel's time on pure-decode batches (benchmarks/RESULTS.md, "First GPU
contact"), and it is measured against JAX's own Pallas paged attention in `benchmarks/gpu_check.py`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int

from paxserve.kernels.attention_args import Window, slopes_operand, window_operand
from paxserve.kernels.kv_cache import fp8_view
from paxserve.kernels.kernel_checks import (
    MIN_DOT,
    check_decode_tables,
    check_options,
    is_pow2,
    next_pow2,
    validate_q_and_cache,
)
from paxserve.kernels.metadata import AttentionMetadata
from paxserve.kernels.reference import ragged_paged_attention_reference
from paxserve.kernels.ragged_paged_attention import _DOT_PRECISION, _SQUEEZED

__all__ = ["PagedDecodeAttentionConfig", "paged_decode_attention", "paged_decode_attention_reference"]


@dataclass(frozen=True)
class PagedDecodeAttentionConfig:
    """Tuning knobs (static, hashable). `None` picks a default from the shapes.

    num_splits: key ranges per sequence (split-K); default: enough programs to fill ~2 waves of a
        large GPU (512 programs), at most one split per inner step of the block table.
    kv_tokens: keys per inner step (a power of two >= 16 and >= block_size); default 64 (32 for
        head_dim 256).
    num_warps, num_stages: Triton launch parameters.
    """

    num_splits: int | None = None
    kv_tokens: int | None = None
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {self.num_splits}")
        if self.kv_tokens is not None and (not is_pow2(self.kv_tokens) or self.kv_tokens < MIN_DOT):
            raise ValueError(f"kv_tokens must be a power of two >= {MIN_DOT}, got {self.kv_tokens}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be one of 1, 2, 4, 8, 16, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")


# ---- kernel --------------------------------------------------------------------------------------


def _kernel(
    *refs,
    group: int,
    rows: int,
    kv_tokens: int,
    split_tokens: int,
    sm_scale: float,
    soft_cap: float | None,
    windowed: bool,
    alibi: bool,
    fp8: str | None = None,
):
    """refs, in order:
    scalars_ref  [1 or 2] int32: layer, and the window if `windowed`
    block_tables_ref  [S, B] int32, B = num_splits * pages_per_split
    context_lens_ref  [S] int32
    slopes_ref  [H] float32, only if `alibi`
    q_ref  [S, G, D] this program's KV group
    k_ref, v_ref  [L, N, P, D] this program's KV head
    acc_ref  [num_splits, S, G, D] float32, unnormalised
    m_ref  [num_splits, S, G] float32 running max (-inf: nothing seen)
    l_ref  [num_splits, S, G] float32 running sum
    """
    scalars_ref, block_tables_ref, context_lens_ref, *slopes, q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref = refs
    seq, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    block_size, head_dim = k_ref.shape[-2], k_ref.shape[-1]
    table_width = block_tables_ref.shape[1]
    layer = scalars_ref[0]
    ctx = context_lens_ref[seq]

    # Rows past the group repeat its last head: same values to the same address, no store mask needed.
    head = jnp.minimum(jnp.arange(rows, dtype=jnp.int32), group - 1)
    d = jnp.arange(head_dim, dtype=jnp.int32)
    q = q_ref[seq, head[:, None], d[None, :]]  # [rows, D]
    slope = slopes[0][kv_head * group + head] if alibi else None  # [rows]

    # This split's keys: [lo, hi). The loop starts at lo's step, so keys before the window (a traced
    # window too) are never loaded.
    lo = split * split_tokens
    if windowed:
        lo = jnp.maximum(lo, ctx - scalars_ref[1])
    hi = jnp.minimum((split + 1) * split_tokens, ctx)
    j = jnp.arange(kv_tokens, dtype=jnp.int32)

    def step(kb, carry):
        m_prev, l_prev, acc_prev = carry
        key_pos = kb * kv_tokens + j
        key_ok = (key_pos >= lo) & (key_pos < hi)
        pages = block_tables_ref[seq, jnp.minimum(key_pos // block_size, table_width - 1)]
        where = (layer, pages[:, None], (key_pos % block_size)[:, None], d[None, :])
        load_mask = jnp.broadcast_to(key_ok[:, None], (kv_tokens, head_dim))
        k = plgpu.load(k_ref.at[where], mask=load_mask, other=0)
        v = plgpu.load(v_ref.at[where], mask=load_mask, other=0)
        k, v = (fp8_view(x, fp8).astype(q.dtype) for x in (k, v))  # fp8 bits widen here (scales act outside)
        scores = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32, precision=_DOT_PRECISION)
        if alibi:  # before the scale, as Hugging Face Falcon adds it; the query sits at ctx - 1
            scores += slope[:, None] * (key_pos - (ctx - 1)).astype(jnp.float32)[None, :]
        scores = scores * sm_scale
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        scores = jnp.where(key_ok[None, :], scores, -jnp.inf)
        m_next = jnp.maximum(m_prev, jnp.max(scores, axis=1))
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
        correction = jnp.exp(m_prev - m_safe)
        p = jnp.exp(scores - m_safe[:, None])
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32, precision=_DOT_PRECISION)
        return m_next, correction * l_prev + jnp.sum(p, axis=1), correction[:, None] * acc_prev + pv

    init = (
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, head_dim), jnp.float32),
    )
    first = lo // kv_tokens
    last = jnp.maximum(first, (hi + kv_tokens - 1) // kv_tokens)
    m, l, acc = jax.lax.fori_loop(first, last, step, init)
    acc_ref[split, seq, head[:, None], d[None, :]] = acc
    m_ref[split, seq, head] = m
    l_ref[split, seq, head] = l


# ---- wrapper -------------------------------------------------------------------------------------


def combine_splits(acc: Array, m: Array, l: Array) -> Array:
    """Merge split-K partials by log-sum-exp: acc [splits, ..., D], running max m and sum l
    [splits, ...] -> [..., D] float32 (splits that saw no key weigh nothing; rows none saw give 0)."""
    m_max = jnp.max(m, axis=0)
    m_max = jnp.where(jnp.isfinite(m_max), m_max, 0.0)
    weight = jnp.exp(m - m_max[None])  # 0 for empty splits (m = -inf)
    num = jnp.sum(weight[..., None] * acc, axis=0)
    den = jnp.sum(weight * l, axis=0)
    return num / jnp.where(den > 0, den, 1.0)[..., None]


def _launch_shape(num_seqs: int, num_kv_heads: int, head_dim: int, block_size: int, width: int,
                  config: PagedDecodeAttentionConfig) -> tuple[int, int, int]:
    """(kv_tokens, num_splits, pages_per_split)."""
    kv_tokens = max(config.kv_tokens or (32 if head_dim >= 256 else 64), block_size)
    pages_per_step = kv_tokens // block_size
    max_splits = max(1, -(-width // pages_per_step))
    num_splits = config.num_splits or -(-512 // (num_seqs * num_kv_heads))
    num_splits = max(1, min(num_splits, max_splits))
    steps_per_split = -(-max_splits // num_splits)
    num_splits = -(-max_splits // steps_per_split)  # drop splits that would cover nothing
    return kv_tokens, num_splits, steps_per_split * pages_per_step


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "config", "interpret", "fp8"))
def _paged_decode_attention(
    q: Array, k_cache: Array, v_cache: Array, layer: Array, block_tables: Array, context_lens: Array,
    sliding_window: Array | int | None, alibi_slopes: Array | None, *,
    sm_scale: float, soft_cap: float | None, config: PagedDecodeAttentionConfig, interpret: bool,
    fp8: str | None = None,
) -> Array:
    num_seqs, num_heads, head_dim = q.shape
    num_layers, num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    rows = max(MIN_DOT, next_pow2(group))
    width = block_tables.shape[1]
    kv_tokens, num_splits, pages_per_split = _launch_shape(num_seqs, num_kv_heads, head_dim, block_size, width,
                                                           config)
    tables = block_tables.astype(jnp.int32)
    if num_splits * pages_per_split > width:
        tables = jnp.pad(tables, ((0, 0), (0, num_splits * pages_per_split - width)))

    q4 = q.reshape(num_seqs, num_kv_heads, group, head_dim)
    full = lambda shape: pl.BlockSpec(block_shape=shape, index_map=lambda s, h, k: (0,) * len(shape))  # noqa: E731
    per_head = pl.BlockSpec(block_shape=(num_layers, num_blocks, block_size, _SQUEEZED, head_dim),
                            index_map=lambda s, h, k: (0, 0, 0, h, 0))
    partial_shape = (num_splits, num_seqs, num_kv_heads, group)
    window = window_operand(sliding_window)
    slopes = slopes_operand(alibi_slopes)
    scalars = jnp.asarray(layer, jnp.int32).reshape(1)
    if window is not None:
        scalars = jnp.concatenate([scalars, window.reshape(1)])
    kernel = functools.partial(
        _kernel, group=group, rows=rows, kv_tokens=kv_tokens, split_tokens=pages_per_split * block_size,
        sm_scale=float(sm_scale), soft_cap=None if soft_cap is None else float(soft_cap),
        windowed=window is not None, alibi=slopes is not None, fp8=fp8,
    )
    head_inputs = ([full((num_heads,))], [slopes]) if slopes is not None else ([], [])
    acc, m, l = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((*partial_shape, head_dim), jnp.float32),
            jax.ShapeDtypeStruct(partial_shape, jnp.float32),
            jax.ShapeDtypeStruct(partial_shape, jnp.float32),
        ),
        grid=(num_seqs, num_kv_heads, num_splits),
        in_specs=[
            full(scalars.shape),
            full(tables.shape),
            full((num_seqs,)),
            *head_inputs[0],
            pl.BlockSpec(block_shape=(num_seqs, _SQUEEZED, group, head_dim), index_map=lambda s, h, k: (0, h, 0, 0)),
            per_head,
            per_head,
        ],
        out_specs=(
            pl.BlockSpec(block_shape=(num_splits, num_seqs, _SQUEEZED, group, head_dim),
                         index_map=lambda s, h, k: (0, 0, h, 0, 0)),
            pl.BlockSpec(block_shape=(num_splits, num_seqs, _SQUEEZED, group), index_map=lambda s, h, k: (0, 0, h, 0)),
            pl.BlockSpec(block_shape=(num_splits, num_seqs, _SQUEEZED, group), index_map=lambda s, h, k: (0, 0, h, 0)),
        ),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="paged_decode_attention",
    )(scalars, tables, context_lens.astype(jnp.int32), *head_inputs[1], q4, k_cache, v_cache)
    return combine_splits(acc, m, l).reshape(num_seqs, num_heads, head_dim).astype(q.dtype)


# ---- public entry and reference ------------------------------------------------------------------


def paged_decode_attention(
    q: Float[Array, "S H D"],
    k_cache: Float[Array, "L N P K D"],
    v_cache: Float[Array, "L N P K D"],
    layer: Int[Array, ""] | int,
    block_tables: Int[Array, "S B"],
    context_lens: Int[Array, " S"],
    *,
    sm_scale: float,
    sliding_window: Window = None,
    soft_cap: float | None = None,
    alibi_slopes: Float[Array, " H"] | None = None,
    config: PagedDecodeAttentionConfig = PagedDecodeAttentionConfig(),
    interpret: bool = False,
    fp8: str | None = None,
) -> Float[Array, "S H D"]:
    """One decode token per sequence attending to its paged context (Pallas/Triton, split-K).

    The token of sequence s sits at `qp = context_lens[s] - 1` and sees cache positions kp with
    `qp - W < kp <= qp` (W = sliding_window, none if None); the score of query head h is
    `(q.k + alibi_slopes[h] * (kp - qp)) * sm_scale` (ALiBi only if given), then
    `soft_cap * tanh(score / soft_cap)` if `soft_cap`. Keys before the window are never read.

    Args:
      q: [num_seqs, num_heads, head_dim] (float32, bfloat16 or float16), the token at position
        `context_lens[s] - 1` of each sequence.
      k_cache, v_cache: [num_layers, num_blocks, block_size, num_kv_heads, head_dim], q's dtype,
        with this step's K/V already written; with `fp8`, uint8 bits of values in that format.
      layer: layer of the stacked cache (int or int32 scalar, may be traced).
      block_tables: [num_seqs, max_blocks] block ids; context_lens: [num_seqs] (0 = padding).
      sm_scale, soft_cap: static, as in `ragged_paged_attention_reference`.
      sliding_window: None (no window code), a Python int >= 1 (ValueError otherwise), or an int32
        scalar that may be traced (not checkable; clamped to [1, NO_WINDOW]; `NO_WINDOW` means no
        window). One compiled kernel serves every window value.
      alibi_slopes: None (no ALiBi code) or float32 [num_heads], a dynamic array.
      config: tuning knobs (split count, keys per step, warps, stages).
      interpret: run with the Pallas interpreter (CPU tests).
    """
    validate_q_and_cache(q, k_cache, v_cache, "paged_decode_attention", fp8=fp8)
    check_decode_tables(q, block_tables, context_lens, "paged_decode_attention")
    window = check_options(q, sm_scale, sliding_window, soft_cap, alibi_slopes, "paged_decode_attention")
    return _paged_decode_attention(
        q, k_cache, v_cache, layer, block_tables, context_lens, window, alibi_slopes, sm_scale=float(sm_scale),
        soft_cap=None if soft_cap is None else float(soft_cap), config=config, interpret=interpret, fp8=fp8,
    )


def decode_metadata(block_tables: Array, context_lens: Array) -> AttentionMetadata:
    """The ragged metadata of a pure-decode batch: one token per sequence (padding sequences too;
    their context length 0 masks everything, so they give zeros)."""
    num_seqs = context_lens.shape[0]
    return AttentionMetadata(
        slot_mapping=jnp.zeros((num_seqs,), jnp.int32), block_tables=block_tables,
        context_lens=context_lens, query_start_loc=jnp.arange(num_seqs + 1, dtype=jnp.int32),
        logits_indices=jnp.arange(num_seqs, dtype=jnp.int32),
    )


def paged_decode_attention_reference(
    q: Float[Array, "S H D"],
    k_cache: Float[Array, "L N P K D"],
    v_cache: Float[Array, "L N P K D"],
    layer: Int[Array, ""] | int,
    block_tables: Int[Array, "S B"],
    context_lens: Int[Array, " S"],
    *,
    sm_scale: float,
    sliding_window: Window = None,
    soft_cap: float | None = None,
    alibi_slopes: Float[Array, " H"] | None = None,
    fp8: str | None = None,
) -> Float[Array, "S H D"]:
    """Pure `jnp` reference: the ragged reference on a one-token-per-sequence batch (same window,
    ALiBi and fp8 contract as `paged_decode_attention`)."""
    return ragged_paged_attention_reference(
        q, k_cache, v_cache, layer, decode_metadata(block_tables, context_lens), sm_scale=sm_scale,
        sliding_window=sliding_window, soft_cap=soft_cap, alibi_slopes=alibi_slopes, fp8=fp8,
    )
