"""KV-cache memory: paged blocks vs contiguous max_model_len reservations, on the engine's real allocator.

    python benchmarks/memory.py [--num-requests 1000] [--max-model-len 2048] [--block-size 16]
                                [--kv-slots 65536] [--seed 0] [--out-dir benchmarks/results]

A host-side simulation: no model and no JAX. A seeded trace (ShareGPT-like lognormal lengths, input
about 160 and output about 340 tokens on average, clipped to max_model_len, Poisson arrivals counted
in engine steps; or fixed lengths with --input-len/--output-len) drives the real `Scheduler` +
`KVCacheManager`; sampled tokens are fake and every request finishes at its drawn output length.
After each step it measures, over the running requests:

- paged: allocated KV slots (blocks held x block size) and how many of them hold real tokens; the
  rest is internal fragmentation, the unfilled tail of each sequence's last block;
- contiguous (the pre-vLLM scheme), from the same running set: running x max_model_len reserved slots
  holding the same tokens;
- the most sequences each scheme runs at once on a budget of --kv-slots slots: paged runs the scheduler
  on budget / block_size blocks with the whole trace queued at once; contiguous admits
  budget // max_model_len;
- with a shared --prefix-len system prompt on every request, logical tokens (the running requests'
  context lengths) per allocated physical slot, prefix caching on vs off.

Prints markdown tables and writes `memory_kv_usage.png` under --out-dir when matplotlib is importable
(`pip install -e .[bench]`); otherwise it says so and skips the plot.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from paxserve.core.kv_cache_manager import KVCacheManager  # noqa: E402
from paxserve.core.request import Request  # noqa: E402
from paxserve.core.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from paxserve.sampling_params import SamplingParams  # noqa: E402
from plotting import pyplot, save_figure  # noqa: E402
from workload import clip_lengths, lognormal_lengths  # noqa: E402

VOCAB = 32000


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_step: float  # engine step at which the request arrives
    input_len: int  # the request's own prompt tokens (after any shared prefix)
    output_len: int


def make_trace(num_requests: int, *, max_model_len: int, seed: int, request_rate: float = 0.35,
               mean_input: float = 160.0, mean_output: float = 340.0, sigma: float = 1.0,
               input_len: int | None = None, output_len: int | None = None,
               prefix_len: int = 0) -> list[TraceRequest]:
    """Lognormal lengths with the given means (or fixed ones), clipped so that prefix + input +
    output fits max_model_len; Poisson arrivals at `request_rate` per step (0: all at step 0)."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if prefix_len + 2 > max_model_len:
        raise ValueError(f"prefix_len {prefix_len} leaves no room in max_model_len {max_model_len}")
    rng = np.random.default_rng(seed)

    def draw(mean: float, fixed: int | None) -> np.ndarray:
        if fixed is not None:
            return np.full(num_requests, fixed)
        return lognormal_lengths(rng, num_requests, mean, sigma)  # the same draws as benchmarks/workload.py's

    inputs, outputs = draw(mean_input, input_len), draw(mean_output, output_len)
    if request_rate > 0:
        arrivals = np.cumsum(rng.exponential(1.0 / request_rate, num_requests))
    else:
        arrivals = np.zeros(num_requests)
    lengths = clip_lengths(inputs, outputs, max_model_len - prefix_len)
    return [TraceRequest(float(a), i, o) for a, (i, o) in zip(arrivals, lengths)]


@dataclass(slots=True)
class StepSample:
    step: int
    running: int
    waiting: int
    tokens: int  # sum of running requests' tokens in the KV cache (their context lengths)
    allocated_slots: int  # physical slots in blocks held (shared blocks counted once)
    tail_waste: int  # sum over running requests of the unfilled slots of their last block


