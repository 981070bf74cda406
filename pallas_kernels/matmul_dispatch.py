"""Which matmul a weight kept quantized runs: XLA's (dequantize, then dot), the Mosaic GPU kernel
or the CPU kernel (cpu_matmul.cc).

The choice is a static, hashable `MatmulKernel` stored on each quantized weight of the params pytree
(`QuantizedWeight.kernel`, `GroupQuantizedWeight.kernel`), so it reaches every jitted program with
the weights themselves: no global, no environment variable, and a program traced with one choice is
never reused for another. `models.layers.dense` asks `kernel_serves` per weight and shape at trace
time; a weight the kernel does not serve (a width that is not a multiple of its tiles, float32
activations, an fp8 x fp8 product) keeps XLA's path.

`resolve_matmul_kernel` picks it at start-up, after the attention backend: on an NVIDIA GPU of
compute capability 9.0 or more (wgmma and TMA), the Mosaic GPU kernel once it has passed
`self_check_matmul` on this device; on a CPU, the CPU kernel for a float32 model once it has built
and passed its self-check (`cpu_library.load_cpu_kernels`), or the Mosaic GPU kernel in interpret mode when
that family was asked for by name (`--attention-backend mosaic`, tests); XLA's path everywhere else.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from paxserve.kernels import cpu_library, cpu_matmul
from paxserve.kernels.mosaic_matmul import (
    mosaic_weight_only_matmul,
    supports_mosaic_matmul,
    weight_only_matmul_reference,
)

__all__ = ["MatmulKernel", "cpu_matmul_kernel", "kernel_serves", "resolve_matmul_kernel", "run_kernel",
           "self_check_matmul"]

logger = logging.getLogger(__name__)
_TOLERANCE = 1e-2  # max|out - ref| / max|ref|: both accumulate the same bf16 weights in float32


@dataclass(frozen=True)
class MatmulKernel:
    """The weight-only matmul kernel quantized weights run ("mosaic": Pallas on Mosaic GPU; "cpu":
    cpu_matmul.cc through XLA's FFI, loaded and registered by `cpu_matmul_kernel`)."""

    name: str = "mosaic"
    interpret: bool = False  # Mosaic GPU's interpret mode on a CPU (tests; slow)
    num_splits: int | None = None  # split-K pieces; None: from the grid (see mosaic_weight_only_matmul)
    # The CPU kernel's weights reordered tile by tile when they are set to run on it
    # (`with_matmul_kernel`, cpu_matmul.tile_columns): not for weights split over devices, whose
    # shards are cut from the plain order.
    tiles: bool = False

    def __post_init__(self) -> None:
        if self.name not in ("mosaic", "cpu"):
            raise ValueError(f"MatmulKernel.name must be 'mosaic' or 'cpu', got {self.name!r}")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"MatmulKernel.num_splits must be >= 1, got {self.num_splits}")
        if self.tiles and self.name != "cpu":
            raise ValueError("MatmulKernel.tiles is the CPU kernel's layout")


def kernel_serves(kernel: MatmulKernel, x: Array, codes: Array, scale_rows: int | None, bits: int,
                  table: bool = False, tiled: bool = False) -> bool:
    """Whether `kernel` runs `x [M, K] @ w` for these codes (2-D: one layer's, one device's
    slice); `scale_rows` is the number of group-scale rows (a table's scale columns), None for a
    per-channel weight; `table`: an embedding table used as the head, `tiled`: codes in the CPU
    kernel's tile order (both the CPU kernel's alone)."""
    if x.ndim != 2 or codes.ndim != 2:
        return False
    if kernel.name == "cpu":
        return cpu_matmul.serves(x, codes, 1 if scale_rows is None else scale_rows, bits, table, tiled)
    if table or tiled:
        return False
    k, n = x.shape[1], codes.shape[1]
    group = k if scale_rows is None else k // scale_rows
    return supports_mosaic_matmul(k, n, bits, group, x.dtype, codes.dtype) is None


def run_kernel(kernel: MatmulKernel, x: Float[Array, "M K"], codes: Array, scale: Array | None,
               offset: Array | None, bits: int, bias: int, table: bool = False, tiled: bool = False
               ) -> Float[Array, "M N"]:
    """x @ dequantize(w) in float32 on `kernel` (see `mosaic_weight_only_matmul`, `cpu_group_matmul`);
    with `scale` None, the per-channel scale is left to the caller."""
    if kernel.name == "cpu":
        if scale is None:  # a per-channel weight: one group of every input, scale 1 (the caller scales)
            scale = jnp.ones((1, codes.shape[1]), jnp.float32)
        return cpu_matmul.cpu_group_matmul(x, codes, scale, offset, bits=bits, bias=bias, table=table, tiled=tiled)
    return mosaic_weight_only_matmul(x, codes, scale, offset, bits=bits, bias=bias, num_splits=kernel.num_splits,
                                     interpret=kernel.interpret)


def cpu_matmul_kernel() -> MatmulKernel | str:
    """The CPU kernel, built, registered and self-checked in this process (`load_cpu_kernels`), or
    why it is not available."""
    loaded = cpu_library.load_cpu_kernels()
    return loaded if isinstance(loaded, str) else MatmulKernel(name="cpu", tiles=True)


