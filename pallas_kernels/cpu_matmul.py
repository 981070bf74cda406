"""The CPU matmul for weights kept as group-quantized codes (cpu_matmul.cc), as an XLA FFI call.

On a CPU a decode step is bound by the bytes of weights it reads: XLA:CPU can only dequantize a
kept-quantized weight into a full float32 copy before its dot, so it reads (and writes) more than a
model stored in float32 would. This kernel reads the codes, widens them in registers and
accumulates in float32: the bundled SmolLM2 Q4_1 file's 90 MiB per token instead of 513 MiB.

The C++ source is compiled once per machine with the system's C++ compiler (`-march=native`: it
runs where it is built) into paxserve's cache directory, keyed by the source, the compiler, the
CPU's features and jaxlib's FFI headers; the library is loaded with ctypes and its handler
registered with XLA for the CPU platform. Where there is no compiler, or the build or the self-check
fails, `load_cpu_matmul` says why and the engine keeps XLA's path (dequantized weights).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from paxserve.kernels.mosaic_matmul import weight_only_matmul_reference

__all__ = ["CpuMatmulLibrary", "cpu_group_matmul", "cpu_group_matmul_reference", "has_avx512", "load_cpu_matmul",
           "self_check_cpu_matmul", "serves"]

logger = logging.getLogger(__name__)
_SOURCE = Path(__file__).with_name("cpu_matmul.cc")
# The FFI target's name; a change of its operands or attributes takes a new one, so that a program
# compiled for the old signature, stored by JAX's compilation cache, can never call the new handler.
TARGET = "paxserve_group_matmul_v1"
_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-w", "-march=native",
          # This machine reports AMX; GCC never emits it for plain vector code, and some VMs trap it.
          "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")
_TOLERANCE = 1e-4  # max|out - ref| / max|ref|: both accumulate the same weights in float32


@dataclass(frozen=True)
class CpuMatmulLibrary:
    """The built kernel: where its library lies and how long the build and self-check took."""

    path: Path
    built: bool  # compiled by this process (False: found in the cache)
    seconds: float


def _cpu_features() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def _compiler() -> str | None:
    return shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def _build(cache_root: Path) -> tuple[Path, bool]:
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++, c++ or clang++) on PATH")
    include = Path(jax.ffi.include_dir())
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    header = (include / "xla" / "ffi" / "api" / "ffi.h").read_bytes()
    key = hashlib.sha256(b"\0".join([_SOURCE.read_bytes(), header, version.encode(), _cpu_features().encode(),
                                     " ".join(_FLAGS).encode(), TARGET.encode()])).hexdigest()[:20]
    out = cache_root / "kernels" / f"cpu_matmul-{key}.so"
    if out.exists():
        return out, False
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        result = subprocess.run([compiler, *_FLAGS, f"-I{include}", str(_SOURCE), "-o", str(tmp_out)],
                                capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{Path(compiler).name} failed: {result.stderr.strip()[-500:]}")
        os.replace(tmp_out, out)  # atomic: a concurrent start sees the whole library or none
    return out, True


# Per process, as XLA's registry of FFI targets is: a target registers once, so the first load
# (from whichever cache directory) serves every later call.
_LOADED: dict[str, CpuMatmulLibrary | str] = {}


def _load(cache_root: Path) -> CpuMatmulLibrary | str:
    start = time.perf_counter()
    try:
        path, built = _build(cache_root)
        library = ctypes.CDLL(str(path))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.PaxserveGroupMatmul), platform="cpu")
    except Exception as error:  # noqa: BLE001 - any failure means XLA's path, said in the log
        return f"{type(error).__name__}: {error}"
    failure = self_check_cpu_matmul()
    if failure is not None:
        return f"its self-check failed: {failure}"
    return CpuMatmulLibrary(path, built, time.perf_counter() - start)


def load_cpu_matmul(cache_root: str | os.PathLike) -> CpuMatmulLibrary | str:
    """Build (once per machine), load and register the kernel, then check it against XLA's
    dequantize-then-dot on every kind of weight it takes. The library, or why not (never raises)."""
    if jax.default_backend() != "cpu":
        return f"the default backend is {jax.default_backend()}, not the CPU"
    if "kernel" not in _LOADED:
        _LOADED["kernel"] = _load(Path(cache_root).expanduser().resolve())
    return _LOADED["kernel"]


def cpu_group_matmul(x: Float[Array, "M K"], codes: Array, scale: Array, offset: Array | None = None, *,
                     bits: int, bias: int = 0, table: bool = False) -> Float[Array, "M N"]:
    """x @ w in float32, w held as group-quantized codes (layouts in cpu_matmul.cc): `codes` [K, N]
    int8 or [K/2, N] uint8 nibbles, `scale` and `offset` [K/group, N] float16 or float32; with
    `table`, an embedding table used as the head, every operand transposed ([N, K], [N, K/group]).
    x must be float32 (the CPU models' dtype). The kernel must be loaded (`load_cpu_matmul`)."""
    n = codes.shape[0] if table else codes.shape[1]
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
    return call(x, codes, scale, scale if offset is None else offset, bits=np.int32(bits), bias=np.int32(bias),
                table=np.int32(table), has_offset=np.int32(offset is not None))


def cpu_group_matmul_reference(x: Float[Array, "M K"], codes: Array, scale: Array, offset: Array | None = None, *,
                               bits: int, bias: int = 0, table: bool = False) -> Float[Array, "M N"]:
    """XLA's path for the same product: the whole weight dequantized, then one dot."""
    if table:
        codes, scale, offset = codes.T, scale.T, None if offset is None else offset.T
    return weight_only_matmul_reference(x, codes, scale, offset, bits=bits, bias=bias)


def serves(x: Array, codes: Array, groups: int, bits: int, table: bool) -> bool:
    """Whether the kernel takes this product: float32 x, 2-D codes of int8 or uint8 nibbles, and
    groups it can step through (a table's: whole vectors of inputs)."""
    if x.ndim != 2 or codes.ndim != 2 or x.dtype != jnp.float32 or x.shape[0] < 1:
        return False
    k = x.shape[1]
    if codes.dtype != (jnp.uint8 if bits == 4 else jnp.int8) or groups <= 0 or k % groups:
        return False
    group = k // groups
    if table:
        return group % (32 if bits == 4 else 16) == 0
    return bits == 8 or group % 2 == 0


def has_avx512() -> bool:
    """Whether this CPU has AVX-512 (the kernel's fast path; other CPUs get plain loops)."""
    return "avx512f" in _cpu_features().split()


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
        ("8-bit table, groups of 32", dict(codes=i8((n, k)), scale=small((n, k // 32), np.float16), bits=8,
                                           table=True)),
        ("4-bit table with offsets", dict(codes=u4((n, k // 2)), scale=small((n, k // 32), np.float32),
                                          offset=small((n, k // 32), np.float32), bits=4, table=True)),
    ]


def self_check_cpu_matmul(seed: int = 0) -> str | None:
    """Each kind of weight at 1, 2 and 5 rows of x against XLA's dequantize-then-dot: None when
    every output is within 1e-4 of the reference's scale, else the first failure in a few words."""
    rng = np.random.default_rng(seed)
    for label, problem in _problems(rng):
        arrays = {name: jnp.asarray(v) for name, v in problem.items() if isinstance(v, np.ndarray)}
        options = {name: v for name, v in problem.items() if not isinstance(v, np.ndarray)}
        for rows in (1, 2, 5):
            x = jnp.asarray(rng.standard_normal((rows, 256)), jnp.float32)
            try:
                want = np.asarray(cpu_group_matmul_reference(x, **arrays, **options), np.float64)
                got = np.asarray(jax.jit(functools.partial(cpu_group_matmul, **options))(x, **arrays), np.float64)
            except Exception as error:  # noqa: BLE001 - a kernel that fails to run has failed
                return f"{label}: {type(error).__name__}: {str(error).strip()[:300]}"
            rel = float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))
            if got.shape != want.shape or not rel < _TOLERANCE:
                return f"{label}, {rows} rows: max relative error {rel:.3g} (shape {got.shape}, want {want.shape})"
    return None
