"""The whole engine under tensor parallelism (two of the four simulated CPU devices conftest.py
starts): chunked prefill, preemption and prefix caching give transformers' greedy tokens, and the
block bookkeeping is the host's alone (it does not know about devices). Sampling under TP is
compared with one device in tests/server/test_tensor_parallel_server.py."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from paxserve import Engine, SamplingParams
from tests.helpers import make_tiny_llama
from tests.paxserve.test_engine import TEST_ENGINE_ARGS, assert_no_blocks_held

VOCAB = 256
# A pool too small for the batch (preemption), a token budget smaller than the prompts (chunked
# prefill), prompts sharing a block (prefix caching).
ARGS = {**TEST_ENGINE_ARGS, "block_size": 8, "num_gpu_blocks_override": 7, "max_model_len": 48,
        "max_num_batched_tokens": 8, "max_num_seqs": 4}
STEPS = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    directory = tmp_path_factory.mktemp("tiny-tp")
    hf = make_tiny_llama(directory, seed=3, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return hf, directory


def make_prompts(n: int, seed: int) -> list[list[int]]:
    """1 to 15 tokens; every other prompt starts with the same 8-token block."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, VOCAB, 8).tolist()
    return [(shared if i % 2 else []) + rng.integers(3, VOCAB, int(rng.integers(1, 8))).tolist() for i in range(n)]


def test_engine_at_tp_2_gives_transformers_tokens_through_preemption_chunking_and_prefix_hits(
    tiny: tuple[Any, Path], caplog: pytest.LogCaptureFixture, report
) -> None:
    hf, directory = tiny
    prompts = make_prompts(10, seed=4)
    with caplog.at_level(logging.INFO):
        engine = Engine(str(directory), **ARGS, tensor_parallel_size=2)
    assert "tensor parallel over 2 devices" in caplog.text and "KV head(s) per device" in caplog.text
    # Served with one array per layer (models/layer_split.py), each split as its stacked field was.
    layers = engine.model.params.layers
    assert isinstance(layers, tuple) and len(layers) == engine.model.config.num_layers
    specs = {(tuple(layer.qkv_w.sharding.spec), tuple(layer.o_w.sharding.spec)) for layer in layers}
    assert specs == {((None, "tp"), ("tp", None))}
    assert engine.runner.kv_cache.k.sharding.spec[3] == "tp"
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True),
                           use_tqdm=False)
    assert engine.stats.preemptions > 0 and engine.kv.prefix_stats.hits > 0
    assert_no_blocks_held(engine)
    # The sampler's state lives whole on every device and keeps its placement from step to step, so
    # each bucket compiles once (a placement that changed would compile its bucket again), and the
    # sampler once per sequence bucket.
    assert engine.runner.sampler_state.counts.sharding.is_fully_replicated
    assert len(engine.runner.sampler_state.counts.sharding.device_set) == 2
    programs = engine.runner.programs.keys()
    assert {key[1:] for key in programs if key[0] == "forward"} == engine.runner.compiled
    assert {key[1] for key in programs if key[0] == "sample"} == {key[1] for key in engine.runner.compiled}
    # A second run of the same prompts compiles nothing (each program kept its placements).
    engine.reset_prefix_cache()
    engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True), use_tqdm=False)
    assert engine.runner.programs.keys() == programs
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=STEPS, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()
    report(f"{len(prompts)} prompts at TP 2: transformers' greedy tokens through {engine.stats.preemptions} "
           f"preemptions and {engine.kv.prefix_stats.hits} prefix-cache hits")


def test_a_size_the_model_cannot_take_fails_before_loading(tiny: tuple[Any, Path]) -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 cannot split this model: 4 attention heads do not "
                                         r"divide into 3.*Valid sizes for it: 1, 2, 4"):
        Engine(str(tiny[1]), **ARGS, tensor_parallel_size=3)


def test_a_draft_model_at_tp_2_gives_transformers_tokens(tiny: tuple[Any, Path], caplog) -> None:
    """A draft model split over the target's devices as the target is (here the target itself:
    its greedy proposals are all right), with async scheduling, in the same small pool with chunked
    prompts; the memory plan counts one device's share of the draft. (Proposals rejected under
    tensor parallelism: test_multihost.py's n-gram run at TP 4.)"""
    from tests.paxserve.test_spec_decode import FlatTimes

    hf, directory = tiny
    prompts = make_prompts(6, seed=7)
    refs = []
    for prompt in prompts:
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=STEPS, do_sample=False, eos_token_id=None, pad_token_id=0)
        refs.append(ref[0, len(prompt):].tolist())
    with caplog.at_level(logging.INFO):
        engine = Engine(str(directory), **{**ARGS, "async_scheduling": True}, tensor_parallel_size=2,
                        speculative_config={"model": str(directory), "num_speculative_tokens": 3})
    core = engine.parts.core
    core._speculator.times = FlatTimes()
    draft = core._speculator.draft
    assert draft.model.tp is not None and draft.kv_cache.k.sharding.spec[3] == "tp"
    assert "each block holds the draft model's pages too" in caplog.text
    # What an engine's warm-up readies: the single-sequence decode pass at the target's warm widths.
    assert draft.warmup(engine.runner.warm_decode_widths) == 2
    assert {key[1:] for key in draft.programs.keys()} == {(1, 1, 4), (1, 1, 8)}
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True),
                           use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs
    stats = core.spec_stats
    assert stats.num_drafts > 3 and stats.num_accepted_tokens == stats.num_draft_tokens, stats
    assert_no_blocks_held(engine)
