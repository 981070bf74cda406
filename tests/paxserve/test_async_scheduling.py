"""Async scheduling (vLLM's --async-scheduling, on by default with an accelerator): step N+1 is scheduled and dispatched
before step N's results are back. Every token must be what synchronous scheduling gives, stops must
never let a token through, and aborts and preemption must cost nothing but their own request."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from paxserve import Engine, SamplingParams
from paxserve.structured_outputs import StructuredOutputsParams
from tests.paxserve import test_engine
from tests.paxserve.test_engine import PROMPTS, TEST_ENGINE_ARGS, assert_no_blocks_held

tiny_dir = test_engine.tiny_dir  # the module fixture: a tiny random Llama with SmolLM2's tokenizer


@pytest.fixture(scope="module")
def engines(tiny_dir: Path) -> dict[bool, Engine]:
    """The same engine twice, with async scheduling on and off."""
    return {mode: Engine(str(tiny_dir), **{**TEST_ENGINE_ARGS, "async_scheduling": mode, "max_num_seqs": 8})
            for mode in (True, False)}


def _texts(engine: Engine, prompts: list, params: list[SamplingParams]) -> list[tuple]:
    outs = engine.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
            for o in outs]


def _mixed_params(eos_like: int) -> list[SamplingParams]:
    """Greedy and seeded rows that end every way a request can end, one step apart or not."""
    return [
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=3, max_tokens=12, ignore_eos=True),
        # Ends on a stop token id the bias makes likely (so it ends early, mid-batch).
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[eos_like], logit_bias={eos_like: 6.0}),
        SamplingParams(temperature=0.8, seed=11, max_tokens=20, stop_token_ids=[eos_like], logit_bias={eos_like: 5.0},
                       min_tokens=3),
        # A stop string, found by the output processor one step after the token.
        SamplingParams(temperature=0.0, max_tokens=16, stop=["a"], ignore_eos=True),
        SamplingParams(temperature=1.0, seed=5, top_p=0.8, presence_penalty=1.0, logprobs=2, max_tokens=7),
        SamplingParams(temperature=0.0, max_tokens=1),
        SamplingParams(temperature=0.0, repetition_penalty=1.4, frequency_penalty=0.5, max_tokens=10),
    ]


def test_async_and_sync_scheduling_give_the_same_answers(engines: dict[bool, Engine]) -> None:
    prompts = PROMPTS[:8]
    params = _mixed_params(eos_like=PROMPTS[0][0])
    sync = _texts(engines[False], prompts, params)
    overlapped = _texts(engines[True], prompts, params)
    assert overlapped == sync
    finishes = {t[2] for t in sync}
    assert finishes >= {"length", "stop"}, finishes  # the workload does end both ways
    assert any(t[3] == PROMPTS[0][0] for t in sync) and any(t[3] == "a" for t in sync)
    for engine in engines.values():
        assert_no_blocks_held(engine)
        assert not engine.core.has_step_in_flight


def test_the_step_loop_really_overlaps(engines: dict[bool, Engine]) -> None:
    """With async scheduling a step returns the previous step's tokens while its own is in flight."""
    engine = engines[True]
    engine.add_request("overlap", PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    first = engine.step()  # the prefill is dispatched; nothing has come back yet
    assert first == [] and engine.core.has_step_in_flight
    seen = []
    while engine.has_unfinished_requests():
        seen += [o for o in engine.step() if o.request_id == "overlap"]
    assert len(seen[-1].outputs[0].token_ids) == 4 and seen[-1].finished
    assert not engine.core.has_step_in_flight
    assert_no_blocks_held(engine)


def test_an_abort_with_a_step_in_flight_emits_nothing_more(engines: dict[bool, Engine]) -> None:
    engine = engines[True]
    engine.add_request("gone", PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    engine.add_request("stays", PROMPTS[4], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.core.has_step_in_flight
    engine.abort("gone")
    later = []
    while engine.has_unfinished_requests():
        later += engine.step()
    assert all(o.request_id != "gone" for o in later)
    stays = [o for o in later if o.request_id == "stays"][-1]
    alone = engines[False].generate([PROMPTS[4]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                                    use_tqdm=False)[0]
    assert stays.outputs[0].token_ids == alone.outputs[0].token_ids
    assert_no_blocks_held(engine)


def test_preemption_and_structured_outputs_under_async_scheduling(tiny_dir: Path) -> None:
    """A tiny pool (requests preempted with steps in flight) and guided rows (whose bitmask needs the
    token in flight, so those steps wait for it) give the synchronous engine's answers."""
    choice = StructuredOutputsParams(choice=["red", "green", "blue"])
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True) for _ in range(6)]
    params[2] = SamplingParams(temperature=0.7, seed=2, max_tokens=24, structured_outputs=choice)
    params[4] = SamplingParams(temperature=0.0, max_tokens=24, frequency_penalty=1.5)
    prompts = PROMPTS[10:16]
    args = {**TEST_ENGINE_ARGS, "num_gpu_blocks_override": 14, "max_model_len": 128}
    answers = {}
    for mode in (False, True):
        engine = Engine(str(tiny_dir), **{**args, "async_scheduling": mode})
        answers[mode] = _texts(engine, prompts, params)
        assert engine.stats.preemptions > 0, "the pool was meant to force preemption"
        assert_no_blocks_held(engine)
    assert answers[True] == answers[False]
    assert answers[True][2][1] in ("red", "green", "blue")


def test_an_id_reused_while_the_old_request_is_in_flight_gets_only_its_own_tokens(
        engines: dict[bool, Engine]) -> None:
    """The old request's token comes back after a new request took its id (and maybe its row): it is
    dropped, not given to the newcomer."""
    engine = engines[True]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    engine.add_request("same", PROMPTS[5], params)
    engine.step()
    engine.step()
    assert engine.core.has_step_in_flight
    engine.abort("same")
    engine.add_request("same", PROMPTS[6], params)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == "same"]
    alone = engines[False].generate([PROMPTS[6]], params, use_tqdm=False)[0]
    assert outs[-1].finished and outs[-1].prompt_token_ids == PROMPTS[6]
    assert outs[-1].outputs[0].token_ids == alone.outputs[0].token_ids
    assert_no_blocks_held(engine)


def test_cpu_defaults_to_synchronous_scheduling_and_says_why(tiny_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """On CPU the "device" is the host's own cores: overlapping only makes them contend (measured
    slower), so the default there is synchronous; the log says so and why."""
    args = {k: v for k, v in TEST_ENGINE_ARGS.items() if k != "async_scheduling"}
    with caplog.at_level(logging.INFO, logger="paxserve.engine.build"):
        engine = Engine(str(tiny_dir), **args)
    assert engine.core.async_scheduling is False
    assert "synchronous scheduling" in caplog.text and "contend" in caplog.text
