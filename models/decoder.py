"""The one functional decoder every family runs, driven by the spec fields of `ModelConfig`.

Params are an explicit pytree with per-layer weights stacked on a leading layer axis, so the
forward pass is one `lax.scan` over layers: XLA compiles the layer body once, whatever the depth,
and the KV cache rides in the scan carry so each layer's writes update it in place. What differs
between layers of one model (the attention window, which RoPE table, an MoE model's dense or
sparse MLP) is a scanned array, not a Python branch, so a Gemma 3 with local and global layers
still compiles one body. MoE weights are stacks indexed by a scanned slot rather than scanned
themselves, so a layer step slices out only the experts its tokens were routed to.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Float, Int

from paxserve.models.config import ModelConfig
from paxserve.models.layers import dense, mlp, norm
from paxserve.models.moe import MLPParams, MoEParams, moe_mlp, take_layer
from paxserve.models.rope import apply_rope, rope_cos_sin, rope_frequencies
from paxserve.models.quant_weights import GroupQuantizedWeight, group_matmul, table_matmul
from paxserve.kernels import REFERENCE, AttentionBackend, AttentionMetadata, KVCache, attention, write_kv_reference
from paxserve.kernels.metadata import NO_WINDOW
from paxserve.kernels.alibi import alibi_slopes
from paxserve.kernels.kv_cache import fp8_bits

if TYPE_CHECKING:
    from paxserve.models.lora import LoraWeights
    from paxserve.models.sharding import TensorParallel


@struct.dataclass
class LayerParams:
    """One field per weight, each with a leading `num_layers` axis (as loaded; the engine serves
    from one `LayerParams` per layer without it, models/layer_split.py); matrices are [in, out].
    Fields a family does not have are None."""

    attn_norm: Float[Array, "L H"]
    qkv_w: Float[Array, "L H QKV"]  # q, k and v projections side by side
    o_w: Float[Array, "L NH H"]
    up_w: Float[Array, "L H I2"] | None = None  # gate and up side by side for a gated MLP, else up alone
    down_w: Float[Array, "L I H"] | None = None  # (None in an MoE model: its MLPs are in DecoderParams.moe)
    attn_norm_b: Float[Array, "L H"] | None = None
    qkv_b: Float[Array, "L QKV"] | None = None
    o_b: Float[Array, "L H"] | None = None
    q_norm: Float[Array, "L D"] | None = None
    k_norm: Float[Array, "L D"] | None = None
    post_attn_norm: Float[Array, "L H"] | None = None  # on the attention output (sandwich norms)
    mlp_norm: Float[Array, "L H"] | None = None  # before the MLP; None when it shares attn_norm
    mlp_norm_b: Float[Array, "L H"] | None = None
    post_mlp_norm: Float[Array, "L H"] | None = None
    up_b: Float[Array, "L I2"] | None = None
    down_b: Float[Array, "L H"] | None = None


@struct.dataclass
class DecoderParams:
    embed: Float[Array, "V H"] | GroupQuantizedWeight  # a GGUF embedding kept quantized (a `table`)
    layers: LayerParams | tuple[LayerParams, ...]  # stacked, or split per layer (models/layer_split.py)
    final_norm: Float[Array, " H"]
    final_norm_b: Float[Array, " H"] | None = None
    lm_head: Float[Array, "H V"] | None = None  # None when tied to the embedding
    moe: MoEParams | None = None  # stacked over cfg.moe_layers
    dense_mlp: MLPParams | None = None  # stacked over cfg.dense_mlp_layers (an MoE model's dense layers)


# Passes of at most this many tokens (decode steps, small chunks) run split layers unrolled: on the
# development CPU a batch-1 decode step of SmolLM2 went from 35 to 21 ms. Larger passes are bound by
# their products (a 256-token pass: ~70 GFLOP, ~170 ms there) beside which the scan's weight copies
# (~20 ms) matter less than an unrolled program's compile (3.5x longer, for every bucket).
UNROLL_MAX_TOKENS = 64


def mlp_slots(cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Scanned per-layer arrays that pick an MoE model's MLP: each layer's index into the MoE (or
    dense-MLP) stack, and whether it is an MoE layer (only when the kinds are mixed)."""
    if not cfg.num_experts:
        return {}
    slots = np.zeros(cfg.num_layers, np.int32)
    for stack in (cfg.moe_layers, cfg.dense_mlp_layers):
        slots[list(stack)] = np.arange(len(stack), dtype=np.int32)
    out = {"mlp_slot": slots}
    if cfg.dense_mlp_layers:
        out["is_moe"] = np.isin(np.arange(cfg.num_layers), cfg.moe_layers)
    return out


