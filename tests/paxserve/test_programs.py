"""`paxserve.programs` through the engine: compiled step programs stored and loaded without tracing,
damaged entries compiled again, steps served by a covering bucket while their own compiles in the
background, and a steady state that compiles nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from paxserve import Engine, SamplingParams
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


def test_a_second_start_loads_every_program_traces_nothing_and_a_damaged_one_is_compiled_again(
    tiny_dir: Path, tmp_path: Path
) -> None:
    first = _probe(tiny_dir, tmp_path)
    assert first["loaded"] == 0 and first["compiled"] == len(first["keys"])
    # Warm-up: the decode step and sampler of the one batch size; then the prompt's prefill bucket.
    assert {"forward-1-1-1", "sample-1"} < set(first["keys"])
    assert len(list(tmp_path.rglob("*.xla"))) == len(first["keys"])
    second = _probe(tiny_dir, tmp_path)
    assert second["loaded"] == len(first["keys"]) and second["compiled"] == 0
    assert not [name for name in second["traces"] if name in ("logits", "sample", "_sample_and_score")], \
        f"a warm start traced the step again: {second['traces']}"
    assert "step programs ready" in second["log"] and f"{len(first['keys'])} loaded" in second["log"]
    assert second["tokens"] == first["tokens"] and second["finish"] == ["length"]
    (damaged,) = tmp_path.rglob("forward-1-1-1.xla")
    damaged.write_bytes(b"not an executable")
    third = _probe(tiny_dir, tmp_path)
    assert "stored program forward-1-1-1.xla is unusable" in third["log"]
    assert third["compiled"] == 1 and third["loaded"] == len(first["keys"]) - 1
    assert third["tokens"] == first["tokens"]


def test_a_missing_bucket_runs_in_a_covering_one_while_its_own_compiles(tiny_dir: Path) -> None:
    engine = _engine(tiny_dir, warmup=False, compile_in_background=True, max_num_seqs=4)
    runner = engine.runner
    runner.programs.get(("forward", 2, 2, 2))
    runner.programs.get(("sample", 2))
    # (1, 1, 2) is not compiled: (2, 2, 2) covers it at 4x the work (tokens x sequences x width), so
    # it serves while (1, 1, 2) compiles in the background.
    assert runner.buckets(1, 1, 2) == (2, 2, 2)
    runner.programs.wait()
    assert ("forward", 1, 1, 2) in runner.programs and runner.buckets(1, 1, 2) == (1, 1, 2)
    # Nothing covers a step 16 tokens long within 4x: it compiles its own.
    assert runner.buckets(16, 1, 1) == (16, 1, 1)
    # A decode step has the next block width and the next batch of decode steps compiled ahead.
    runner.buckets(1, 1, 1)
    runner.programs.wait()
    assert {("forward", 1, 1, 2), ("forward", 2, 2, 1), ("sample", 2)} <= set(runner.programs.keys())
    runner.programs.close()


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
