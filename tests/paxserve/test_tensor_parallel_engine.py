"""The whole engine under tensor parallelism (two of the four simulated CPU devices conftest.py
starts): chunked prefill, preemption, prefix caching and every sampler feature give TP 1's tokens
and logprobs, and the block bookkeeping is the same (the host side does not know about devices)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from paxserve import Engine, SamplingParams
from tests.helpers import make_tiny_llama
from tests.paxserve.test_engine import TEST_ENGINE_ARGS, assert_no_blocks_held

VOCAB = 256  # a small vocabulary keeps the sampler's programs quick to compile

# A pool too small for the batch (preemption), a token budget smaller than the prompts (chunked
# prefill), prompts sharing a block (prefix caching), and one request shape using every sampler
# feature at once (each distinct mix of features and widths compiles its own step, and two engines
# compile them all: the greedy path is checked by the model and server tests).
ARGS = {**TEST_ENGINE_ARGS, "block_size": 8, "num_gpu_blocks_override": 7, "max_model_len": 48,
        "max_num_batched_tokens": 8, "max_num_seqs": 4}
PARAMS = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.05, repetition_penalty=1.3,
                        presence_penalty=0.4, frequency_penalty=0.2, logit_bias={5: 2.0}, seed=7, n=2, max_tokens=8,
                        logprobs=3, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-tp")
    make_tiny_llama(directory, seed=3, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return directory


def make_prompts(n: int, seed: int) -> list[list[int]]:
    """1 to 15 tokens; every other prompt starts with the same 8-token block."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, VOCAB, 8).tolist()
    return [(shared if i % 2 else []) + rng.integers(3, VOCAB, int(rng.integers(1, 8))).tolist() for i in range(n)]


def _run(engine: Engine, prompts: list[list[int]]) -> list:
    outs = engine.generate(prompts, PARAMS, use_tqdm=False)
    assert_no_blocks_held(engine)
    return outs


def test_engine_at_tp_2_gives_tp_1_outputs_through_preemption_chunking_and_prefix_hits(
    tiny_dir: Path, caplog: pytest.LogCaptureFixture, report
) -> None:
    prompts = make_prompts(10, seed=4)
    single = Engine(str(tiny_dir), **ARGS)
    want = _run(single, prompts)
    with caplog.at_level(logging.INFO):
        split = Engine(str(tiny_dir), **ARGS, tensor_parallel_size=2)
    assert "tensor parallel over 2 devices" in caplog.text and "KV head(s) per device" in caplog.text
    assert split.model.params.layers.qkv_w.sharding.spec[2] == "tp"
    got = _run(split, prompts)
    assert split.stats.preemptions > 0 and split.kv.prefix_stats.hits > 0
    assert (split.stats.preemptions, split.kv.prefix_stats.hits) == (single.stats.preemptions,
                                                                     single.kv.prefix_stats.hits)
    worst = 0.0
    for a, b in zip(got, want):
        assert [s.token_ids for s in a.outputs] == [s.token_ids for s in b.outputs]
        assert [s.finish_reason for s in a.outputs] == [s.finish_reason for s in b.outputs]
        for sa, sb in zip(a.outputs, b.outputs):
            assert (sa.logprobs is None) == (sb.logprobs is None)
            for la, lb in zip(sa.logprobs or [], sb.logprobs or []):
                assert la.keys() == lb.keys()  # the same top tokens
                worst = max(worst, *(abs(la[t].logprob - lb[t].logprob) for t in la))
    assert worst < 1e-4
    report(f"10 prompts x 2 seeded samples: TP 2 tokens equal TP 1, logprobs within {worst:.1e}, "
           f"{split.stats.preemptions} preemptions, {split.kv.prefix_stats.hits} prefix-cache hits in both")
    assert np.isfinite(worst)


def test_a_size_the_model_cannot_take_fails_before_loading(tiny_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 cannot split this model: 4 attention heads do not "
                                         r"divide into 3.*Valid sizes for it: 1, 2, 4"):
        Engine(str(tiny_dir), **ARGS, tensor_parallel_size=3)
