"""Functional Llama (`LlamaForCausalLM`) over the paged KV cache.

Params are an explicit pytree with per-layer weights stacked on a leading layer axis, so the
forward pass is one `lax.scan` over layers: XLA compiles the layer body once, whatever the depth,
and the KV cache rides in the scan carry so each layer's writes update it in place.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Float, Int

from models.config import ModelConfig
from models.layers import dense, gated_mlp, rms_norm
from models.rope import apply_rope, rope_cos_sin, rope_frequencies
from pallas_kernels import REFERENCE, AttentionBackend, AttentionMetadata, KVCache, attention, write_kv_reference


@struct.dataclass
class LlamaLayerParams:
    """One field per weight, each with a leading `num_layers` axis; matrices are [in, out]."""

    input_norm: Float[Array, "L H"]
    qkv_w: Float[Array, "L H QKV"]
    qkv_b: Float[Array, "L QKV"] | None
    o_w: Float[Array, "L NH H"]
    o_b: Float[Array, "L H"] | None
    post_norm: Float[Array, "L H"]
    gate_up_w: Float[Array, "L H I2"]
    gate_up_b: Float[Array, "L I2"] | None
    down_w: Float[Array, "L I H"]
    down_b: Float[Array, "L H"] | None


@struct.dataclass
class LlamaParams:
    embed: Float[Array, "V H"]
    layers: LlamaLayerParams
    final_norm: Float[Array, " H"]
    lm_head: Float[Array, "H V"] | None  # None when tied to the embedding


def forward(
    params: LlamaParams,
    kv_cache: KVCache,
    input_ids: Int[Array, " T"],
    positions: Int[Array, " T"],
    metadata: AttentionMetadata,
    cfg: ModelConfig,
    attention_backend: AttentionBackend = REFERENCE,
) -> tuple[Float[Array, "S V"], KVCache]:
    """Run a flattened ragged batch of new tokens; return float32 logits at
    `metadata.logits_indices` and the updated cache. `attention_backend` (static) picks the
    attention implementation: the XLA reference by default, or the Pallas kernel."""
    num_tokens = input_ids.shape[0]
    x = params.embed[input_ids]
    inv_freq, rope_scale = rope_frequencies(cfg)
    cos, sin = rope_cos_sin(positions, inv_freq, rope_scale, x.dtype)
    q_size = cfg.num_heads * cfg.head_dim
    kv_size = cfg.num_kv_heads * cfg.head_dim

    def layer(carry: tuple[Array, Array, Array], xs: tuple[LlamaLayerParams, Array]):
        x, k_cache, v_cache = carry
        p, index = xs
        h = rms_norm(x, p.input_norm, cfg.rms_norm_eps)
        qkv = dense(h, p.qkv_w, p.qkv_b)
        q = qkv[:, :q_size].reshape(num_tokens, cfg.num_heads, cfg.head_dim)
        k = qkv[:, q_size : q_size + kv_size].reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        v = qkv[:, q_size + kv_size :].reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache, v_cache = write_kv_reference(k_cache, v_cache, index, k, v, metadata.slot_mapping)
        attn = attention(
            q, k_cache, v_cache, index, metadata, sm_scale=cfg.head_dim**-0.5, backend=attention_backend
        )
        x = x + dense(attn.reshape(num_tokens, q_size), p.o_w, p.o_b)
        h = rms_norm(x, p.post_norm, cfg.rms_norm_eps)
        x = x + gated_mlp(h, p.gate_up_w, p.gate_up_b, p.down_w, p.down_b)
        return (x, k_cache, v_cache), None

    layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    (x, k_cache, v_cache), _ = jax.lax.scan(layer, (x, kv_cache.k, kv_cache.v), (params.layers, layer_ids))
    h = rms_norm(x[metadata.logits_indices], params.final_norm, cfg.rms_norm_eps)
    head = params.embed.T if params.lm_head is None else params.lm_head
    logits = jnp.dot(h, head, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return logits, KVCache(k=k_cache, v=v_cache)


# ---- Hugging Face checkpoint layout -------------------------------------------------------------

_LAYER = "model.layers.{i}."


def hf_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a `LlamaForCausalLM` checkpoint must hold, with its [out, in] shape."""
    h, q, kv, inter = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        pre = _LAYER.format(i=i)
        shapes |= {
            pre + "input_layernorm.weight": (h,),
            pre + "post_attention_layernorm.weight": (h,),
            pre + "self_attn.q_proj.weight": (q, h),
            pre + "self_attn.k_proj.weight": (kv, h),
            pre + "self_attn.v_proj.weight": (kv, h),
            pre + "self_attn.o_proj.weight": (h, q),
            pre + "mlp.gate_proj.weight": (inter, h),
            pre + "mlp.up_proj.weight": (inter, h),
            pre + "mlp.down_proj.weight": (h, inter),
        }
        if cfg.attention_bias:
            shapes |= {pre + "self_attn.q_proj.bias": (q,), pre + "self_attn.k_proj.bias": (kv,),
                       pre + "self_attn.v_proj.bias": (kv,), pre + "self_attn.o_proj.bias": (h,)}
        if cfg.mlp_bias:
            shapes |= {pre + "mlp.gate_proj.bias": (inter,), pre + "mlp.up_proj.bias": (inter,),
                       pre + "mlp.down_proj.bias": (h,)}
    return shapes


