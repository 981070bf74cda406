"""Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`) and Qwen3 (`Qwen3ForCausalLM`)."""

from __future__ import annotations

from typing import Any, Mapping

from paxserve.models.config import ModelConfig
from paxserve.models.families.common import FULL, SLIDING, base_fields, windows_from_layer_types


def qwen_window(hf: Mapping[str, Any]) -> int | None:
    """Every Qwen config (dense and MoE) has a window only with `use_sliding_window`."""
    return hf.get("sliding_window", 4096) if hf.get("use_sliding_window", False) else None


def _windows(hf: Mapping[str, Any], num_layers: int) -> tuple[int, ...]:
    """Qwen's windows exist only with `use_sliding_window`, on layers from `max_window_layers` on
    (unless `layer_types` says otherwise), as transformers' Qwen configs build them."""
    window = qwen_window(hf)
    start = int(hf.get("max_window_layers", 28))
    default = [SLIDING if window and i >= start else FULL for i in range(num_layers)]
    return windows_from_layer_types(hf, num_layers, window, default)


def qwen2_config(hf: Mapping[str, Any]) -> ModelConfig:
    """Biases on q, k and v, none on o; small models tie their embeddings."""
    fields = base_fields(hf, max_position_embeddings=32768)
    return ModelConfig(**fields, attention_bias=True, layer_windows=_windows(hf, fields["num_layers"]))


def qwen3_config(hf: Mapping[str, Any]) -> ModelConfig:
    """RMSNorm on each head of q and k before RoPE; `attention_bias` covers q, k, v and o."""
    fields = base_fields(hf, max_position_embeddings=32768)
    bias = bool(hf.get("attention_bias", False))
    return ModelConfig(**fields, attention_bias=bias, o_bias=bias, qk_norm=True,
                       layer_windows=_windows(hf, fields["num_layers"]))
