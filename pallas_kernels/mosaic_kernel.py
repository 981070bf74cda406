"""The Mosaic GPU (Hopper, sm90+) paged attention kernel: one program per (KV head, work unit).

A *work unit* is a tile of up to 64 query rows that share one KV head and one sequence, against
one contiguous range of that sequence's cache positions `[kv_lo, kv_hi)`:

* rows are (query token x query head of the KV head's group): row `r` is token `r // group_pad` of
  the unit and query head `r % group_pad` of the group (`group_pad` = the GQA group rounded up to a
  power of two). A decode unit is one token whose G heads are the rows of the wgmma (padded to its
  M of 64); a prompt unit is `64 // group_pad` consecutive tokens.
* the cache range is walked in *stages* of 64 positions: `64 // block_size` whole pages, each page
  fetched by one TMA copy with its page id read from the block table, into a ring of
  `num_buffers` shared-memory slots, so `num_buffers - 1` stages are in flight while one is computed.
* per stage: S = Q K^T on the tensor cores (wgmma, bf16/fp16 in, float32 out), scale, ALiBi,
  soft-cap, causal / window / range mask, online softmax in float32, then P V by a second wgmma.
* the unit writes its unnormalised float32 accumulator and its running max and sum; the wrapper
  (`mosaic_attention.py`) merges units that split one tile's range (split-K) by log-sum-exp.

Garbage in the cache never reaches the result: pages past a unit's last page are not fetched (the
last valid page is fetched again in their slot so every stage waits for the same byte count),
masked scores are replaced (not added to) by -inf, and in a unit's last stage the V rows at
positions `>= kv_hi` (the unwritten tail of the last page, or a repeated page) are zeroed in shared
memory before P V, since 0 x NaN would still be NaN inside the matmul.

An fp8 cache (float8_e4m3fn or float8_e5m2 pages) is copied as it is stored, half the bytes of a
bf16 one, into a ring of fp8 slots; each stage's K and V tiles are then widened to q's dtype in
registers (exact: both fp8 formats fit bf16 and f16) into one bf16 / f16 tile each, which the
wgmmas read. V's rows past the unit's range are zeroed in that same pass (a garbage fp8 byte can be
NaN). The per-layer scales act outside the kernel (`kv_cache.py`).

Block sizes: 32 is the fastest (two 4 KiB page copies per 64-position stage at d=128), 16 is close,
8 issues eight small copies per stage and spends more of its time in TMA issue than in transfer.
Block sizes must divide 64.

Written for JAX's Mosaic GPU Pallas backend in its default (lane) lowering; both operands of
every wgmma live in shared memory (P is staged through it), which is also what JAX >= 0.11.2's GPU
interpret mode (`plgpu.InterpretGPUParams`) can simulate on a CPU.
"""

from __future__ import annotations

import dataclasses
import inspect

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float, Int

ROWS = 64  # the M of one warpgroup wgmma: query rows per unit
STAGE = 64  # cache positions per pipeline stage
# Per-unit int32 fields of the `units` operand.
U_QBLOCK, U_SEQ, U_QPOS0, U_KV_LO, U_KV_HI = range(5)
UNIT_FIELDS = 8  # padded so each unit's row is 32 bytes
# JAX 0.10's `plgpu.load` takes the index positionally; 0.11 deprecates passing it (index the ref).
_LOAD_TAKES_INDEX = inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty


def _load(ref, layout):  # noqa: ANN001, ANN202
    return plgpu.load(ref, (), layout=layout) if _LOAD_TAKES_INDEX else plgpu.load(ref, layout=layout)


@dataclasses.dataclass(frozen=True)
class KernelShape:
    """Everything static about one compiled kernel."""

    num_kv_heads: int
    group: int  # query heads per KV head
    group_pad: int  # `group` rounded up to a power of two (<= 64)
    tokens_per_unit: int  # query tokens per unit (1 for decode)
    head_dim: int
    block_size: int
    dtype: jnp.dtype
    num_buffers: int
    sm_scale: float
    soft_cap: float | None
    has_window: bool
    has_alibi: bool
    fp8: str | None = None  # the pages' fp8 format ("float8_e4m3fn" / "float8_e5m2"), None: `dtype` pages

    @property
    def rows_in(self) -> int:
        """Query rows a unit really has, at least the 8-row tile its copies move."""
        return max(8, self.group_pad * self.tokens_per_unit)

    @property
    def pages_per_stage(self) -> int:
        return STAGE // self.block_size

    @property
    def page_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype if self.fp8 is None else self.fp8)


def _widen(pages, dtype: jnp.dtype):  # noqa: ANN001, ANN202
    """fp8 values in q's dtype, exactly: Hopper converts fp8 only to f16 (every e4m3 and e5m2 value is
    an f16 one); bf16 then goes through float32 (f16 -> f32 -> bf16 is exact for them too)."""
    wide = pages.astype(jnp.float16)
    return wide if jnp.dtype(dtype) == jnp.dtype(jnp.float16) else wide.astype(jnp.float32).astype(dtype)


