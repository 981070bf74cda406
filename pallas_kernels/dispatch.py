"""Attention backend dispatch: the Pallas kernel on GPU, the XLA reference on CPU.

The choice is a static, hashable `AttentionBackend` that the model's jitted forward takes as a
static argument (no globals, no environment variables). `resolve_attention_backend` turns the
engine option ("auto", "pallas", "reference") into one, from the platform and the model's shapes;
on a GPU it runs the kernel once against the reference first (`self_check.py`) and falls back to the
reference if the kernel fails to compile or disagrees.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.attention_args import Window
from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.paged_attention_reference import ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention import (
    RaggedPagedAttentionConfig,
    ragged_paged_attention,
    supports_ragged_paged_attention,
)
from pallas_kernels.self_check import self_check_attention

logger = logging.getLogger(__name__)

ATTENTION_BACKEND_OPTIONS = ("auto", "pallas", "reference")
_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


@dataclass(frozen=True)
class AttentionBackend:
    """Which attention implementation the model runs.

    name: "pallas" (the Triton kernel) or "reference" (pure jnp / XLA).
    interpret: run the Pallas kernel with the Pallas interpreter (CPU tests; slow).
    config: the Pallas kernel's tuning knobs.
    """

    name: str = "reference"
    interpret: bool = False
    config: RaggedPagedAttentionConfig = field(default_factory=RaggedPagedAttentionConfig)

    def __post_init__(self) -> None:
        if self.name not in ("pallas", "reference"):
            raise ValueError(f"AttentionBackend.name must be 'pallas' or 'reference', got {self.name!r}")


REFERENCE = AttentionBackend("reference")


def attention(
    q: Float[Array, "T H D"],
    k_cache: Float[Array, "L N P K D"],
    v_cache: Float[Array, "L N P K D"],
    layer: Int[Array, ""] | int,
    metadata: AttentionMetadata,
    *,
    sm_scale: float,
    backend: AttentionBackend = REFERENCE,
    sliding_window: Window = None,
    soft_cap: float | None = None,
    alibi_slopes: Float[Array, " H"] | None = None,
) -> Float[Array, "T H D"]:
    """Ragged paged attention (see `ragged_paged_attention_reference`) on the chosen backend.

    sliding_window: None, a Python int >= 1 (ValueError otherwise) or an int32 scalar that may be
      traced (a per-layer window scanned over layers; `NO_WINDOW` for a global layer).
    alibi_slopes: None or float32 [num_heads] (`alibi_slopes(num_heads)` gives Falcon's), added as
      `slope[h] * (key position - query position)` to q.k before `sm_scale`.
    """
    if backend.name == "pallas":
        return ragged_paged_attention(
            q, k_cache, v_cache, layer, metadata, sm_scale=sm_scale, sliding_window=sliding_window,
            soft_cap=soft_cap, alibi_slopes=alibi_slopes, config=backend.config, interpret=backend.interpret,
        )
    return ragged_paged_attention_reference(
        q, k_cache, v_cache, layer, metadata, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        alibi_slopes=alibi_slopes,
    )


def resolve_attention_backend(
    option: str,
    platform: str,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: jnp.dtype,
    self_check: Callable[..., str | None] | None = self_check_attention,
    sliding_window: int | None = None,
    alibi: bool = False,
) -> AttentionBackend:
    """The backend for an engine option on a platform (`jax.devices()[0].platform`).

    "auto": Pallas on a GPU when the kernel supports the model's shapes and passes its self-check,
      else the reference.
    "pallas": the kernel, or a ValueError naming what it does not support or why it failed its
      self-check; on a CPU it can only run in interpret mode (slow, for tests), which is what it
      then does.
    "reference": the XLA reference everywhere.

    self_check: called once as `self_check(backend, num_heads=..., num_kv_heads=..., head_dim=...,
      block_size=..., dtype=...)` when the Pallas kernel is chosen for a GPU (never for interpret
      mode); returns None if the kernel works, else the reason it does not. None skips the check.
    sliding_window, alibi: the model's attention variants (its largest window, whether it uses
      ALiBi); when given they are passed on to `self_check` as keyword arguments of the same names
      so the kernel is also checked on them (left out when not given, so a `self_check` that does
      not know them keeps working).
    """
    if option not in ATTENTION_BACKEND_OPTIONS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKEND_OPTIONS)}, got {option!r}")
    if option == "reference":
        return REFERENCE
    reason = supports_ragged_paged_attention(num_heads, num_kv_heads, head_dim, block_size, dtype)
    on_gpu = platform.lower() in _GPU_PLATFORMS
    if option == "auto":
        if not on_gpu:
            return REFERENCE
        if reason:
            logger.warning("attention: the Pallas kernel does not support this model (%s); using the XLA reference",
                           reason)
            return REFERENCE
    elif reason:
        raise ValueError(f"attention_backend='pallas' cannot serve this model: {reason}")
    elif not on_gpu:
        logger.warning("attention: Pallas on %s runs in interpret mode (slow; meant for tests)", platform)
        return AttentionBackend("pallas", interpret=True)
    backend = AttentionBackend("pallas")
    if self_check is None:
        logger.info("attention: using the Pallas kernel on %s without a start-up self-check (none requested)",
                    platform)
        return backend
    shapes = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                  dtype=dtype)
    if sliding_window is not None:
        shapes["sliding_window"] = sliding_window
    if alibi:
        shapes["alibi"] = True
    start = time.perf_counter()
    try:
        failure = self_check(backend, **shapes)
    except Exception as error:  # noqa: BLE001 - a check that raises has failed, it must not stop start-up
        failure = f"the self-check raised {type(error).__name__}: {error}"
    elapsed_ms = (time.perf_counter() - start) * 1e3
    if failure is None:
        logger.info("attention: the Pallas kernel passed its start-up self-check against the XLA reference "
                    "in %.0f ms; using it", elapsed_ms)
        return backend
    if option == "pallas":
        raise ValueError(f"attention_backend='pallas': the Pallas kernel failed its start-up self-check on "
                         f"{platform} ({failure})")
    logger.warning("attention: the Pallas kernel failed its start-up self-check on %s (%s); using the XLA "
                   "reference instead", platform, failure)
    return REFERENCE