@dataclass(slots=True)
class SimResult:
    block_size: int
    usable_blocks: int
    max_model_len: int
    enable_caching: bool
    steps: int = 0
    samples: list[StepSample] = field(default_factory=list)
    preemptions: int = 0
    finished: int = 0
    final_free_blocks: int = 0
    final_held_refs: int = 0  # sum of ref counts left on blocks after the run (0 = nothing leaked)
    prefix_hit_rate: float = 0.0

    @property
    def kv_slots(self) -> int:
        return self.usable_blocks * self.block_size

    def _busy(self) -> list[StepSample]:
        return [s for s in self.samples if s.running > 0]

    @property
    def paged_utilization(self) -> float:
        """Slots holding real tokens / allocated slots, summed over all steps (caching off: every
        token is stored once)."""
        busy = self._busy()
        return sum(s.tokens for s in busy) / max(1, sum(s.allocated_slots for s in busy))

    @property
    def contiguous_utilization(self) -> float:
        busy = self._busy()
        return sum(s.tokens for s in busy) / max(1, sum(s.running * self.max_model_len for s in busy))

    @property
    def fragmentation(self) -> float:
        """Unfilled tails of last blocks / allocated slots, summed over all steps."""
        busy = self._busy()
        return sum(s.tail_waste for s in busy) / max(1, sum(s.allocated_slots for s in busy))

    @property
    def waste_per_seq(self) -> float:
        busy = self._busy()
        return sum(s.tail_waste for s in busy) / max(1, sum(s.running for s in busy))

    @property
    def logical_per_physical(self) -> float:
        """Logical tokens (context lengths) per allocated physical slot, summed over all steps."""
        return self.paged_utilization  # same ratio; with caching on, tokens count once per request

    def utilization_percentile(self, q: float, min_running: int = 1) -> float:
        vals = [s.tokens / s.allocated_slots for s in self.samples if s.running >= min_running and s.allocated_slots]
        return float(np.percentile(vals, q)) if vals else float("nan")

    @property
    def peak_running(self) -> int:
        return max((s.running for s in self.samples), default=0)

    @property
    def mean_running(self) -> float:
        busy = self._busy()
        return sum(s.running for s in busy) / max(1, len(busy))

    @property
    def mean_running_saturated(self) -> float:
        """Mean running over the steps that left requests waiting (the pool or the token budget was
        the limit); nan if none did."""
        sat = [s.running for s in self.samples if s.waiting > 0]
        return sum(sat) / len(sat) if sat else float("nan")

    @property
    def peak_allocated_slots(self) -> int:
        return max((s.allocated_slots for s in self.samples), default=0)

    @property
    def peak_contiguous_reserved(self) -> int:
        return max((s.running * self.max_model_len for s in self.samples), default=0)


def simulate(trace: list[TraceRequest], *, block_size: int, kv_slots: int, max_model_len: int,
             enable_caching: bool = False, prefix_len: int = 0, max_num_seqs: int = 1024,
             max_num_batched_tokens: int = 2048, all_at_once: bool = False, seed: int = 0) -> SimResult:
    """Run the trace through the real scheduler and KV cache manager on `kv_slots // block_size`
    usable blocks (plus the reserved null block), one fake token per completed request per step."""
    usable = kv_slots // block_size
    kv = KVCacheManager(usable + 1, block_size, enable_caching)
    sched = Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len), kv)
    rng = np.random.default_rng(seed + 1)
    prefix = rng.integers(3, VOCAB, prefix_len).tolist()
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=None)
    result = SimResult(block_size, usable, max_model_len, enable_caching)
    order = sorted(range(len(trace)), key=lambda k: 0.0 if all_at_once else trace[k].arrival_step)
    next_arrival, step, fake_token = 0, 0, 0
    while next_arrival < len(order) or sched.num_unfinished:
        if not sched.num_unfinished and not all_at_once:  # idle: jump to the next arrival
            step = max(step, math.ceil(trace[order[next_arrival]].arrival_step))
        while next_arrival < len(order) and (all_at_once or trace[order[next_arrival]].arrival_step <= step):
            k = order[next_arrival]
            t = trace[k]
            sched.add_request(Request(f"r{k}", prefix + rng.integers(3, VOCAB, t.input_len).tolist(), params,
                                      max_tokens=t.output_len, arrival_time=float(t.arrival_step)))
            next_arrival += 1
        out = sched.schedule()
        sampled = []
        for _ in out.scheduled:
            fake_token += 1
            sampled.append(3 + fake_token % (VOCAB - 3))
        result.finished += len(sched.update_from_output(out, sampled))
        result.preemptions += len(out.preempted_ids)
        tokens = waste = 0
        for r in sched.running:
            n = r.num_computed_tokens
            tokens += n
            waste += len(kv.req_blocks.get(r.request_id, ())) * block_size - n
        held = usable - kv.num_free_blocks
        result.samples.append(StepSample(step, len(sched.running), len(sched.waiting), tokens, held * block_size,
                                         waste))
        step += 1
    result.steps = step
    result.final_free_blocks = kv.num_free_blocks
    result.final_held_refs = sum(b.ref_cnt for b in kv.pool.blocks)
    result.prefix_hit_rate = kv.prefix_stats.hit_rate
    return result


