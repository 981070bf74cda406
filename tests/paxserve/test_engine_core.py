"""Failure isolation of the engine core under fault injection, and prefix-cache trust (salts,
rolled-back registrations), on the tiny random Llama with SmolLM2's tokenizer."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pytest

from paxserve import Engine, SamplingParams
from tests.paxserve.test_engine import TEST_ENGINE_ARGS, assert_no_blocks_held, make_prompts, tiny_dir  # noqa: F401

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = make_prompts(12, seed=7)


class StepFault(RuntimeError):
    """The injected failure."""


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> Engine:  # noqa: F811
    return Engine(str(tiny_dir), **TEST_ENGINE_ARGS)


@pytest.fixture(scope="module")
def alone(engine: Engine) -> list[list[int]]:
    return [engine.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]


def inject(engine: Engine, monkeypatch: pytest.MonkeyPatch, should_fail: Callable[[int], bool],
           lose_kv: Callable[[int], bool] = lambda _: False, at: str = "dispatch") -> list[int]:
    """Make the runner's `dispatch` (starting a step) or `collect` (taking its results in: where a
    device error shows) raise on the calls `should_fail` picks (counting from 0); where `lose_kv`
    also picks them, delete the cache first, as a step that took the donated cache down would."""
    real = getattr(engine.runner, at)
    failed: list[int] = []
    calls = iter(range(10**9))

    def fail_or_run(*args):  # noqa: ANN002, ANN202
        call = next(calls)
        if should_fail(call):
            failed.append(call)
            if lose_kv(call):
                for leaf in (engine.runner.kv_cache.k, engine.runner.kv_cache.v):
                    leaf.delete()
            raise StepFault(f"injected failure at step {call} (buffer <object at 0xdeadbeef>)")
        return real(*args)

    monkeypatch.setattr(engine.runner, at, fail_or_run)
    return failed


@contextlib.contextmanager
def limits(engine: Engine, **changes: int) -> Iterator[None]:
    """Run with other scheduler limits (max_num_seqs, max_num_batched_tokens), then restore them."""
    saved = engine.scheduler.config
    engine.scheduler.config = replace(saved, **changes)
    try:
        yield
    finally:
        engine.scheduler.config = saved


def run_all(engine: Engine, prompts: list, params: SamplingParams) -> dict[str, object]:
    """Step until these prompts' requests (others may be in the engine) have all finished."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    finals = {}
    while len(finals) < len(prompts):
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def test_a_step_that_raises_fails_only_its_requests(engine: Engine, alone, monkeypatch) -> None:
    failed = inject(engine, monkeypatch, lambda call: call == 3)
    # Two at a time: the failing step carries two requests; the others come before and after it.
    with limits(engine, max_num_seqs=2):
        finals = run_all(engine, PROMPTS[:6], GREEDY)
    monkeypatch.undo()
    assert failed == [3]
    errored = [rid for rid, out in finals.items() if out.outputs[0].finish_reason == "error"]
    assert len(errored) == 2, {rid: out.outputs[0].finish_reason for rid, out in finals.items()}
    for rid, out in finals.items():
        if rid in errored:
            assert out.error and "0x" not in out.error and "injected" not in out.error  # nothing internal leaks
        else:
            assert out.outputs[0].token_ids == alone[int(rid[1:])], rid
    assert engine.core.num_failed_steps >= 1 and engine.core.num_kv_cache_resets == 0
    assert_no_blocks_held(engine)
    # And the engine goes on serving.
    assert engine.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == alone[0]