def _problems(rng: np.random.Generator) -> list[tuple[str, dict]]:
    """Every kind of weight the engine keeps: per-channel int8 and fp8, 8-bit and 4-bit group codes
    (GGUF's groups of 32 with offsets and f16 scales, AWQ/GPTQ's 128 with a bias), two row tiles."""
    k, n = 256, 128
    u4 = lambda: rng.integers(0, 256, (k // 2, n)).astype(np.uint8)  # noqa: E731
    scales = lambda g, dt: (rng.random((k // g, n)) * 0.02).astype(dt)  # noqa: E731
    return [
        ("int8 per channel", dict(codes=rng.integers(-127, 128, (k, n)).astype(np.int8))),
        ("fp8 per channel", dict(codes=(rng.standard_normal((k, n)) * 50).astype(jnp.float8_e4m3fn))),
        ("8-bit groups of 32", dict(codes=rng.integers(-127, 128, (k, n)).astype(np.int8),
                                    scale=scales(32, np.float16))),
        ("4-bit groups of 32 with offsets", dict(codes=u4(), scale=scales(32, np.float32),
                                                 offset=scales(32, np.float32), bits=4)),
        ("4-bit groups of 128, bias 8", dict(codes=u4(), scale=scales(128, np.float16), bits=4, bias=8)),
    ]


def self_check_matmul(kernel: MatmulKernel, dtype: object, seed: int = 0) -> str | None:
    """Run the kernel once per kind of quantized weight on this device, 70 rows of x (two row
    tiles, the second partial), against XLA's dequantize-then-dot. None when every output is finite
    and within 1e-2 of the reference's scale, else the first failure in a few words. Never raises."""
    rng = np.random.default_rng(seed)
    try:
        x = jnp.asarray(rng.standard_normal((70, 256)), dtype)
        problems = _problems(rng)
    except Exception as error:  # noqa: BLE001 - the check must never raise
        return f"problem setup failed: {type(error).__name__}: {error}"
    for label, problem in problems:
        arrays = {k: jnp.asarray(v) for k, v in problem.items() if isinstance(v, np.ndarray)}
        options = {k: v for k, v in problem.items() if not isinstance(v, np.ndarray)}
        try:
            want = np.asarray(weight_only_matmul_reference(x, **arrays, **options), np.float64)
            got = run_kernel(kernel, x, arrays["codes"], arrays.get("scale"), arrays.get("offset"),
                             options.get("bits", 8), options.get("bias", 0))
            got = np.asarray(jax.block_until_ready(got), np.float64)
        except Exception as error:  # noqa: BLE001 - a kernel that fails to compile or run has failed
            first = (str(error).strip().splitlines() or ["(no message)"])[0][:300]
            return f"{label}: compile/run failed: {type(error).__name__}: {first}"
        if got.shape != want.shape or not np.isfinite(got).all():
            return f"{label}: output {got.shape} with {int(np.sum(~np.isfinite(got)))} values NaN or inf"
        rel = float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))
        if not rel < _TOLERANCE:
            return f"{label}: mismatch, max relative error {rel:.3g} > {_TOLERANCE:g}"
    return None


def resolve_matmul_kernel(attention_option: str, platform: str, *, dtype: object,
                          compute_capability: str | None = None,
                          self_check: Callable[..., str | None] | None = self_check_matmul) -> MatmulKernel | None:
    """The kernel quantized weights run, or None for XLA's path (see the module docstring); says
    what it decided, and why, in the log."""
    if platform.lower() == "cpu" and attention_option != "mosaic":
        if jnp.dtype(dtype) != jnp.dtype(jnp.float32):
            logger.info("quantized matmuls: XLA's (the CPU kernel takes float32 activations, the model runs in %s)",
                        jnp.dtype(dtype).name)
            return None
        kernel = cpu_matmul_kernel()
        if isinstance(kernel, str):
            logger.warning("quantized matmuls: XLA's, dequantizing each weight before its product (the CPU kernel "
                           "is not available: %s)", kernel)
            return None
        logger.info("quantized matmuls: the CPU kernel (codes widened in registers, %s)",
                    "AVX-512" if cpu_library.has_avx512() else "without AVX-512: plain loops")
        return kernel
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        logger.info("quantized matmuls: XLA's (the Mosaic GPU kernel takes bfloat16 / float16 activations, "
                    "the model runs in %s)", jnp.dtype(dtype).name)
        return None
    if platform.lower() not in ("gpu", "cuda"):
        from jax.experimental.pallas import mosaic_gpu as plgpu

        if not hasattr(plgpu, "InterpretGPUParams"):
            logger.info("quantized matmuls: XLA's (Mosaic GPU's interpret mode needs JAX >= 0.11.2)")
            return None
        logger.warning("quantized matmuls: the Mosaic GPU kernel in interpret mode on %s (slow; meant for tests)",
                       platform)
        return MatmulKernel(interpret=True)
    try:
        hopper = compute_capability is not None and int(str(compute_capability).split(".")[0]) >= 9
    except ValueError:
        hopper = False
    if not hopper:
        logger.info("quantized matmuls: XLA's (the Mosaic GPU kernel needs compute capability 9.0+, this GPU "
                    "has %s)", compute_capability or "an unknown one")
        return None
    kernel = MatmulKernel()
    if self_check is None:
        logger.info("quantized matmuls: the Mosaic GPU kernel, without a start-up self-check (none requested)")
        return kernel
    start = time.perf_counter()
    failure = self_check(kernel, dtype)
    if failure is not None:
        logger.warning("quantized matmuls: XLA's; the Mosaic GPU kernel failed its start-up self-check (%s)", failure)
        return None
    logger.info("quantized matmuls: the Mosaic GPU kernel (codes widened in registers), which passed its "
                "start-up self-check against XLA's in %.0f ms", (time.perf_counter() - start) * 1e3)
    return kernel