def contiguous_capacity(kv_slots: int, max_model_len: int) -> int:
    return kv_slots // max_model_len


# --------------------------------------------------------------------------- report


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def trace_summary(trace: list[TraceRequest], prefix_len: int = 0) -> str:
    ins = np.array([t.input_len for t in trace])
    outs = np.array([t.output_len for t in trace])
    span = trace[-1].arrival_step if trace else 0.0
    pre = f" after a {prefix_len}-token shared prefix" if prefix_len else ""
    return (f"{len(trace)} requests over {span:.0f} steps; input{pre} mean {ins.mean():.0f} / p50 "
            f"{np.median(ins):.0f} / p99 {np.percentile(ins, 99):.0f} / max {ins.max()}; output mean "
            f"{outs.mean():.0f} / p50 {np.median(outs):.0f} / p99 {np.percentile(outs, 99):.0f} / max {outs.max()}")


def usage_table(results: list[SimResult]) -> str:
    rows = ["| block size | steps | mean / peak running | preemptions | paged: slots holding tokens | "
            "p10 over steps (>= 8 running) | internal fragmentation | wasted slots per seq | "
            "contiguous: slots holding tokens | peak slots paged / contiguous (budget) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        rows.append(
            f"| {r.block_size} | {r.steps} | {r.mean_running:.1f} / {r.peak_running} | {r.preemptions} | "
            f"{_pct(r.paged_utilization)} | {_pct(r.utilization_percentile(10, 8))} | {_pct(r.fragmentation)} | "
            f"{r.waste_per_seq:.1f} | {_pct(r.contiguous_utilization)} | "
            f"{r.peak_allocated_slots} / {r.peak_contiguous_reserved} ({r.kv_slots}) |")
    return "\n".join(rows)


def capacity_table(results: list[SimResult], kv_slots: int, max_model_len: int) -> str:
    contiguous = contiguous_capacity(kv_slots, max_model_len)
    rows = ["| scheme | KV slots | peak running | mean running while requests wait | preemptions | "
            "vs contiguous (peak / mean) |",
            "|---|---|---|---|---|---|",
            f"| contiguous, {max_model_len} slots per sequence | {kv_slots} | {contiguous} | {contiguous} | 0 | "
            "1.0x / 1.0x |"]
    for r in results:
        rows.append(f"| paged, block {r.block_size} | {r.kv_slots} | {r.peak_running} | "
                    f"{r.mean_running_saturated:.1f} | {r.preemptions} | {r.peak_running / max(1, contiguous):.1f}x / "
                    f"{r.mean_running_saturated / max(1, contiguous):.1f}x |")
    return "\n".join(rows)


def prefix_table(off: SimResult, on: SimResult) -> str:
    rows = ["| prefix caching | logical tokens per physical slot | p50 over steps | mean / peak running | "
            "preemptions | prompt tokens from cache | steps |",
            "|---|---|---|---|---|---|---|"]
    for name, r in (("off", off), ("on", on)):
        rows.append(f"| {name} | {r.logical_per_physical:.2f} | {r.utilization_percentile(50):.2f} | "
                    f"{r.mean_running:.1f} / {r.peak_running} | {r.preemptions} | {_pct(r.prefix_hit_rate)} | "
                    f"{r.steps} |")
    return "\n".join(rows)


