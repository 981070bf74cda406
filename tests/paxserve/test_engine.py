"""Engine behaviour a user notices, on a tiny random Llama that carries the real SmolLM2 tokenizer."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from paxserve import AsyncEngine, Engine, SamplingParams
from paxserve.models.bundled import default_model_path
from paxserve.models.gguf_io import GGUFCheckpoint
from paxserve.models.tokenizer import tokenizer_from_gguf
from paxserve.sampling_params import MAX_LOGPROBS, RequestOutputKind
from tests.helpers import make_tiny_llama

VOCAB = 49152
# Buckets compile in the step that needs them (no background compiles: the tests count programs).
# Async scheduling as on an accelerator (CPU's default is synchronous), so the engine, async-engine
# and fault tests run the pipeline GPUs use; the servers the server tests start run CPU's default.
TEST_ENGINE_ARGS: dict[str, Any] = dict(warmup=False, log_stats_interval=0, compilation_cache_dir="",
                                        max_model_len=256, kv_cache_memory_bytes=64 * 2**20,
                                        compile_in_background=False, async_scheduling=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama with SmolLM2's vocabulary, tokenizer and chat template."""
    directory = tmp_path_factory.mktemp("tiny-engine")
    make_tiny_llama(directory, seed=3, vocab_size=VOCAB, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=512, eos_token_id=2, bos_token_id=1)
    tokenizer_from_gguf(GGUFCheckpoint(default_model_path())).save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> Engine:
    return Engine(str(tiny_dir), **TEST_ENGINE_ARGS)


def make_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Mixed lengths (1 to 70 tokens); half share a 40-token prefix so prefix caching has work."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, VOCAB, 40).tolist()
    prompts = []
    for i in range(n):
        tail = rng.integers(3, VOCAB, int(rng.integers(1, 31))).tolist()
        prompts.append(shared + tail if i % 2 else tail + rng.integers(3, VOCAB, int(rng.integers(0, 40))).tolist())
    return prompts


GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = make_prompts(32)


@pytest.fixture(scope="module")
def alone(engine: Engine) -> list[list[int]]:
    """Each prompt's greedy tokens when it runs by itself."""
    return [engine.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]


def assert_no_blocks_held(engine: Engine) -> None:
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.plan.num_blocks - 1
    assert all(b.ref_cnt == 0 for b in engine.kv.pool.blocks)


@pytest.mark.parametrize("block_size,prefix_caching", [(16, True), (8, True), (32, False)])
def test_greedy_output_is_the_same_alone_and_in_a_batch_of_32(
    tiny_dir: Path, alone: list[list[int]], block_size: int, prefix_caching: bool
) -> None:
    eng = Engine(str(tiny_dir), **{**TEST_ENGINE_ARGS, "block_size": block_size,
                                   "enable_prefix_caching": prefix_caching})
    outs = eng.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert [o.prompt_token_ids for o in outs] == PROMPTS  # input order kept
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    if prefix_caching:
        assert eng.kv.prefix_stats.hits > 0
    else:
        assert eng.kv.prefix_stats.hits == 0
    assert_no_blocks_held(eng)


def test_preemption_under_a_tiny_kv_pool_still_gives_the_same_output(tiny_dir: Path, alone: list[list[int]]) -> None:
    # 24 blocks of 16 tokens cannot hold 32 prompts of up to 78 tokens at once.
    eng = Engine(str(tiny_dir), **{**TEST_ENGINE_ARGS, "num_gpu_blocks_override": 24, "max_model_len": 128})
    outs = eng.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert eng.stats.preemptions > 0, "the pool was meant to force preemption"
    assert [o.outputs[0].token_ids for o in outs] == alone
    # Each finished output says how often it was preempted (vLLM's per-request histogram reads it)
    # and when it first got a batch place; they add up to the engine's count.
    assert sum(o.num_preemptions for o in outs) == eng.stats.preemptions
    assert all(o.first_scheduled_time is not None for o in outs)
    assert_no_blocks_held(eng)


