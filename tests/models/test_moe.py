"""The mixture-of-experts layer: only routed experts run, rows go back to their tokens, and the
checkpoint layouts and config mapping hold. (Parity with transformers for Mixtral, Qwen2-MoE and
Qwen3-MoE is in test_families.py.)"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxserve.models import load_model
from paxserve.models.config import ModelConfig
from paxserve.models.moe import experts_forward, experts_forward_reference, plan_tiles, route, tile_rows_for
from paxserve.worker.model_runner import ModelRunner
from paxserve.worker.step_inputs import SeqChunk, build_batch
from tests.models.family_checkpoints import FAMILIES, VOCAB, make_family_checkpoint
from tests.paged_greedy import greedy_tokens_and_logits
from tests.helpers import compute_logits

_experts = jax.jit(experts_forward, static_argnames=("act",))


def _weights(rng, num_experts, hidden=16, width=8):
    up = jnp.asarray(rng.normal(size=(num_experts, hidden, 2 * width)), jnp.float32)
    down = jnp.asarray(rng.normal(size=(num_experts, width, hidden)), jnp.float32)
    return up, down


@pytest.mark.parametrize("tokens,num_experts,top_k,skew", [
    (1, 4, 2, False), (7, 4, 2, False), (64, 8, 2, False), (33, 16, 4, False), (5, 64, 1, False),
    (40, 8, 2, True),  # nearly every token on one expert: that group spans many tiles
])
def test_routed_experts_equal_the_dense_computation(tokens, num_experts, top_k, skew) -> None:
    rng = np.random.default_rng(tokens)
    x = jnp.asarray(rng.normal(size=(tokens, 16)), jnp.float32)
    weights, ids = route(x, jnp.asarray(rng.normal(size=(16, num_experts)), jnp.float32), top_k, True)
    if skew:
        ids = ids.at[:, 0].set(3).at[:-2, 1].set(5)
    up, down = _weights(rng, num_experts)
    got = _experts(x, weights, ids, up, down, act="silu")
    ref = experts_forward_reference(x, weights, ids, up, down, act="silu")
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)


def test_computing_the_empty_tiles_changes_nothing() -> None:
    """The no-cond variant gpu_check times on a GPU: empty tiles run but write nothing back."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(9, 16)), jnp.float32)
    weights, ids = route(x, jnp.asarray(rng.normal(size=(16, 7)), jnp.float32), 2, False)  # expert 7 unrouted
    up, down = _weights(rng, 8)
    both = [jax.jit(experts_forward, static_argnames=("act", "skip_empty_tiles"))(
        x, weights, ids, up.at[7].set(jnp.nan), down, act="silu", skip_empty_tiles=skip) for skip in (True, False)]
    assert np.isfinite(np.asarray(both[1])).all()
    np.testing.assert_array_equal(both[0], both[1])


def test_tile_plan_covers_every_routed_row_once() -> None:
    sizes = jnp.asarray([0, 5, 1, 0, 17, 3], jnp.int32)
    rows = int(sizes.sum())
    m = tile_rows_for(rows, 6)
    plan = plan_tiles(sizes, rows, m)
    covered = np.zeros(rows, int)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    for e, start, n in zip(*(np.asarray(a) for a in (plan.expert, plan.row_start, plan.num_rows))):
        if n:
            assert starts[e] <= start and start + n <= starts[e + 1], "a tile reaches into another expert's rows"
            covered[start:start + n] += 1
    assert (covered == 1).all()


def test_an_unrouted_expert_is_never_computed() -> None:
    """An expert holding NaN that no token is routed to leaves every output finite and unchanged;
    any dense all-experts product (0 * NaN) or wrong gather would spread the NaN."""
    rng = np.random.default_rng(0)
    tokens, num_experts, top_k, poisoned = 24, 8, 2, 5
    x = jnp.asarray(rng.normal(size=(tokens, 16)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.choice([e for e in range(num_experts) if e != poisoned], top_k, replace=False)
                                for _ in range(tokens)]), jnp.int32)
    weights = jax.nn.softmax(jnp.asarray(rng.normal(size=(tokens, top_k)), jnp.float32))
    up, down = _weights(rng, num_experts)
    clean = _experts(x, weights, ids, up, down, act="silu")
    got = _experts(x, weights, ids, up.at[poisoned].set(jnp.nan), down.at[poisoned].set(jnp.nan), act="silu")
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_array_equal(got, clean)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("mixtral")
    hf = make_family_checkpoint("mixtral", directory, seed=11)
    return hf, load_model(directory), directory


