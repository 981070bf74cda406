"""GPU memory: JAX's allocator sized from `--gpu-memory-utilization`, and the device's real total.

vLLM's `--gpu-memory-utilization` is a fraction of the GPU's *total* memory. JAX's GPU client
preallocates a pool of `XLA_PYTHON_CLIENT_MEM_FRACTION` (default 0.75) of the total when its backend
starts and reports that pool, not the device, as `memory_stats()["bytes_limit"]`. So, before the
backend starts, the engine sets the fraction to the flag's value (unless the user set it), which
makes the pool exactly the memory the flag grants; and it plans from `util x total`, capped by the
pool when the pool is smaller (a fraction the user set, or a backend someone else started).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import MutableMapping

logger = logging.getLogger(__name__)

MEM_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"
PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"
JAX_DEFAULT_FRACTION = 0.75


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """One accelerator's memory: its physical total and the pool JAX's allocator may hand out."""

    total_bytes: int
    pool_bytes: int

    def usable(self, gpu_memory_utilization: float) -> int:
        return min(int(gpu_memory_utilization * self.total_bytes), self.pool_bytes)


def configure_allocator(gpu_memory_utilization: float, backend_started: bool,
                        environ: MutableMapping[str, str] | None = None) -> str:
    """Size JAX's GPU pool from the flag if the backend has not started and the user left it alone;
    returns what was decided, in words, for the start-up log."""
    environ = os.environ if environ is None else environ
    if backend_started:
        return (f"JAX's backend had already started, so its allocator keeps the pool it made "
                f"({MEM_FRACTION}={environ.get(MEM_FRACTION, JAX_DEFAULT_FRACTION)}); the plan is capped by it")
    if MEM_FRACTION in environ:
        return f"{MEM_FRACTION}={environ[MEM_FRACTION]} set by the user is kept; the plan is capped by that pool"
    environ[MEM_FRACTION] = f"{gpu_memory_utilization:.4f}"
    environ.setdefault(PREALLOCATE, "true")
    return (f"JAX's GPU allocator (if this process uses a GPU) gets {gpu_memory_utilization:.0%} of the "
            f"device's memory ({MEM_FRACTION}={environ[MEM_FRACTION]}), as --gpu-memory-utilization asks")


def device_memory(stats: dict | None, environ: MutableMapping[str, str] | None = None) -> DeviceMemory | None:
    """The device's memory from its `memory_stats()`; None when it reports no limit (CPU).

    The total is the pool divided by the fraction the allocator was started with; with the
    platform allocator (no pool) the limit is the device itself."""
    environ = os.environ if environ is None else environ
    if not stats or not stats.get("bytes_limit"):
        return None
    pool = int(stats["bytes_limit"])
    allocator = environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "").lower()
    try:
        fraction = float(environ.get(MEM_FRACTION, JAX_DEFAULT_FRACTION))
    except ValueError:
        fraction = JAX_DEFAULT_FRACTION
    if allocator == "platform" or not 0 < fraction <= 1:
        return DeviceMemory(total_bytes=pool, pool_bytes=pool)
    # XLA sizes the pool as `fraction x total` (preallocated or grown on demand alike).
    return DeviceMemory(total_bytes=int(round(pool / fraction)), pool_bytes=pool)
