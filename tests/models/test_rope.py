"""RoPE frequencies, scaling and rotation against Hugging Face transformers (torch, CPU)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from paxserve.models.config import ROPE_TYPES, ModelConfig, RopeScaling, model_config_from_hf
from paxserve.models.rope import apply_rope, rope_cos_sin, rope_frequencies

ARCH = ["LlamaForCausalLM"]
BASE: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=8192,
)

ROPE_CASES: dict[str, dict[str, Any]] = {
    "default": {"rope_type": "default", "rope_theta": 500000.0},
    "default-theta1e4": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    # Llama 3.1 style; original length 1024 puts frequencies in all three bands (kept, smoothed, divided).
    "llama3": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 1024,
    },
    "llama3-other": {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 32.0, "low_freq_factor": 2.0,
        "high_freq_factor": 8.0, "original_max_position_embeddings": 2048,
    },
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 2048},
    "yarn-mscale": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
        "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 0.707, "mscale_all_dim": 1.0, "truncate": False,
    },
    "yarn-attention-factor": {
        "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 2.0, "original_max_position_embeddings": 4096,
        "attention_factor": 0.8,
    },
}


def hf_config(rope_parameters: dict[str, Any], **overrides: Any) -> LlamaConfig:
    config = LlamaConfig(**{**BASE, **overrides}, rope_parameters=dict(rope_parameters))
    config.architectures = ARCH
    return config


def hf_frequencies(config: LlamaConfig) -> tuple[np.ndarray, float]:
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        inv_freq, factor = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](config)
    return inv_freq.numpy(), float(factor)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", list(ROPE_CASES))
def test_frequencies_match_hugging_face(name: str, head_dim: int) -> None:
    config = hf_config(ROPE_CASES[name], head_dim=head_dim)
    cfg = model_config_from_hf(config.to_dict())
    assert cfg.head_dim == head_dim
    assert cfg.rope_scaling.rope_type == ROPE_CASES[name]["rope_type"]
    inv_freq, attention_factor = rope_frequencies(cfg)
    ref_inv_freq, ref_factor = hf_frequencies(config)
    assert inv_freq.dtype == np.float32
    assert inv_freq.shape == (head_dim // 2,)
    np.testing.assert_allclose(inv_freq, ref_inv_freq, rtol=1e-6, atol=0)
    assert attention_factor == pytest.approx(ref_factor, rel=1e-12)


def test_scaled_frequencies_really_differ_from_default() -> None:
    """Guard against the comparison above passing trivially: each scaling changes the frequencies,
    and the llama3 case covers all three bands."""
    default, _ = rope_frequencies(model_config_from_hf(hf_config(ROPE_CASES["default"]).to_dict()))
    linear_cfg = hf_config(ROPE_CASES["linear"])
    linear, _ = rope_frequencies(model_config_from_hf(linear_cfg.to_dict()))
    base_1e4, _ = rope_frequencies(model_config_from_hf(hf_config(ROPE_CASES["default-theta1e4"]).to_dict()))
    np.testing.assert_allclose(linear, base_1e4 / 4.0, rtol=1e-6)
    llama3, _ = rope_frequencies(model_config_from_hf(hf_config(ROPE_CASES["llama3"]).to_dict()))
    ratio = default / llama3
    assert np.any(np.isclose(ratio, 1.0)), "no high-frequency band kept as is"
    assert np.any(np.isclose(ratio, 8.0)), "no low-frequency band divided by the factor"
    assert np.any((ratio > 1.01) & (ratio < 7.99)), "no smoothed middle band"
    yarn, factor = rope_frequencies(model_config_from_hf(hf_config(ROPE_CASES["yarn"]).to_dict()))
    assert factor > 1.0 and not np.allclose(yarn, base_1e4)


@pytest.mark.parametrize("name", ["default", "linear", "llama3", "yarn-mscale"])
def test_cos_sin_match_hugging_face_rotary_embedding(name: str) -> None:
    config = hf_config(ROPE_CASES[name], head_dim=64)
    cfg = model_config_from_hf(config.to_dict())
    positions = np.random.default_rng(0).integers(0, 8192, size=50).astype(np.int32)
    inv_freq, scale = rope_frequencies(cfg)
    cos, sin = rope_cos_sin(jnp.asarray(positions), inv_freq, scale, jnp.float32)
    rotary = LlamaRotaryEmbedding(config)
    x = torch.zeros(1, len(positions), 64)
    ref_cos, ref_sin = rotary(x, torch.from_numpy(positions.astype(np.int64))[None])
    # inv_freq agrees to ~1 float32 ulp (2e-7 relative), so the angles agree to position * 2e-7.
    tol = 1e-5 + positions[:, None].astype(np.float64) * 3e-7
    cos_err = np.abs(np.asarray(cos, np.float64) - ref_cos[0].numpy())
    sin_err = np.abs(np.asarray(sin, np.float64) - ref_sin[0].numpy())
    assert np.all(cos_err <= tol), f"cos differs by up to {cos_err.max():.3g}"
    assert np.all(sin_err <= tol), f"sin differs by up to {sin_err.max():.3g}"


def test_apply_rope_matches_hugging_face() -> None:
    rng = np.random.default_rng(1)
    num_tokens, num_heads, num_kv_heads, head_dim = 11, 4, 2, 64
    q = rng.standard_normal((num_tokens, num_heads, head_dim)).astype(np.float32)
    k = rng.standard_normal((num_tokens, num_kv_heads, head_dim)).astype(np.float32)
    positions = rng.integers(0, 4096, size=num_tokens).astype(np.int32)
    cfg = model_config_from_hf(hf_config(ROPE_CASES["yarn"], head_dim=head_dim).to_dict())
    inv_freq, scale = rope_frequencies(cfg)
    cos, sin = rope_cos_sin(jnp.asarray(positions), inv_freq, scale, jnp.float32)
    ours_q = np.asarray(apply_rope(jnp.asarray(q), cos, sin))
    ours_k = np.asarray(apply_rope(jnp.asarray(k), cos, sin))
    # HF layout: [batch, heads, tokens, head_dim] with cos/sin [batch, tokens, head_dim].
    tq = torch.from_numpy(q).permute(1, 0, 2)[None]
    tk = torch.from_numpy(k).permute(1, 0, 2)[None]
    tcos = torch.from_numpy(np.array(cos))[None]
    tsin = torch.from_numpy(np.array(sin))[None]
    ref_q, ref_k = apply_rotary_pos_emb(tq, tk, tcos, tsin, unsqueeze_dim=1)
    np.testing.assert_allclose(ours_q, ref_q[0].permute(1, 0, 2).numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ours_k, ref_k[0].permute(1, 0, 2).numpy(), rtol=1e-6, atol=1e-6)
    # A rotation (scaled by the attention factor) keeps each pair's norm.
    half = head_dim // 2
    pair_norm = np.hypot(q[..., :half], q[..., half:]) * scale
    np.testing.assert_allclose(np.hypot(ours_q[..., :half], ours_q[..., half:]), pair_norm, rtol=1e-5)
    assert not np.allclose(ours_q, q)


def test_apply_rope_at_position_zero_is_identity() -> None:
    x = np.random.default_rng(2).standard_normal((3, 2, 16)).astype(np.float32)
    cfg = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=10, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2,
        head_dim=16, intermediate_size=64,
    )
    inv_freq, scale = rope_frequencies(cfg)
    cos, sin = rope_cos_sin(jnp.zeros(3, jnp.int32), inv_freq, scale, jnp.float32)
    np.testing.assert_array_equal(np.asarray(apply_rope(jnp.asarray(x), cos, sin)), x)


# --- reading the two config spellings -------------------------------------------------------------


def raw_config(**rope: Any) -> dict[str, Any]:
    return {"architectures": ARCH, **BASE, **rope}


LLAMA3_PARAMS = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.mark.parametrize(
    "spelling",
    [
        raw_config(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", **LLAMA3_PARAMS}),
        raw_config(rope_theta=500000.0, rope_scaling={"type": "llama3", **LLAMA3_PARAMS}),
        raw_config(rope_theta=500000.0, rope_scaling={"type": "llama3", "rope_type": "llama3", **LLAMA3_PARAMS}),
        raw_config(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3_PARAMS}),
    ],
    ids=["v4-rope_type", "v4-type", "v4-both", "v5-rope_parameters"],
)
def test_v4_and_v5_spellings_give_the_same_config(spelling: dict[str, Any]) -> None:
    cfg = model_config_from_hf(spelling)
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == RopeScaling(rope_type="llama3", **LLAMA3_PARAMS)


@pytest.mark.parametrize(
    "spelling",
    [
        raw_config(rope_theta=10000.0, rope_scaling={"type": "linear", "factor": 2.0}),
        raw_config(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    ],
    ids=["v4", "v5"],
)
def test_linear_spellings(spelling: dict[str, Any]) -> None:
    cfg = model_config_from_hf(spelling)
    assert cfg.rope_scaling == RopeScaling(rope_type="linear", factor=2.0)
    config = LlamaConfig(**{k: v for k, v in spelling.items() if k != "architectures"})
    np.testing.assert_allclose(rope_frequencies(cfg)[0], hf_frequencies(config)[0], rtol=1e-6)


def test_theta_and_default_rope() -> None:
    v4 = model_config_from_hf(raw_config(rope_theta=123456.0))
    v5 = model_config_from_hf(raw_config(rope_parameters={"rope_type": "default", "rope_theta": 123456.0}))
    missing = model_config_from_hf(raw_config())
    assert v4.rope_theta == v5.rope_theta == 123456.0
    assert v4.rope_scaling == v5.rope_scaling == RopeScaling()
    assert missing.rope_theta == 10000.0 and missing.rope_scaling == RopeScaling()
    v4_null = model_config_from_hf(raw_config(rope_theta=5e5, rope_scaling=None))
    assert v4_null.rope_theta == 5e5 and v4_null.rope_scaling.rope_type == "default"


def test_yarn_defaults_follow_hugging_face() -> None:
    """Without original_max_position_embeddings yarn uses max_position_embeddings; factor None is
    max_position_embeddings / original_max_position_embeddings."""
    no_orig = model_config_from_hf(raw_config(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}))
    assert no_orig.rope_scaling.original_max_position_embeddings == BASE["max_position_embeddings"]
    hf = hf_config({"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0})
    np.testing.assert_allclose(rope_frequencies(no_orig)[0], hf_frequencies(hf)[0], rtol=1e-6)
    no_factor = model_config_from_hf(
        raw_config(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": None,
                                    "original_max_position_embeddings": 2048, "beta_fast": None})
    )
    assert no_factor.rope_scaling.factor == pytest.approx(8192 / 2048)
    assert no_factor.rope_scaling.beta_fast == 32.0
    hf = hf_config({"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 2048})
    inv_freq, factor = rope_frequencies(no_factor)
    ref_inv_freq, ref_factor = hf_frequencies(hf)
    np.testing.assert_allclose(inv_freq, ref_inv_freq, rtol=1e-6)
    assert factor == pytest.approx(ref_factor)


def test_llama3_without_original_length_falls_back_like_hugging_face() -> None:
    """Hugging Face fills a missing llama3 `original_max_position_embeddings` from
    `max_position_embeddings` (as this loader already does for yarn); a config HF loads must load here."""
    params = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    hf = LlamaConfig(**BASE, rope_theta=500000.0, rope_scaling=dict(params))
    ref_inv_freq, _ = hf_frequencies(hf)
    cfg = model_config_from_hf(raw_config(rope_theta=500000.0, rope_scaling=dict(params)))
    assert cfg.rope_scaling.original_max_position_embeddings == BASE["max_position_embeddings"]
    np.testing.assert_allclose(rope_frequencies(cfg)[0], ref_inv_freq, rtol=1e-6)


UNSUPPORTED = {
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "su": {"type": "su", "factor": 2.0},
    # Phi-3 style longrope carries its own keys; the message must still say the type is unsupported.
    "longrope": {
        "rope_type": "longrope", "short_factor": [1.0] * 32, "long_factor": [2.0] * 32,
        "original_max_position_embeddings": 4096,
    },
}


@pytest.mark.parametrize("spelling", ["v4", "v5"])
@pytest.mark.parametrize("rope_type", list(UNSUPPORTED))
def test_unknown_rope_type_is_rejected_naming_supported_ones(rope_type: str, spelling: str) -> None:
    params = UNSUPPORTED[rope_type]
    if spelling == "v4":
        hf = raw_config(rope_theta=10000.0, rope_scaling=dict(params))
    else:
        hf = raw_config(rope_parameters={**params, "rope_theta": 10000.0})
    with pytest.raises(ValueError) as info:
        model_config_from_hf(hf)
    message = str(info.value)
    assert repr(rope_type) in message
    for supported in ROPE_TYPES:
        assert supported in message, f"{supported!r} not named in: {message}"