def plot(main: SimResult, others: list[SimResult], path: Path) -> str | None:
    """KV slots over time (paged allocated, tokens, contiguous reserved, budget) and utilization."""
    plt = pyplot()
    if plt is None:
        return None
    steps = [s.step for s in main.samples]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    ax1.plot(steps, [s.running * main.max_model_len for s in main.samples],
             label=f"contiguous: reserved (running x {main.max_model_len})", color="tab:red")
    ax1.plot(steps, [s.allocated_slots for s in main.samples], label=f"paged: allocated (block {main.block_size})",
             color="tab:blue")
    ax1.plot(steps, [s.tokens for s in main.samples], label="tokens held", color="black", linestyle=":")
    ax1.axhline(main.kv_slots, color="gray", linestyle="--", label=f"KV budget ({main.kv_slots} slots)")
    ax1.set_ylabel("KV slots")
    ax1.set_title("KV cache usage over time, same running set")
    ax1.legend(loc="upper left", fontsize=8)
    for r, color in zip([main, *others], ["tab:blue", "tab:green", "tab:purple", "tab:orange"]):
        xs = [s.step for s in r.samples if s.allocated_slots]
        ax2.plot(xs, [s.tokens / s.allocated_slots for s in r.samples if s.allocated_slots],
                 label=f"paged, block {r.block_size}", color=color, linewidth=0.8)
    xs = [s.step for s in main.samples if s.running]
    ax2.plot(xs, [s.tokens / (s.running * main.max_model_len) for s in main.samples if s.running],
             label="contiguous", color="tab:red")
    ax2.set_ylim(0, 1.02)
    ax2.set_ylabel("slots holding tokens")
    ax2.set_xlabel("engine step")
    ax2.legend(loc="lower right", fontsize=8)
    return save_figure(plt, fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16, help="block size of the plotted run")
    parser.add_argument("--other-block-sizes", default="8,32", help="also report these (comma list; '' for none)")
    parser.add_argument("--kv-slots", type=int, default=65536, help="KV budget in token slots for every scheme")
    parser.add_argument("--request-rate", type=float, default=0.35, help="Poisson arrivals per engine step")
    parser.add_argument("--input-len", type=int, default=None, help="fixed input length (default: lognormal, mean 160)")
    parser.add_argument("--output-len", type=int, default=None,
                        help="fixed output length (default: lognormal, mean 340)")
    parser.add_argument("--prefix-len", type=int, default=512, help="shared system prompt for the prefix-caching run")
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args(argv)
    start = time.perf_counter()
    sizes = [args.block_size] + [int(x) for x in args.other_block_sizes.split(",") if x.strip()]
    common = dict(kv_slots=args.kv_slots, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed)
    lengths = dict(max_model_len=args.max_model_len, seed=args.seed, input_len=args.input_len,
                   output_len=args.output_len)
    trace = make_trace(args.num_requests, request_rate=args.request_rate, **lengths)

    print("# paxserve KV memory simulation (host-side: real Scheduler + KVCacheManager, no model)\n")
    print(f"Trace: {trace_summary(trace)}; Poisson arrivals at {args.request_rate} per step. "
          f"KV budget {args.kv_slots} slots, max_model_len {args.max_model_len}, max_num_seqs {args.max_num_seqs}, "
          f"max_num_batched_tokens {args.max_num_batched_tokens}, prefix caching off.\n")
    usage = [simulate(trace, block_size=bs, **common) for bs in sizes]
    print("## KV slots holding real tokens over time (Poisson arrivals)\n")
    print(usage_table(usage) + "\n")

    print(f"## Concurrent sequences on {args.kv_slots} KV slots (whole trace queued at step 0)\n")
    capacity = [simulate(trace, block_size=bs, all_at_once=True, **common) for bs in sorted(sizes)]
    print(capacity_table(capacity, args.kv_slots, args.max_model_len) + "\n")

    ptrace = make_trace(args.num_requests, request_rate=args.request_rate, prefix_len=args.prefix_len, **lengths)
    pre = [simulate(ptrace, block_size=args.block_size, prefix_len=args.prefix_len, enable_caching=c, **common)
           for c in (False, True)]
    print(f"## Shared {args.prefix_len}-token system prompt, block {args.block_size}: "
          "logical tokens per physical slot\n")
    print(f"Trace: {trace_summary(ptrace, args.prefix_len)}.\n")
    print(prefix_table(*pre) + "\n")

    leaks = [r for r in usage + capacity + pre if r.final_free_blocks != r.usable_blocks or r.final_held_refs]
    unfinished = [r for r in usage + capacity + pre if r.finished != len(trace)]
    print(f"All runs: every request finished: {not unfinished}; every block free at the end: {not leaks}.")
    png = plot(usage[0], usage[1:], Path(args.out_dir) / "memory_kv_usage.png")
    print(f"Plot: {png}" if png else "Plot skipped: matplotlib is not importable (pip install -e .[bench]).")
    print(f"Simulated in {time.perf_counter() - start:.1f} s.")
    return 1 if leaks or unfinished else 0


if __name__ == "__main__":
    raise SystemExit(main())
