"""`paxserve.worker.programs`: compiled step programs stored and loaded without tracing (and only when first
needed), damaged entries compiled again, a step's own program built ahead of the background queue,
steps served by a covering bucket while their own compiles in the background, and a steady state that
compiles nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxserve import Engine, SamplingParams
from paxserve.worker import model_runner
from paxserve.worker import programs as programs_module
from paxserve.worker.programs import Key, Programs
from tests.paxserve import test_engine
from tests.paxserve.test_engine import PROMPTS, TEST_ENGINE_ARGS

tiny_dir = test_engine.tiny_dir  # the module fixture: a tiny random Llama with SmolLM2's tokenizer

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _engine(tiny_dir: Path, **overrides: object) -> Engine:
    return Engine(str(tiny_dir), **{**TEST_ENGINE_ARGS, "max_num_seqs": 2, "warmup": True, **overrides})


def _probe(tiny_dir: Path, store: Path, max_num_seqs: int = 1) -> dict:
    """A fresh process (JAX's own persistent cache off, as in a real start) building an engine on
    `store` and generating (see programs_probe.py)."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-m", "tests.paxserve.programs_probe", str(tiny_dir), str(store),
                           str(max_num_seqs)], capture_output=True, text=True, cwd=root, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr[-3000:]
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "log": done.stderr}


