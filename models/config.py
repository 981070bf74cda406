"""Hugging Face `config.json` -> a static, hashable model config.

The config is a frozen dataclass so it can be a static argument of `jax.jit`: every field that
changes the traced program lives here, and nothing else does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _check_rope_type(rope_type: str) -> None:
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_scaling.rope_type={rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling as Hugging Face names it (`rope_type` and its parameters)."""

    rope_type: str = "default"
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        _check_rope_type(self.rope_type)
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if self.rope_type == "llama3" and self.original_max_position_embeddings is None:
            raise ValueError("rope_scaling of type 'llama3' needs original_max_position_embeddings")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Everything about a model's shape that the forward pass needs, read once from the checkpoint."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model config field {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} must be a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported; supported: silu")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies in the cache across all layers, per byte of dtype."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def _rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, RopeScaling]:
    """Read RoPE settings in both the transformers v4 (`rope_theta` + `rope_scaling`) and v5
    (`rope_parameters`) spellings, since checkpoints in the wild use either."""
    params = hf.get("rope_parameters") or {}
    scaling = dict(hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    merged = {**scaling, **{k: v for k, v in params.items() if k != "rope_theta"}}
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    if rope_type == "default":
        return float(theta), RopeScaling()
    _check_rope_type(rope_type)  # before the key check, so the message names the supported types
    known = {f.name for f in dataclasses.fields(RopeScaling)} - {"rope_type"}
    unknown = sorted(set(merged) - known - {"partial_rotary_factor"})
    if unknown:
        raise ValueError(f"rope scaling of type {rope_type!r} has unsupported keys: {unknown}")
    if merged.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1.0 is not supported")
    merged.pop("partial_rotary_factor", None)
    if rope_type in ("yarn", "llama3") and merged.get("original_max_position_embeddings") is None:
        # Hugging Face falls back to the model's own context length when the field is absent.
        merged["original_max_position_embeddings"] = hf.get("max_position_embeddings")
    if rope_type == "yarn":
        if merged.get("factor") is None:
            merged["factor"] = hf["max_position_embeddings"] / merged["original_max_position_embeddings"]
    for key in ("beta_fast", "beta_slow"):
        if merged.get(key) is None:
            merged.pop(key, None)
    return float(theta), RopeScaling(rope_type=rope_type, **merged)


def model_config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """Build a `ModelConfig` from the dict in a Hugging Face `config.json`."""
    architectures = hf.get("architectures") or []
    if not architectures:
        raise ValueError("config.json has no 'architectures' entry; cannot tell which model to build")
    try:
        hidden = int(hf["hidden_size"])
        num_heads = int(hf["num_attention_heads"])
        theta, scaling = _rope_from_hf(hf)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return ModelConfig(
            architecture=architectures[0],
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden // num_heads),
            intermediate_size=int(hf["intermediate_size"]),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            hidden_act=str(hf.get("hidden_act", "silu")),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
    except KeyError as e:
        raise ValueError(f"config.json is missing the required field {e.args[0]!r}") from None
