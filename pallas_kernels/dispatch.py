"""Attention backend dispatch: the Pallas kernels on GPUs (Triton first, then Mosaic GPU), the XLA
reference elsewhere; a pure-decode step's program takes the decode-only kernel of the same family.

The choice is a static, hashable `AttentionBackend` that the model's jitted forward takes as a
static argument (no globals, no environment variables). `resolve_attention_backend` turns the
engine option ("auto", "mosaic", "triton", "reference"; "pallas" is the earlier name of "triton")
into one, from the platform, the GPU's compute capability and the model's shapes; on a GPU it runs
the chosen kernel once against the reference first (`self_check.py`) and falls back (Triton to Mosaic
GPU to the reference) if a kernel fails to compile or disagrees.

Why Triton before Mosaic GPU on Hopper, and why a decode-only kernel: on one H200 (JAX 0.11.2,
benchmarks/RESULTS.md, "First GPU contact") the Triton ragged kernel took 0.55-0.93x the Mosaic
GPU one's time at every measured shape, and each family's decode-only kernel 0.24-0.8x its ragged
kernel's on pure-decode batches. Mosaic GPU stays the fallback: JAX 0.11 deprecates Pallas-Triton.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from paxserve.kernels import cpu_attention, cpu_library
from paxserve.kernels.attention_args import Window
from paxserve.kernels.metadata import AttentionMetadata
from paxserve.kernels.mosaic_attention import (
    MosaicAttentionConfig,
    mosaic_paged_decode_attention,
    mosaic_ragged_paged_attention,
    supports_mosaic_attention,
)
from paxserve.kernels.decode_attention import PagedDecodeAttentionConfig, paged_decode_attention
from paxserve.kernels.reference import ragged_paged_attention_reference
from paxserve.kernels.ragged_paged_attention import (
    RaggedPagedAttentionConfig,
    ragged_paged_attention,
    supports_ragged_paged_attention,
)
from paxserve.kernels.self_check import self_check_attention

logger = logging.getLogger(__name__)

ATTENTION_BACKEND_OPTIONS = ("auto", "mosaic", "triton", "pallas", "reference")
_ALIASES = {"pallas": "triton"}
_GPU_PLATFORMS = ("gpu", "cuda", "rocm")
_KERNELS = ("mosaic", "triton")
_FAMILY = {"mosaic": "Mosaic GPU", "triton": "Triton"}
_LABEL = {name: f"{family} kernel" for name, family in _FAMILY.items()}


@dataclass(frozen=True)
class AttentionBackend:
    """Which attention implementation the model runs.

    name: "mosaic" (Pallas on Mosaic GPU: Hopper's TMA and wgmma), "triton" (Pallas on Triton;
      "pallas", its earlier name, is accepted and stored as "triton") or "reference" (pure jnp / XLA).
    interpret: run the kernel in its interpret mode on a CPU (tests; slow). Mosaic GPU's needs
      JAX >= 0.11.2.
    config, mosaic_config, decode_config: the Triton ragged, the Mosaic GPU and the Triton
      decode-only kernel's tuning knobs.
    decode_kernel: the engine compiles pure-decode steps as their own programs, which run the
      family's decode-only kernel (False when that kernel failed its start-up self-check; never
      for the reference, whose decode steps are ragged steps like any other).
    pure_decode: this program is a pure-decode step: every sequence has exactly one query token,
      token s belongs to sequence s, and tokens past the sequences are padding (the engine sets it
      on its "decode" programs only; `attention` then calls the decode-only kernel).
    cpu_kernel: the reference on a CPU, whose steps run paxserve's CPU kernel (cpu_attention.py)
      where it takes the model's attention; "auto" sets it on a CPU once the kernel has built and
      passed its self-check.
    """

    name: str = "reference"
    interpret: bool = False
    config: RaggedPagedAttentionConfig = field(default_factory=RaggedPagedAttentionConfig)
    mosaic_config: MosaicAttentionConfig = field(default_factory=MosaicAttentionConfig)
    decode_config: PagedDecodeAttentionConfig = field(default_factory=PagedDecodeAttentionConfig)
    decode_kernel: bool = True
    pure_decode: bool = False
    cpu_kernel: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", _ALIASES.get(self.name, self.name))
        if self.name not in (*_KERNELS, "reference"):
            raise ValueError(f"AttentionBackend.name must be 'mosaic', 'triton' or 'reference', got {self.name!r}")
        if self.name == "reference":
            object.__setattr__(self, "decode_kernel", False)
        if self.cpu_kernel and self.name != "reference":
            raise ValueError("AttentionBackend: cpu_kernel goes with the reference backend only")
        if self.pure_decode and not self.decode_kernel:
            raise ValueError(f"AttentionBackend: pure_decode needs a decode kernel, and {self.name!r} has none here")

    def describe(self) -> str:
        """The choice in plain words, for the start-up log."""
        if self.name == "reference" and self.cpu_kernel:
            return ("paxserve's CPU kernel for float32 models without windows, ALiBi or soft caps; the XLA "
                    "reference for the rest")
        if self.name == "reference":
            return "the XLA reference (jnp gathers through the block table; no Pallas kernel)"
        family = _FAMILY[self.name]
        mode = " in interpret mode" if self.interpret else ""
        decode = (f"pure-decode steps on the {family} decode-only kernel" if self.decode_kernel
                  else "pure-decode steps on the ragged kernel too")
        return f"{family}{mode}: mixed steps on the ragged kernel, {decode}"


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
    fp8: str | None = None,
) -> Float[Array, "T H D"]:
    """Ragged paged attention (see `ragged_paged_attention_reference`) on the chosen backend.

    sliding_window: None, a Python int >= 1 (ValueError otherwise) or an int32 scalar that may be
      traced (a per-layer window scanned over layers; `NO_WINDOW` for a global layer).
    alibi_slopes: None or float32 [num_heads] (`alibi_slopes(num_heads)` gives Falcon's), added as
      `slope[h] * (key position - query position)` to q.k before `sm_scale`.
    fp8: the caches hold uint8 bits of values in this fp8 format (pallas_kernels/kv_cache.py), which
      every backend widens as it reads them.
    """
    if backend.pure_decode:
        return _decode_step(q, k_cache, v_cache, layer, metadata, sm_scale=sm_scale, backend=backend,
                            sliding_window=sliding_window, soft_cap=soft_cap, alibi_slopes=alibi_slopes, fp8=fp8)
    if backend.name == "mosaic":
        return mosaic_ragged_paged_attention(
            q, k_cache, v_cache, layer, metadata, sm_scale=sm_scale, sliding_window=sliding_window,
            soft_cap=soft_cap, alibi_slopes=alibi_slopes, config=backend.mosaic_config, interpret=backend.interpret,
            fp8=fp8,
        )
    if backend.name == "triton":
        return ragged_paged_attention(
            q, k_cache, v_cache, layer, metadata, sm_scale=sm_scale, sliding_window=sliding_window,
            soft_cap=soft_cap, alibi_slopes=alibi_slopes, config=backend.config, interpret=backend.interpret,
            fp8=fp8,
        )
    if backend.cpu_kernel and cpu_attention.serves(q, k_cache, metadata, sliding_window=sliding_window,
                                                   soft_cap=soft_cap, alibi_slopes=alibi_slopes, fp8=fp8):
        return cpu_attention.cpu_decode_attention(q, k_cache, v_cache, layer, metadata, sm_scale=sm_scale)
    return ragged_paged_attention_reference(
        q, k_cache, v_cache, layer, metadata, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        alibi_slopes=alibi_slopes, fp8=fp8,
    )


def _decode_step(q: Float[Array, "T H D"], k_cache: Float[Array, "L N P K D"], v_cache: Float[Array, "L N P K D"],
                 layer: Int[Array, ""] | int, metadata: AttentionMetadata, *, sm_scale: float,
                 backend: AttentionBackend, sliding_window: Window, soft_cap: float | None,
                 alibi_slopes: Float[Array, " H"] | None, fp8: str | None = None) -> Float[Array, "T H D"]:
    """A pure-decode step on the decode-only kernel: token s is sequence s's one query token (its
    position `context_lens[s] - 1`), so the first S rows of q are the kernel's queries; the padding
    tokens past them (a token bucket larger than the sequence bucket) get zeros, as padding
    sequences do."""
    num_tokens, num_seqs = q.shape[0], metadata.context_lens.shape[0]
    queries = q[:num_seqs] if num_tokens >= num_seqs else jnp.pad(q, ((0, num_seqs - num_tokens), (0, 0), (0, 0)))
    args = (queries, k_cache, v_cache, layer, metadata.block_tables, metadata.context_lens)
    options = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, alibi_slopes=alibi_slopes,
                   interpret=backend.interpret, fp8=fp8)
    if backend.name == "mosaic":
        out = mosaic_paged_decode_attention(*args, config=backend.mosaic_config, **options)
    else:
        out = paged_decode_attention(*args, config=backend.decode_config, **options)
    if num_tokens >= num_seqs:
        return jnp.pad(out, ((0, num_tokens - num_seqs), (0, 0), (0, 0)))
    return out[:num_tokens]


def supports(kernel: str, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
             dtype: jnp.dtype) -> str | None:
    """None if `kernel` ("mosaic" or "triton") serves these shapes, else the reason it does not (both
    also read an fp8 KV cache)."""
    check = supports_mosaic_attention if kernel == "mosaic" else supports_ragged_paged_attention
    return check(num_heads, num_kv_heads, head_dim, block_size, dtype)


def _mosaic_interpret_available() -> bool:
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return hasattr(plgpu, "InterpretGPUParams")


def _is_hopper_or_newer(compute_capability: str | None) -> bool:
    try:
        return compute_capability is not None and int(str(compute_capability).split(".")[0]) >= 9
    except ValueError:
        return False


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
    compute_capability: str | None = None,
    kv_dtype: jnp.dtype | None = None,
) -> AttentionBackend:
    """The backend for an engine option on a platform (`jax.devices()[0].platform`).

    "auto": on an NVIDIA GPU, Triton, then (compute capability 9.0 or more, `compute_capability`,
      e.g. "9.0") Mosaic GPU; on ROCm, Triton. A kernel that does not serve the model's shapes or
      fails its self-check hands over to the next, and the XLA reference serves when none is left.
      The reference on a CPU. (Triton first: it measured faster on an H200, see the module doc.)
    "mosaic", "triton" ("pallas"): that kernel, or a ValueError naming what it does not support or
      why it failed its self-check; on a CPU it can only run in interpret mode (slow, for tests),
      which is what it then does (Mosaic GPU's needs JAX >= 0.11.2).
    "reference": the XLA reference everywhere.

    self_check: called once per kernel tried on a GPU as `self_check(backend, num_heads=...,
      num_kv_heads=..., head_dim=..., block_size=..., dtype=...)` (never for interpret mode); returns
      None if the kernel works, else the reason it does not. None skips the check.
    sliding_window, alibi: the model's attention variants (its largest window, whether it uses
      ALiBi); when given they are passed on to `self_check` as keyword arguments of the same names
      so the kernel is also checked on them (left out when not given, so a `self_check` that does
      not know them keeps working).
    kv_dtype: the KV cache's dtype when it is not `dtype` (fp8); the self-check is given it as
      `kv_dtype`, so each kernel is checked on the pages it will read.
    """
    if option not in ATTENTION_BACKEND_OPTIONS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKEND_OPTIONS)}, got {option!r}")
    option = _ALIASES.get(option, option)
    if option == "reference":
        return REFERENCE
    shapes = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                  dtype=dtype)
    on_gpu = platform.lower() in _GPU_PLATFORMS
    fp8_cache = kv_dtype is not None and jnp.dtype(kv_dtype) != jnp.dtype(dtype)
    if option == "auto":
        if not on_gpu:
            return _reference_on_cpu(platform)
        hopper = platform.lower() != "rocm" and _is_hopper_or_newer(compute_capability)
        candidates = ["triton", "mosaic"] if hopper else ["triton"]
        logger.info("attention: %s (compute capability %s): trying %s", platform, compute_capability or "unknown",
                    ", then ".join(_LABEL[c] for c in candidates))
    else:
        reason = supports(option, **shapes)
        if reason:
            raise ValueError(f"attention_backend={option!r} cannot serve this model: {reason}")
        if not on_gpu:
            if option == "mosaic" and not _mosaic_interpret_available():
                import jax

                raise ValueError(f"attention_backend='mosaic' on {platform} runs in Mosaic GPU's interpret mode, "
                                 f"which needs JAX >= 0.11.2 (this is JAX {jax.__version__})")
            logger.warning("attention: the %s on %s runs in interpret mode (slow; meant for tests)",
                           _LABEL[option], platform)
            return AttentionBackend(option, interpret=True)
        candidates = [option]
    if sliding_window is not None:
        shapes["sliding_window"] = sliding_window
    if alibi:
        shapes["alibi"] = True
    if fp8_cache:
        shapes["kv_dtype"] = kv_dtype
    for kernel in candidates:
        reason = supports(kernel, num_heads, num_kv_heads, head_dim, block_size, dtype)
        if reason:
            logger.warning("attention: the %s does not support this model (%s)", _LABEL[kernel], reason)
            continue
        backend = AttentionBackend(kernel)
        failure = _run_self_check(self_check, backend, platform, shapes)
        if failure is None:
            return _with_checked_decode_kernel(self_check, backend, platform, shapes)
        if option != "auto":
            raise ValueError(f"attention_backend={option!r}: the {_LABEL[kernel]} failed its start-up self-check "
                             f"on {platform} ({failure})")
        logger.warning("attention: the %s failed its start-up self-check on %s (%s)", _LABEL[kernel], platform,
                       failure)
    logger.warning("attention: no Pallas kernel serves this model here; using the XLA reference")
    return REFERENCE


def _reference_on_cpu(platform: str) -> AttentionBackend:
    """The reference, with the CPU kernel for decode steps where it builds and passes its self-check."""
    if platform.lower() != "cpu":
        return REFERENCE
    loaded = cpu_library.load_cpu_kernels()
    if isinstance(loaded, str):
        logger.warning("attention: the XLA reference for every step (paxserve's CPU kernels are not available: %s)",
                       loaded)
        return REFERENCE
    return AttentionBackend("reference", cpu_kernel=True)


def _with_checked_decode_kernel(self_check: Callable[..., str | None] | None, backend: AttentionBackend,
                                platform: str, shapes: dict) -> AttentionBackend:
    """`backend` with its decode-only kernel, when that kernel passes its own self-check on a
    pure-decode batch; else without it (pure-decode steps then run the ragged kernel, as mixed ones do)."""
    decode = replace(backend, pure_decode=True)
    failure = _run_self_check(self_check, decode, platform, shapes)
    if failure is None:
        return backend
    logger.warning("attention: the %s's decode-only kernel failed its start-up self-check on %s (%s); pure-decode "
                   "steps run the ragged kernel", _LABEL[backend.name], platform, failure)
    return replace(backend, decode_kernel=False)


def _run_self_check(self_check: Callable[..., str | None] | None, backend: AttentionBackend, platform: str,
                    shapes: dict) -> str | None:
    label = _LABEL[backend.name] + ("'s decode-only kernel" if backend.pure_decode else "")
    if self_check is None:
        logger.info("attention: using the %s on %s without a start-up self-check (none requested)", label, platform)
        return None
    start = time.perf_counter()
    try:
        failure = self_check(backend, **shapes)
    except Exception as error:  # noqa: BLE001 - a check that raises has failed, it must not stop start-up
        failure = f"the self-check raised {type(error).__name__}: {error}"
    if failure is None:
        logger.info("attention: the %s passed its start-up self-check against the XLA reference in %.0f ms; "
                    "using it", label, (time.perf_counter() - start) * 1e3)
    return failure
