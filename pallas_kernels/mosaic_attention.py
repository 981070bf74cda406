"""Paged attention on Mosaic GPU (Hopper): the engine's ragged mixed step and its pure-decode step.

Both entries cut the batch into *work units* with `jnp` inside the jit and run the one kernel of
`mosaic_kernel.py` over (KV head, unit); their references are the XLA ones the tests compare with:
`ragged_paged_attention_reference` (`reference.py`) and
`paged_decode_attention_reference` (`decode_attention.py`).

* Query packing: each unit's rows (token x head of a KV group, see `mosaic_kernel.py`) are gathered
  into a dense `[num_kv_heads, units, rows, head_dim]` array, so one TMA copy loads a unit's query.
  Decode units have `group_pad` rows (at least 8); prompt units `64 // group_pad` tokens of 64 rows.
* Split-K: a unit's cache range can be split into `num_splits` pieces of whole 64-position stages,
  each its own program; the pieces' float32 partial outputs are merged here by log-sum-exp. The
  split count is chosen from the grid: enough programs for two waves over the GPU's SMs (132 on an
  H100/H200 SXM) when the batch alone does not fill them, never pieces shorter than 4 stages.
* Every option of the reference is served: causal, sliding window (a run-time scalar, so one compile
  serves every layer of a `lax.scan`), soft-cap, ALiBi, GQA groups up to 64, block sizes 8/16/32/64,
  head dims 64/128/256 in bfloat16 or float16, and an fp8 cache (`fp8`: its uint8 bits are seen as
  that format, copied at one byte a value and widened in the kernel).

`interpret=True` (or a `plgpu.InterpretGPUParams`) runs the kernel in Mosaic GPU's interpret mode on
the CPU (JAX >= 0.11.2), which simulates shared memory, barriers and TMA; lowering for CUDA needs no
GPU at all (`jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from paxserve.kernels.attention_args import Window, slopes_operand, window_operand
from paxserve.kernels.kv_cache import fp8_view
from paxserve.kernels.kernel_checks import check_decode_tables, check_options, next_pow2, validate_q_and_cache
from paxserve.kernels.metadata import AttentionMetadata
from paxserve.kernels.mosaic_kernel import (
    ROWS,
    STAGE,
    U_KV_HI,
    U_KV_LO,
    U_QBLOCK,
    U_QPOS0,
    U_SEQ,
    UNIT_FIELDS,
    KernelShape,
    launch_units,
    smem_bytes,
)
from paxserve.kernels.decode_attention import combine_splits

__all__ = ["MosaicAttentionConfig", "mosaic_paged_decode_attention", "mosaic_ragged_paged_attention",
           "supports_mosaic_attention"]

MOSAIC_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_SMEM_BUDGET = 200 * 1024  # of the 227 KiB an H100/H200 block may use, leaving room for the compiler


@dataclasses.dataclass(frozen=True)
class MosaicAttentionConfig:
    """Tuning knobs (static, hashable); None picks from the shapes.

    num_buffers: K/V stages in the shared-memory ring (>= 2): 3 up to head_dim 128, 2 at 256.
    num_splits: split-K pieces per unit (>= 1).
    num_sms: streaming multiprocessors the split heuristic fills (132 on H100/H200 SXM).
    """

    num_buffers: int | None = None
    num_splits: int | None = None
    num_sms: int = 132

    def __post_init__(self) -> None:
        if self.num_buffers is not None and self.num_buffers < 2:
            raise ValueError(f"num_buffers must be >= 2, got {self.num_buffers}")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {self.num_splits}")
        if self.num_sms < 1:
            raise ValueError(f"num_sms must be >= 1, got {self.num_sms}")


def supports_mosaic_attention(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                              dtype: jnp.dtype) -> str | None:
    """None if the Mosaic GPU kernel serves these shapes, else the reason it does not."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        return f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}"
    if num_heads // num_kv_heads > ROWS:
        return f"a GQA group of {num_heads // num_kv_heads} query heads exceeds the {ROWS} rows of one wgmma"
    if head_dim % 64 or not 64 <= head_dim <= 256:
        return f"head_dim={head_dim} must be 64, 128, 192 or 256 (128-byte swizzled tiles)"
    if block_size < 8 or STAGE % block_size:
        return f"block_size={block_size} must divide {STAGE} and be >= 8 (8, 16, 32 or 64)"
    if jnp.dtype(dtype) not in MOSAIC_DTYPES:
        return f"dtype {jnp.dtype(dtype).name} is not bfloat16 or float16 (the wgmma input types)"
    return None