def test_a_second_start_loads_each_program_when_first_needed_traces_nothing_else_and_a_damaged_one_is_compiled_again(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """Two starts on one store (each a fresh process): the first compiles and stores every program;
    before the second, the prompt's program (loaded on first use, after ready) is damaged. The
    second loads the rest without tracing them and compiles that one again, with the same tokens."""
    first = _probe(tiny_dir, tmp_path)
    assert first["loaded"] == 0 and first["compiled"] == len(first["keys"])
    # Warm-up: the decode step and sampler of the one batch size; then the prompt's prefill bucket.
    assert {"forward-1-1-1", "sample-1"} < set(first["keys"])
    assert len(list(tmp_path.rglob("*.xla"))) == len(first["keys"])
    prefills = [k for k in first["keys"] if k.startswith("forward-") and k != "forward-1-1-1"]
    assert prefills, first["keys"]
    (damaged,) = tmp_path.rglob(f"{prefills[0]}.xla")
    damaged.write_bytes(b"not an executable")
    second = _probe(tiny_dir, tmp_path)
    assert f"stored program {prefills[0]}.xla is unusable" in second["log"]
    assert second["loaded"] == len(first["keys"]) - 1 and second["compiled"] == 1
    # The damaged forward is traced again, once; nothing else is (no sampler, no other forward).
    assert [name for name in second["traces"] if name in ("logits", "sample", "_sample_and_score")] == ["logits"], \
        f"a warm start traced more than the damaged program: {second['traces']}"
    # Only warm-up's programs (the one decode step and its sampler) load before ready; the prefill's
    # loads (here: is found damaged and compiled) when the prompt first needs it.
    assert (f"2 loaded from the program store, 0 compiled now; {len(first['keys']) - 2} more stored programs "
            "found, left to load on first use") in second["log"]
    assert second["tokens"] == first["tokens"] and second["finish"] == ["length"]


def test_a_missing_bucket_runs_in_a_covering_one_while_its_own_compiles(tiny_dir: Path) -> None:
    engine = _engine(tiny_dir, warmup=False, compile_in_background=True, max_num_seqs=4)
    runner = engine.runner
    runner.programs.get(("forward", 2, 2, 2))
    runner.programs.get(("sample", 2))
    # (1, 1, 2) is not compiled: (2, 2, 2) covers it at 4x the work (tokens x sequences x width), so
    # it serves while (1, 1, 2) compiles in the background.
    assert runner.program(1, 1, 2) == ("forward", 2, 2, 2)
    runner.programs.wait()
    assert ("forward", 1, 1, 2) in runner.programs and runner.program(1, 1, 2) == ("forward", 1, 1, 2)
    # Nothing covers a step 16 tokens long within 4x: it compiles its own.
    assert runner.program(16, 1, 1) == ("forward", 16, 1, 1)
    # A decode step has the next block width and the next batch of decode steps compiled ahead.
    runner.program(1, 1, 1)
    runner.programs.wait()
    assert {("forward", 1, 1, 2), ("forward", 2, 2, 1), ("sample", 2)} <= set(runner.programs.keys())
    runner.programs.close()


def test_warm_up_readies_a_single_sequence_step_wide_enough_for_a_first_answer_s_early_widths(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chat prompt never fits one block: warm-up's decode step is built at block widths 4 and 8,
    which serve widths 1-8 at no more than 4x the work; a narrower own bucket is only a guess (the
    context grows into the wide one anyway), so it never compiles beside a request's steps."""
    monkeypatch.setattr(model_runner, "_QUIET_S", 3600.0)  # guesses wait: nothing races the asserts
    engine = _engine(tiny_dir, compile_in_background=True, max_num_seqs=1)
    programs = engine.runner.programs
    try:
        assert set(programs.keys()) == {("forward", 1, 1, 4), ("forward", 1, 1, 8), ("sample", 1)}
        assert programs.queued_guesses() == [("forward", 1, 1, 1)]
        assert engine.runner.program(1, 1, 2) == ("forward", 1, 1, 4)
        assert ("forward", 1, 1, 2) in programs.queued_guesses()
        assert engine.runner.program(1, 1, 3) == ("forward", 1, 1, 4)
        # Past width 4 the context runs in the width-8 step; nothing is queued as soon needed.
        assert engine.runner.program(1, 1, 5) == ("forward", 1, 1, 8)
        assert programs.queued_guesses()[-1] == ("forward", 1, 1, 16)
    finally:
        programs.close()


def test_background_compiles_give_the_same_tokens_and_then_a_steady_state(tiny_dir: Path) -> None:
    """Tokens do not depend on which bucket served a step, and once the workload's buckets are
    compiled a second pass compiles nothing, in the step or in the background."""
    prompts = PROMPTS[:6]
    reference = Engine(str(tiny_dir), **{**TEST_ENGINE_ARGS, "max_num_seqs": 4})
    want = [o.outputs[0].token_ids for o in reference.generate(prompts, GREEDY, use_tqdm=False)]
    engine = _engine(tiny_dir, compile_in_background=True, max_num_seqs=4)
    got = [o.outputs[0].token_ids for o in engine.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == want
    engine.runner.programs.wait()
    compiled = engine.runner.programs.num_compiled
    engine.reset_prefix_cache()
    assert [o.outputs[0].token_ids for o in engine.generate(prompts, GREEDY, use_tqdm=False)] == want
    engine.runner.programs.wait()
    assert engine.runner.programs.num_compiled == compiled
    engine.runner.programs.close()


def test_nothing_is_stored_on_cpu_while_jax_s_own_persistent_cache_is_on(tiny_dir: Path, tmp_path: Path) -> None:
    """This pytest process runs with JAX's persistent cache on (conftest), where XLA:CPU has stored
    programs that fail when run: the store is left alone, and the programs still compile and serve."""
    import jax

    assert jax.config.jax_compilation_cache_dir
    store = tmp_path / "store"
    engine = _engine(tiny_dir, compilation_cache_dir=str(store), warmup=False)
    out = engine.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 6 and engine.runner.programs.num_compiled > 0
    assert not list(store.rglob("*.xla"))


# ---- Programs alone: a fake spec whose compiles block until the test lets them finish ----------------


class _FakeCompiles:
    """A `Spec` whose programs are strings; compiling one records which thread did it and, for the
    keys in `gates`, waits for that key's event (set by the test), so orders are certain, not timed."""

    def __init__(self, gated: list[Key]) -> None:
        self.gates = {key: threading.Event() for key in gated}
        self.started = {key: threading.Event() for key in gated}
        self.compiled_by: list[tuple[Key, str]] = []
        self._lock = threading.Lock()

    def spec(self, key: Key) -> tuple[Any, tuple[Any, ...], Any]:
        return (lambda: _FakeLowered(self, key)), (), None

    def count(self, key: Key) -> int:
        return sum(1 for k, _ in self.compiled_by if k == key)


class _FakeLowered:
    def __init__(self, owner: _FakeCompiles, key: Key) -> None:
        self.owner, self.key = owner, key

    def compile(self) -> str:
        if self.key in self.owner.gates:
            self.owner.started[self.key].set()
            assert self.owner.gates[self.key].wait(30), f"the test never released {self.key}"
        with self.owner._lock:
            self.owner.compiled_by.append((self.key, threading.current_thread().name))
        return f"program {self.key}"


def _in_thread(call: Any) -> tuple[threading.Thread, list[Any]]:
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    return thread, result


def test_a_step_builds_a_queued_program_at_once_instead_of_waiting_for_the_queue_ahead_of_it() -> None:
    slow, ahead, needed, behind = ("slow",), ("ahead",), ("needed",), ("behind",)
    fake = _FakeCompiles(gated=[slow])
    programs = Programs(fake.spec, lambda kind: kind, None, background=True)
    try:
        for key in (slow, ahead, needed, behind):
            programs.compile_later(key)
        assert fake.started[slow].wait(30), "the worker never started the first queued compile"
        # The worker is inside `slow` (it cannot finish until released): `needed`, queued behind it and
        # `ahead`, is built on the asking thread now.
        thread, got = _in_thread(lambda: programs.get(needed))
        thread.join(30)
        assert not thread.is_alive(), "get() of a queued key waited for the background queue"
        assert got == ["program ('needed',)"] and fake.compiled_by == [(needed, thread.name)]
        assert needed in programs and programs.is_loaded(needed)
        # The key the worker is compiling at this moment is waited for, not compiled a second time.
        waiter, got_slow = _in_thread(lambda: programs.get(slow))
        waiter.join(0.2)
        assert waiter.is_alive() and not got_slow
        fake.gates[slow].set()
        waiter.join(30)
        assert got_slow == ["program ('slow',)"]
        programs.wait()
    finally:
        for gate in fake.gates.values():
            gate.set()
        programs.close()
    # Every key compiled exactly once; the one the step claimed was skipped by the worker.
    assert sorted(fake.compiled_by, key=str) == sorted(
        [(slow, "paxserve-compile"), (ahead, "paxserve-compile"), (needed, thread.name),
         (behind, "paxserve-compile")], key=str)


def test_the_worker_skips_claimed_keys_and_a_failed_background_compile_is_retried_by_the_step() -> None:
    slow, claimed, failing = ("slow",), ("claimed",), ("failing",)
    fake = _FakeCompiles(gated=[slow])
    failures = [RuntimeError("XLA ran out of something")]

    def spec(key: Key) -> tuple[Any, tuple[Any, ...], Any]:
        if key == failing and failures:
            raise failures.pop()
        return fake.spec(key)

    programs = Programs(spec, lambda kind: kind, None, background=True)
    try:
        programs.compile_later(slow)
        assert fake.started[slow].wait(30)
        programs.compile_later(slow)  # asked for again while it compiles: nothing more to do
        programs.compile_later(claimed)
        programs.compile_later(failing)
        programs.compile_later(claimed)  # queued twice: still one compile
        assert programs.get(claimed) == "program ('claimed',)"
        fake.gates[slow].set()
        programs.wait()
        assert failing not in programs and not failures  # the background attempt failed
        assert programs.get(failing) == "program ('failing',)"  # built again by the step
    finally:
        for gate in fake.gates.values():
            gate.set()
        programs.close()
    assert [fake.count(key) for key in (slow, claimed, failing)] == [1, 1, 1]
    assert programs.num_compiled == 3


def test_a_dropped_queue_is_not_compiled_and_the_program_in_progress_still_finishes() -> None:
    slow, queued = ("slow",), ("queued",)
    fake = _FakeCompiles(gated=[slow])
    programs = Programs(fake.spec, lambda kind: kind, None, background=True)
    programs.compile_later(slow)
    programs.compile_later(queued)
    assert fake.started[slow].wait(30)
    programs.close()
    fake.gates[slow].set()
    programs.wait()
    assert slow in programs and queued not in programs and fake.count(queued) == 0
    assert programs.get(queued) == "program ('queued',)"  # after close: built on the caller's thread


def test_keys_a_step_will_need_go_before_guesses_and_guesses_wait_for_quiet_steps_unless_promoted() -> None:
    slow, guess, soon = ("slow",), ("guess",), ("soon",)
    fake = _FakeCompiles(gated=[slow])
    programs = Programs(fake.spec, lambda kind: kind, None, background=True)  # quiet_s=0: guesses when due
    try:
        programs.compile_later(slow)
        assert fake.started[slow].wait(30)
        programs.compile_later(guess, guess=True)
        programs.compile_later(soon)  # asked for later, but needed: it goes first
        fake.gates[slow].set()
        programs.wait()
    finally:
        programs.close()
    assert [key for key, _ in fake.compiled_by] == [slow, soon, guess]

    fake = _FakeCompiles(gated=[soon])
    # Steps "ran" a moment ago and the steps must be quiet for an hour: a guess never starts, a key a
    # step will need does.
    programs = Programs(fake.spec, lambda kind: kind, None, background=True, quiet_s=3600.0)
    try:
        programs.get(("step",))
        programs.compile_later(guess, guess=True)
        programs.compile_later(soon)
        assert fake.started[soon].wait(30), "the worker did not take the key a step will need"
        fake.gates[soon].set()
        assert programs.get(soon) == "program ('soon',)"  # the worker's build, waited for
        assert fake.compiled_by == [(("step",), "MainThread"), (soon, "paxserve-compile")]
        assert guess not in programs
        programs.compile_later(guess)  # a step now says it will need the guess: it is due at once
        programs.wait()
        assert fake.compiled_by[-1] == (guess, "paxserve-compile")
    finally:
        programs.close()


# ---- Programs alone: the store, with real (tiny) programs ------------------------------------------


def _tiny_spec(loads: list[Key]) -> Any:
    """`forward`-kind keys whose program adds the key's size to a vector of that size."""

    def spec(key: Key) -> tuple[Any, tuple[Any, ...], Any]:
        loads.append(key)
        arg = jax.ShapeDtypeStruct((key[1],), jnp.float32)
        return (lambda: jax.jit(lambda x: x * 2 + key[1]).lower(arg)), (arg,), arg

    return spec


def test_a_warm_start_lists_the_store_and_loads_a_program_only_when_it_is_first_needed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # This pytest process runs with JAX's persistent cache on, where nothing would be stored (see the
    # test below); these tiny programs compile far below its threshold, so they are safe to store.
    monkeypatch.setattr(programs_module, "_compile_for_storing", lambda lowered, platform: (lowered.compile(), True))
    keys = [("forward", n, 1, 1) for n in range(1, 13)]
    first = Programs(_tiny_spec([]), lambda kind: "tiny " + kind, tmp_path, background=False)
    for key in keys:
        first.get(key)
    assert first.num_compiled == len(keys) and len(list(tmp_path.rglob("*.xla"))) == len(keys)

    specs: list[Key] = []  # a load builds the key's spec (its argument structure): none before use
    second = Programs(_tiny_spec(specs), lambda kind: "tiny " + kind, tmp_path, background=False)
    assert second.scan_store() == len(keys)
    assert second.num_loaded == 0 and second.num_unloaded == len(keys) and not specs
    assert all(key in second for key in keys) and not any(second.is_loaded(key) for key in keys)
    assert ("forward", 99, 1, 1) not in second and set(second.keys()) == set(keys)
    program = second.get(keys[2])
    assert specs == [keys[2]] and second.num_loaded == 1 and second.num_compiled == 0
    assert second.num_unloaded == len(keys) - 1 and second.is_loaded(keys[2])
    np.testing.assert_allclose(np.asarray(program(jnp.ones(3, jnp.float32))), [5.0, 5.0, 5.0])
    # Another fingerprint (another model, another source) sees none of them.
    other = Programs(_tiny_spec([]), lambda kind: "other " + kind, tmp_path, background=False)
    assert other.scan_store() == 0 and keys[0] not in other