def _swizzled(itemsize: int = 2, cols: int = 64) -> tuple[plgpu.TilingTransform, plgpu.SwizzleTransform]:
    # 8-row tiles of up to 128 bytes with that swizzle: the wgmma operand layout for 2-byte types
    # (8 x 64), and the layout a register load of 1-byte fp8 pages reads.
    width = min(128, cols * itemsize)
    return plgpu.TilingTransform((8, width // itemsize)), plgpu.SwizzleTransform(width)


def _unit_kernel(units_ref, tables_ref, scalars_ref, slopes_ref, q_ref, k_ref, v_ref,  # noqa: ANN001
                 o_ref, m_ref, l_ref, *, shape: KernelShape) -> None:
    kh = lax.axis_index("kv_head")
    w = lax.axis_index("unit")
    qblock, seq = units_ref[w, U_QBLOCK], units_ref[w, U_SEQ]
    qpos0, kv_lo, kv_hi = units_ref[w, U_QPOS0], units_ref[w, U_KV_LO], units_ref[w, U_KV_HI]
    layer = scalars_ref[0]
    bs, pps, nbuf, d = shape.block_size, shape.pages_per_stage, shape.num_buffers, shape.head_dim
    first_page = kv_lo // bs
    last_page = jnp.maximum(kv_hi - 1, 0) // bs
    num_stages = jnp.where(kv_hi > kv_lo, (last_page - first_page) // pps + 1, 0)
    stage0 = first_page * bs

    def kv_phase(q_smem, k_smem, v_smem, p_smem, slopes_smem, q_bar, k_bar, v_bar, k16_smem=None, v16_smem=None):
        # Rows past the unit's real ones must be finite zeros (uninitialised shared memory may hold NaN).
        q_smem[...] = plgpu.layout_cast(jnp.zeros((ROWS, d), shape.dtype), plgpu.Layout.WGMMA)
        plgpu.commit_smem()
        plgpu.copy_gmem_to_smem(q_ref.at[kh, qblock], q_smem.at[pl.ds(0, shape.rows_in)], q_bar)
        if shape.has_alibi:
            plgpu.copy_gmem_to_smem(slopes_ref.at[kh], slopes_smem, q_bar)

        def fetch(stage, slot):
            for j in range(pps):
                page = tables_ref[seq, jnp.minimum(first_page + stage * pps + j, last_page)]
                rows = pl.ds(j * bs, bs)
                plgpu.copy_gmem_to_smem(k_ref.at[layer, page, :, kh, :], k_smem.at[slot, rows], k_bar.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[layer, page, :, kh, :], v_smem.at[slot, rows], v_bar.at[slot])

        for i in range(nbuf - 1):
            pl.when(i < num_stages)(lambda i=i: fetch(i, i))
        plgpu.barrier_wait(q_bar)

        row = plgpu.broadcasted_iota(jnp.int32, (ROWS, STAGE), 0, layout=plgpu.Layout.WGMMA)
        col = plgpu.broadcasted_iota(jnp.int32, (ROWS, STAGE), 1, layout=plgpu.Layout.WGMMA)
        qpos = qpos0 + row // shape.group_pad
        if shape.has_window:
            window = scalars_ref[1]
        if shape.has_alibi:
            slopes = lax.broadcast_in_dim(_load(slopes_smem, plgpu.Layout.WGMMA.reduce(1)),
                                          (ROWS, STAGE), [0])

        def stage_body(i, carry):
            acc, m, l = carry
            slot = lax.rem(i, nbuf)
            ahead = i + nbuf - 1

            @pl.when(ahead < num_stages)
            def _():
                fetch(ahead, lax.rem(ahead, nbuf))

            plgpu.barrier_wait(k_bar.at[slot])
            if shape.fp8 is None:
                k_tile = k_smem.at[slot]
            else:  # widen the fp8 page tile in registers into the one bf16 / f16 tile the wgmma reads
                k16_smem[...] = _widen(_load(k_smem.at[slot], plgpu.Layout.WGMMA), shape.dtype)
                plgpu.commit_smem()
                k_tile = k16_smem

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k_tile.transpose((1, 0)))
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((ROWS, STAGE), jnp.float32))
            kpos = stage0 + i * STAGE + col
            if shape.has_alibi:  # before the scale, as Hugging Face Falcon adds it
                s = s + slopes * (kpos - qpos).astype(jnp.float32)
            s = s * shape.sm_scale
            if shape.soft_cap is not None:
                s = shape.soft_cap * jnp.tanh(s / shape.soft_cap)
            allowed = (kpos <= qpos) & (kpos >= kv_lo) & (kpos < kv_hi)
            if shape.has_window:
                allowed = allowed & (kpos > qpos - window)
            s = jnp.where(allowed, s, -jnp.inf)
            m_next = jnp.maximum(m, s.max(axis=1))
            m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # rows that have seen nothing yet
            alpha = jnp.exp(m - m_safe)
            p = jnp.exp(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
            l = l * alpha + p.sum(axis=1)

            plgpu.barrier_wait(v_bar.at[slot])

            def v_rows_in_range():  # noqa: ANN202 - [STAGE, d]: the V rows this unit may read
                vrow = plgpu.broadcasted_iota(jnp.int32, (STAGE, d), 0, layout=plgpu.Layout.WGMMA)
                return stage0 + i * STAGE + vrow < kv_hi

            if shape.fp8 is None:
                v_tile = v_smem.at[slot]

                @pl.when(stage0 + (i + 1) * STAGE > kv_hi)
                def _():  # the unit's last stage: zero V rows at positions it must not read
                    vals = _load(v_smem.at[slot], plgpu.Layout.WGMMA)
                    v_smem.at[slot][...] = jnp.where(v_rows_in_range(), vals, jnp.zeros_like(vals))
            else:  # widened like K, V rows past the range zeroed on the way
                vals = _widen(_load(v_smem.at[slot], plgpu.Layout.WGMMA), shape.dtype)
                v16_smem[...] = jnp.where(v_rows_in_range(), vals, jnp.zeros_like(vals))
                v_tile = v16_smem

            p_smem[...] = p.astype(shape.dtype)
            plgpu.commit_smem()

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p_smem, v_tile)
                return acc_ref[...]

            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pl.run_scoped(
                pv, plgpu.ACC((ROWS, d), jnp.float32))
            return acc, m_next, l

        acc = plgpu.layout_cast(jnp.zeros((ROWS, d), jnp.float32), plgpu.Layout.WGMMA)
        m = plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        l = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        return lax.fori_loop(0, num_stages, stage_body, (acc, m, l))

    swizzle = _swizzled()
    pages = _swizzled(shape.page_dtype.itemsize, d)
    staging = () if shape.fp8 is None else (plgpu.SMEM((STAGE, d), shape.dtype, transforms=swizzle),) * 2
    acc, m, l = pl.run_scoped(
        kv_phase,
        plgpu.SMEM((ROWS, d), shape.dtype, transforms=swizzle),
        plgpu.SMEM((nbuf, STAGE, d), shape.page_dtype, transforms=pages),
        plgpu.SMEM((nbuf, STAGE, d), shape.page_dtype, transforms=pages),
        plgpu.SMEM((ROWS, STAGE), shape.dtype, transforms=swizzle),
        plgpu.SMEM((ROWS,), jnp.float32),
        plgpu.Barrier(num_arrivals=2 if shape.has_alibi else 1),
        plgpu.Barrier(num_arrivals=pps, num_barriers=nbuf),
        plgpu.Barrier(num_arrivals=pps, num_barriers=nbuf),
        *staging,
    )

    def store_phase(o_smem, m_smem, l_smem):  # reuses the shared memory the K/V ring held
        o_smem[...] = acc
        m_smem[...] = m
        l_smem[...] = l
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, shape.rows_in)], o_ref.at[kh, w])
        plgpu.copy_smem_to_gmem(m_smem, m_ref.at[kh, w])
        plgpu.copy_smem_to_gmem(l_smem, l_ref.at[kh, w])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(store_phase, plgpu.SMEM((ROWS, d), jnp.float32), plgpu.SMEM((ROWS,), jnp.float32),
                  plgpu.SMEM((ROWS,), jnp.float32))