def test_penalties_bias_and_min_tokens_survive_preemption_mid_output(tiny_dir: Path, engine: Engine) -> None:
    """A request whose tokens depend on its own output so far (penalties), a bias and min_tokens is
    preempted after 8 tokens and recomputed: its sampler state is rebuilt from those tokens and it
    ends exactly as it does alone."""
    first = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    # The bias makes five tokens the only candidates, and the frequency penalty then picks among
    # them by how often each was used: a count off by one shows in the next token.
    penalised = SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.2, frequency_penalty=1.0,
                               presence_penalty=0.3, logit_bias={t: 30.0 for t in (5, 9, 13, 17, 21)},
                               min_tokens=20, stop_token_ids=[11])
    prompts = [PROMPTS[0][:40] + [3] * (40 - len(PROMPTS[0][:40])), PROMPTS[1][:40]]
    want = [engine.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, (first,
                                                                                                      penalised))]
    assert want[1] != engine.generate([prompts[1]], first, use_tqdm=False)[0].outputs[0].token_ids
    # 7 usable blocks of 16: both 40-token prompts fit (3 blocks each), both 64-token answers do not,
    # so the newer (the penalised one) is preempted when both reach 48 tokens.
    eng = Engine(str(tiny_dir), **{**TEST_ENGINE_ARGS, "num_gpu_blocks_override": 8, "max_model_len": 64})
    rebuilt = []
    write = eng.runner.write_sampler_state
    eng.runner.write_sampler_state = lambda w: (rebuilt.append(int(w.counts.sum())), write(w))[1]
    outs = eng.generate(prompts, [first, penalised], use_tqdm=False)
    assert eng.stats.preemptions > 0 and rebuilt[0] == 0 and max(rebuilt) >= 8
    assert [o.outputs[0].token_ids for o in outs] == want
    assert_no_blocks_held(eng)


def test_chunked_prefill_with_a_small_token_budget_gives_the_same_output(
    tiny_dir: Path, alone: list[list[int]]
) -> None:
    eng = Engine(str(tiny_dir), **{**TEST_ENGINE_ARGS, "max_num_batched_tokens": 24, "max_num_seqs": 4})
    outs = eng.generate(PROMPTS[:8], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == alone[:8]


def test_seeded_sampling_is_reproducible_and_independent_of_batch_mates(engine: Engine) -> None:
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True)
    prompt = PROMPTS[3]
    first = engine.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    mates = [SamplingParams(temperature=0.7, top_k=5, max_tokens=6), SamplingParams(temperature=0.0, max_tokens=12),
             SamplingParams(temperature=1.3, top_p=0.8, presence_penalty=1.0, max_tokens=9, logprobs=3)]
    outs = engine.generate([PROMPTS[0], prompt, PROMPTS[5], PROMPTS[9]], [mates[0], seeded, mates[1], mates[2]],
                           use_tqdm=False)
    assert outs[1].outputs[0].token_ids == first
    other_seed = SamplingParams(temperature=1.0, seed=99, max_tokens=10, ignore_eos=True)
    assert engine.generate([prompt], other_seed, use_tqdm=False)[0].outputs[0].token_ids != first


def test_top_k_1_and_tiny_top_p_equal_greedy(engine: Engine, alone: list[list[int]]) -> None:
    for params in (SamplingParams(temperature=1.0, top_k=1, max_tokens=8, ignore_eos=True),
                   SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=8, ignore_eos=True)):
        outs = engine.generate(PROMPTS[:4], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == alone[:4]


def test_stop_strings_split_across_tokens(engine: Engine) -> None:
    tok = engine.tokenizer
    prompt = PROMPTS[7]
    full = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
    # A stop string made of the end of token 3 and the start of token 4 spans a token boundary.
    before = tok.decode(full.token_ids[:3])
    assert len(before) >= 1 and len(tok.decode(full.token_ids[:4])) > len(before) + 1
    stop = full.text[len(before) - 1 : len(before) + 1]
    start = full.text.index(stop)
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop]),
                          use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (full.text[:start], "stop", stop)
    kept = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=stop,
                                                    include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == full.text[: start + len(stop)]
    assert_no_blocks_held(engine)


def test_min_tokens_holds_back_eos(engine: Engine) -> None:
    eos = 2
    forced = dict(temperature=0.0, max_tokens=12, logit_bias={eos: 100.0})
    quick = engine.generate([PROMPTS[1]], SamplingParams(**forced), use_tqdm=False)[0].outputs[0]
    assert quick.token_ids == [eos] and quick.finish_reason == "stop" and quick.text == ""
    held = engine.generate([PROMPTS[1]], SamplingParams(**forced, min_tokens=5), use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) == 6 and eos not in held.token_ids[:5] and held.token_ids[5] == eos
    assert held.finish_reason == "stop"


