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


NORMS = ("rms", "rms_one_plus", "layer")
ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh", "gelu_new")
PARALLEL_BLOCKS = ("none", "shared_norm", "two_norms")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Everything about a model's shape that the forward pass needs, read once from the checkpoint.

    The fields after `eos_token_ids` are the per-family decoder spec: which norm, where the norms
    sit, what the attention adds (window per layer, a second RoPE table, ALiBi, soft-caps, q/k norm)
    and which MLP. A family module (`models/families/`) maps its HF config onto them; the one decoder
    (`models/decoder.py`) reads only these fields.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6  # the eps of every norm, whatever its kind
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on the q, k and v projections
    mlp_bias: bool = False
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # ---- decoder spec ----
    o_bias: bool = False  # bias on the attention output projection
    norm: str = "rms"  # "rms": w * x/rms(x); "rms_one_plus": (1 + w) * x/rms(x) in float32 (Gemma); "layer"
    norm_bias: bool = False  # LayerNorm with a bias
    sandwich_norm: bool = False  # extra norms on the attention and MLP outputs (Gemma 3)
    parallel: str = "none"  # attention and MLP read the same input and add up (Falcon); see PARALLEL_BLOCKS
    qk_norm: bool = False  # a norm over each head of q and k before RoPE (Qwen3, Gemma 3)
    attn_scale: float | None = None  # None: head_dim ** -0.5
    alibi: bool = False  # ALiBi biases instead of RoPE (Falcon-RW)
    attn_soft_cap: float | None = None
    final_soft_cap: float | None = None
    gated_mlp: bool = True  # act(gate) * up, else act(up)
    embed_scale: bool = False  # embeddings times sqrt(hidden), rounded to the weight dtype (Gemma)
    layer_windows: tuple[int, ...] = ()  # per layer; 0 (or an empty tuple) is full attention
    local_rope_theta: float | None = None  # RoPE base of the windowed layers when it differs (Gemma 3)
    local_rope_scaling: RopeScaling = RopeScaling()
    # ---- mixture of experts (num_experts 0: a dense MLP on every layer) ----
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k: experts each token runs through
    moe_intermediate_size: int = 0  # each expert's width
    moe_renormalize: bool = True  # the top-k router weights rescaled to sum to 1 (Mixtral; Qwen's norm_topk_prob)
    moe_weights_in_dtype: bool = False  # router weights rounded to the model dtype before combining (Qwen)
    shared_expert_size: int = 0  # width of a dense expert every token also runs, sigmoid-gated (Qwen2-MoE)
    dense_mlp_layers: tuple[int, ...] = ()  # layers of an MoE model that keep a dense MLP (Qwen's mlp_only_layers)

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
        if self.head_dim % 2 and not self.alibi:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
        if self.norm not in NORMS:
            raise ValueError(f"norm={self.norm!r} is not one of {', '.join(NORMS)}")
        if self.parallel not in PARALLEL_BLOCKS:
            raise ValueError(f"parallel={self.parallel!r} is not one of {', '.join(PARALLEL_BLOCKS)}")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"layer_windows has {len(self.layer_windows)} entries for {self.num_layers} layers")
        if self.local_rope_theta is not None and not any(self.layer_windows):
            raise ValueError("local_rope_theta applies to windowed layers, but no layer has a window")
        if any(not isinstance(w, int) or w < 0 for w in self.layer_windows):
            raise ValueError(f"layer_windows must be integers >= 0 (0: full attention), got {self.layer_windows}")
        for name in ("attn_soft_cap", "final_soft_cap", "attn_scale"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"model config field {name} must be > 0 or None, got {value!r}")
        self._check_moe()

    def _check_moe(self) -> None:
        if not self.num_experts:
            if self.num_experts_per_tok or self.moe_intermediate_size or self.shared_expert_size or self.dense_mlp_layers:
                raise ValueError("MoE fields are set but num_experts is 0")
            return
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                             f"got {self.num_experts_per_tok}")
        if self.moe_intermediate_size < 1:
            raise ValueError(f"moe_intermediate_size must be a positive integer, got {self.moe_intermediate_size}")
        if not self.gated_mlp:
            raise ValueError("mixture-of-experts layers are gated (SwiGLU-style) MLPs")
        if list(self.dense_mlp_layers) != sorted(set(self.dense_mlp_layers)) or any(
                not 0 <= i < self.num_layers for i in self.dense_mlp_layers):
            raise ValueError(f"dense_mlp_layers must be distinct increasing layer indices in [0, {self.num_layers}), "
                             f"got {self.dense_mlp_layers}")
        if len(self.dense_mlp_layers) == self.num_layers:
            raise ValueError("every layer is a dense MLP layer: set num_experts to 0 instead")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies in the cache across all layers, per byte of dtype."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @property
    def sliding_window(self) -> int | None:
        """The widest window of any windowed layer, or None when every layer sees the whole context."""
        return max(self.layer_windows) or None if self.layer_windows else None

    @property
    def has_full_attention_layer(self) -> bool:
        return not self.layer_windows or 0 in self.layer_windows

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Layers whose MLP is a mixture of experts (none for a dense model)."""
        if not self.num_experts:
            return ()
        return tuple(i for i in range(self.num_layers) if i not in self.dense_mlp_layers)

    @property
    def inactive_params_per_token(self) -> int:
        """Expert weights a token does not run through: total params minus this are its active params."""
        per_expert = 3 * self.hidden_size * self.moe_intermediate_size  # gate, up and down
        return len(self.moe_layers) * (self.num_experts - self.num_experts_per_tok) * per_expert

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5 if self.attn_scale is None else self.attn_scale

    def describe(self) -> str:
        """The decoder spec in plain words, for the start-up log."""
        windowed = sum(1 for w in self.layer_windows if w)
        if windowed == 0:
            layers = f"{self.num_layers} layers, full attention"
        elif windowed == self.num_layers:
            layers = f"{self.num_layers} layers, all with a {self.sliding_window}-token sliding window"
        else:
            layers = (f"{self.num_layers} layers ({windowed} with a {self.sliding_window}-token sliding window, "
                      f"{self.num_layers - windowed} global)")
        heads = f"{self.num_heads} heads / {self.num_kv_heads} KV heads of {self.head_dim}"
        if self.alibi:
            position = "ALiBi"
        else:
            position = f"RoPE base {self.rope_theta:g}" + (
                f" ({self.rope_scaling.rope_type} x{self.rope_scaling.factor:g})" if self.rope_scaling.rope_type != "default" else "")
            if self.local_rope_theta is not None:
                position += f", local layers {self.local_rope_theta:g}"
        extras = [name for flag, name in (
            (self.qk_norm, "q/k norm"), (self.sandwich_norm, "sandwich norms"), (self.parallel != "none", "parallel attention+MLP"),
            (self.attn_soft_cap is not None, f"attention soft-cap {self.attn_soft_cap}"),
            (self.final_soft_cap is not None, f"logit soft-cap {self.final_soft_cap}"),
        ) if flag]
        mlp = f"{'gated ' if self.gated_mlp else ''}{self.hidden_act} MLP"
        if self.num_experts:
            mlp = (f"MoE MLP: {self.num_experts} gated {self.hidden_act} experts of width "
                   f"{self.moe_intermediate_size}, top-{self.num_experts_per_tok} per token"
                   f"{' (weights renormalised)' if self.moe_renormalize else ''}")
            if self.shared_expert_size:
                mlp += f", plus a sigmoid-gated shared expert of width {self.shared_expert_size}"
            if self.dense_mlp_layers:
                mlp += f", dense MLP of width {self.intermediate_size} on layers {list(self.dense_mlp_layers)}"
        return ", ".join([layers, heads, position, f"{self.norm} norm", mlp, *extras])

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def rope_from_hf(hf: Mapping[str, Any], default_theta: float = 10000.0) -> tuple[float, RopeScaling]:
    """Read RoPE settings in both the transformers v4 (`rope_theta` + `rope_scaling`) and v5
    (`rope_parameters`) spellings, since checkpoints in the wild use either."""
    params = hf.get("rope_parameters") or {}
    scaling = dict(hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", default_theta))
    return rope_from_parameters(theta, {**scaling, **{k: v for k, v in params.items() if k != "rope_theta"}}, hf)


def rope_from_parameters(theta: float, merged: dict[str, Any], hf: Mapping[str, Any]) -> tuple[float, RopeScaling]:
    """(theta, scaling) from one RoPE parameter dict (`rope_type` and its keys); `hf` supplies the
    model's context length, which some scalings fall back to."""
    merged = dict(merged)
    merged.pop("rope_theta", None)
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
    """Build a `ModelConfig` from the dict in a Hugging Face `config.json`, through the family module
    registered for its `architectures` name."""
    from paxserve.models.registry import get_architecture  # the registry imports the families, which import this

    architectures = hf.get("architectures") or []
    if not architectures:
        raise ValueError("config.json has no 'architectures' entry; cannot tell which model to build")
    arch = get_architecture(architectures[0])
    try:
        return arch.config_from_hf(hf)
    except KeyError as e:
        raise ValueError(f"config.json is missing the required field {e.args[0]!r}") from None


def eos_ids_from_hf(hf: Mapping[str, Any]) -> tuple[int, ...]:
    eos = hf.get("eos_token_id")
    return tuple(int(e) for e in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