def launch_units(
    units: Int[Array, "W 8"],
    block_tables: Int[Array, "S B"],
    scalars: Int[Array, " 2"],
    slopes: Float[Array, "K 64"],
    q_blocks: Float[Array, "K QB R D"],
    k_cache: Float[Array, "L N P K D"],
    v_cache: Float[Array, "L N P K D"],
    shape: KernelShape,
) -> tuple[Float[Array, "K W R D"], Float[Array, "K W 64"], Float[Array, "K W 64"]]:
    """Run the kernel over every (KV head, unit): the unnormalised float32 output of each unit's
    `rows_in` rows, and its running max and sum per row (of all 64). `scalars` = (layer, window).
    The caches hold `shape.page_dtype` values (an fp8 cache's uint8 bits already seen as fp8)."""
    num_units = units.shape[0]
    k = shape.num_kv_heads
    out_type = (
        jax.ShapeDtypeStruct((k, num_units, shape.rows_in, shape.head_dim), jnp.float32),
        jax.ShapeDtypeStruct((k, num_units, ROWS), jnp.float32),
        jax.ShapeDtypeStruct((k, num_units, ROWS), jnp.float32),
    )
    body = lambda *refs: _unit_kernel(*refs, shape=shape)  # noqa: E731
    return plgpu.kernel(body, out_type=out_type, grid=(k, num_units), grid_names=("kv_head", "unit"))(
        units, block_tables, scalars, slopes, q_blocks, k_cache, v_cache)


def smem_bytes(head_dim: int, num_buffers: int, itemsize: int = 2, page_itemsize: int | None = None) -> int:
    """Shared memory the K/V phase holds (the larger of the kernel's two phases); pages of another
    width than q's (fp8) add the two widened tiles."""
    pages = 2 * num_buffers * STAGE * head_dim * (page_itemsize or itemsize)
    staging = 0 if page_itemsize in (None, itemsize) else 2 * STAGE * head_dim * itemsize
    return (ROWS * head_dim + ROWS * STAGE) * itemsize + pages + staging + ROWS * 4
