"""Gemma 3 (`Gemma3ForCausalLM`, and the text part of `Gemma3ForConditionalGeneration`).

Embeddings scaled by sqrt(hidden) in the weight dtype; RMSNorm as x * (1 + w) in float32; four
norms per layer (sandwich) plus q/k norms; scale `query_pre_attn_scalar ** -0.5`; gated
`gelu_pytorch_tanh`; 5 local (sliding-window) layers to 1 global by default, each kind with its
own RoPE table; optional tanh soft-caps on attention scores and final logits.
"""

from __future__ import annotations

from typing import Any, Mapping

from paxserve.models.config import ModelConfig, rope_from_parameters
from paxserve.models.families.common import FULL, SLIDING, base_fields, llama_layout, windows_from_layer_types
from paxserve.models.layout import Layout

# Gemma3TextConfig's defaults, for config.json files that leave fields out.
_DEFAULTS = dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131_072,
                 rms_norm_eps=1e-6, tie_word_embeddings=True)
_GLOBAL_THETA, _LOCAL_THETA = 1_000_000.0, 10_000.0


def text_config(hf: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text model's config: the top level for Gemma3ForCausalLM, `text_config` for the
    multimodal checkpoint (whose vision tower paxserve does not run)."""
    if "text_config" in hf:
        return {**hf["text_config"], "architectures": hf["architectures"]}
    return hf


def _rope_tables(hf: Mapping[str, Any]) -> tuple[tuple[float, Any], tuple[float, Any]]:
    """(global, local) RoPE: transformers v5 writes `rope_parameters` per layer type; v4 wrote
    `rope_theta` + `rope_scaling` (global) and `rope_local_base_freq` (local)."""
    params = hf.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        full, local = dict(params.get(FULL) or {}), dict(params.get(SLIDING) or {})
    else:
        full = {**(hf.get("rope_scaling") or {}), **params}
        local = {}
        full.setdefault("rope_theta", hf.get("rope_theta", _GLOBAL_THETA))
        local["rope_theta"] = hf.get("rope_local_base_freq", _LOCAL_THETA)
    g = rope_from_parameters(full.get("rope_theta", _GLOBAL_THETA), full, hf)
    l_ = rope_from_parameters(local.get("rope_theta", _LOCAL_THETA), local, hf)
    return g, l_


def gemma3_config(hf: Mapping[str, Any]) -> ModelConfig:
    hf = text_config(hf)
    if hf.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3 with use_bidirectional_attention (an embedding model) is not supported")
    fields = base_fields({k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_scaling")},
                         **_DEFAULTS)
    (theta, scaling), (local_theta, local_scaling) = _rope_tables(hf)
    n = fields["num_layers"]
    pattern = int(hf.get("sliding_window_pattern") or 6)
    default_types = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    windows = windows_from_layer_types(hf, n, hf.get("sliding_window", 4096), default_types)
    bias = bool(hf.get("attention_bias", False))
    soft = lambda key: None if hf.get(key) is None else float(hf[key])  # noqa: E731
    fields |= dict(rope_theta=theta, rope_scaling=scaling,
                   hidden_act=str(hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"))
    return ModelConfig(
        **fields, attention_bias=bias, o_bias=bias, norm="rms_one_plus", sandwich_norm=True, qk_norm=True,
        attn_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5, embed_scale=True,
        attn_soft_cap=soft("attn_logit_softcapping"), final_soft_cap=soft("final_logit_softcapping"),
        layer_windows=windows,
        local_rope_theta=local_theta if windows else None, local_rope_scaling=local_scaling,
    )


def gemma3_layout(cfg: ModelConfig) -> Layout:
    return llama_layout(cfg)


def gemma3_multimodal_layout(cfg: ModelConfig) -> Layout:
    """transformers v5 saves the multimodal checkpoint's text model under `model.language_model.`
    (older checkpoints' `language_model.model.` names are renamed on load, see `rename_legacy`)."""
    return llama_layout(cfg, prefix="model.language_model.")


# The multimodal checkpoint's other parts, which a text-only server leaves unread.
MULTIMODAL_IGNORED_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.",
                               "multi_modal_projector.")


def rename_legacy(name: str) -> str:
    """Checkpoints saved before transformers 4.52 (most on the Hub) name the text model
    `language_model.model.*` and its head `language_model.lm_head.*`."""
    if name.startswith("language_model.model."):
        return "model.language_model." + name.removeprefix("language_model.model.")
    if name.startswith("language_model.lm_head."):
        return "lm_head." + name.removeprefix("language_model.lm_head.")
    return name
