"""Ragged paged attention as one Pallas (Triton) kernel: the engine's whole mixed step in one launch.

The batch is the engine's flattened ragged batch (see `metadata.py`): each sequence brings a query
chunk (a prompt chunk or one decode token) that attends causally to its cached context through its
block table. Semantics and signature match `ragged_paged_attention_reference` beside this file
(`reference.py`), which is what CPU serving runs and what the tests compare with.

Work decomposition (all shapes static):

* A *work item* is (sequence, query block): `block_q` consecutive query tokens of one sequence. The
  wrapper lists the work items with `jnp` from the metadata inside the jit; their count is bounded
  by `min(T, T // block_q + S)` (each sequence wastes at most one partial block), which is the grid's
  first axis. Programs past the real count return at once.
* The grid's second axis is the KV head. A program computes all query heads that share that KV head
  together: its rows are (query token x head of the group), `block_q * group_pad` rows, where
  `group_pad` is the group size rounded up to a power of two and `block_q` is chosen so the rows
  reach `query_rows` (at least the 16 rows a tensor-core dot needs). A decode token therefore puts
  its G heads in the rows; a prompt chunk fills them with (tokens x G heads).
* The program walks its keys `kv_tokens` at a time (a few pages, read through the block table),
  from the first key any of its rows may see (sliding window) to its last query's position only, with
  an online softmax in float32 (running max, running sum, float32 accumulator).
* Every K/V load is masked by "this key is in the context and in range for this block": masked
  lanes are not read at all on the GPU (and are zero in interpret mode), so unused pages (even full of
  NaN) never reach the result; scores of disallowed keys are -inf before the softmax.
* The sliding window is a run-time scalar (the third entry of the kernel's int32 scalars), so one
  compiled kernel serves every layer of a `lax.scan` whatever its window; ALiBi slopes are an [H]
  float32 input. Neither is in the kernel at all when not given.
* Padding tokens belong to no work item: the output starts as zeros (an aliased zero buffer) and
  only real rows are stored, so padding tokens come out as exact zeros, as in the reference.

KV-cache writes stay in XLA (`write_kv_reference`): the scatter of this step's T new rows into
their slots is already a single pass over the new tokens with no extra traffic; a Pallas write
kernel cannot beat it unless fused into the attention kernel itself, which would serialise the
write behind the attention grid (every query block of a chunk needs the whole chunk written first).

Dot products are `lax.dot_general` with `preferred_element_type=float32` and `precision=HIGHEST`,
so the kernel body is backend-neutral and also runs under `interpret=True` on CPU; the Triton
lowering is selected by passing Triton compiler params. Why HIGHEST: Pallas' Triton lowering runs
a float32 dot without an explicit precision as TF32 (relative error near 3e-4), which the float32
tolerance of the start-up self-check and of gpu_check (1e-5) rightly rejects; HIGHEST lowers to
IEEE float32 there. For 16-bit inputs it changes nothing (they multiply exactly into float32).
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
    check_options,
    is_pow2,
    next_pow2,
    supports_ragged_paged_attention,
    validate_q_and_cache,
)
from paxserve.kernels.metadata import AttentionMetadata
from paxserve.kernels.reference import ragged_paged_attention_reference

__all__ = [
    "RaggedPagedAttentionConfig",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "supports_ragged_paged_attention",
]

# `pl.squeezed` is the newer spelling of a squeezed block dimension; `None` is the older one.
_SQUEEZED = getattr(pl, "squeezed", None)
# IEEE float32 for float32 inputs in the Triton lowering (its default is TF32); see the docstring.
_DOT_PRECISION = jax.lax.Precision.HIGHEST


@dataclass(frozen=True)
class RaggedPagedAttentionConfig:
    """Tuning knobs (static, hashable). `None` picks a default from the shapes.

    query_rows: rows per program (query tokens x heads of a KV group), a power of two >= 16.
    kv_tokens: keys per inner step (pages_per_step = kv_tokens // block_size), a power of two >= 16
        and >= block_size; default 64 (32 for head_dim 256).
    num_warps, num_stages: Triton launch parameters.
    """

    query_rows: int = 32
    kv_tokens: int | None = None
    num_warps: int | None = None
    num_stages: int = 2

    def __post_init__(self) -> None:
        if not is_pow2(self.query_rows) or self.query_rows < MIN_DOT:
            raise ValueError(f"query_rows must be a power of two >= {MIN_DOT}, got {self.query_rows}")
        if self.kv_tokens is not None and (not is_pow2(self.kv_tokens) or self.kv_tokens < MIN_DOT):
            raise ValueError(f"kv_tokens must be a power of two >= {MIN_DOT}, got {self.kv_tokens}")
        if self.num_warps is not None and self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be one of 1, 2, 4, 8, 16, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")


# ---- kernel --------------------------------------------------------------------------------------


def _kernel(
    *refs,
    block_q: int,
    group: int,
    group_pad: int,
    kv_tokens: int,
    sm_scale: float,
    soft_cap: float | None,
    windowed: bool,
    alibi: bool,
    fp8: str | None = None,
):
    """refs, in order:
    scalars_ref  [2 or 3] int32: layer, number of real work items, and the window if `windowed`
    block_tables_ref  [S, B] int32, B a multiple of pages per step
    context_lens_ref  [S] int32
    query_start_loc_ref  [S + 1] int32
    item_seq_ref  [W] int32: sequence of each work item
    item_qblock_ref  [W] int32: query block of each work item within its sequence
    slopes_ref  [H] float32, only if `alibi`
    q_ref  [T, G, D] this program's KV group
    k_ref, v_ref  [L, N, P, D] this program's KV head
    zeros_ref  [T, G, D] aliased with the output (its initial zeros); never read
    o_ref  [T, G, D]
    """
    (scalars_ref, block_tables_ref, context_lens_ref, query_start_loc_ref, item_seq_ref, item_qblock_ref,
     *slopes, q_ref, k_ref, v_ref, _zeros_ref, o_ref) = refs
    # Program ids are read here: the interpreter does not replace them inside the `pl.when` body.
    item, kv_head = pl.program_id(0), pl.program_id(1)
    block_size, head_dim = k_ref.shape[-2], k_ref.shape[-1]
    table_width = block_tables_ref.shape[1]

    @pl.when(item < scalars_ref[1])
    def _():
        layer = scalars_ref[0]
        window = scalars_ref[2] if windowed else None
        seq = item_seq_ref[item]
        q_start = query_start_loc_ref[seq]
        q_end = query_start_loc_ref[seq + 1]
        ctx = context_lens_ref[seq]
        first_token = q_start + item_qblock_ref[item] * block_q

        rows = block_q * group_pad
        r = jnp.arange(rows, dtype=jnp.int32)
        token = first_token + r // group_pad
        head = r % group_pad
        # Rows past the chunk's last token or the group's last head repeat that token/head: they
        # compute exactly its values and store them to its address, so no row needs a store mask
        # (a masked scatter with repeated addresses is not well defined in interpret mode).
        token = jnp.minimum(token, q_end - 1)
        head = jnp.minimum(head, group - 1)
        q_pos = ctx - (q_end - token)  # cache position of each row's token
        d = jnp.arange(head_dim, dtype=jnp.int32)
        q = q_ref[token[:, None], head[:, None], d[None, :]]  # [rows, D]
        slope = slopes[0][kv_head * group + head] if alibi else None  # [rows]

        # Keys any row of this block may see: [lo, hi]. The key loop starts at lo's step, so steps
        # wholly before the window (a traced window too) are never loaded.
        first_pos = ctx - (q_end - first_token)
        hi = jnp.minimum(first_pos + block_q - 1, ctx - 1)
        lo = jnp.int32(0) if window is None else jnp.maximum(first_pos - window + 1, 0)
        j = jnp.arange(kv_tokens, dtype=jnp.int32)

        def step(kb, carry):
            m_prev, l_prev, acc_prev = carry
            key_pos = kb * kv_tokens + j
            key_ok = (key_pos >= lo) & (key_pos <= hi)
            page_index = jnp.minimum(key_pos // block_size, table_width - 1)
            pages = block_tables_ref[seq, page_index]  # [kv_tokens] (one entry per key; pages repeat)
            offsets = key_pos % block_size
            load_mask = jnp.broadcast_to(key_ok[:, None], (kv_tokens, head_dim))
            where = (layer, pages[:, None], offsets[:, None], d[None, :])
            k = plgpu.load(k_ref.at[where], mask=load_mask, other=0)
            v = plgpu.load(v_ref.at[where], mask=load_mask, other=0)
            k, v = (fp8_view(x, fp8).astype(q.dtype) for x in (k, v))  # fp8 bits widen here (scales act outside)

            scores = jax.lax.dot_general(
                q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32, precision=_DOT_PRECISION
            )  # [rows, kv_tokens]
            if alibi:  # before the scale, as Hugging Face Falcon adds it
                scores += slope[:, None] * (key_pos[None, :] - q_pos[:, None]).astype(jnp.float32)
            scores = scores * sm_scale
            if soft_cap is not None:
                scores = soft_cap * jnp.tanh(scores / soft_cap)
            allowed = key_ok[None, :] & (key_pos[None, :] <= q_pos[:, None])
            if window is not None:
                allowed &= key_pos[None, :] > q_pos[:, None] - window
            scores = jnp.where(allowed, scores, -jnp.inf)

            m_next = jnp.maximum(m_prev, jnp.max(scores, axis=1))
            m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # rows with nothing seen yet
            correction = jnp.exp(m_prev - m_safe)
            p = jnp.exp(scores - m_safe[:, None])
            l_next = correction * l_prev + jnp.sum(p, axis=1)
            pv = jax.lax.dot_general(
                p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32, precision=_DOT_PRECISION
            )
            return m_next, l_next, correction[:, None] * acc_prev + pv

        init = (
            jnp.full((rows,), -jnp.inf, jnp.float32),
            jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32),
        )
        _, l_fin, acc = jax.lax.fori_loop(lo // kv_tokens, hi // kv_tokens + 1, step, init)
        out = acc / jnp.where(l_fin > 0, l_fin, 1.0)[:, None]
        o_ref[token[:, None], head[:, None], d[None, :]] = out.astype(o_ref.dtype)


# ---- wrapper -------------------------------------------------------------------------------------


def _launch_shape(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                  config: RaggedPagedAttentionConfig) -> tuple[int, int, int, int]:
    group = num_heads // num_kv_heads
    group_pad = next_pow2(group)
    block_q = max(1, config.query_rows // group_pad)
    kv_tokens = config.kv_tokens or (32 if head_dim >= 256 else 64)
    kv_tokens = max(kv_tokens, block_size)
    return group, group_pad, block_q, kv_tokens


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "config", "interpret", "fp8"))
def _ragged_paged_attention(
    q: Array, k_cache: Array, v_cache: Array, layer: Array, metadata: AttentionMetadata,
    sliding_window: Array | int | None, alibi_slopes: Array | None, *,
    sm_scale: float, soft_cap: float | None, config: RaggedPagedAttentionConfig, interpret: bool,
    fp8: str | None = None,
) -> Array:
    num_tokens, num_heads, head_dim = q.shape
    num_layers, num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = metadata.num_seqs
    group, group_pad, block_q, kv_tokens = _launch_shape(num_heads, num_kv_heads, head_dim, block_size, config)
    pages_per_step = kv_tokens // block_size
    window = window_operand(sliding_window)
    slopes = slopes_operand(alibi_slopes)

    item_seq, item_qblock, num_items = metadata.query_blocks(num_tokens, block_q)
    max_items = item_seq.shape[0]
    scalars = [jnp.asarray(layer, jnp.int32).reshape(()), num_items.astype(jnp.int32)]
    scalars = jnp.stack(scalars if window is None else [*scalars, window])
    tables = metadata.block_tables.astype(jnp.int32)
    width = tables.shape[1]
    if width % pages_per_step:  # every step reads whole groups of table entries
        tables = jnp.pad(tables, ((0, 0), (0, pages_per_step - width % pages_per_step)))

    q4 = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    full = lambda shape: pl.BlockSpec(block_shape=shape, index_map=lambda w, h: (0,) * len(shape))  # noqa: E731
    per_group = pl.BlockSpec(block_shape=(num_tokens, _SQUEEZED, group, head_dim), index_map=lambda w, h: (0, h, 0, 0))
    per_head = pl.BlockSpec(
        block_shape=(num_layers, num_blocks, block_size, _SQUEEZED, head_dim), index_map=lambda w, h: (0, 0, 0, h, 0)
    )
    kernel = functools.partial(
        _kernel, block_q=block_q, group=group, group_pad=group_pad, kv_tokens=kv_tokens, sm_scale=float(sm_scale),
        soft_cap=None if soft_cap is None else float(soft_cap), windowed=window is not None,
        alibi=slopes is not None, fp8=fp8,
    )
    head_inputs = ([full((num_heads,))], [slopes]) if slopes is not None else ([], [])
    in_specs = [full(scalars.shape), full(tables.shape), full((num_seqs,)), full((num_seqs + 1,)),
                full((max_items,)), full((max_items,)), *head_inputs[0], per_group, per_head, per_head, per_group]
    args = [scalars, tables, metadata.context_lens.astype(jnp.int32), metadata.query_start_loc.astype(jnp.int32),
            item_seq, item_qblock, *head_inputs[1], q4, k_cache, v_cache, jnp.zeros_like(q4)]
    num_warps = config.num_warps or (8 if block_q * group_pad * head_dim >= 64 * 256 else 4)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(q4.shape, q.dtype),
        grid=(max_items, num_kv_heads),
        in_specs=in_specs,
        out_specs=per_group,
        input_output_aliases={len(args) - 1: 0},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="ragged_paged_attention",
    )(*args)
    return out.reshape(num_tokens, num_heads, head_dim)


# ---- public entry --------------------------------------------------------------------------------


def _validate_metadata(metadata: AttentionMetadata) -> None:
    s = metadata.context_lens.shape
    if len(s) != 1 or metadata.query_start_loc.shape != (s[0] + 1,) or metadata.block_tables.shape[:1] != s:
        raise ValueError(
            "metadata: context_lens [S], query_start_loc [S + 1] and block_tables [S, B] disagree: "
            f"{metadata.context_lens.shape}, {metadata.query_start_loc.shape}, {metadata.block_tables.shape}"
        )


def ragged_paged_attention(
    q: Float[Array, "T H D"],
    k_cache: Float[Array, "L N P K D"],
    v_cache: Float[Array, "L N P K D"],
    layer: Int[Array, ""] | int,
    metadata: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: Window = None,
    soft_cap: float | None = None,
    alibi_slopes: Float[Array, " H"] | None = None,
    config: RaggedPagedAttentionConfig = RaggedPagedAttentionConfig(),
    interpret: bool = False,
    fp8: str | None = None,
) -> Float[Array, "T H D"]:
    """Causal attention of each new token to its own sequence's cached context (Pallas/Triton).

    Same contract as `ragged_paged_attention_reference`: token t of sequence s (query length n,
    context length c, this step's K/V already written) sits at position
    `qp = c - n + (t - query_start_loc[s])` and attends to cache positions kp `<= qp` (and, with a
    sliding window W, `> qp - W`); the score of query head h is
    `(q.k + alibi_slopes[h] * (kp - qp)) * sm_scale` (ALiBi only if given), then
    `soft_cap * tanh(score / soft_cap)` if `soft_cap`; padding tokens give zeros; pages outside a
    sequence's context or wholly before a query block's window are never read.

    Args:
      q: [num_tokens, num_heads, head_dim] in float32, bfloat16 or float16.
      k_cache, v_cache: [num_layers, num_blocks, block_size, num_kv_heads, head_dim], q's dtype, or
        with `fp8` ("float8_e4m3fn" / "float8_e5m2") uint8 bits of values in that format, widened in the
        kernel as they are loaded (pallas_kernels/kv_cache.py).
      layer: which layer of the stacked cache to read (int or int32 scalar, may be traced).
      metadata: the step's `AttentionMetadata` (slot_mapping and logits_indices are not used).
      sm_scale: score scale, usually head_dim ** -0.5 (static).
      sliding_window: None (no window code in the kernel), a Python int >= 1 (ValueError
        otherwise), or an int32 scalar that may be traced (a per-layer window scanned over layers;
        not checkable, clamped to [1, NO_WINDOW]; `NO_WINDOW` means no window). One compiled
        kernel serves every window value.
      soft_cap: optional, > 0 (static).
      alibi_slopes: None (no ALiBi code) or float32 [num_heads], a dynamic array.
      config: tuning knobs.
      interpret: run the kernel with the Pallas interpreter (CPU tests) instead of Triton.

    Requirements: num_heads a multiple of num_kv_heads; head_dim a power of two >= 16; block_size a
    power of two. Raises ValueError otherwise (`supports_ragged_paged_attention` checks ahead).
    """
    validate_q_and_cache(q, k_cache, v_cache, "ragged_paged_attention", fp8=fp8)
    _validate_metadata(metadata)
    window = check_options(q, sm_scale, sliding_window, soft_cap, alibi_slopes, "ragged_paged_attention")
    return _ragged_paged_attention(
        q, k_cache, v_cache, layer, metadata, window, alibi_slopes, sm_scale=float(sm_scale),
        soft_cap=None if soft_cap is None else float(soft_cap), config=config, interpret=interpret, fp8=fp8,
    )