def _logits(model, prompts: list[list[int]]) -> np.ndarray:
    runner = ModelRunner(model, num_blocks=16, block_size=16)
    chunks, next_block = [], 1
    for p in prompts:
        n = -(-len(p) // 16)
        chunks.append(SeqChunk(p, 0, list(range(next_block, next_block + n))))
        next_block += n
    return compute_logits(runner, build_batch(chunks, 16, pad_tokens_to=64, pad_seqs_to=4, pad_blocks_to=4))


def test_whole_model_with_a_poisoned_unrouted_expert_stays_finite_and_equal(mixtral) -> None:
    """The router is forced off expert 3 by giving it the same router column as experts 0 and 1:
    top-k breaks ties towards the lower index, so with k=2 expert 3 never wins a slot. Then NaN in
    every one of expert 3's weights must not reach the logits."""
    _, model, _ = mixtral
    moe = model.params.moe
    router = moe.router_w.at[:, :, 0].set(moe.router_w[:, :, 3]).at[:, :, 1].set(moe.router_w[:, :, 3])
    forced = dataclasses.replace(model, params=model.params.replace(moe=moe.replace(router_w=router)))
    poisoned = dataclasses.replace(forced, params=forced.params.replace(moe=forced.params.moe.replace(
        experts_up_w=moe.experts_up_w.at[:, 3].set(jnp.nan), experts_down_w=moe.experts_down_w.at[:, 3].set(jnp.nan))))
    prompts = [np.random.default_rng(i).integers(3, VOCAB, n).tolist() for i, n in enumerate((21, 3, 9))]
    clean, got = _logits(forced, prompts), _logits(poisoned, prompts)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, clean)


def test_greedy_alone_equals_greedy_batched(mixtral) -> None:
    """Batching changes which rows share an expert's tiles, never a token's result."""
    _, model, _ = mixtral
    prompts = [np.random.default_rng(20 + i).integers(3, VOCAB, n).tolist() for i, n in enumerate((27, 6))]
    runner = ModelRunner(model, num_blocks=24, block_size=16)
    batched, _ = greedy_tokens_and_logits(runner, prompts, 8, shuffle_seed=1)
    for i, p in enumerate(prompts):
        alone, _ = greedy_tokens_and_logits(runner, [p], 8, shuffle_seed=2 + i)
        assert alone[0] == batched[i], f"prompt {i}"


@pytest.mark.parametrize("name", ["mixtral", "qwen2-moe"])
def test_fused_expert_checkpoints_load_like_per_expert_ones(name: str, tmp_path: Path) -> None:
    """transformers v5 can save experts fused (`save_original_format=False`: mlp.experts.gate_up_proj);
    by default it writes them per expert. Both give the same params."""
    import torch
    import transformers

    config_cls, model_cls, overrides = FAMILIES[name]
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**overrides)).eval()
    hf.save_pretrained(str(tmp_path / "per-expert"))
    hf.save_pretrained(str(tmp_path / "fused"), save_original_format=False)
    per_expert, fused = (load_model(tmp_path / d, use_param_cache=False).params for d in ("per-expert", "fused"))
    assert jax.tree.structure(per_expert) == jax.tree.structure(fused)
    for a, b in zip(jax.tree.leaves(per_expert), jax.tree.leaves(fused)):
        np.testing.assert_array_equal(a, b)