def test_a_step_that_loses_the_kv_cache_recomputes_the_survivors(engine: Engine, alone, monkeypatch) -> None:
    resets = engine.core.num_kv_cache_resets
    engine.reset_prefix_cache()
    # Step 0 prefills everything; step 2 fails mid-decode with all twelve in it: all of them fail.
    inject(engine, monkeypatch, lambda call: call == 2, lose_kv=lambda call: True)
    finals = run_all(engine, PROMPTS, GREEDY)
    monkeypatch.undo()
    assert all(out.outputs[0].finish_reason == "error" for out in finals.values())
    assert engine.core.num_kv_cache_resets == resets + 1
    assert engine.runner.kv_cache_intact()

    # A request that is running but not in the failing step (here: paused, so skipped) had its KV
    # in the lost cache: it must be recomputed from its tokens, not go on from zeros.
    engine.add_request("survivor", PROMPTS[5], GREEDY)
    for _ in range(3):
        engine.step()  # prefilled and decoding: its KV lives in the cache
    assert engine.scheduler.requests["survivor"].num_computed_tokens > len(PROMPTS[5])
    engine.core.set_paused("survivor", True)
    inject(engine, monkeypatch, lambda call: call == 0, lose_kv=lambda call: True)
    finals = run_all(engine, PROMPTS[:2], GREEDY)
    monkeypatch.undo()
    assert all(out.outputs[0].finish_reason == "error" for out in finals.values())
    assert engine.scheduler.requests["survivor"].num_computed_tokens == 0, "not sent back to be recomputed"
    engine.core.set_paused("survivor", False)
    survivor = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            survivor = out
    assert survivor.outputs[0].finish_reason == "length"
    assert survivor.outputs[0].token_ids == alone[5]
    assert engine.core.num_kv_cache_resets == resets + 2
    assert_no_blocks_held(engine)


@pytest.mark.parametrize("at", ["dispatch", "collect"])
def test_faults_at_random_steps_under_load(engine: Engine, alone, monkeypatch, at: str) -> None:
    """Faults as a step starts, and as its results are taken in: with async scheduling the next
    step is then already on the device on top of the failed one, and is undone and scheduled again."""
    rng = np.random.default_rng(11)
    fail_at = set(int(x) for x in rng.choice(40, size=6, replace=False))
    lose_at = set(list(fail_at)[:2])
    failed = inject(engine, monkeypatch, lambda call: call in fail_at, lose_kv=lambda call: call in lose_at, at=at)
    engine.reset_prefix_cache()
    with limits(engine, max_num_seqs=4):
        finals = run_all(engine, PROMPTS * 2, GREEDY)
    monkeypatch.undo()
    assert failed, "no fault was injected: the test proves nothing"
    assert len(finals) == 2 * len(PROMPTS)
    num_errors = 0
    for rid, out in finals.items():
        o = out.outputs[0]
        if o.finish_reason == "error":
            num_errors += 1
        else:
            assert o.finish_reason == "length" and o.token_ids == alone[int(rid[1:]) % len(PROMPTS)], rid
    assert 0 < num_errors < len(finals)
    assert_no_blocks_held(engine)


def test_a_failed_prefill_leaves_no_unwritten_block_in_the_prefix_cache(engine: Engine, alone, monkeypatch) -> None:
    engine.reset_prefix_cache()
    prompt = PROMPTS[1]  # 40+ tokens: two full blocks would be registered while scheduling
    assert len(prompt) > 2 * engine.plan.block_size
    inject(engine, monkeypatch, lambda call: call == 0)
    out = engine.generate([prompt], GREEDY, use_tqdm=False)[0]
    monkeypatch.undo()
    assert out.outputs[0].finish_reason == "error"
    assert not engine.kv.pool.cached, "the failed step's blocks must not stay in the prefix cache"
    hits = engine.kv.prefix_stats.hits
    again = engine.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert engine.kv.prefix_stats.hits == hits and again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == alone[1]
    third = engine.generate([prompt], GREEDY, use_tqdm=False)[0]  # now written by a step that ran
    assert third.num_cached_tokens >= 2 * engine.plan.block_size and third.outputs[0].token_ids == alone[1]


def test_cache_salt_keeps_tenants_apart(engine: Engine, alone) -> None:
    engine.reset_prefix_cache()
    prompt = PROMPTS[3]

    def cached(salt: str | None) -> int:
        out = engine.generate([{"prompt_token_ids": prompt, **({"cache_salt": salt} if salt else {})}], GREEDY,
                              use_tqdm=False)[0]
        assert out.outputs[0].token_ids == alone[3]
        return out.num_cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 0  # same tenant: its own prefix is reused
    assert cached("tenant-b") == 0  # another tenant never sees it
    assert cached(None) == 0  # nor does an unsalted request
    assert cached(None) > 0
    with pytest.raises(ValueError, match="cache_salt"):
        engine.add_request("bad-salt", {"prompt_token_ids": prompt, "cache_salt": ""}, GREEDY)
    assert_no_blocks_held(engine)