def layer_windows(cfg: ModelConfig) -> np.ndarray | None:
    """Per-layer window as the kernels take it (NO_WINDOW for full attention), or None when no
    layer has a window (then no window code is traced at all)."""
    if not any(cfg.layer_windows):
        return None
    return np.asarray([w or NO_WINDOW for w in cfg.layer_windows], np.int32)


def forward(
    params: DecoderParams,
    kv_cache: KVCache,
    input_ids: Int[Array, " T"],
    positions: Int[Array, " T"],
    metadata: AttentionMetadata,
    cfg: ModelConfig,
    attention_backend: AttentionBackend = REFERENCE,
    tp: TensorParallel | None = None,
    aux_layers: tuple[int, ...] = (),
    lora: LoraWeights | None = None,
    lora_slots: Int[Array, " T"] | None = None,
) -> tuple[Float[Array, "S V"], KVCache] | tuple[Float[Array, "S V"], KVCache, Float[Array, "T A"]]:
    """Run a flattened ragged batch of new tokens; return float32 logits at
    `metadata.logits_indices` and the updated cache. `attention_backend` (static) picks the
    attention implementation: the XLA reference by default, or the Pallas kernel. With
    `aux_layers` (static; an EAGLE-3 head reads them), also the residual stream entering each of
    those layers at every token, side by side ([T, len(aux_layers) x hidden]).

    Stacked `params.layers` run in a `lax.scan` (each pass copies its layer's weights out of the
    stack). Split ones (a tuple, what the engine serves with) run unrolled in a program of at most
    UNROLL_MAX_TOKENS tokens, every product reading its weight in place; a larger program
    scans, picking each layer's weights with a switch: the copy is small beside its products, and the
    program compiles in about a third of the unrolled one's time (each unrolled layer is its own code).

    With `tp`, this runs on one device inside `shard_map` (models/sharding.py): `cfg` and `params`
    are that device's share, the row-parallel products are summed over `tp.axis`, and the
    logits are gathered to the whole vocabulary.

    With `lora` (every slot's adapter, models/lora.py) and `lora_slots` (each token's slot, -1 for
    the base model alone), each token's adapter adds its delta to the attention and MLP products."""
    num_tokens = input_ids.shape[0]
    if (lora is None) != (lora_slots is None):
        raise ValueError("lora and lora_slots go together")
    eps = cfg.rms_norm_eps
    reduce = None if tp is None else (lambda y: jax.lax.psum(y, tp.axis))
    x = _embed(params.embed, input_ids, tp, params.final_norm.dtype)
    if cfg.embed_scale:
        x = x * jnp.asarray(math.sqrt(cfg.hidden_size), x.dtype)
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    if cfg.alibi:
        rope, slopes = None, jnp.asarray(alibi_slopes(cfg.num_heads if tp is None else tp.cfg.num_heads))
        if tp is not None:  # this device's heads' slopes
            slopes = jax.lax.dynamic_slice_in_dim(slopes, jax.lax.axis_index(tp.axis) * cfg.num_heads, cfg.num_heads)
    else:
        slopes = None
        rope = rope_cos_sin(positions, *rope_frequencies(cfg), x.dtype)
        if cfg.local_rope_theta is not None:
            local = rope_cos_sin(positions, *rope_frequencies(cfg, local=True), x.dtype)
            rope = tuple(jnp.stack([g, l]) for g, l in zip(rope, local))  # [2, T, D]: global, local
    windows = layer_windows(cfg)
    scanned = {"index": jnp.arange(cfg.num_layers, dtype=jnp.int32)}
    if windows is not None:
        scanned["window"] = jnp.asarray(windows)
    scanned |= {name: jnp.asarray(value) for name, value in mlp_slots(cfg).items()}
    if aux_layers:  # which of the kept streams each layer's input is (a layer may be named twice)
        scanned["aux"] = jnp.asarray(np.arange(cfg.num_layers)[:, None] == np.asarray(aux_layers)[None, :])
    if lora is not None:
        from paxserve.models.lora import lora_delta, slot_mask

        scanned["lora"] = lora
        mask = slot_mask(lora_slots, lora.num_slots, x.dtype)
        # A step without adapter rows skips the products (every device alike: the slots are replicated).
        any_adapter = jnp.any(lora_slots >= 0)

    def delta(xs: dict[str, Array], short: str) -> Any:
        """What each token's LoRA adapter adds to a product (`short`: qkv, o, up, down), from its
        input; None without adapters for it."""
        lw = xs.get("lora")
        if lw is None or getattr(lw, f"{short}_a") is None:
            return None
        row_parallel = reduce if short in ("o", "down") else None
        b = getattr(lw, f"{short}_b")
        # A fused field's parts, as the base product is split: q | k | v, and gate | up.
        parts = (q_size, kv_size, kv_size) if short == "qkv" else (b.shape[-1] // 2,) * 2 if short == "up" else ()
        a = getattr(lw, f"{short}_a")
        return lambda h: jax.lax.cond(any_adapter, lambda h: lora_delta(h, a, b, mask, row_parallel, parts),
                                      lambda h: jnp.zeros((h.shape[0], b.shape[-1]), h.dtype), h)
    fp8 = kv_cache.fp8
    if fp8 is not None:  # each layer's K and V scales
        scanned |= {"k_scale": kv_cache.k_scale, "v_scale": kv_cache.v_scale}

    def attend(p: LayerParams, h: Array, k_cache: Array, v_cache: Array, xs: dict[str, Array]):
        qkv = dense(h, p.qkv_w, p.qkv_b)
        if (qkv_delta := delta(xs, "qkv")) is not None:
            qkv = qkv + qkv_delta(h)
        q = qkv[:, :q_size].reshape(num_tokens, cfg.num_heads, cfg.head_dim)
        k = qkv[:, q_size : q_size + kv_size].reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        v = qkv[:, q_size + kv_size :].reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = norm(cfg.norm, q, p.q_norm, None, eps), norm(cfg.norm, k, p.k_norm, None, eps)
        if rope is not None:
            cos, sin = rope
            if cfg.local_rope_theta is not None:  # windowed layers take the local table
                table = (xs["window"] != NO_WINDOW).astype(jnp.int32)
                cos, sin = cos[table], sin[table]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if fp8 is not None:  # the cache holds K / k_scale and V / v_scale (pallas_kernels/kv_cache.py)
            k = fp8_bits(k.astype(jnp.float32) / xs["k_scale"], fp8)
            v = fp8_bits(v.astype(jnp.float32) / xs["v_scale"], fp8)
            q = (q.astype(jnp.float32) * xs["k_scale"]).astype(q.dtype)
        k_cache, v_cache = write_kv_reference(k_cache, v_cache, xs["index"], k, v, metadata.slot_mapping)
        out = attention(
            q, k_cache, v_cache, xs["index"], metadata, sm_scale=cfg.softmax_scale, backend=attention_backend,
            sliding_window=xs.get("window"), soft_cap=cfg.attn_soft_cap, alibi_slopes=slopes, fp8=fp8,
        )
        if fp8 is not None:
            out = (out.astype(jnp.float32) * xs["v_scale"]).astype(out.dtype)
        out = out.reshape(num_tokens, q_size)
        o = dense(out, p.o_w, p.o_b, reduce)
        if (o_delta := delta(xs, "o")) is not None:
            o = o + o_delta(out)
        return o, k_cache, v_cache

    def ffn(p: LayerParams, h: Array, xs: dict[str, Array]) -> Array:
        if not cfg.num_experts:
            return mlp(h, p.up_w, p.up_b, p.down_w, p.down_b, act=cfg.hidden_act, gated=cfg.gated_mlp,
                       reduce=reduce, up_delta=delta(xs, "up"), down_delta=delta(xs, "down"))

        def sparse(h: Array) -> Array:
            return moe_mlp(h, params.moe, xs["mlp_slot"], top_k=cfg.num_experts_per_tok,
                           renormalize=cfg.moe_renormalize, weights_in_dtype=cfg.moe_weights_in_dtype,
                           act=cfg.hidden_act, reduce=reduce,
                           expert_axis=tp.axis if tp is not None and tp.expert_parallel else None)

        if not cfg.dense_mlp_layers:
            return sparse(h)

        def dense_layer(h: Array) -> Array:
            d = take_layer(params.dense_mlp, xs["mlp_slot"])
            return mlp(h, d.up_w, d.up_b, d.down_w, d.down_b, act=cfg.hidden_act, gated=cfg.gated_mlp,
                       reduce=reduce)

        return jax.lax.cond(xs["is_moe"], sparse, dense_layer, h)  # only the layer's own kind runs

    def layer(carry: tuple[Array, ...], xs: tuple[LayerParams, dict[str, Array]]):
        x, k_cache, v_cache, *aux = carry
        p, per_layer = xs
        if aux:
            aux = [jnp.where(per_layer["aux"][:, None, None], x[None], aux[0])]
        x, k_cache, v_cache = block(p, per_layer, x, k_cache, v_cache)
        return (x, k_cache, v_cache, *aux), None

    def block(p: LayerParams, per_layer: dict[str, Array], x: Array, k_cache: Array, v_cache: Array
              ) -> tuple[Array, Array, Array]:
        h = norm(cfg.norm, x, p.attn_norm, p.attn_norm_b, eps)
        a, k_cache, v_cache = attend(p, h, k_cache, v_cache, per_layer)
        if cfg.parallel != "none":  # attention and MLP both read the layer input
            m_in = h if cfg.parallel == "shared_norm" else norm(cfg.norm, x, p.mlp_norm, p.mlp_norm_b, eps)
            return x + a + ffn(p, m_in, per_layer), k_cache, v_cache
        if cfg.sandwich_norm:
            a = norm(cfg.norm, a, p.post_attn_norm, None, eps)
        x = x + a
        m = ffn(p, norm(cfg.norm, x, p.mlp_norm, p.mlp_norm_b, eps), per_layer)
        if cfg.sandwich_norm:
            m = norm(cfg.norm, m, p.post_mlp_norm, None, eps)
        return x + m, k_cache, v_cache

    carry = (x, kv_cache.k, kv_cache.v)
    if aux_layers:
        carry += (jnp.zeros((len(aux_layers), *x.shape), x.dtype),)
    if not isinstance(params.layers, tuple):  # stacked, as loaded
        (x, k_cache, v_cache, *aux), _ = jax.lax.scan(layer, carry, (params.layers, scanned))
    elif num_tokens <= UNROLL_MAX_TOKENS:  # split (models/layer_split.py): unrolled, weights read in place
        for i, layer_params in enumerate(params.layers):
            carry, _ = layer(carry, (layer_params, jax.tree.map(lambda a: a[i], scanned)))
        x, k_cache, v_cache, *aux = carry
    else:  # split, a pass with many tokens: scanned, each layer's weights picked (copied) by a switch
        branches = [lambda layer_params=layer_params: layer_params for layer_params in params.layers]
        (x, k_cache, v_cache, *aux), _ = jax.lax.scan(
            lambda c, xs: layer(c, (jax.lax.switch(xs["index"], branches), xs)), carry, scanned)
    h = norm(cfg.norm, x[metadata.logits_indices], params.final_norm, params.final_norm_b, eps)
    head = params.lm_head
    if isinstance(head, GroupQuantizedWeight):  # kept quantized: its own kernel, or dequantized by XLA
        logits = group_matmul(h, head)
    elif head is None and isinstance(params.embed, GroupQuantizedWeight):  # tied to an embedding kept quantized
        logits = table_matmul(h, params.embed)
    else:
        head = params.embed.T if head is None else head  # None: tied to the embedding
        logits = jnp.dot(h, head, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    if cfg.final_soft_cap is not None:
        logits = cfg.final_soft_cap * jnp.tanh(logits / cfg.final_soft_cap)
    if tp is not None and tp.vocab_parallel:  # each device holds one slice of the vocabulary
        logits = jax.lax.all_gather(logits, tp.axis, axis=1, tiled=True)
    if aux_layers:
        return logits, kv_cache.replace(k=k_cache, v=v_cache), aux[0].transpose(1, 0, 2).reshape(num_tokens, -1)
    return logits, kv_cache.replace(k=k_cache, v=v_cache)


def _embed(embed: Float[Array, "V H"] | GroupQuantizedWeight, input_ids: Int[Array, " T"], tp: TensorParallel | None,
           dtype: Any) -> Array:
    """Embedding lookup; with a vocabulary-parallel table, each device looks up the ids in its slice
    (zeros elsewhere) and one sum over the devices completes every row, exactly. A GGUF embedding
    kept quantized dequantizes only the rows it looks up, to the model's `dtype`."""
    if isinstance(embed, GroupQuantizedWeight):
        rows, lookup = embed.shape[0], lambda ids: embed.rows(ids).dequantize(dtype)  # noqa: E731
    else:
        rows, lookup = embed.shape[0], lambda ids: embed[ids]  # noqa: E731
    if tp is None or not tp.vocab_parallel:
        return lookup(input_ids)
    local = input_ids - jax.lax.axis_index(tp.axis) * rows
    mine = (local >= 0) & (local < rows)
    x = lookup(jnp.clip(local, 0, rows - 1))
    x = jnp.where(mine[:, None], x, jnp.zeros((), x.dtype))
    return jax.lax.psum(x, tp.axis)
