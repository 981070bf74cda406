"""The CPU matmul for weights kept as group-quantized codes (cpu_matmul.cc), as an XLA FFI call.

On a CPU a decode step is bound by the bytes of weights it reads: XLA:CPU can only dequantize a
kept-quantized weight into a full float32 copy before its dot, so it reads (and writes) more than a
model stored in float32 would. This kernel reads the codes, widens them in registers and
accumulates in float32: the bundled SmolLM2 Q4_1 file's 90 MiB per token instead of 513 MiB.
Built and registered with the other CPU kernels by `cpu_library.load_cpu_kernels`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from paxserve.kernels.cpu_library import TARGETS
from paxserve.kernels.mosaic_matmul import weight_only_matmul_reference

__all__ = ["TILE", "cpu_group_matmul", "cpu_group_matmul_reference", "self_check_cpu_matmul", "serves", "tile_columns",
           "untile_columns"]

TARGET = TARGETS["PaxserveGroupMatmul"]
_TOLERANCE = 1e-4  # max|out - ref| / max|ref|: both accumulate the same weights in float32
TILE = 64  # output columns per tile (cpu_matmul.cc's kTile)


def tile_columns(a: Array) -> Array:
    """`a` [..., R, N] (codes, scale or offset of the columns layout) with its bytes reordered so that
    each tile of TILE columns lies in one piece ([N / TILE, R, TILE] in memory), still shaped
    [..., R, N]: the order the kernel streams with `tiled` (N must be a multiple of TILE)."""
    *lead, rows, n = a.shape
    tiles = a.reshape(*lead, rows, n // TILE, TILE)
    return jnp.swapaxes(tiles, -3, -2).reshape(a.shape)


def untile_columns(a: Array) -> Array:
    """`tile_columns`' inverse: the array in its plain [..., R, N] order."""
    *lead, rows, n = a.shape
    tiles = a.reshape(*lead, n // TILE, rows, TILE)
    return jnp.swapaxes(tiles, -3, -2).reshape(a.shape)


def cpu_group_matmul(x: Float[Array, "M K"], codes: Array, scale: Array, offset: Array | None = None, *,
                     bits: int, bias: int = 0, table: bool = False, tiled: bool = False) -> Float[Array, "M N"]:
    """x @ w in float32, w held as group-quantized codes (layouts in cpu_matmul.cc): `codes` [K, N]
    int8 or [K/2, N] uint8 nibbles, `scale` and `offset` [K/group, N] float16 or float32; with
    `table`, an embedding table used as the head, every operand transposed ([N, K], [N, K/group]);
    with `tiled`, codes, scale and offset as `tile_columns` reorders them. x must be float32 (the CPU
    models' dtype). The kernel must be loaded (`load_cpu_kernels`)."""
    n = codes.shape[0] if table else codes.shape[1]
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
    return call(x, codes, scale, scale if offset is None else offset, bits=np.int32(bits), bias=np.int32(bias),
                table=np.int32(table), has_offset=np.int32(offset is not None), tiled=np.int32(tiled))


def cpu_group_matmul_reference(x: Float[Array, "M K"], codes: Array, scale: Array, offset: Array | None = None, *,
                               bits: int, bias: int = 0, table: bool = False, tiled: bool = False
                               ) -> Float[Array, "M N"]:
    """XLA's path for the same product: the whole weight dequantized, then one dot."""
    if tiled:
        codes, scale, offset = untile_columns(codes), untile_columns(scale), None if offset is None else untile_columns(
            offset)
    if table:
        codes, scale, offset = codes.T, scale.T, None if offset is None else offset.T
    return weight_only_matmul_reference(x, codes, scale, offset, bits=bits, bias=bias)


def serves(x: Array, codes: Array, groups: int, bits: int, table: bool, tiled: bool = False) -> bool:
    """Whether the kernel takes this product: float32 x, 2-D codes of int8 or uint8 nibbles, and
    groups it can step through (a table's: whole vectors of inputs; tiled codes: whole tiles)."""
    if x.ndim != 2 or codes.ndim != 2 or x.dtype != jnp.float32 or x.shape[0] < 1:
        return False
    if tiled and (table or codes.shape[1] % TILE):
        return False
    k = x.shape[1]
    if codes.dtype != (jnp.uint8 if bits == 4 else jnp.int8) or groups <= 0 or k % groups:
        return False
    group = k // groups
    if table:
        return group % (32 if bits == 4 else 16) == 0
    return bits == 8 or group % 2 == 0


def _problems(rng: np.random.Generator) -> list[tuple[str, dict]]:
    """Every kind of weight the engine keeps, in both layouts, with columns past a whole tile."""
    k, n = 256, 200
    u4 = lambda shape: rng.integers(0, 256, shape).astype(np.uint8)  # noqa: E731
    i8 = lambda shape: rng.integers(-127, 128, shape).astype(np.int8)  # noqa: E731
    small = lambda shape, dt: (rng.random(shape) * 0.02).astype(dt)  # noqa: E731
    return [
        ("int8 per channel", dict(codes=i8((k, n)), scale=small((1, n), np.float32), bits=8)),
        ("8-bit groups of 32", dict(codes=i8((k, n)), scale=small((k // 32, n), np.float16), bits=8)),
        ("4-bit groups of 32 with offsets", dict(codes=u4((k // 2, n)), scale=small((k // 32, n), np.float16),
                                                 offset=small((k // 32, n), np.float16), bits=4)),
        ("4-bit groups of 128, bias 8", dict(codes=u4((k // 2, n)), scale=small((k // 128, n), np.float32), bits=4,
                                             bias=8)),
        ("tiled 4-bit groups of 32 with offsets", dict(codes=u4((k // 2, 192)), scale=small((k // 32, 192), np.float16),
                                                       offset=small((k // 32, 192), np.float16), bits=4, tiled=True)),
        ("tiled 8-bit groups of 32", dict(codes=i8((k, 128)), scale=small((k // 32, 128), np.float32), bits=8,
                                          tiled=True)),
        ("8-bit table, groups of 32", dict(codes=i8((n, k)), scale=small((n, k // 32), np.float16), bits=8,
                                           table=True)),
        ("4-bit table with offsets", dict(codes=u4((n, k // 2)), scale=small((n, k // 32), np.float32),
                                          offset=small((n, k // 32), np.float32), bits=4, table=True)),
    ]


def self_check_cpu_matmul(seed: int = 0) -> str | None:
    """Each kind of weight at 1, 5 and 70 rows of x (codes widened per row, per block of rows, and
    the dequantized panels with two blocks of rows) against XLA's dequantize-then-dot, all in one
    program (one compile: every engine start runs it): None when every output is within 1e-4 of the
    reference's scale, else the first failure in a few words."""
    rng = np.random.default_rng(seed)
    cases = []
    for label, problem in _problems(rng):
        arrays = {name: jnp.asarray(v) for name, v in problem.items() if isinstance(v, np.ndarray)}
        options = {name: v for name, v in problem.items() if not isinstance(v, np.ndarray)}
        for rows in (1, 5, 70):
            cases.append((f"{label}, {rows} rows", options, arrays, jnp.asarray(rng.standard_normal((rows, 256)),
                                                                                 jnp.float32)))

    def run(inputs: list) -> list:
        return [(cpu_group_matmul(x, **arrays, **options), cpu_group_matmul_reference(x, **arrays, **options))
                for (_, options, _, _), (arrays, x) in zip(cases, inputs)]

    try:
        outputs = jax.jit(run)([(arrays, x) for _, _, arrays, x in cases])
    except Exception as error:  # noqa: BLE001 - a kernel that fails to run has failed
        return f"{type(error).__name__}: {str(error).strip()[:300]}"
    for (label, *_), (got, want) in zip(cases, outputs):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        rel = float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))
        if got.shape != want.shape or not rel < _TOLERANCE:
            return f"{label}: max relative error {rel:.3g} (shape {got.shape}, want {want.shape})"
    return None
