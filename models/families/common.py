"""What the Llama-shaped families (Llama, Mistral, Qwen2, Qwen3, Gemma 3) share: the config fields
they spell alike and the `model.layers.{i}.self_attn.q_proj` tensor layout."""

from __future__ import annotations

from typing import Any, Mapping

from paxserve.models.config import ModelConfig, eos_ids_from_hf, rope_from_hf
from paxserve.models.layout import LAYER_INDEX, Layout, linear, vector

SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_TYPES = (SLIDING, FULL)


def base_fields(hf: Mapping[str, Any], **defaults: Any) -> dict[str, Any]:
    """The ModelConfig fields every Llama-shaped config spells the same way (`defaults` fills
    fields a family's config class defaults differently from Llama's)."""
    get = lambda key: hf[key] if hf.get(key) is not None else defaults[key]  # noqa: E731
    hidden, num_heads = int(get("hidden_size")), int(get("num_attention_heads"))
    theta, scaling = rope_from_hf(hf, defaults.get("rope_theta", 10000.0))
    return dict(
        architecture=hf["architectures"][0],
        vocab_size=int(get("vocab_size")),
        hidden_size=hidden,
        num_layers=int(get("num_hidden_layers")),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or defaults.get("num_key_value_heads") or num_heads),
        head_dim=int(hf.get("head_dim") or defaults.get("head_dim") or hidden // num_heads),
        intermediate_size=int(get("intermediate_size")),
        rms_norm_eps=float(hf.get("rms_norm_eps", defaults.get("rms_norm_eps", 1e-6))),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", defaults.get("tie_word_embeddings", False))),
        max_position_embeddings=int(hf.get("max_position_embeddings") or defaults.get("max_position_embeddings", 2048)),
        hidden_act=str(hf.get("hidden_act") or defaults.get("hidden_act", "silu")),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids_from_hf(hf),
    )


def windows_from_layer_types(hf: Mapping[str, Any], num_layers: int, window: int | None,
                             default_types: list[str]) -> tuple[int, ...]:
    """Per-layer windows from `layer_types` (or the family's default pattern): `window` on sliding
    layers, 0 (full attention) elsewhere; () when no layer is windowed."""
    types = hf.get("layer_types") or default_types
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported; supported: {', '.join(LAYER_TYPES)}")
    if not window:
        return ()
    windows = tuple(int(window) if t == SLIDING else 0 for t in types)
    return windows if any(windows) else ()


def llama_layout(cfg: ModelConfig, prefix: str = "model.", head: str = "lm_head.weight") -> Layout:
    """Tensor layout of the Llama-shaped families; which optional tensors exist follows the spec
    (biases, q/k norms, Gemma's sandwich norms)."""
    h, q, kv, inter = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    pre = f"{prefix}layers.{LAYER_INDEX}."
    attn, mlp_ = pre + "self_attn.", pre + "mlp."
    layer = {
        "attn_norm": vector((pre + "input_layernorm.weight", (h,))),
        "qkv_w": linear((attn + "q_proj.weight", (q, h)), (attn + "k_proj.weight", (kv, h)),
                        (attn + "v_proj.weight", (kv, h))),
        "o_w": linear((attn + "o_proj.weight", (h, q))),
        "up_w": linear((mlp_ + "gate_proj.weight", (inter, h)), (mlp_ + "up_proj.weight", (inter, h))),
        "down_w": linear((mlp_ + "down_proj.weight", (h, inter))),
    }
    if cfg.attention_bias:
        layer["qkv_b"] = vector((attn + "q_proj.bias", (q,)), (attn + "k_proj.bias", (kv,)),
                                (attn + "v_proj.bias", (kv,)))
    if cfg.o_bias:
        layer["o_b"] = vector((attn + "o_proj.bias", (h,)))
    if cfg.mlp_bias:
        layer["up_b"] = vector((mlp_ + "gate_proj.bias", (inter,)), (mlp_ + "up_proj.bias", (inter,)))
        layer["down_b"] = vector((mlp_ + "down_proj.bias", (h,)))
    if cfg.qk_norm:
        layer["q_norm"] = vector((attn + "q_norm.weight", (cfg.head_dim,)))
        layer["k_norm"] = vector((attn + "k_norm.weight", (cfg.head_dim,)))
    if cfg.sandwich_norm:
        layer["post_attn_norm"] = vector((pre + "post_attention_layernorm.weight", (h,)))
        layer["mlp_norm"] = vector((pre + "pre_feedforward_layernorm.weight", (h,)))
        layer["post_mlp_norm"] = vector((pre + "post_feedforward_layernorm.weight", (h,)))
    else:
        layer["mlp_norm"] = vector((pre + "post_attention_layernorm.weight", (h,)))
    top = {"embed": vector((prefix + "embed_tokens.weight", (cfg.vocab_size, h))),
           "final_norm": vector((prefix + "norm.weight", (h,)))}
    if not cfg.tie_word_embeddings:
        top["lm_head"] = linear((head, (cfg.vocab_size, h)))
    return Layout(top=top, layer=layer)