def test_n_samples_share_the_prompt_and_differ(engine: Engine) -> None:
    hits_before = engine.kv.prefix_stats.hits
    out = engine.generate([PROMPTS[11]], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True),
                          use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 8 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) == 3
    assert engine.kv.prefix_stats.hits > hits_before  # samples 2 and 3 reuse the prompt's full blocks
    assert_no_blocks_held(engine)


def test_logprobs_are_returned_for_each_token(engine: Engine) -> None:
    out = engine.generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 4
    for token, entry in zip(out.token_ids, out.logprobs):
        assert entry[token].rank == 1  # greedy picks the most likely token
        assert len(entry) == 3 and all(lp.logprob <= 0 for lp in entry.values())
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


def test_logprob_token_ids_give_those_tokens_logprobs_as_the_top_list_scores_them(engine: Engine) -> None:
    top = engine.generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=3, logprobs=MAX_LOGPROBS,
                                                       ignore_eos=True), use_tqdm=False)[0].outputs[0]
    first = sorted(top.logprobs[0].items(), key=lambda kv: kv[1].rank)
    chosen = [first[6][0], first[0][0], first[12][0]]  # ranks 7, 1 and 13 at the first position, out of order
    out = engine.generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=3, logprob_token_ids=chosen,
                                                       ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == top.token_ids  # asking for logprobs changes nothing sampled
    for position, entry in enumerate(out.logprobs):
        assert set(entry) == set(chosen) | {out.token_ids[position]}
    for t in chosen:
        assert out.logprobs[0][t].logprob == pytest.approx(top.logprobs[0][t].logprob, abs=1e-5)
        assert out.logprobs[0][t].rank is None  # chosen, not ranked: their ranks are not computed


def test_more_top_logprobs_than_the_device_columns_and_the_whole_vocabulary(engine: Engine) -> None:
    def run(**kw: Any) -> Any:
        return engine.generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, **kw),
                               use_tqdm=False)[0].outputs[0]

    top, wide, every = run(logprobs=MAX_LOGPROBS), run(logprobs=3 * MAX_LOGPROBS), run(logprobs=-1)
    assert wide.token_ids == top.token_ids == every.token_ids
    for position in range(2):
        ranked = sorted(wide.logprobs[position].items(), key=lambda kv: kv[1].rank)
        assert len(ranked) == 3 * MAX_LOGPROBS and [kv[1].rank for kv in ranked] == list(range(1, 3 * MAX_LOGPROBS + 1))
        for t, lp in top.logprobs[position].items():  # the first 20 as the device's top-k has them
            assert wide.logprobs[position][t].rank == lp.rank
            assert wide.logprobs[position][t].logprob == pytest.approx(lp.logprob, abs=1e-5)
        whole = every.logprobs[position]
        assert len(whole) == VOCAB  # every token, a distribution
        assert np.exp(np.array([lp.logprob for lp in whole.values()], np.float64)).sum() == pytest.approx(1, abs=1e-3)
    with pytest.raises(ValueError, match="vocabulary size"):
        run(logprobs=VOCAB + 1)


def test_chat_uses_the_template(engine: Engine) -> None:
    out = engine.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0.0, max_tokens=3),
                      use_tqdm=False)[0]
    assert out.prompt.startswith("<|im_start|>system") and out.prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("kwargs,field", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_k=-5), "top_k"),
    (dict(max_tokens=0), "max_tokens"), (dict(n=0), "n"),
    (dict(min_p=1.5), "min_p"), (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logprobs=-2), "logprobs"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(stop=[""]), "stop"), (dict(logit_bias={5: 101.0}), "logit_bias"), (dict(seed=2**63), "seed"),
])
def test_invalid_sampling_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}="):
        SamplingParams(**kwargs)