def _kernel_shape(q: Array, k_cache: Array, tokens_per_unit: int | None, *, sm_scale: float,
                  soft_cap: float | None, window: Array | None, slopes: Array | None,
                  config: MosaicAttentionConfig, fp8: str | None = None) -> KernelShape:
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[3]
    group = num_heads // num_kv_heads
    group_pad = next_pow2(group)
    page_itemsize = None if fp8 is None else 1
    nbuf = config.num_buffers or (3 if smem_bytes(head_dim, 3, q.dtype.itemsize, page_itemsize) <= _SMEM_BUDGET
                                  else 2)
    return KernelShape(
        num_kv_heads=num_kv_heads, group=group, group_pad=group_pad,
        tokens_per_unit=tokens_per_unit or ROWS // group_pad, head_dim=head_dim, block_size=k_cache.shape[2],
        dtype=jnp.dtype(q.dtype), num_buffers=nbuf, sm_scale=float(sm_scale),
        soft_cap=None if soft_cap is None else float(soft_cap), has_window=window is not None,
        has_alibi=slopes is not None, fp8=fp8)


def ceil_div(a, b):  # noqa: ANN001, ANN201 - Python ints and int32 arrays alike
    return -(-a // b)


def _num_splits(config: MosaicAttentionConfig, num_kv_heads: int, num_units: int, max_context: int) -> int:
    if config.num_splits is not None:
        return config.num_splits
    wanted = ceil_div(2 * config.num_sms, num_kv_heads * num_units)
    return max(1, min(wanted, max_context // (4 * STAGE)))


def _split(units: Int[Array, "W 8"], kv_lo: Array, kv_hi: Array, splits: int) -> Int[Array, "WS 8"]:
    """Each unit's range cut into `splits` pieces of whole stages (empty pieces read nothing)."""
    if splits == 1:
        return units.at[:, U_KV_LO].set(kv_lo).at[:, U_KV_HI].set(kv_hi)
    piece = ceil_div(jnp.maximum(kv_hi - kv_lo, 0), splits * STAGE) * STAGE
    j = jnp.arange(splits, dtype=jnp.int32)[None, :]
    lo = jnp.minimum(kv_hi[:, None], kv_lo[:, None] + j * piece[:, None])
    hi = jnp.minimum(kv_hi[:, None], lo + piece[:, None])
    out = jnp.repeat(units, splits, axis=0)
    return out.at[:, U_KV_LO].set(lo.reshape(-1)).at[:, U_KV_HI].set(hi.reshape(-1))


def _run(q_blocks: Array, units: Array, kv_lo: Array, kv_hi: Array, tables: Array, k_cache: Array,
         v_cache: Array, layer: Array | int, window: Array | None, slopes: Array | None, shape: KernelShape,
         config: MosaicAttentionConfig, interpret: object) -> Float[Array, "K W R D"]:
    """Launch over the (split) units and merge the pieces: normalised float32 rows per unit."""
    num_units = units.shape[0]
    splits = _num_splits(config, shape.num_kv_heads, num_units, tables.shape[1] * shape.block_size)
    units = _split(units, kv_lo, kv_hi, splits)
    scalars = jnp.stack([jnp.asarray(layer, jnp.int32).reshape(()),
                         jnp.asarray(0 if window is None else window, jnp.int32).reshape(())])
    if slopes is None:
        slope_rows = jnp.zeros((shape.num_kv_heads, ROWS), jnp.float32)
    else:  # row r of a unit is head r % group_pad of its KV group
        per_group = slopes.reshape(shape.num_kv_heads, shape.group)
        per_group = jnp.pad(per_group, ((0, 0), (0, shape.group_pad - shape.group)))
        slope_rows = jnp.tile(per_group, (1, ROWS // shape.group_pad))
    k_cache, v_cache = fp8_view(k_cache, shape.fp8), fp8_view(v_cache, shape.fp8)  # free bitcasts
    args = (units, tables, scalars, slope_rows, q_blocks, k_cache, v_cache)
    if interpret:
        from jax.experimental.pallas import mosaic_gpu as plgpu

        if not hasattr(plgpu, "InterpretGPUParams"):
            raise RuntimeError(f"Mosaic GPU interpret mode needs JAX >= 0.11.2 (this is JAX {jax.__version__})")
        params = interpret if isinstance(interpret, plgpu.InterpretGPUParams) else plgpu.InterpretGPUParams()
        with plgpu.force_gpu_interpret_mode(params):
            o, m, l = launch_units(*args, shape)
    else:
        o, m, l = launch_units(*args, shape)
    r = shape.rows_in
    o = o.reshape(shape.num_kv_heads, num_units, splits, r, shape.head_dim)
    m = m[..., :r].reshape(shape.num_kv_heads, num_units, splits, r)
    l = l[..., :r].reshape(shape.num_kv_heads, num_units, splits, r)
    return combine_splits(jnp.moveaxis(o, 2, 0), jnp.moveaxis(m, 2, 0), jnp.moveaxis(l, 2, 0))


def _pack_query(q: Array, shape: KernelShape, token_idx: Array, token_ok: Array) -> Float[Array, "K W R D"]:
    """q [T, H, D] -> per unit [K, W, rows_in, D]: row (t, g) = q[token_idx[w, t], head g of the group]."""
    num_tokens, _, d = q.shape
    q4 = q.reshape(num_tokens, shape.num_kv_heads, shape.group, d)
    q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, shape.group_pad - shape.group), (0, 0)))
    blocks = jnp.where(token_ok[..., None, None, None], q4[token_idx], 0)  # [W, bq, K, Gp, D]
    w, bq = token_idx.shape
    blocks = blocks.transpose(2, 0, 1, 3, 4).reshape(shape.num_kv_heads, w, bq * shape.group_pad, d)
    if blocks.shape[2] < shape.rows_in:
        blocks = jnp.pad(blocks, ((0, 0), (0, 0), (0, shape.rows_in - blocks.shape[2]), (0, 0)))
    return blocks.astype(q.dtype)


def _units(qblock: Array, seq: Array, qpos0: Array) -> Int[Array, "W 8"]:
    units = jnp.zeros((qblock.shape[0], UNIT_FIELDS), jnp.int32)
    return units.at[:, U_QBLOCK].set(qblock).at[:, U_SEQ].set(seq).at[:, U_QPOS0].set(qpos0)


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "config", "interpret", "fp8"))
def _ragged(q, k_cache, v_cache, layer, metadata: AttentionMetadata, window, slopes, *, sm_scale, soft_cap,  # noqa: ANN001
            config, interpret, fp8):
    num_tokens, num_heads, head_dim = q.shape
    window, slopes = window_operand(window), slopes_operand(slopes)
    shape = _kernel_shape(q, k_cache, None, sm_scale=sm_scale, soft_cap=soft_cap, window=window, slopes=slopes,
                          config=config, fp8=fp8)
    bq = shape.tokens_per_unit
    seq, blk, count = metadata.query_blocks(num_tokens, bq)
    qsl, ctx = metadata.query_start_loc.astype(jnp.int32), metadata.context_lens.astype(jnp.int32)
    qlen = qsl[1:] - qsl[:-1]
    real = jnp.arange(seq.shape[0], dtype=jnp.int32) < count
    first = blk * bq
    ntok = jnp.where(real, jnp.clip(qlen[seq] - first, 0, bq), 0)
    qpos0 = ctx[seq] - qlen[seq] + first
    kv_hi = jnp.where(ntok > 0, qpos0 + ntok, 0)
    kv_lo = jnp.zeros_like(kv_hi) if window is None else jnp.clip(qpos0 - window + 1, 0, kv_hi)
    t = jnp.arange(bq, dtype=jnp.int32)[None, :]
    token_idx = jnp.clip(qsl[seq][:, None] + first[:, None] + t, 0, num_tokens - 1)
    q_blocks = _pack_query(q, shape, token_idx, t < ntok[:, None])
    units = _units(jnp.arange(seq.shape[0], dtype=jnp.int32), seq, qpos0)
    rows = _run(q_blocks, units, kv_lo, kv_hi, metadata.block_tables.astype(jnp.int32), k_cache, v_cache, layer,
                window, slopes, shape, config, interpret)
    # Back to tokens: token i of sequence s is row (i % bq) of unit (first unit of s) + i // bq.
    tok = jnp.arange(num_tokens, dtype=jnp.int32)
    tseq = metadata.token_seq_ids(num_tokens)
    i = tok - qsl[tseq]
    blocks_per_seq = ceil_div(qlen, bq)
    unit = (jnp.cumsum(blocks_per_seq) - blocks_per_seq)[tseq] + i // bq
    unit = jnp.clip(unit, 0, rows.shape[1] - 1)
    row = (i % bq)[:, None] * shape.group_pad + jnp.arange(shape.group, dtype=jnp.int32)[None, :]
    kv = jnp.arange(shape.num_kv_heads, dtype=jnp.int32)
    out = rows[kv[None, :, None], unit[:, None, None], row[:, None, :]]  # [T, K, G, D]
    out = jnp.where(metadata.token_is_valid(num_tokens)[:, None, None, None], out, 0.0)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


