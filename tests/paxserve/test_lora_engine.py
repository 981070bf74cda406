"""Multi-LoRA serving through the engine: requests for several adapters and for the base model run
in the same steps, each getting transformers + PEFT's greedy tokens, while adapters move in and out
of the device's slots (fewer slots than adapters) without a new compiled program; the prefix cache
never serves one adapter's KV to another; adapters that cannot serve are refused naming why."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from paxserve import Engine, LoRARequest, SamplingParams
from tests.helpers import make_tiny_llama
from tests.models.test_lora import ADAPTERS, write_adapter

pytestmark = [pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
              pytest.mark.filterwarnings("ignore:Setting `save_embedding_layers`:UserWarning")]

ARGS: dict[str, Any] = dict(warmup=False, log_stats_interval=0, compilation_cache_dir="", max_model_len=128,
                            kv_cache_memory_bytes=8 * 2**20, compile_in_background=False, async_scheduling=True,
                            block_size=8, max_num_seqs=4, enable_lora=True, max_loras=2, max_lora_rank=16,
                            max_cpu_loras=2)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("lora-engine")
    base = make_tiny_llama(root / "base", seed=11, num_key_value_heads=2)
    adapters = [write_adapter(base, root / f"adapter{i}", seed=40 + i, **settings)
                for i, settings in enumerate(ADAPTERS)]
    engine = Engine(str(root / "base"), **ARGS)
    requests = [LoRARequest(f"adapter{i}", i + 1, str(path)) for i, (path, _) in enumerate(adapters)]
    return dict(root=root, base=base, hf=[model for _, model in adapters], engine=engine, loras=requests)


def reference(model: Any, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


PROMPTS = [[5 + (7 * i + 3 * j) % 240 for j in range(4 + 5 * i)] for i in range(8)]


def test_a_batch_of_several_adapters_and_the_base_model_gives_each_request_its_own_tokens(setup) -> None:
    """Eight requests over three adapters and the base model with two device slots and two adapters
    in host memory: adapters are evicted from slots and re-read from disk, every request's tokens are
    PEFT's, and a second mix of the same prompts compiles no new program."""
    engine, loras, hf = setup["engine"], setup["loras"], setup["hf"]
    runner = engine.runner

    def run(mix: list[int]) -> None:
        outs = engine.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=[None if a < 0 else loras[a] for a in mix])
        differs = 0
        for prompt, a, out in zip(PROMPTS, mix, outs):
            want = reference(setup["base"] if a < 0 else hf[a], prompt, GREEDY.max_tokens)
            assert out.outputs[0].token_ids == want, (a, prompt)
            differs += a >= 0 and want != reference(setup["base"], prompt, GREEDY.max_tokens)
        assert differs >= 4  # the adapters change what is generated: a row run on the base would fail

    run([-1, 0, 1, 2, 0, -1, 2, 1])
    writes, reads, compiled = runner.num_lora_writes, engine.input_processor.lora.num_reads, runner.programs.num_compiled
    assert writes >= 3 and reads >= 3  # 3 adapters through 2 slots and 2 host places
    run([2, -1, 0, 1, 1, 2, -1, 0])
    assert runner.num_lora_writes > writes and engine.input_processor.lora.num_reads > reads
    assert runner.programs.num_compiled == compiled, "a new mix of adapters compiled a program"
    assert runner._write_lora._cache_size() == 1  # one slot-writing program for every slot
    assert engine.kv.num_free_blocks == engine.plan.num_blocks - 1
    snap = engine.snapshot()
    assert snap.max_lora == 2 and snap.lora_running == () and snap.lora_waiting == ()


def test_the_prefix_cache_keeps_each_adapters_kv_apart(setup) -> None:
    engine, loras = setup["engine"], setup["loras"]
    prompt = [9 + (5 * j) % 200 for j in range(30)]  # three full blocks of 8
    one = SamplingParams(temperature=0.0, max_tokens=1)
    first = engine.generate([prompt], one, use_tqdm=False, lora_request=loras[0])[0]
    other = engine.generate([prompt], one, use_tqdm=False, lora_request=loras[1])[0]
    base = engine.generate([prompt], one, use_tqdm=False)[0]
    again = engine.generate([prompt], one, use_tqdm=False, lora_request=loras[0])[0]
    assert (first.num_cached_tokens, other.num_cached_tokens, base.num_cached_tokens) == (0, 0, 0)
    assert again.num_cached_tokens == 24
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_adapters_that_cannot_serve_are_refused_and_the_engine_goes_on(setup) -> None:
    engine, root, base = setup["engine"], setup["root"], setup["base"]
    wide, _ = write_adapter(base, root / "rank32", seed=50, r=32, lora_alpha=32, target_modules=["q_proj"])
    engine.add_lora(setup["loras"][0])  # id 1 is adapter0's while it is held
    cases = [(LoRARequest("wide", 7, str(wide)), "rank 32"),
             (LoRARequest("gone", 8, str(root / "missing")), "adapter_config.json"),
             (LoRARequest("adapter0", 1, str(wide)), "one id per adapter")]
    for request, words in cases:
        with pytest.raises(ValueError, match=words):
            engine.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora_request=request)
    assert not engine.has_unfinished_requests()
    assert engine.add_lora(setup["loras"][2]) and 3 in engine.list_loras()
    assert engine.remove_lora(3) and 3 not in engine.list_loras() and not engine.remove_lora(3)
    out = engine.generate([PROMPTS[1]], GREEDY, use_tqdm=False, lora_request=setup["loras"][0])[0]
    assert out.outputs[0].token_ids == reference(setup["hf"][0], PROMPTS[1], GREEDY.max_tokens)


def test_adapters_with_speculation_give_the_same_tokens(setup) -> None:
    """With speculative decoding (a verifying step runs each row's proposals through its adapter:
    proposals right for 2 tokens and wrong after, each verified) and one slot for three adapters,
    rewritten while requests wait: every request's tokens are PEFT's. (Slots split and written over
    several devices: test_lora.py at TP 2 and 4, and the two-process engine of test_multihost.py.)"""
    from tests.paxserve.test_spec_decode import FlatTimes, OracleProposer

    root, loras, hf = setup["root"], setup["loras"], setup["hf"]
    engine = Engine(str(root / "base"), **{**ARGS, "max_loras": 1,
                                           "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}})
    mix = [0, 1, -1, 1, 0, 2]
    prompts = PROMPTS[:len(mix)]
    want = [reference(setup["base"] if a < 0 else hf[a], p, GREEDY.max_tokens) for p, a in zip(prompts, mix)]
    speculator = engine.parts.core._speculator
    speculator.proposer = OracleProposer([p + w for p, w in zip(prompts, want)], right=2, vocab_size=256)
    speculator.times = FlatTimes()  # every proposal is verified, whatever this machine's step times
    outs = engine.generate(prompts, GREEDY, use_tqdm=False, lora_request=[None if a < 0 else loras[a] for a in mix])
    assert [o.outputs[0].token_ids for o in outs] == want
    assert engine.runner.num_lora_writes >= 3
    snap = engine.snapshot()
    assert snap.spec_decode_num_drafts >= 6 and 0 < snap.spec_decode_num_accepted_tokens < snap.spec_decode_num_draft_tokens
    assert engine.kv.num_free_blocks == engine.plan.num_blocks - 1
