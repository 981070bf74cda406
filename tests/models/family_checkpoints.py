"""Tiny random checkpoints of every family, written with transformers' own `save_pretrained`.

Every weight is drawn at random (biases too; norm scales near 1), since transformers' init (zero
biases, unit norms) would hide a missing bias or a misplaced norm. Windows are short (8-12
tokens) so prompts of a few dozen tokens cross them, and Gemma 3 has 6 layers so both its local
and its global layers (with their two RoPE bases) run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

VOCAB = 256
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
_FALCON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=512, bos_token_id=1, eos_token_id=2, layer_norm_epsilon=1e-5)

# name -> (transformers config class, model class, config overrides)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    # Mistral v0.1-style window on every layer, explicit head_dim != hidden / heads (Nemo-style).
    "mistral-window": ("MistralConfig", "MistralForCausalLM",
                       dict(_COMMON, num_key_value_heads=2, head_dim=32, sliding_window=12, rms_norm_eps=1e-5)),
    # Mistral v0.2+: sliding_window null.
    "mistral-no-window": ("MistralConfig", "MistralForCausalLM",
                          dict(_COMMON, num_key_value_heads=1, sliding_window=None, rope_theta=1e6)),
    # Qwen2: q/k/v biases, tied embeddings, windows from max_window_layers on (layer 0 full).
    "qwen2-window": ("Qwen2Config", "Qwen2ForCausalLM",
                     dict(_COMMON, num_hidden_layers=3, num_key_value_heads=2, tie_word_embeddings=True,
                          use_sliding_window=True, sliding_window=10, max_window_layers=1)),
    # Qwen3: q/k norms, explicit head_dim, attention_bias on q/k/v/o, untied.
    "qwen3-bias": ("Qwen3Config", "Qwen3ForCausalLM",
                   dict(_COMMON, num_key_value_heads=2, head_dim=32, attention_bias=True, tie_word_embeddings=False)),
    # Gemma 3: 6 layers = 5 local (window 8, RoPE base 1e4) + 1 global (base 1e6, linear scaling),
    # query_pre_attn_scalar != head_dim, final logit soft-cap, tied embeddings.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(_COMMON, num_hidden_layers=6, num_key_value_heads=1, head_dim=32, sliding_window=8,
                    query_pre_attn_scalar=48, final_logit_softcapping=3.0, rms_norm_eps=1e-6,
                    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    # Falcon-40b style: grouped fused QKV (new_decoder_architecture), two LayerNorms, parallel.
    "falcon-grouped": ("FalconConfig", "FalconForCausalLM",
                       dict(_FALCON, new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=2,
                            parallel_attn=True, bias=False, tie_word_embeddings=False)),
    # Falcon-7b style: multi-query, parallel attention + MLP sharing one LayerNorm, tied.
    "falcon-multi-query": ("FalconConfig", "FalconForCausalLM",
                           dict(_FALCON, multi_query=True, parallel_attn=True, bias=False)),
    # Falcon-RW style: ALiBi, per-head interleaved QKV, sequential pre-LN, biases.
    "falcon-rw-alibi": ("FalconConfig", "FalconForCausalLM",
                        dict(_FALCON, alibi=True, multi_query=False, parallel_attn=False, bias=True)),
    # Mixtral: 4 experts of width 48, top-2 renormalised, GQA, a window on every layer.
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(_COMMON, intermediate_size=48, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                     sliding_window=12, rms_norm_eps=1e-5)),
    # Qwen2-MoE: q/k/v biases, 4 experts top-2 without renormalisation, a sigmoid-gated shared expert.
    "qwen2-moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(_COMMON, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=40, norm_topk_prob=False)),
    # Qwen3-MoE: q/k norms, 6 experts top-3 renormalised; layer 1 dense (mlp_only_layers) among sparse ones.
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(_COMMON, num_hidden_layers=3, num_key_value_heads=2, head_dim=32, num_experts=6,
                       num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1])),
}
MOE_FAMILIES = ("mixtral", "qwen2-moe", "qwen3-moe")


def make_family_checkpoint(name: str, directory: Path, seed: int = 0):
    """Save the named tiny random model to `directory`; return the torch model (float32, eval)."""
    import torch
    import transformers

    config_cls, model_cls, overrides = FAMILIES[name]
    config = getattr(transformers, config_cls)(**overrides)
    # Eager attention is transformers' plain reference path, except for ALiBi Falcon: there the eager
    # path adds the bias twice (once itself, once through the causal mask it was folded into), while
    # SDPA adds it once, as the model was trained.
    config._attn_implementation = "sdpa" if overrides.get("alibi") else "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    one_plus = config_cls.startswith("Gemma")  # Gemma's norms scale by (1 + w)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            is_norm = "norm" in pname or "ln_" in pname
            if is_norm and pname.endswith("weight"):
                p.copy_((0.0 if one_plus else 1.0) + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    model.save_pretrained(str(directory))
    return model


def make_gemma3_multimodal_checkpoint(directory: Path, seed: int = 0):
    """A tiny `Gemma3ForConditionalGeneration` (text model plus a one-layer vision tower): paxserve
    serves its text part and must leave the vision tensors unread."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    # No final soft-cap: transformers applies it in Gemma3ForCausalLM but not in the multimodal class
    # (real Gemma 3 checkpoints set none, so the two agree there).
    text = {k: v for k, v in FAMILIES["gemma3"][2].items()
            if k not in ("bos_token_id", "eos_token_id", "final_logit_softcapping")}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = Gemma3Config(text_config={**text, "vocab_size": VOCAB + 8}, vision_config=vision, mm_tokens_per_image=4,
                          image_token_index=VOCAB + 7, boi_token_index=VOCAB + 5, eoi_token_index=VOCAB + 6)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.copy_((0.1 if "norm" in pname else 0.15) * torch.randn_like(p))
    model.config._attn_implementation = "eager"
    model.save_pretrained(str(directory))
    return model
