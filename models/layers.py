"""Layers shared by the decoder-only architectures, as pure functions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


def rms_norm(x: Float[Array, "T H"], weight: Float[Array, " H"], eps: float) -> Float[Array, "T H"]:
    """RMSNorm computed in float32 and cast back before the weight, as Hugging Face does."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def dense(x: Float[Array, "T I"], w: Float[Array, "I O"], b: Float[Array, " O"] | None = None) -> Float[Array, "T O"]:
    """x @ w (+ b) with float32 accumulation; HIGHEST precision keeps float32 models exact on GPUs
    that would otherwise use TF32."""
    y = jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32).astype(x.dtype)
    return y if b is None else y + b


def gated_mlp(
    x: Float[Array, "T H"],
    gate_up_w: Float[Array, "H I2"],
    gate_up_b: Float[Array, " I2"] | None,
    down_w: Float[Array, "I H"],
    down_b: Float[Array, " H"] | None,
) -> Float[Array, "T H"]:
    """SwiGLU MLP with the gate and up projections fused into one matmul."""
    gate, up = jnp.split(dense(x, gate_up_w, gate_up_b), 2, axis=-1)
    return dense(jax.nn.silu(gate) * up, down_w, down_b)
