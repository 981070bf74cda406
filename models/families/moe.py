"""Mixture-of-experts families: Mixtral (`MixtralForCausalLM`), Qwen2-MoE (`Qwen2MoeForCausalLM`,
with its sigmoid-gated shared expert) and Qwen3-MoE (`Qwen3MoeForCausalLM`).

Attention and norms are Llama's (Qwen's biases and q/k norms as in the dense Qwen families); the
MLP of each MoE layer is a router plus stacked experts. The tensor layout uses the fused names
transformers v5 keeps in memory (`mlp.experts.gate_up_proj` [experts, 2 * width, hidden],
`mlp.experts.down_proj`); checkpoints saved per expert (`block_sparse_moe.experts.{e}.w1`,
`mlp.experts.{e}.gate_proj`, what `save_pretrained` writes by default) are fused on read by
`FusedExperts`.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any, Mapping

import numpy as np

from paxserve.models.config import ModelConfig
from paxserve.models.families.common import FULL, SLIDING, base_fields, llama_layout, windows_from_layer_types
from paxserve.models.families.qwen import qwen_window
from paxserve.models.layout import LAYER_INDEX, Layout, Stack, linear
from paxserve.models.moe import MLPParams, MoEParams


def _num_experts(hf: Mapping[str, Any], default: int) -> int:
    # transformers v5 writes `num_local_experts` for every family; Qwen's own configs say `num_experts`.
    for key in ("num_local_experts", "num_experts"):
        if hf.get(key) is not None:
            return int(hf[key])
    return default


def mixtral_config(hf: Mapping[str, Any]) -> ModelConfig:
    """Every layer sparse; experts as wide as `intermediate_size`; top-k weights always renormalised
    and kept in float32; one window on every layer when `sliding_window` is set."""
    fields = base_fields(hf, max_position_embeddings=4096 * 32, rope_theta=1e6, rms_norm_eps=1e-5,
                         intermediate_size=14336)
    window = hf.get("sliding_window")
    return ModelConfig(
        **fields, layer_windows=(int(window),) * fields["num_layers"] if window else (),
        num_experts=_num_experts(hf, 8), num_experts_per_tok=int(hf.get("num_experts_per_tok") or 2),
        moe_intermediate_size=fields["intermediate_size"], moe_renormalize=True,
    )


def _qwen_experts(hf: Mapping[str, Any], num_layers: int, num_experts: int, top_k: int,
                  width: int) -> dict[str, Any]:
    """Qwen's sparse layers: every `decoder_sparse_step`-th one, except `mlp_only_layers`. A config
    with no sparse layer is a dense model and gets the dense spec."""
    step = int(hf.get("decoder_sparse_step") or 1)
    only_mlp = set(hf.get("mlp_only_layers") or [])
    num_experts = _num_experts(hf, num_experts)
    dense = tuple(i for i in range(num_layers) if i in only_mlp or num_experts == 0 or (i + 1) % step)
    if len(dense) == num_layers:
        return {}
    return dict(num_experts=num_experts, num_experts_per_tok=int(hf.get("num_experts_per_tok") or top_k),
                moe_intermediate_size=int(hf.get("moe_intermediate_size") or width),
                moe_renormalize=bool(hf.get("norm_topk_prob", False)), moe_weights_in_dtype=True,
                dense_mlp_layers=dense)


def qwen2_moe_config(hf: Mapping[str, Any]) -> ModelConfig:
    """Biases on q, k and v (`qkv_bias`); a shared expert on every sparse layer; windows (with
    `use_sliding_window`) on the layer pattern Qwen2MoeConfig builds."""
    fields = base_fields(hf, max_position_embeddings=32768, intermediate_size=5632)
    n = fields["num_layers"]
    window = qwen_window(hf)
    start = int(hf.get("max_window_layers", 28))
    default = [SLIDING if window and (i + 1) % 2 and i < start else FULL for i in range(n)]
    experts = _qwen_experts(hf, n, 60, 4, 1408)
    if experts:
        experts["shared_expert_size"] = int(hf.get("shared_expert_intermediate_size") or 5632)
    return ModelConfig(**fields, attention_bias=bool(hf.get("qkv_bias", True)),
                       layer_windows=windows_from_layer_types(hf, n, window, default), **experts)


def qwen3_moe_config(hf: Mapping[str, Any]) -> ModelConfig:
    """Qwen3's attention (q/k norms, `attention_bias` on q, k, v and o); with `use_sliding_window`
    every layer has the window, as Qwen3MoeAttention applies it."""
    fields = base_fields(hf, max_position_embeddings=32768, intermediate_size=6144)
    n = fields["num_layers"]
    window = qwen_window(hf)
    bias = bool(hf.get("attention_bias", False))
    return ModelConfig(**fields, attention_bias=bias, o_bias=bias, qk_norm=True,
                       layer_windows=(int(window),) * n if window else (), **_qwen_experts(hf, n, 128, 8, 768))


def moe_layout(cfg: ModelConfig) -> Layout:
    """Llama's attention and norms on every layer; router, experts (and shared expert) stacked over
    the MoE layers; the dense MLP (Llama's `mlp.gate_proj` names) stacked over the dense layers."""
    base = llama_layout(cfg)
    if not cfg.num_experts:
        return base
    h, e, width, shared = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_size
    pre = f"model.layers.{LAYER_INDEX}.mlp."
    moe = {
        "router_w": linear((pre + "gate.weight", (e, h))),
        "experts_up_w": linear((pre + "experts.gate_up_proj", (e, 2 * width, h))),
        "experts_down_w": linear((pre + "experts.down_proj", (e, h, width))),
    }
    if shared:
        moe["shared_up_w"] = linear((pre + "shared_expert.gate_proj.weight", (shared, h)),
                                    (pre + "shared_expert.up_proj.weight", (shared, h)))
        moe["shared_down_w"] = linear((pre + "shared_expert.down_proj.weight", (h, shared)))
        moe["shared_gate_w"] = linear((pre + "shared_expert_gate.weight", (1, h)))
    mlp_fields = ("up_w", "down_w", "up_b", "down_b")
    stacks = {"moe": Stack(MoEParams, cfg.moe_layers, moe)}
    if cfg.dense_mlp_layers:
        stacks["dense_mlp"] = Stack(MLPParams, cfg.dense_mlp_layers,
                                    {k: v for k, v in base.layer.items() if k in mlp_fields})
    return Layout(top=base.top, layer={k: v for k, v in base.layer.items() if k not in mlp_fields}, stacks=stacks)


_PER_EXPERT = re.compile(r"^(?P<layer>.+\.)(?:block_sparse_moe|mlp)\.experts\.(?P<e>\d+)\."
                         r"(?P<proj>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_MIXTRAL_ROUTER = re.compile(r"^(?P<layer>.+\.)block_sparse_moe\.gate\.weight$")
_PROJ = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


class FusedExperts:
    """A checkpoint seen with its per-expert tensors fused the way transformers v5 fuses them on
    load: `{layer}mlp.experts.gate_up_proj` = each expert's gate rows then up rows, stacked over
    experts; `{layer}mlp.experts.down_proj`; Mixtral's `block_sparse_moe.gate` as `mlp.gate`. A
    layer whose experts are not all there (0..E-1 of each projection) is left as it is, so the
    strict tensor check names what is missing."""

    def __init__(self, ckpt: Any) -> None:
        self._ckpt = ckpt
        self._names: dict[str, str] = {}  # name seen -> checkpoint name, for plain and renamed tensors
        self._fused: dict[str, list[list[str]]] = {}  # fused name -> per expert, the parts to concatenate
        groups: dict[str, dict[str, dict[int, str]]] = defaultdict(lambda: defaultdict(dict))
        for name in ckpt.names():
            if m := _PER_EXPERT.match(name):
                groups[m["layer"]][_PROJ[m["proj"]]][int(m["e"])] = name
            elif m := _MIXTRAL_ROUTER.match(name):
                self._names[m["layer"] + "mlp.gate.weight"] = name
            else:
                self._names[name] = name
        for layer, projs in groups.items():
            n = len(projs.get("gate", {}))
            if n and all(sorted(projs.get(p, {})) == list(range(n)) for p in ("gate", "up", "down")):
                self._fused[layer + "mlp.experts.gate_up_proj"] = [[projs["gate"][e], projs["up"][e]] for e in range(n)]
                self._fused[layer + "mlp.experts.down_proj"] = [[projs["down"][e]] for e in range(n)]
            else:
                self._names |= {name: name for parts in projs.values() for name in parts.values()}

    def names(self) -> set[str]:
        return set(self._names) | set(self._fused)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._fused:
            return tuple(self._ckpt.shape(self._names[name]))
        first = [tuple(self._ckpt.shape(part)) for part in self._fused[name][0]]
        return (len(self._fused[name]), sum(s[0] for s in first), *first[0][1:])

    def read(self, name: str) -> np.ndarray:
        if name not in self._fused:
            return self._ckpt.read(self._names[name])
        experts = self._fused[name]
        first = [self._ckpt.read(part) for part in experts[0]]
        out = np.empty((len(experts), sum(p.shape[0] for p in first), *first[0].shape[1:]), first[0].dtype)
        for e, parts in enumerate(experts):
            arrays = first if e == 0 else [self._ckpt.read(part) for part in parts]
            out[e] = np.concatenate(arrays) if len(arrays) > 1 else arrays[0]
        return out
