"""The memory plan: JAX's GPU allocator sized from `--gpu-memory-utilization`, the device's real
total, and how many KV-cache blocks fit, decided before the weights are loaded.

Budget = gpu_memory_utilization x device memory - weights - activation peak - the sampler's
per-request state on an accelerator, a fixed host budget on CPU, or the explicit
`kv_cache_memory_bytes` / `num_gpu_blocks_override`. A max_model_len request that cannot fit fails
here, with the numbers and what to change.

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
from dataclasses import dataclass

from paxserve.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from paxserve.models.config import ModelConfig

logger = logging.getLogger(__name__)
GiB = 2**30


@dataclass(frozen=True, slots=True)
class KVCachePlan:
    num_blocks: int  # including the reserved null block 0
    block_size: int
    bytes_per_block: int
    max_model_len: int

    @property
    def num_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    @property
    def max_concurrency(self) -> float:
        return self.num_tokens / self.max_model_len

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, itemsize: int) -> int:
    return cfg.kv_bytes_per_token * block_size * itemsize


def plan_kv_cache(
    cfg: ModelConfig,
    config: EngineConfig,
    itemsize: int,
    weight_bytes: int,
    device_bytes: int | None,
    activation_bytes: int = 0,
    num_devices: int = 1,
    sampler_state_bytes: int = 0,
    pool_bytes: int | None = None,
    draft_bytes_per_block: int = 0,
) -> KVCachePlan:
    """`device_bytes` is the accelerator's total memory, or None on CPU; `pool_bytes`, JAX's
    allocator pool, caps what `gpu_memory_utilization` grants when it is smaller. Under tensor parallelism `cfg`
    is one device's share and every budget is per device (as vLLM's --kv-cache-memory-bytes and
    --gpu-memory-utilization are), except the CPU default, a host budget the `num_devices`
    simulated devices share. `draft_bytes_per_block`: a draft model's cache, in the same blocks (its
    weights are in `weight_bytes`)."""
    bs = config.block_size
    per_block = kv_bytes_per_block(cfg, bs, itemsize) + draft_bytes_per_block
    if config.num_gpu_blocks_override is not None:
        num_blocks, source = config.num_gpu_blocks_override, "num_gpu_blocks_override"
        budget = num_blocks * per_block
    else:
        if config.kv_cache_memory_bytes is not None:
            budget, source = config.kv_cache_memory_bytes, "kv_cache_memory_bytes"
        elif device_bytes is None:
            budget, source = DEFAULT_CPU_KV_CACHE_BYTES // num_devices, \
                "the CPU KV-cache budget (set kv_cache_memory_bytes to change)"
        else:
            usable = int(config.gpu_memory_utilization * device_bytes)
            if pool_bytes is not None and pool_bytes < usable:
                logger.warning("JAX's allocator pool (%.2f GiB) is smaller than gpu_memory_utilization %s x %.1f GiB; "
                               "planning within the pool", pool_bytes / GiB, config.gpu_memory_utilization,
                               device_bytes / GiB)
                usable = pool_bytes
            budget = usable - weight_bytes - activation_bytes - sampler_state_bytes
            source = (f"gpu_memory_utilization {config.gpu_memory_utilization} x {device_bytes / GiB:.1f} GiB "
                      f"- weights {weight_bytes / GiB:.2f} GiB - activations {activation_bytes / GiB:.2f} GiB "
                      f"- sampler state {sampler_state_bytes / GiB:.2f} GiB")
            if budget < per_block:  # a shorter max_model_len cannot help: the model itself does not fit
                where = "per device" if num_devices > 1 else "on the device"
                raise ValueError(
                    f"the model does not fit: its weights take {weight_bytes / GiB:.2f} GiB {where} and the largest "
                    f"step's activations {activation_bytes / GiB:.2f} GiB (plus {sampler_state_bytes / GiB:.2f} GiB "
                    f"of per-request sampler state), leaving no KV-cache memory within "
                    f"gpu_memory_utilization {config.gpu_memory_utilization} x {device_bytes / GiB:.1f} GiB = "
                    f"{usable / GiB:.2f} GiB. Split it over more devices (--tensor-parallel-size), use a smaller "
                    f"--dtype, or raise --gpu-memory-utilization")
        num_blocks = max(0, budget // per_block)
    fits_len = max(0, (num_blocks - 1) * bs)
    model_len = cfg.max_position_embeddings
    if config.max_model_len == "auto":
        max_model_len = min(model_len, fits_len)
        if max_model_len < 1:
            raise ValueError(f"no KV-cache memory left: {source} gives {budget / GiB:.2f} GiB, "
                             f"less than one {bs}-token block ({per_block} bytes)")
    else:
        max_model_len = config.max_model_len or model_len
        if max_model_len > model_len:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={model_len}"
            )
    if fits_len < max_model_len:
        raise ValueError(
            f"one {max_model_len}-token request needs {-(-max_model_len // bs)} KV blocks "
            f"({-(-max_model_len // bs) * per_block / GiB:.3f} GiB) but {source} leaves room for {max(0, num_blocks - 1)} "
            f"({budget / GiB:.3f} GiB); the largest max_model_len that fits is {fits_len}. Lower --max-model-len "
            f"(or use --max-model-len auto), or raise --gpu-memory-utilization / --kv-cache-memory-bytes / "
            f"--num-gpu-blocks-override"
        )
    plan = KVCachePlan(num_blocks=num_blocks, block_size=bs, bytes_per_block=per_block, max_model_len=max_model_len)
    logger.info(
        "KV cache: %d blocks of %d tokens = %d tokens, %.2f GiB%s (from %s); maximum concurrency for %d-token "
        "requests: %.2fx", num_blocks - 1, bs, plan.num_tokens, plan.num_bytes / GiB,
        "" if num_devices == 1 else f" on each of {num_devices} devices", source, max_model_len, plan.max_concurrency,
    )
    if draft_bytes_per_block:
        logger.info("KV cache: each block holds the draft model's pages too (%d of its %d bytes)",
                    draft_bytes_per_block, per_block)
    return plan


# ---- JAX's GPU allocator and the device's memory ------------------------------------------------

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
