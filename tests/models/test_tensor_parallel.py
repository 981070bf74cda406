"""Tensor parallelism on simulated CPU devices (tests/conftest.py starts JAX with four): the split
itself (which device holds which heads and widths), the errors for sizes a model cannot take, and
greedy decoding at TP 2 and 4 giving TP 1's and transformers' tokens for a GQA Llama, Mistral,
Gemma 3, multi-query Falcon (one KV head, so it is repeated over the devices) and Mixtral."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from paxserve.models import load_model
from paxserve.models.config import ModelConfig
from paxserve.models.sharding import TensorParallel, valid_sizes
from paxserve.worker.model_runner import ModelRunner
from tests.helpers import make_tiny_llama, rel_error
from tests.models.family_checkpoints import VOCAB, make_family_checkpoint
from tests.models.test_families import hf_greedy, prompts_for
from tests.paged_greedy import greedy_tokens_and_logits

STEPS = 12
FAMILIES = ("llama-gqa", "mistral-window", "gemma3", "falcon-multi-query", "mixtral")


def tiny_config(**overrides: Any) -> ModelConfig:
    base = dict(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, num_layers=1, num_heads=8,
                num_kv_heads=2, head_dim=4, intermediate_size=16)
    return ModelConfig(**{**base, **overrides})


def test_fused_qkv_is_regrouped_per_device_with_kv_heads_repeated() -> None:
    cfg = tiny_config(num_heads=4, num_kv_heads=1, head_dim=2)
    tp = TensorParallel.create(cfg, 4)
    # Column j of the fused [q | k | v] projection holds j, so the regrouping can be read back.
    w = np.arange(cfg.hidden_size * 12, dtype=np.float32).reshape(cfg.hidden_size, 12) % 12
    per_device = np.split(tp.reorder("layers.qkv_w", w[None])[0], 4, axis=1)
    for d, cols in enumerate(per_device):
        # device d: query head d (columns 2d, 2d+1), then the one KV head, repeated (k: 8-9, v: 10-11)
        assert cols[0].tolist() == [2 * d, 2 * d + 1, 8, 9, 10, 11]
    assert tp.kv_replicas == 4 and tp.local.num_kv_heads == 1 and tp.local.num_heads == 1


def test_gate_and_up_are_split_so_each_device_holds_its_slice_of_both() -> None:
    cfg = tiny_config(intermediate_size=4)
    tp = TensorParallel.create(cfg, 2)
    up = np.tile(np.arange(8, dtype=np.float32), (1, cfg.hidden_size, 1))  # gate 0-3, up 4-7
    first, second = np.split(tp.reorder("layers.up_w", up)[0], 2, axis=1)
    assert first[0].tolist() == [0, 1, 4, 5] and second[0].tolist() == [2, 3, 6, 7]
    assert tp.reorder("layers.o_w", up) is up  # row-parallel fields keep their order
    assert tp.spec("layers.o_w", (2, 64, 32)) == jax.sharding.PartitionSpec(None, "tp", None)
    assert tp.spec("layers.attn_norm", (2, 32)) == jax.sharding.PartitionSpec()


@pytest.mark.parametrize("overrides,size,mentions", [
    (dict(num_heads=9, num_kv_heads=3, head_dim=4, hidden_size=36, intermediate_size=48), 2,
     "9 attention heads do not divide into 2; 3 KV heads neither divide into 2 nor 2 into them. Valid sizes for it: 1, 3"),
    (dict(num_heads=8, num_kv_heads=8, intermediate_size=12), 8, "intermediate_size=12 does not divide into 8"),
    (dict(num_heads=12, num_kv_heads=3, head_dim=4, hidden_size=48), 2, "3 KV heads neither divide into 2"),
])
def test_sizes_a_model_cannot_take_fail_naming_the_valid_ones(overrides: dict, size: int, mentions: str) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size") as e:
        TensorParallel.create(tiny_config(**overrides), size)
    assert mentions in str(e.value)


def test_more_devices_than_visible_fails_with_the_hint() -> None:
    cfg = tiny_config(num_heads=8, num_kv_heads=8, intermediate_size=64)
    assert 8 in valid_sizes(cfg)
    with pytest.raises(ValueError, match=r"needs 8 devices but 4 cpu device\(s\) are visible.*"
                                         r"xla_force_host_platform_device_count=8"):
        TensorParallel.create(cfg, 8)


_MODELS: dict[str, tuple[Any, Path]] = {}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, str]:
    return _checkpoint(request.param, tmp_path_factory)


def _checkpoint(name: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, str]:
    if name not in _MODELS:
        directory = tmp_path_factory.mktemp(f"tp-{name}")
        if name == "llama-gqa":
            hf = make_tiny_llama(directory, seed=11, num_key_value_heads=2, vocab_size=VOCAB)
        else:
            hf = make_family_checkpoint(name, directory, seed=len(name))
        _MODELS[name] = (hf, directory)
    return (*_MODELS[name], name)


def _check_split(model: Any, runner: ModelRunner, size: int) -> None:
    """The weights and the cache are really split: each device holds 1/size of every split field."""
    tp, cfg, params = model.tp, model.config, model.params
    assert tp is not None and tp.size == size
    qkv = params.layers[-1].qkv_w  # the runner serves one array per layer (models/layer_split.py)
    assert qkv.sharding.spec == jax.sharding.PartitionSpec(None, "tp") and not qkv.is_fully_replicated
    assert len({s.device for s in qkv.addressable_shards}) == size
    local_heads = cfg.num_heads // size + 2 * max(cfg.num_kv_heads, size) // size
    assert qkv.addressable_shards[0].data.shape[-1] == local_heads * cfg.head_dim
    assert params.embed.addressable_shards[0].data.shape == (cfg.vocab_size // size, cfg.hidden_size)
    k = runner.kv_cache.k
    assert k.sharding.spec[3] == "tp" and k.addressable_shards[0].data.shape[3] == max(1, cfg.num_kv_heads // size)
    if params.moe is not None:
        up = params.moe.experts_up_w
        assert up.addressable_shards[0].data.shape[-1] == 2 * cfg.moe_intermediate_size // size
        assert params.moe.router_w.is_fully_replicated  # every device routes alike


def test_greedy_tokens_at_tp_2_and_4_equal_tp_1_and_transformers(family, report) -> None:
    """Block 8, prompts shorter and longer than the windows, decoding past them: TP 1 is checked
    against transformers' logits too (test_families.py leaves these families' block 8 to this)."""
    hf, directory, name = family
    prompts = prompts_for(7, [5, 23])
    reference = [hf_greedy(hf, p, STEPS) for p in prompts]
    want = [tokens for tokens, _ in reference]
    results = {}
    # TP 4 where KV heads are repeated over devices (Mistral's 2, Gemma 3's and Falcon's 1); Llama and
    # Mixtral run the same split code at TP 2 (the TP engine and server tests add Llama at TP 2 too).
    sizes = (1, 2) if name in ("llama-gqa", "mixtral") else (1, 2, 4)
    for size in sizes:
        model = load_model(directory, tensor_parallel_size=size)
        runner = ModelRunner(model, num_blocks=32, block_size=8, max_model_len=128)
        if size > 1:
            _check_split(model, runner, size)
        results[size] = greedy_tokens_and_logits(runner, prompts, STEPS, shuffle_seed=size)
        del model, runner
    tokens_1, logits_1 = results[1]
    assert tokens_1 == want
    assert max(rel_error(a, b)[1] for (_, hf_steps), ours in zip(reference, logits_1)
               for a, b in zip(ours, hf_steps)) < 1e-4
    for size in sizes[1:]:
        tokens, logits = results[size]
        assert tokens == want, f"TP {size} changed the greedy tokens"
        worst = max(rel_error(a, b)[1] for la, lb in zip(logits, logits_1) for a, b in zip(la, lb))
        assert worst < 1e-5
        report(f"{name} TP {size}: greedy tokens equal TP 1 and transformers, max relative logit error {worst:.1e}")


@pytest.mark.parametrize("name,size", [("mixtral", 2), ("qwen2-moe", 4)])
def test_expert_parallel_places_whole_experts_and_keeps_the_tokens(
    name: str, size: int, tmp_path_factory: pytest.TempPathFactory, report
) -> None:
    hf, directory, _ = _checkpoint(name, tmp_path_factory)
    prompts = prompts_for(3, [6, 19])
    want = [hf_greedy(hf, p, STEPS) for p in prompts]
    # one size per model: 2 experts per device for Mixtral, 1 for Qwen2-MoE (with its shared expert)
    model = load_model(directory, tensor_parallel_size=size, enable_expert_parallel=True)
    up = model.params.moe.experts_up_w
    experts = model.config.num_experts
    # each device holds num_experts / size experts at their full width
    assert up.addressable_shards[0].data.shape[1:] == (experts // size, model.config.hidden_size,
                                                        2 * model.config.moe_intermediate_size)
    runner = ModelRunner(model, num_blocks=32, block_size=16, max_model_len=128)
    tokens, logits = greedy_tokens_and_logits(runner, prompts, STEPS, shuffle_seed=size)
    assert tokens == [w[0] for w in want]
    worst = max(rel_error(a, b)[1] for (_, hf_steps), ours in zip(want, logits) for a, b in zip(ours, hf_steps))
    assert worst < 1e-4
    report(f"{name} expert-parallel TP {size}: {experts // size} experts per device, transformers' tokens, "
           f"max relative logit error {worst:.1e}")
