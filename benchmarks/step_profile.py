"""Where an engine step's device time goes at a batch of B requests: its programs timed by bucket, and
one traced step's XLA ops and CPU-kernel calls.

    python benchmarks/step_profile.py [--model PATH] [--batch 32] [--prompt-tokens 256] [--step decode]

B requests of random prompt ids (`ignore_eos`, 32 tokens each) run through `Engine` with synchronous
scheduling, once to compile and once measured, with fresh prompts (no prefix-cache hits): every
forward program and sampler call is blocked on and timed, by bucket. A JAX profiler trace then covers
three calls of the batch's decode bucket (`--step decode`) or the second prefill step (`--step
prefill`, one call): milliseconds per call by XLA op name, and the FFI calls (the CPU kernels) by their
place in a layer, the head's last. On SmolLM2 kept quantized a layer makes five: qkv, attention, o,
gate-up and down. The trace takes a minute or two, not the whole generation (which took >15 min).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def op_times(trace_dir: str, calls: int) -> tuple[dict[str, float], list[float]]:
    """Milliseconds per traced call by op name (numbered copies merged), and the FFI calls' durations
    in the order the first traced call made them."""
    trace = json.load(gzip.open(next(Path(trace_dir).rglob("*.trace.json.gz"))))
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    ops: dict[str, float] = defaultdict(float)
    ffi = []
    for e in trace["traceEvents"]:
        if e.get("ph") != "X" or not names.get((e.get("pid"), e.get("tid")), "").startswith("tf_XLA"):
            continue
        if e["name"].startswith(("ThunkExecutor", "Slinky", "end: ")):
            continue
        name = re.sub(r"_\d+$", "", re.sub(r"(\.\d+)+$", "", e["name"]))
        ops[name] += e["dur"] / 1e3 / calls
        if name == "ffi_call":
            ffi.append((e["ts"], e["dur"] / 1e3))
    return dict(ops), [d for _, d in sorted(ffi)][: len(ffi) // calls]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint or GGUF (default: the bundled SmolLM2)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--step", choices=("decode", "prefill"), default="decode")
    args = parser.parse_args()

    import jax

    from paxserve import Engine, SamplingParams

    engine = Engine(args.model, max_model_len=1024, max_num_seqs=max(64, args.batch), seed=0, async_scheduling=False)
    runner = engine.parts.core.runner
    times: dict[tuple, list[float]] = defaultdict(list)
    forward, run = runner._forward, runner._run
    calls = 3 if args.step == "decode" else 1
    trace = {"dir": tempfile.mkdtemp(), "key": None, "left": calls, "prefills": 0}

    def wanted(key: tuple) -> bool:
        if args.step == "decode":
            return key[1] == args.batch and key[2] == args.batch and len(times[key]) == 2
        trace["prefills"] += key[1] > args.batch
        return key[1] > args.batch and trace["prefills"] == 2

    def timed_forward(key: tuple, inputs: tuple) -> Any:
        if trace["key"] is None and wanted(key):
            trace["key"] = key
            jax.profiler.start_trace(trace["dir"])
        start = time.perf_counter()
        out = jax.block_until_ready(forward(key, inputs))
        times[key].append(time.perf_counter() - start)
        if key == trace["key"] and trace["left"] > 0:
            trace["left"] -= 1
            if trace["left"] == 0:
                jax.profiler.stop_trace()
        return out

    def timed_run(key: tuple, *inputs: Any) -> Any:
        if key[0] != "sample":
            return run(key, *inputs)
        start = time.perf_counter()
        out = jax.block_until_ready(run(key, *inputs))
        times[key].append(time.perf_counter() - start)
        return out

    rng = np.random.default_rng(1)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    engine.generate([rng.integers(100, 40000, args.prompt_tokens).tolist() for _ in range(args.batch)], params,
                    use_tqdm=False)
    runner._forward, runner._run = timed_forward, timed_run
    start = time.perf_counter()
    engine.generate([rng.integers(100, 40000, args.prompt_tokens).tolist() for _ in range(args.batch)], params,
                    use_tqdm=False)
    print(f"{args.batch} requests x {args.prompt_tokens} prompt tokens, 32 decoded: {time.perf_counter() - start:.2f} s")
    for key, spent in sorted(times.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {key}: {len(spent)} calls, median {statistics.median(spent) * 1e3:.1f} ms, {sum(spent):.2f} s in all")
    layers = runner.model.config.num_layers
    engine.close()
    if trace["key"] is None or trace["left"]:
        raise SystemExit(f"no {args.step} step of the batch's bucket was traced")
    ops, ffi = op_times(trace["dir"], calls)
    print(f"traced {trace['key']}: {sum(ops.values()):.1f} ms of ops per call")
    for name in sorted(ops, key=ops.get, reverse=True)[:12]:
        print(f"  {ops[name]:9.2f} ms  {name}")
    per_layer = (len(ffi) - 1) // layers if layers else 0
    if per_layer and per_layer * layers + 1 == len(ffi):
        medians = [statistics.median(ffi[i:-1:per_layer]) for i in range(per_layer)]
        print(f"FFI calls: {per_layer} per layer, medians " + ", ".join(f"{m:.3f}" for m in medians)
              + f" ms; the head {ffi[-1]:.2f} ms")


if __name__ == "__main__":
    main()
