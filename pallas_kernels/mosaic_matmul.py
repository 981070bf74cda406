"""The weight-only quantized matmul on Mosaic GPU (Hopper, sm90+): y = x @ dequantize(W) in float32.

Decode is bound by reading the weights once per step; a weight kept as int8, fp8 or 4-bit codes is
2-4x fewer bytes to read, but XLA dequantizes a whole weight into memory before its dot, which reads
more bytes than the full-width weight. This kernel widens each tile in registers instead:

* grid (output tile of `tile_n` columns, row tile of 64 rows of x, split-K piece); each program
  walks its piece of the inputs in stages of `STAGE_K` (128) with a ring of `num_buffers`
  shared-memory slots, so the next stages' TMA copies (x's tile, the codes, their scales and
  offsets) are in flight while one is computed. A decode batch has few output tiles (32 for a
  4096-wide layer), so the inputs are split until the grid covers the GPU twice; the pieces'
  float32 partial products are summed after the kernel;
* per stage the codes are loaded from shared memory into registers, widened to float32, turned into
  weights `scale * (code - bias) + offset` (each input row's own group), rounded once to x's dtype
  (so every weight equals `GroupQuantizedWeight.dequantize(x.dtype)` bit for bit), stored into a
  swizzled bf16 / f16 tile and multiplied by x's tile on the tensor cores (wgmma, float32 acc);
* 4-bit codes arrive packed two to a byte along the inputs (byte i: inputs 2i, low nibble, and 2i + 1).
  The low nibbles of a stage become its first 64 weight rows and the high ones its last 64, so the
  wrapper reorders x's columns within each stage to match (even inputs first), a cheap gather of x.

Per-channel weights (`QuantizedWeight`: int8 or float8_e4m3fn `q` with one scale per output) are
widened exactly (both fit bf16 and f16) and scaled after the dot, as `quantized_matmul` does.

`weight_only_matmul_reference` beside it is the XLA path the engine otherwise takes.

Both wgmma operands live in shared memory, which is what JAX >= 0.11.2's GPU interpret mode
(`plgpu.InterpretGPUParams`) simulates on a CPU; lowering for CUDA needs no GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float, Int

from paxserve.kernels.mosaic_kernel import _load

__all__ = ["MosaicMatmulShape", "mosaic_weight_only_matmul", "supports_mosaic_matmul",
           "weight_only_matmul_reference"]

ROWS = 64  # rows of x per program: the M of one warpgroup wgmma
STAGE_K = 128  # inputs per pipeline stage
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_CODE_DTYPES = (np.dtype(np.int8), np.dtype(np.uint8), np.dtype(jnp.float8_e4m3fn))


@dataclasses.dataclass(frozen=True)
class MosaicMatmulShape:
    """Everything static about one compiled kernel."""

    k: int  # inputs
    n: int  # outputs
    tile_n: int
    bits: int  # 8 (one code per byte) or 4 (two)
    group: int  # inputs per scale row (k when there is no scale)
    bias: int  # subtracted from every code before the scale
    has_scale: bool
    has_offset: bool
    dtype: jnp.dtype  # x's, and the widened weights'
    num_splits: int = 1  # split-K: programs that share one output tile, each over a range of stages
    num_buffers: int = 3

    @property
    def stages_per_split(self) -> int:
        return -(-(self.k // STAGE_K) // self.num_splits)

    @property
    def code_rows(self) -> int:
        """Rows of codes per stage."""
        return STAGE_K if self.bits == 8 else STAGE_K // 2

    @property
    def scale_rows(self) -> int:
        """Scale rows per stage: the stage's groups (one when a group spans stages)."""
        return max(1, STAGE_K // self.group)


def supports_mosaic_matmul(k: int, n: int, bits: int, group: int, dtype: object, code_dtype: object) -> str | None:
    """None if the kernel serves a `[k, n]` weight of these codes for x of `dtype`, else why not."""
    if jnp.dtype(dtype) not in _DTYPES:
        return f"activations in {jnp.dtype(dtype).name}, not bfloat16 or float16 (the wgmma input types)"
    if np.dtype(code_dtype) not in _CODE_DTYPES:
        return f"codes in {np.dtype(code_dtype).name}"
    if bits not in (4, 8):
        return f"{bits}-bit codes"
    if k % STAGE_K:
        return f"{k} inputs, not a multiple of {STAGE_K}"
    if n % 64:
        return f"{n} outputs, not a multiple of 64"
    if group % STAGE_K and STAGE_K % group:
        return f"a group of {group} inputs neither divides nor is a multiple of {STAGE_K}"
    if bits == 4 and group % 2:
        return f"4-bit codes in groups of an odd {group} inputs"
    return None


def _swizzle(itemsize: int, cols: int = STAGE_K) -> tuple[plgpu.TilingTransform, plgpu.SwizzleTransform]:
    # Tiles of 8 rows x up to 128 bytes with the swizzle of their width: the wgmma operand layout for
    # 16-bit tiles, and what a register load in that layout reads the codes through.
    width = min(128, cols * itemsize)
    return plgpu.TilingTransform((8, width // itemsize)), plgpu.SwizzleTransform(width)


def _kernel(x_ref, codes_ref, scale_ref, offset_ref, o_ref, *, shape: MosaicMatmulShape) -> None:  # noqa: ANN001
    n_tile, m_tile, split = lax.axis_index("n"), lax.axis_index("m"), lax.axis_index("split")
    tn, nbuf, crows, srows = shape.tile_n, shape.num_buffers, shape.code_rows, shape.scale_rows
    first = split * shape.stages_per_split  # this program's stages: [first, first + num_stages)
    num_stages = jnp.minimum(shape.stages_per_split, shape.k // STAGE_K - first)
    cols = pl.ds(n_tile * tn, tn)
    wide = jnp.float32

    def body(x_smem, c_smem, s_smem, o_smem, w_smem, bars):
        return pl.run_scoped(functools.partial(stages, x_smem, c_smem, s_smem, o_smem, w_smem, bars),
                             plgpu.ACC((ROWS, tn), jnp.float32))

    def stages(x_smem, c_smem, s_smem, o_smem, w_smem, bars, acc_ref):  # noqa: ANN001, ANN202
        def fetch(stage, slot):
            stage = first + stage
            plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(m_tile * ROWS, ROWS), pl.ds(stage * STAGE_K, STAGE_K)],
                                    x_smem.at[slot], bars.at[slot])
            plgpu.copy_gmem_to_smem(codes_ref.at[pl.ds(stage * crows, crows), cols], c_smem.at[slot],
                                    bars.at[slot])
            if shape.has_scale:
                srow = stage * srows if shape.group < STAGE_K else stage * STAGE_K // shape.group
                plgpu.copy_gmem_to_smem(scale_ref.at[pl.ds(srow, srows), cols], s_smem.at[slot], bars.at[slot])
                if shape.has_offset:
                    plgpu.copy_gmem_to_smem(offset_ref.at[pl.ds(srow, srows), cols], o_smem.at[slot],
                                            bars.at[slot])

        for i in range(nbuf - 1):
            pl.when(i < num_stages)(lambda i=i: fetch(i, i))

        layout = plgpu.Layout.WGMMA
        step = 2 if shape.bits == 4 else 1  # inputs between consecutive weight rows of a tile

        def per_row(ref, slot, first_input, rows):  # noqa: ANN001, ANN202 - [rows, tn]: each weight row's value
            # Weight row r of this tile is input `first_input + step * r` of the stage; only the
            # groups those inputs fall in are loaded (one, for groups of 128 or more).
            last_input = first_input + step * (rows - 1)
            groups = range(min(first_input // shape.group, srows - 1), min(last_input // shape.group, srows - 1) + 1)
            row = plgpu.broadcasted_iota(jnp.int32, (rows, tn), 0, layout=layout)
            out = None
            for g in groups:
                v = _load(ref.at[slot, g], layout.reduce(0)).astype(wide)
                v = lax.broadcast_in_dim(v, (rows, tn), [1])
                out = v if out is None else jnp.where((first_input + step * row) // shape.group >= g, v, out)
            return out

        def widen(codes, slot, first_input):  # noqa: ANN001, ANN202
            w = codes.astype(wide)
            if shape.bias:
                w = w - float(shape.bias)
            if shape.has_scale:
                w = w * per_row(s_smem, slot, first_input, codes.shape[0])
                if shape.has_offset:
                    w = w + per_row(o_smem, slot, first_input, codes.shape[0])
            return w.astype(shape.dtype)

        def stage_body(i, carry):
            slot = lax.rem(i, nbuf)
            ahead = i + nbuf - 1

            @pl.when(ahead < num_stages)
            def _():
                fetch(ahead, lax.rem(ahead, nbuf))

            plgpu.barrier_wait(bars.at[slot])
            # 64 weight rows at a time (fewer live registers): 8-bit codes' rows in order, 4-bit
            # codes' low nibbles (even inputs) then their high ones (odd inputs).
            if shape.bits == 8:
                for half in range(STAGE_K // ROWS):
                    codes = _load(c_smem.at[slot].at[pl.ds(half * ROWS, ROWS)], layout)
                    w_smem.at[pl.ds(half * ROWS, ROWS)][...] = widen(codes, slot, half * ROWS)
            else:  # 8-bit types take only bitwise operations in registers: unpack in int32
                codes = _load(c_smem.at[slot], layout).astype(jnp.int32)
                w_smem.at[pl.ds(0, ROWS)][...] = widen(codes & 0xF, slot, 0)
                w_smem.at[pl.ds(ROWS, ROWS)][...] = widen(codes >> 4, slot, 1)
            plgpu.commit_smem()
            plgpu.wgmma(acc_ref, x_smem.at[slot], w_smem)
            plgpu.wgmma_wait(0)  # w_smem and this slot are overwritten next stage
            return carry

        lax.fori_loop(0, num_stages, stage_body, 0)
        return acc_ref[...]

    x_item = jnp.dtype(shape.dtype).itemsize
    c_item = np.dtype(codes_ref.dtype).itemsize
    per_slot = 2 + int(shape.has_scale) + int(shape.has_offset)  # copies that land on a slot's barrier
    acc = pl.run_scoped(
        body,
        plgpu.SMEM((nbuf, ROWS, STAGE_K), shape.dtype, transforms=_swizzle(x_item)),
        plgpu.SMEM((nbuf, crows, tn), codes_ref.dtype, transforms=_swizzle(c_item, tn)),
        plgpu.SMEM((nbuf, srows, tn), scale_ref.dtype),
        plgpu.SMEM((nbuf, srows, tn), offset_ref.dtype),
        plgpu.SMEM((STAGE_K, tn), shape.dtype, transforms=_swizzle(x_item)),
        plgpu.Barrier(num_arrivals=per_slot, num_barriers=nbuf),
    )

    def store(out_smem):  # noqa: ANN001, ANN202
        out_smem[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, o_ref.at[split, pl.ds(m_tile * ROWS, ROWS), cols])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(store, plgpu.SMEM((ROWS, tn), jnp.float32))


def _launch(x, codes, scale, offset, shape: MosaicMatmulShape, interpret: object) -> Float[Array, "M N"]:  # noqa: ANN001
    m = x.shape[0]
    body = lambda *refs: _kernel(*refs, shape=shape)  # noqa: E731
    call = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((shape.num_splits, m, shape.n), jnp.float32),
                        grid=(shape.n // shape.tile_n, m // ROWS, shape.num_splits), grid_names=("n", "m", "split"))
    if not interpret:
        return call(x, codes, scale, offset)
    if not hasattr(plgpu, "InterpretGPUParams"):
        raise RuntimeError(f"Mosaic GPU interpret mode needs JAX >= 0.11.2 (this is JAX {jax.__version__})")
    params = interpret if isinstance(interpret, plgpu.InterpretGPUParams) else plgpu.InterpretGPUParams()
    with plgpu.force_gpu_interpret_mode(params):
        return call(x, codes, scale, offset)


def _stage_order(x: Array) -> Array:
    """x's columns in the order 4-bit weight rows take in a stage: even inputs, then odd ones."""
    m, k = x.shape
    return x.reshape(m, k // STAGE_K, STAGE_K // 2, 2).transpose(0, 1, 3, 2).reshape(m, k)


def _num_splits(num_splits: int | None, programs: int, num_stages: int, num_sms: int) -> int:
    """Split-K pieces: as asked, else enough programs for two waves over the GPU's SMs when the
    output tiles alone do not fill them (decode: a 4096-wide layer has 32 tiles of 128 for 132 SMs
    on an H100/H200), never pieces of fewer than 2 stages; every piece non-empty."""
    splits = num_splits or max(1, min(-(-2 * num_sms // programs), num_stages // 2))
    splits = min(splits, num_stages)
    return -(-num_stages // -(-num_stages // splits))


@functools.partial(jax.jit, static_argnames=("bits", "bias", "tile_n", "num_splits", "num_sms", "interpret"))
def _matmul(x, codes, scale, offset, *, bits, bias, tile_n, num_splits, num_sms, interpret):  # noqa: ANN001, ANN202
    m, k = x.shape
    n = codes.shape[1]
    group = k if scale is None else k // scale.shape[0]
    rows = -(-m // ROWS) * ROWS
    splits = _num_splits(num_splits, (n // tile_n) * (rows // ROWS), k // STAGE_K, num_sms)
    shape = MosaicMatmulShape(k=k, n=n, tile_n=tile_n, bits=bits, group=group, bias=bias,
                              has_scale=scale is not None, has_offset=offset is not None, dtype=jnp.dtype(x.dtype),
                              num_splits=splits)
    xp = jnp.pad(x, ((0, rows - m), (0, 0)))
    if bits == 4:
        xp = _stage_order(xp)
    dummy = jnp.zeros((1, n), jnp.float32)
    y = _launch(xp, codes, dummy if scale is None else scale, dummy if offset is None else offset, shape, interpret)
    return y[0, :m] if splits == 1 else y[:, :m].sum(axis=0)


def mosaic_weight_only_matmul(
    x: Float[Array, "M K"],
    codes: Int[Array, "KC N"],
    scale: Float[Array, "G N"] | None = None,
    offset: Float[Array, "G N"] | None = None,
    *,
    bits: int = 8,
    bias: int = 0,
    tile_n: int | None = None,
    num_splits: int | None = None,
    num_sms: int = 132,
    interpret: object = False,
) -> Float[Array, "M N"]:
    """x @ w in float32, w = `scale` * (`codes` - `bias`) + `offset` by groups of `K // G` inputs,
    each weight rounded to x's dtype before the product (`GroupQuantizedWeight`'s weights); with no
    `scale`, w is the codes widened (exact for int8 and float8_e4m3fn; a per-channel scale is the
    caller's, after the product).

    x: bfloat16 or float16 [M, K], any M. codes: int8 / float8_e4m3fn [K, N] (`bits` 8) or uint8
      [K // 2, N] with two 4-bit codes a byte along K (`bits` 4: byte i holds inputs 2i, low
      nibble, and 2i + 1). scale, offset: float16 or float32 [G, N].
    tile_n: outputs per program (64 or 128; default 128 when N allows).
    num_splits: split-K pieces (their float32 partial products summed after the kernel); default
      enough programs for two waves over `num_sms` streaming multiprocessors (132 on an H100/H200).
    interpret: False on a GPU; True or a `plgpu.InterpretGPUParams` for Mosaic GPU's interpret mode
      (JAX >= 0.11.2, CPU).
    Raises ValueError for shapes `supports_mosaic_matmul` rejects.
    """
    k = x.shape[1]
    n = codes.shape[1]
    if codes.shape[0] * (8 // bits) != k:
        raise ValueError(f"mosaic_weight_only_matmul: x has {k} inputs, {bits}-bit codes {codes.shape} have "
                         f"{codes.shape[0] * (8 // bits)}")
    if offset is not None and scale is None:
        raise ValueError("mosaic_weight_only_matmul: an offset needs a scale")
    group = k if scale is None else k // scale.shape[0]
    reason = supports_mosaic_matmul(k, n, bits, group, x.dtype, codes.dtype)
    if reason:
        raise ValueError(f"mosaic_weight_only_matmul does not serve this weight: {reason}")
    tile_n = tile_n or (128 if n % 128 == 0 else 64)
    if tile_n not in (64, 128) or n % tile_n:
        raise ValueError(f"mosaic_weight_only_matmul: tile_n must be 64 or 128 and divide {n}, got {tile_n}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"mosaic_weight_only_matmul: num_splits must be >= 1, got {num_splits}")
    return _matmul(x, codes, scale, offset, bits=bits, bias=bias, tile_n=tile_n, num_splits=num_splits,
                   num_sms=num_sms, interpret=interpret)


def weight_only_matmul_reference(x: Float[Array, "M K"], codes: Array, scale: Array | None = None,
                                 offset: Array | None = None, *, bits: int = 8, bias: int = 0) -> Float[Array, "M N"]:
    """The XLA path: the whole weight dequantized to x's dtype, then one float32-accumulated dot."""
    if bits == 4:
        codes = jnp.stack([codes & 0xF, codes >> 4], axis=1).reshape(-1, codes.shape[1])
    w = codes.astype(jnp.float32) - bias
    if scale is not None:
        group = w.shape[0] // scale.shape[0]
        w = w * jnp.repeat(scale.astype(jnp.float32), group, axis=0)
        if offset is not None:
            w = w + jnp.repeat(offset.astype(jnp.float32), group, axis=0)
    return jnp.dot(x, w.astype(x.dtype), precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
