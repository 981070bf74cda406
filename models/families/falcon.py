"""Falcon (`FalconForCausalLM`): fused QKV in three layouts, LayerNorms with bias, GELU MLP,
parallel attention + MLP (one or two norms) or sequential pre-LN, RoPE or ALiBi.

The fused `query_key_value` rows are re-ordered at load time into the decoder's [q | k | v]
layout, so the forward pass is the same one every family runs:
- `new_decoder_architecture` (falcon-40b/180b): per KV group, its query heads then one key and one
  value head: [kv, q_per_kv + 2, head_dim];
- `multi_query` (falcon-7b): all query heads, then one shared key and one value head;
- otherwise (falcon-rw): per head, its query, key and value: [heads, 3, head_dim].
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from paxserve.models.config import ModelConfig, eos_ids_from_hf, rope_from_hf
from paxserve.models.layout import LAYER_INDEX, Layout, linear, vector


def _layout_kind(hf: Mapping[str, Any]) -> str:
    if hf.get("new_decoder_architecture", False):
        return "grouped"
    return "multi_query" if hf.get("multi_query", True) else "interleaved"


def falcon_config(hf: Mapping[str, Any]) -> ModelConfig:
    hidden = int(hf.get("hidden_size") or hf.get("n_embed") or 4544)
    num_heads = int(hf.get("num_attention_heads") or hf.get("n_head") or 71)
    kind = _layout_kind(hf)
    kv = {"grouped": int(hf.get("num_kv_heads") or num_heads), "multi_query": 1, "interleaved": num_heads}[kind]
    parallel = bool(hf.get("parallel_attn", True))
    if kind == "grouped" and not parallel:
        raise ValueError("Falcon with new_decoder_architecture and parallel_attn=false is not supported")
    if parallel:
        num_ln = hf.get("num_ln_in_parallel_attn") or (2 if kind == "grouped" else 1)
        block = "two_norms" if kind == "grouped" and num_ln == 2 else "shared_norm"
    else:
        block = "none"
    alibi = bool(hf.get("alibi", False))
    theta, scaling = rope_from_hf(hf)
    bias = bool(hf.get("bias", False))
    return ModelConfig(
        architecture=hf["architectures"][0],
        vocab_size=int(hf.get("vocab_size") or 65024),
        hidden_size=hidden,
        num_layers=int(hf.get("num_hidden_layers") or hf.get("n_layer") or 32),
        num_heads=num_heads,
        num_kv_heads=kv,
        head_dim=hidden // num_heads,
        intermediate_size=int(hf.get("ffn_hidden_size") or 4 * hidden),
        rms_norm_eps=float(hf.get("layer_norm_epsilon") or 1e-5),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        attention_bias=bias,
        o_bias=bias,
        mlp_bias=bias,
        max_position_embeddings=int(hf.get("max_position_embeddings") or 2048),
        hidden_act=str(hf.get("activation") or "gelu"),
        bos_token_id=hf.get("bos_token_id", 11),
        eos_token_ids=eos_ids_from_hf(hf) if "eos_token_id" in hf else (11,),
        norm="layer",
        norm_bias=True,
        parallel=block,
        alibi=alibi,
        gated_mlp=False,
    )


def qkv_row_order(cfg: ModelConfig) -> np.ndarray:
    """Row indices that turn the fused weight's rows into [all q | all k | all v]. The three layouts
    are one: per KV group its query heads, then its key and value head ([kv, q_per_kv + 2, d]);
    multi-query is the case kv = 1 and the per-head interleave the case kv = heads."""
    d, nh, kv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    rows = np.arange((nh + 2 * kv) * d).reshape(kv, nh // kv + 2, d)
    return np.concatenate([rows[:, :-2].reshape(-1), rows[:, -2].reshape(-1), rows[:, -1].reshape(-1)])


def falcon_layout(cfg: ModelConfig) -> Layout:
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    qkv_rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * d
    order = qkv_row_order(cfg)
    reorder: Callable[[np.ndarray], np.ndarray] = lambda t: t[order]  # noqa: E731
    pre = f"transformer.h.{LAYER_INDEX}."
    attn_ln = "ln_attn" if cfg.parallel == "two_norms" else "input_layernorm"
    layer = {
        "attn_norm": vector((pre + attn_ln + ".weight", (h,))),
        "attn_norm_b": vector((pre + attn_ln + ".bias", (h,))),
        "qkv_w": linear((pre + "self_attention.query_key_value.weight", (qkv_rows, h)), transform=reorder),
        "o_w": linear((pre + "self_attention.dense.weight", (h, cfg.num_heads * d))),
        "up_w": linear((pre + "mlp.dense_h_to_4h.weight", (inter, h))),
        "down_w": linear((pre + "mlp.dense_4h_to_h.weight", (h, inter))),
    }
    if cfg.attention_bias:
        layer |= {"qkv_b": vector((pre + "self_attention.query_key_value.bias", (qkv_rows,)), transform=reorder),
                  "o_b": vector((pre + "self_attention.dense.bias", (h,))),
                  "up_b": vector((pre + "mlp.dense_h_to_4h.bias", (inter,))),
                  "down_b": vector((pre + "mlp.dense_4h_to_h.bias", (h,)))}
    mlp_ln = {"two_norms": "ln_mlp", "none": "post_attention_layernorm"}.get(cfg.parallel)
    if mlp_ln:
        layer |= {"mlp_norm": vector((pre + mlp_ln + ".weight", (h,))),
                  "mlp_norm_b": vector((pre + mlp_ln + ".bias", (h,)))}
    top = {"embed": vector(("transformer.word_embeddings.weight", (cfg.vocab_size, h))),
           "final_norm": vector(("transformer.ln_f.weight", (h,))),
           "final_norm_b": vector(("transformer.ln_f.bias", (h,)))}
    if not cfg.tie_word_embeddings:
        top["lm_head"] = linear(("lm_head.weight", (cfg.vocab_size, h)))
    return Layout(top=top, layer=layer)
