"""Rotary position embeddings, including the `linear`, `llama3` and `yarn` frequency scalings.

Frequencies are computed once on the host in float32 (the same arithmetic Hugging Face uses, so
logits agree to float32 rounding) and baked into the traced program as constants.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from paxserve.models.config import ModelConfig


def _base_inv_freq(theta: float, dim: int) -> np.ndarray:
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    return (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float32)


def _llama3(inv_freq: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    s = cfg.rope_scaling
    old_len = float(s.original_max_position_embeddings)
    low_wavelen = old_len / s.low_freq_factor
    high_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def _yarn(cfg: ModelConfig, dim: int) -> tuple[np.ndarray, float]:
    s = cfg.rope_scaling
    base = cfg.rope_theta
    orig_len = s.original_max_position_embeddings or cfg.max_position_embeddings

    def mscale_of(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.attention_factor
    if attention_factor is None:
        if s.mscale and s.mscale_all_dim:
            attention_factor = mscale_of(s.factor, s.mscale) / mscale_of(s.factor, s.mscale_all_dim)
        else:
            attention_factor = mscale_of(s.factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the ramp would divide by zero
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
    extrapolation = np.float32(1.0) / pos_freqs
    interpolation = np.float32(1.0) / (np.float32(s.factor) * pos_freqs)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrapolation_weight = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq.astype(np.float32), float(attention_factor)


def rope_frequencies(cfg: ModelConfig, local: bool = False) -> tuple[np.ndarray, float]:
    """Inverse frequencies [head_dim // 2] and the cos/sin scale ("attention factor"); `local`: the
    table of the windowed layers (`local_rope_theta`, Gemma 3) instead of the global one."""
    if local:
        if cfg.local_rope_theta is None:
            raise ValueError("this model has no separate RoPE table for its local layers")
        cfg = cfg.replace(rope_theta=cfg.local_rope_theta, rope_scaling=cfg.local_rope_scaling)
    dim = cfg.head_dim
    kind = cfg.rope_scaling.rope_type
    if kind == "yarn":
        return _yarn(cfg, dim)
    inv_freq = _base_inv_freq(cfg.rope_theta, dim)
    if kind == "linear":
        inv_freq = (inv_freq / np.float32(cfg.rope_scaling.factor)).astype(np.float32)
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, cfg)
    return inv_freq, 1.0


def rope_cos_sin(
    positions: Int[Array, " T"], inv_freq: np.ndarray, scale: float, dtype: jnp.dtype
) -> tuple[Float[Array, "T D"], Float[Array, "T D"]]:
    """cos/sin tables for the given positions, in Hugging Face's half-split layout."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return (jnp.cos(emb) * scale).astype(dtype), (jnp.sin(emb) * scale).astype(dtype)


def apply_rope(
    x: Float[Array, "T N D"], cos: Float[Array, "T D"], sin: Float[Array, "T D"]
) -> Float[Array, "T N D"]:
    """Rotate pairs (i, i + D/2): the layout of Hugging Face Llama weights (GGUF weights are
    converted to it at load time)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
