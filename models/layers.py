"""Layers shared by the decoder-only architectures, as pure functions."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from paxserve.models.quant_weights import GroupQuantizedWeight, QuantizedWeight, group_matmul, quantized_matmul

Reduce = Callable[[Array], Array]  # sums a row-parallel product's partial results over the devices


def rms_norm(x: Float[Array, "T H"], weight: Float[Array, " H"], eps: float) -> Float[Array, "T H"]:
    """RMSNorm computed in float32 and cast back before the weight, as Hugging Face Llama does."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def rms_norm_one_plus(x: Float[Array, "T H"], weight: Float[Array, " H"], eps: float) -> Float[Array, "T H"]:
    """Gemma's RMSNorm: (1 + w) * x / rms(x), all in float32, cast back only at the end (the weight
    is stored as an offset from 1, so rounding it first would change bfloat16 results)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def layer_norm(
    x: Float[Array, "T H"], weight: Float[Array, " H"], bias: Float[Array, " H"] | None, eps: float
) -> Float[Array, "T H"]:
    """LayerNorm in float32 (torch computes half-precision LayerNorm in float32 too)."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps) * weight.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)


def norm(kind: str, x: Array, weight: Array, bias: Array | None, eps: float) -> Array:
    """The norm a model's spec names ("rms", "rms_one_plus" or "layer"); works over the last axis,
    so it also serves per-head q/k norms."""
    if kind == "layer":
        return layer_norm(x, weight, bias, eps)
    if kind == "rms_one_plus":
        return rms_norm_one_plus(x, weight, eps)
    return rms_norm(x, weight, eps)


def dense(
    x: Float[Array, "T I"], w: Float[Array, "I O"] | QuantizedWeight | GroupQuantizedWeight,
    b: Float[Array, " O"] | None = None,
    reduce: Reduce | None = None,
) -> Float[Array, "T O"]:
    """x @ w (+ b) with float32 accumulation; HIGHEST precision keeps float32 models exact on GPUs
    that would otherwise use TF32. `reduce` (row-parallel: `w` holds this device's rows) sums the
    float32 partial products over the devices before the one rounding and the bias, so a split
    layer rounds as the whole one does. A quantized `w` is dequantized inside the product; a GGUF
    weight kept quantized to `x`'s dtype first, so the product is the dequantized file's exactly."""
    if isinstance(w, QuantizedWeight):
        y = quantized_matmul(x, w)
    elif isinstance(w, GroupQuantizedWeight):
        y = group_matmul(x, w)
    else:
        y = jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    if reduce is not None:
        y = reduce(y)
    y = y.astype(x.dtype)
    return y if b is None else y + b


def activation(name: str, x: Array) -> Array:
    """Hugging Face's activation by its config name."""
    if name in ("silu", "swish"):
        return jax.nn.silu(x)
    if name in ("gelu_pytorch_tanh", "gelu_new"):
        return jax.nn.gelu(x, approximate=True)
    if name == "gelu":
        return jax.nn.gelu(x, approximate=False)
    raise ValueError(f"activation {name!r} is not supported")


def mlp(
    x: Float[Array, "T H"],
    up_w: Float[Array, "H I2"],
    up_b: Float[Array, " I2"] | None,
    down_w: Float[Array, "I H"],
    down_b: Float[Array, " H"] | None,
    *,
    act: str,
    gated: bool,
    reduce: Reduce | None = None,
    up_delta: Callable[[Array], Array] | None = None,
    down_delta: Callable[[Array], Array] | None = None,
) -> Float[Array, "T H"]:
    """Gated MLP (act(gate) * up, gate and up fused into one matmul) or plain (act(up)); `reduce`
    as in `dense`, for the down projection. `up_delta` / `down_delta`: what each row's LoRA adapter
    adds to the up and down products (models/lora.py), from their inputs."""
    h = dense(x, up_w, up_b)
    if up_delta is not None:
        h = h + up_delta(x)
    if gated:
        gate, up = jnp.split(h, 2, axis=-1)
        h = activation(act, gate) * up
    else:
        h = activation(act, h)
    y = dense(h, down_w, down_b, reduce)
    return y if down_delta is None else y + down_delta(h)

