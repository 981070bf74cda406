"""paxserve's CPU kernels (cpu_matmul.cc, cpu_attention.cc): built, loaded and registered with XLA.

The C++ sources are compiled once per machine with the system's C++ compiler (`-march=native`: they
run where they are built) into one library under paxserve's cache directory, keyed by the sources,
the compiler, the CPU's features and jaxlib's FFI headers; the library is loaded with ctypes and
each handler registered with XLA for the CPU platform, then every kernel is checked against its XLA
reference (once per build: a mark beside the library records that they passed). Where there is
no compiler, or the build or a check fails, `load_cpu_kernels` says why and the engine keeps XLA's
paths.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax

__all__ = ["CpuKernels", "has_avx512", "load_cpu_kernels"]

_HERE = Path(__file__).parent
_SOURCES = ("cpu_matmul.cc", "cpu_attention.cc")
_HEADERS = ("cpu_vector.h",)
# FFI target names, by the handler symbol each binds. A change of a kernel's operands or attributes
# takes a new name, so that a program compiled for the old signature and stored by JAX's
# compilation cache can never call the new handler.
TARGETS = {"PaxserveGroupMatmul": "paxserve_group_matmul_v2", "PaxserveDecodeAttention": "paxserve_decode_attention_v1"}
_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-w", "-march=native",
          # This machine reports AMX; GCC never emits it for plain vector code, and some VMs trap it.
          "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")


@dataclass(frozen=True)
class CpuKernels:
    """The built library: where it lies, whether this process compiled it, and how long the build,
    load and self-checks took."""

    path: Path
    built: bool
    seconds: float


def _cpu_features() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def has_avx512() -> bool:
    """Whether this CPU has AVX-512 (the kernels' fast path; other CPUs get plain loops)."""
    return "avx512f" in _cpu_features().split()


def _compiler() -> str | None:
    return shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def _build(cache_root: Path) -> tuple[Path, bool]:
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++, c++ or clang++) on PATH")
    include = Path(jax.ffi.include_dir())
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    parts = [(_HERE / name).read_bytes() for name in (*_SOURCES, *_HEADERS)]
    parts += [(include / "xla" / "ffi" / "api" / "ffi.h").read_bytes(), version.encode(), _cpu_features().encode(),
              " ".join(_FLAGS).encode(), repr(sorted(TARGETS.items())).encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:20]
    out = cache_root / "kernels" / f"paxserve_cpu-{key}.so"
    if out.exists():
        return out, False
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        result = subprocess.run([compiler, *_FLAGS, f"-I{include}", *(str(_HERE / s) for s in _SOURCES), "-o",
                                 str(tmp_out)], capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{Path(compiler).name} failed: {result.stderr.strip()[-500:]}")
        os.replace(tmp_out, out)  # atomic: a concurrent start sees the whole library or none
    return out, True


# Per process, as XLA's registry of FFI targets is: a target registers once, so the first load
# (from whichever cache directory) serves every later call.
_LOADED: dict[str, CpuKernels | str] = {}


def _load(cache_root: Path, checks: list[Callable[[], str | None]]) -> CpuKernels | str:
    from paxserve.models.param_cache import file_lock

    # One process builds and checks at a time: the others, started beside it (a test run's workers
    # and servers, a host's engine ranks), wait and then find the library and its mark instead of
    # compiling and checking it again each (8 s of g++ alone, more on shared cores).
    with file_lock(cache_root / "kernels" / "build.lock",
                   "another process is building or checking paxserve's CPU kernels: waiting for it"):
        return _load_locked(cache_root, checks)


def _load_locked(cache_root: Path, checks: list[Callable[[], str | None]]) -> CpuKernels | str:
    start = time.perf_counter()
    try:
        path, built = _build(cache_root)
        library = ctypes.CDLL(str(path))
        for symbol, target in TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    except Exception as error:  # noqa: BLE001 - any failure means XLA's paths, said in the log
        return f"{type(error).__name__}: {error}"
    # Checked once per build: the same key is the same binary on the same CPU, so a later start
    # that finds the mark (written only after every check passed) skips the ~2 s of checks.
    passed = path.with_suffix(".checked")
    if not passed.exists():
        for check in checks:
            failure = check()
            if failure is not None:
                return f"a self-check failed: {failure}"
        passed.touch()
    return CpuKernels(path, built, time.perf_counter() - start)


def load_cpu_kernels(cache_root: str | os.PathLike | None = None) -> CpuKernels | str:
    """Build (once per machine), load and register the kernels, then check each against its XLA
    reference. The library, or why not (never raises). It lives under `cache_root`, by default
    paxserve's cache directory ($XDG_CACHE_HOME/paxserve), whatever directory a model's params are
    cached in: one build per machine."""
    if jax.default_backend() != "cpu":
        return f"the default backend is {jax.default_backend()}, not the CPU"
    if "kernels" not in _LOADED:
        from paxserve.kernels.cpu_attention import self_check_cpu_attention
        from paxserve.kernels.cpu_matmul import self_check_cpu_matmul
        from paxserve.models.param_cache import cache_root as default_root

        root = default_root() if cache_root is None else Path(cache_root).expanduser().resolve()
        _LOADED["kernels"] = _load(root, [self_check_cpu_matmul, self_check_cpu_attention])
    return _LOADED["kernels"]