def test_a_missing_expert_is_a_clear_error(tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    make_family_checkpoint("qwen2-moe", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.2.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensors.*model\.layers\.1\.mlp\.experts\.gate_up_proj"):
        load_model(tmp_path)


def test_config_checks_and_describes_the_experts() -> None:
    base = dict(architecture="MixtralForCausalLM", vocab_size=32, hidden_size=16, num_layers=4, num_heads=2,
                num_kv_heads=2, head_dim=8, intermediate_size=24)
    cfg = ModelConfig(**base, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, dense_mlp_layers=(0,))
    assert cfg.moe_layers == (1, 2, 3)
    assert cfg.inactive_params_per_token == 3 * 6 * 3 * 16 * 24  # 3 MoE layers x 6 idle experts x gate/up/down
    assert "8 gated silu experts of width 24, top-2 per token" in cfg.describe()
    for bad, message in [(dict(num_experts_per_tok=9), r"num_experts_per_tok must be in \[1, num_experts=8\]"),
                         (dict(num_experts_per_tok=0), "num_experts_per_tok"),
                         (dict(dense_mlp_layers=(0, 1, 2, 3)), "every layer is a dense MLP layer"),
                         (dict(dense_mlp_layers=(4,)), "dense_mlp_layers"),
                         (dict(moe_intermediate_size=0), "moe_intermediate_size")]:
        with pytest.raises(ValueError, match=message):
            ModelConfig(**{**base, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 24, **bad})
    with pytest.raises(ValueError, match="num_experts is 0"):
        ModelConfig(**base, num_experts_per_tok=2)


def test_memory_plan_counts_every_expert_and_the_log_says_what_is_active(mixtral, caplog) -> None:
    import logging

    from paxserve.models.loader import inspect_model

    _, model, directory = mixtral
    leaves = jax.tree.leaves(model.params)
    assert inspect_model(directory).weight_bytes == sum(a.size * a.dtype.itemsize for a in leaves)
    cfg = model.config
    expert_params = cfg.num_layers * cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    assert model.params.moe.experts_up_w.size + model.params.moe.experts_down_w.size == expert_params
    with caplog.at_level(logging.INFO, logger="paxserve.models.loader"):
        load_model(directory)
    total = sum(a.size for a in leaves)
    active = total - cfg.num_layers * (cfg.num_experts - cfg.num_experts_per_tok) * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("MoE:"))
    assert line.startswith("MoE: 4 experts on 2 of 2 layers, 2 routed per token")
    assert f"{total / 1e6:.2f}M params in all" in line and f"{active / 1e6:.2f}M active per token" in line


def test_qwen_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers() -> None:
    """Qwen's rule: layer i is sparse when (i + 1) % decoder_sparse_step == 0 and i is not in
    mlp_only_layers; a config with no sparse layer is a dense model."""
    from paxserve.models.config import model_config_from_hf

    hf = dict(architectures=["Qwen2MoeForCausalLM"], vocab_size=32, hidden_size=16, intermediate_size=24,
              num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=8, shared_expert_intermediate_size=12, decoder_sparse_step=2, mlp_only_layers=[3])
    cfg = model_config_from_hf(hf)
    assert cfg.moe_layers == (1, 5) and cfg.dense_mlp_layers == (0, 2, 3, 4)
    assert cfg.shared_expert_size == 12 and not cfg.moe_renormalize and cfg.attention_bias
    dense = model_config_from_hf({**hf, "architectures": ["Qwen3MoeForCausalLM"], "mlp_only_layers": [1, 3, 5]})
    assert dense.num_experts == 0 and dense.qk_norm
    mixtral = model_config_from_hf(dict(architectures=["MixtralForCausalLM"], vocab_size=32, hidden_size=16,
                                        intermediate_size=24, num_hidden_layers=2, num_attention_heads=2))
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size) == (8, 2, 24)
    assert mixtral.rope_theta == 1e6 and mixtral.moe_renormalize and not mixtral.layer_windows


def test_windows_follow_transformers_config_classes() -> None:
    """With `use_sliding_window`, Qwen2-MoE windows the layers Qwen2MoeConfig marks (read from
    `layer_types`, or its own default pattern when a config omits them); Qwen3-MoE windows every layer."""
    import transformers

    from paxserve.models.config import model_config_from_hf

    small = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=6, num_attention_heads=2,
                 num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                 use_sliding_window=True, sliding_window=8, max_window_layers=4)
    hf = transformers.Qwen2MoeConfig(**small, shared_expert_intermediate_size=12).to_dict()
    expected = tuple(8 if t == "sliding_attention" else 0 for t in hf["layer_types"])
    assert any(expected) and 0 in expected
    for config in (hf, {k: v for k, v in hf.items() if k != "layer_types"}):
        assert model_config_from_hf({**config, "architectures": ["Qwen2MoeForCausalLM"]}).layer_windows == expected
    qwen3 = transformers.Qwen3MoeConfig(**small).to_dict()
    assert model_config_from_hf({**qwen3, "architectures": ["Qwen3MoeForCausalLM"]}).layer_windows == (8,) * 6