def test_bad_requests_fail_cleanly_and_leave_the_engine_serving(engine: Engine) -> None:
    with pytest.raises(ValueError, match="maximum context length is 256 tokens"):
        engine.generate([[5] * 256], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[5, VOCAB]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([[]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias"):
        engine.generate([[5]], SamplingParams(logit_bias={VOCAB + 1: 1.0}), use_tqdm=False)
    assert_no_blocks_held(engine)
    # max_tokens beyond the room left is an error naming both numbers, as in vLLM and OpenAI.
    with pytest.raises(ValueError, match=r"'max_tokens' or 'max_completion_tokens' is too large: 100\. .* "
                                         r"your request has 250 input tokens \(100 > 256 - 250\)"):
        engine.generate([[5] * 250], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True),
                        use_tqdm=False)
    # max_tokens=None takes the room left.
    out = engine.generate([[5] * 250], SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"
    assert_no_blocks_held(engine)


def test_abort_frees_blocks_at_once(engine: Engine) -> None:
    engine.add_request("to-abort", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.kv.num_free_blocks < engine.plan.num_blocks - 1
    engine.abort("to-abort")
    assert_no_blocks_held(engine)
    assert engine.step() == []


# Every sampler feature a request can ask for, one mix per request: none of them is a compile key.
MIXED = [SamplingParams(temperature=0.8, top_k=20, seed=3),
         SamplingParams(temperature=0.0, logprobs=5, repetition_penalty=1.3),
         SamplingParams(temperature=1.1, top_p=0.7, min_p=0.05, frequency_penalty=1.2, seed=8, logprobs=20),
         SamplingParams(temperature=0.0, logit_bias={7: 4.0, 8: -4.0}, min_tokens=6, stop_token_ids=[3]),
         SamplingParams(temperature=0.5, presence_penalty=-1.0, logprobs=0, seed=1),
         SamplingParams(temperature=0.0)]


def test_no_recompilation_in_steady_state(engine: Engine) -> None:
    """A mixed steady state (penalties, logprobs, bias, min_tokens, filters, greedy; long and short
    prompts) runs the programs plain greedy requests of the same shapes compiled: nothing more."""
    prompts = PROMPTS[:12]
    # Prefix hits (from earlier tests or the first run) would change the batch shapes: both runs
    # start from an empty prefix cache so the second has the shapes of the first.
    engine.reset_prefix_cache()
    engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    buckets = set(engine.runner.compiled)
    programs = set(engine.runner.programs.keys())
    engine.reset_prefix_cache()
    mixed = [SamplingParams(**{**{f: getattr(MIXED[i % len(MIXED)], f) for f in MIXED_FIELDS},
                               "max_tokens": 6, "ignore_eos": True}) for i in range(len(prompts))]
    outs = engine.generate(prompts, mixed, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    assert outs[1].outputs[0].logprobs is not None and len(outs[1].outputs[0].logprobs[0]) >= 5
    assert engine.runner.compiled == buckets
    assert set(engine.runner.programs.keys()) == programs


MIXED_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seed", "logprobs", "presence_penalty", "frequency_penalty",
                "repetition_penalty", "logit_bias", "min_tokens", "stop_token_ids")


def test_async_engine_streams_and_aborts_on_disconnect(engine: Engine) -> None:
    async def run() -> tuple[str, str]:
        aeng = AsyncEngine(engine.parts)
        try:
            deltas, final = [], None
            delta = SamplingParams(temperature=0.0, max_tokens=8, output_kind=RequestOutputKind.DELTA)
            async for out in aeng.generate("s1", PROMPTS[4], delta):
                deltas.append(out.outputs[0].text)
            async for out in aeng.generate("s1-again", PROMPTS[4], SamplingParams(temperature=0.0, max_tokens=8)):
                final = out  # cumulative: the last output holds everything
            async for _ in aeng.generate("s2", PROMPTS[5], SamplingParams(temperature=0.0, max_tokens=50,
                                                                        ignore_eos=True)):
                break  # the client goes away after the first chunk
            with pytest.raises(ValueError, match="outside the vocabulary"):
                async for _ in aeng.generate("s3", [VOCAB + 5], None):
                    pass
            for _ in range(200):  # the abort is a command: it lands before the loop's next step
                if aeng.snapshot.num_requests_running == 0 and aeng.snapshot.kv_cache_usage == 0:
                    break
                await asyncio.sleep(0.01)
            return "".join(deltas), final.outputs[0].text
        finally:
            aeng.shutdown()

    joined, text = asyncio.run(run())
    assert joined == text
    assert_no_blocks_held(engine)