# Tensors some checkpoints carry that hold nothing the model needs (old rotary caches).
HF_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def params_from_hf(read: Callable[[str], np.ndarray], cfg: ModelConfig, dtype: np.dtype) -> LlamaParams:
    """Assemble params from HF-named tensors (already checked for presence and shape)."""

    def stacked(parts: Callable[[int], list[np.ndarray]], transpose: bool) -> jax.Array:
        first = np.concatenate(parts(0), axis=0)
        first = first.T if transpose else first
        out = np.empty((cfg.num_layers, *first.shape), dtype)
        out[0] = first
        for i in range(1, cfg.num_layers):
            t = np.concatenate(parts(i), axis=0)
            out[i] = t.T if transpose else t
        return jnp.asarray(out)

    def names(*suffixes: str) -> Callable[[int], list[np.ndarray]]:
        return lambda i: [read(_LAYER.format(i=i) + s) for s in suffixes]

    attn = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    gate_up = ("mlp.gate_proj", "mlp.up_proj")
    with_suffix = lambda mods, suffix: tuple(m + suffix for m in mods)  # noqa: E731
    layers = LlamaLayerParams(
        input_norm=stacked(names("input_layernorm.weight"), False),
        qkv_w=stacked(names(*with_suffix(attn, ".weight")), True),
        qkv_b=stacked(names(*with_suffix(attn, ".bias")), False) if cfg.attention_bias else None,
        o_w=stacked(names("self_attn.o_proj.weight"), True),
        o_b=stacked(names("self_attn.o_proj.bias"), False) if cfg.attention_bias else None,
        post_norm=stacked(names("post_attention_layernorm.weight"), False),
        gate_up_w=stacked(names(*with_suffix(gate_up, ".weight")), True),
        gate_up_b=stacked(names(*with_suffix(gate_up, ".bias")), False) if cfg.mlp_bias else None,
        down_w=stacked(names("mlp.down_proj.weight"), True),
        down_b=stacked(names("mlp.down_proj.bias"), False) if cfg.mlp_bias else None,
    )
    as_dtype = lambda a: jnp.asarray(np.asarray(a, dtype))  # noqa: E731
    return LlamaParams(
        embed=as_dtype(read("model.embed_tokens.weight")),
        layers=layers,
        final_norm=as_dtype(read("model.norm.weight")),
        lm_head=None if cfg.tie_word_embeddings else as_dtype(read("lm_head.weight").T),
    )


def abstract_params(cfg: ModelConfig, dtype: np.dtype) -> LlamaParams:
    """Shapes and dtypes of the params without materialising them: lets memory planning size the
    weights before loading, and tells the on-disk param cache what to restore."""
    h, nl, inter = cfg.hidden_size, cfg.num_layers, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    s = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
    layers = LlamaLayerParams(
        input_norm=s(nl, h),
        qkv_w=s(nl, h, q + 2 * kv),
        qkv_b=s(nl, q + 2 * kv) if cfg.attention_bias else None,
        o_w=s(nl, q, h),
        o_b=s(nl, h) if cfg.attention_bias else None,
        post_norm=s(nl, h),
        gate_up_w=s(nl, h, 2 * inter),
        gate_up_b=s(nl, 2 * inter) if cfg.mlp_bias else None,
        down_w=s(nl, inter, h),
        down_b=s(nl, h) if cfg.mlp_bias else None,
    )
    return LlamaParams(
        embed=s(cfg.vocab_size, h),
        layers=layers,
        final_norm=s(h),
        lm_head=None if cfg.tie_word_embeddings else s(h, cfg.vocab_size),
    )
