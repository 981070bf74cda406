"""Llama (`LlamaForCausalLM`) and Mistral (`MistralForCausalLM`): the plain pre-norm decoder."""

from __future__ import annotations

from typing import Any, Mapping

from paxserve.models.config import ModelConfig
from paxserve.models.families.common import base_fields


def llama_config(hf: Mapping[str, Any]) -> ModelConfig:
    bias = bool(hf.get("attention_bias", False))
    return ModelConfig(**base_fields(hf), attention_bias=bias, o_bias=bias, mlp_bias=bool(hf.get("mlp_bias", False)))


def mistral_config(hf: Mapping[str, Any]) -> ModelConfig:
    """Every layer has the same window when `sliding_window` is set (v0.1: 4096; v0.2+: null).
    Mistral's config defaults differ from Llama's (sliding_window 4096, 32k context): a config.json
    that omits them means those defaults."""
    fields = base_fields(hf, max_position_embeddings=4096 * 32, rope_theta=10000.0)
    window = hf.get("sliding_window", 4096)
    return ModelConfig(**fields, layer_windows=(int(window),) * fields["num_layers"] if window else ())
