"""What rendering chat templates in killable worker processes costs per request, and what it buys.

    python benchmarks/chat_template_pool.py [--renders 500] [--runs 5]

On the bundled SmolLM2 template with a three-message conversation: the latency of one render in the
calling thread (the sandbox alone) and through `RenderPool` (the sandbox inside a worker process,
one pickled round trip), interleaved, medians of --runs runs of p50 and p99 over --renders renders.
Then a template stuck in one long C call (a quadratic `sum(start=[])`), with a 1 s limit: how long
the in-thread sandbox takes to give up and how long the pool takes to kill it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from paxserve.engine.chat_template.pool import RenderPool  # noqa: E402
from paxserve.engine.chat_template.template import ChatTemplateError, RenderLimits, render_chat_template  # noqa: E402
from paxserve.models.bundled import default_model_path  # noqa: E402
from paxserve.models.gguf_io import GGUFCheckpoint  # noqa: E402
from paxserve.models.tokenizer import tokenizer_from_gguf  # noqa: E402

MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France? Answer in one word."},
            {"role": "assistant", "content": "Paris."}]
UNINTERRUPTIBLE = "{{ ([[1]] * 100000)|sum(start=[])|length }}"


def percentiles(times: list[float]) -> tuple[float, float]:
    times = sorted(times)
    return statistics.median(times), times[int(0.99 * (len(times) - 1))]


def stopped_after(render, template: str) -> float:  # noqa: ANN001
    start = time.perf_counter()
    try:
        render(template)
    except ChatTemplateError:
        pass
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--renders", type=int, default=500)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    template = tokenizer_from_gguf(GGUFCheckpoint(default_model_path())).chat_template
    pool = RenderPool(num_workers=1)
    start = time.perf_counter()
    pool.render(template, MESSAGES, add_generation_prompt=True)
    print(f"first render through the pool (starts its worker): {1000 * (time.perf_counter() - start):.0f} ms")
    rows = {"in-thread": [], "pool": []}
    for _ in range(args.runs):
        times = {"in-thread": [], "pool": []}
        for _ in range(args.renders):
            for name, render in (("in-thread", render_chat_template), ("pool", pool.render)):
                t = time.perf_counter()
                render(template, MESSAGES, add_generation_prompt=True)
                times[name].append(time.perf_counter() - t)
        for name in rows:
            rows[name].append(percentiles(times[name]))
    print(f"\n{args.renders} renders x {args.runs} runs (medians of the runs' percentiles)")
    print("| render | p50 | p99 |\n|---|---|---|")
    med = {name: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs)) for name, rs in rows.items()}
    for name, (p50, p99) in med.items():
        print(f"| {name} | {1000 * p50:.3f} ms | {1000 * p99:.3f} ms |")
    print(f"added by the pool: {1000 * (med['pool'][0] - med['in-thread'][0]):.3f} ms at p50")
    limits = RenderLimits(timeout_s=1.0)
    stuck = RenderPool(num_workers=1, limits=limits)
    print("\na render stuck in one C call, limit 1 s:")
    print(f"  pool: stopped after {stopped_after(lambda t: stuck.render(t, MESSAGES), UNINTERRUPTIBLE):.2f} s")
    print(f"  in-thread sandbox: gave up after "
          f"{stopped_after(lambda t: render_chat_template(t, MESSAGES, limits=limits), UNINTERRUPTIBLE):.2f} s")
    pool.close()
    stuck.close()


if __name__ == "__main__":
    main()