def mosaic_ragged_paged_attention(
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
    config: MosaicAttentionConfig = MosaicAttentionConfig(),
    interpret: object = False,
    fp8: str | None = None,
) -> Float[Array, "T H D"]:
    """The engine's mixed prefill + decode step on Mosaic GPU; the contract of
    `ragged_paged_attention_reference` (causal attention of each new token to its own sequence's
    cached context, this step's K/V already written; padding tokens give zeros; pages outside a
    sequence's context never reach the result).

    q: [num_tokens, num_heads, head_dim], bfloat16 or float16; caches `[L, N, P, K, D]` alike.
    layer: int or int32 scalar (may be traced). sliding_window: None, an int >= 1 or a traced int32.
    alibi_slopes: None or [num_heads] floats. sm_scale, soft_cap: static floats.
    interpret: False on a GPU; True or a `plgpu.InterpretGPUParams` for Mosaic GPU's interpret mode
      (JAX >= 0.11.2, CPU).
    fp8: the caches hold uint8 bits of values in this format ("float8_e4m3fn" / "float8_e5m2"),
      widened in the kernel; their scales are the caller's (q before, the output after).
    Raises ValueError for shapes `supports_mosaic_attention` rejects.
    """
    validate_q_and_cache(q, k_cache, v_cache, "mosaic_ragged_paged_attention", supports_mosaic_attention, fp8=fp8)
    window = check_options(q, sm_scale, sliding_window, soft_cap, alibi_slopes, "mosaic_ragged_paged_attention")
    return _ragged(q, k_cache, v_cache, layer, metadata, window, alibi_slopes, sm_scale=float(sm_scale),
                   soft_cap=None if soft_cap is None else float(soft_cap), config=config, interpret=interpret, fp8=fp8)


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "config", "interpret", "fp8"))
def _decode(q, k_cache, v_cache, layer, block_tables, context_lens, window, slopes, *, sm_scale, soft_cap,  # noqa: ANN001
            config, interpret, fp8):
    num_seqs, num_heads, head_dim = q.shape
    window, slopes = window_operand(window), slopes_operand(slopes)
    shape = _kernel_shape(q, k_cache, 1, sm_scale=sm_scale, soft_cap=soft_cap, window=window, slopes=slopes,
                          config=config, fp8=fp8)
    ctx = context_lens.astype(jnp.int32)
    seqs = jnp.arange(num_seqs, dtype=jnp.int32)
    kv_hi = jnp.maximum(ctx, 0)
    kv_lo = jnp.zeros_like(kv_hi) if window is None else jnp.clip(ctx - window, 0, kv_hi)
    q_blocks = _pack_query(q, shape, seqs[:, None], (ctx > 0)[:, None])
    rows = _run(q_blocks, _units(seqs, seqs, ctx - 1), kv_lo, kv_hi, block_tables.astype(jnp.int32), k_cache,
                v_cache, layer, window, slopes, shape, config, interpret)
    out = rows[:, :, : shape.group].transpose(1, 0, 2, 3)  # [S, K, G, D]
    return out.reshape(num_seqs, num_heads, head_dim).astype(q.dtype)


def mosaic_paged_decode_attention(
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
    config: MosaicAttentionConfig = MosaicAttentionConfig(),
    interpret: object = False,
    fp8: str | None = None,
) -> Float[Array, "S H D"]:
    """One decode token per sequence (at position `context_lens[s] - 1`, its K/V already written)
    against its paged context, split-K over long contexts; the contract of
    `paged_decode_attention_reference`. Sequences with context 0 give zeros. Arguments as
    `mosaic_ragged_paged_attention`."""
    validate_q_and_cache(q, k_cache, v_cache, "mosaic_paged_decode_attention", supports_mosaic_attention, fp8=fp8)
    check_decode_tables(q, block_tables, context_lens, "mosaic_paged_decode_attention")
    window = check_options(q, sm_scale, sliding_window, soft_cap, alibi_slopes, "mosaic_paged_decode_attention")
    return _decode(q, k_cache, v_cache, layer, block_tables, context_lens, window, alibi_slopes,
                   sm_scale=float(sm_scale), soft_cap=None if soft_cap is None else float(soft_cap), config=config,
                   interpret=interpret, fp8=fp8)
