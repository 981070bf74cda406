"""Offline throughput: paxserve's Engine next to transformers' generate, same prompts, same run.

    python benchmarks/throughput.py [--dataset sharegpt|fixed|short] [--num-prompts 64] [--runs 3]
                                    [--single-num-prompts 16] [--concurrency-sweep 1,4,16,64] [--json PATH]

Workload (seeded, the same for every engine): `--dataset sharegpt` (default) draws ShareGPT-like
lognormal lengths, input about 160 and output about 340 tokens on average, long-tailed, clipped so
that input + output <= --max-model-len (benchmarks/workload.py, the model memory.py uses);
`--dataset fixed` draws input lengths uniformly in [--min-input-len, --max-input-len] and gives
every request --output-len output tokens; `--dataset short` draws inputs of 27-400 tokens (20-300 words) and outputs
of 16-192 tokens, uniformly. Prompts are random token ids. Every request produces
exactly its own requested number of tokens on both engines (ignore_eos, greedy).

- paxserve: `Engine` with continuous batching (--max-num-seqs), every request added at once with
  SamplingParams(max_tokens=len_i, ignore_eos=True, temperature=0); the prefix cache is reset before
  every run (the same prompts would otherwise come from it).
- paxserve with max_num_seqs=1: one sequence at a time, to show what continuous batching adds. It is
  slow, so it runs the first --single-num-prompts prompts only (0: all of them) and is compared by
  rates (per second), not totals. --skip-single leaves it out.
- transformers: `generate` with static batching as a plain Hugging Face user runs it: requests in
  arrival order (not sorted by length), left padding, each batch running max_new_tokens =
  min_new_tokens = its longest requested output. Only the requested tokens count as output tokens, for
  both engines; the rest of what transformers generates (shorter requests running on to their batch's
  longest) is the cost of static batching and is reported as generated vs useful tokens. The batch size
  is swept (--hf-batch-sizes, one run each) and the best is kept.

Figures are medians over --runs timed runs after one untimed warm-up run (paxserve: the whole workload,
which compiles the buckets it uses; transformers: one short batch, since torch eager compiles nothing).
--concurrency-sweep adds paxserve's output tokens/s at each max_num_seqs (a fresh Engine each: a warm-up
run and --sweep-runs timed runs; max_num_seqs=1 is the single-sequence run above, on its subset) next to
transformers' at each batch size of its sweep: a markdown table and `throughput_vs_concurrency.png`
under --out-dir (with matplotlib: `pip install -e .[bench]`). --json writes every figure.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from plotting import pyplot, save_figure  # noqa: E402
from workload import check_fixed_lengths, describe_lengths, length_summary, sharegpt_requests  # noqa: E402

BUNDLED_VOCAB = 49152

# --------------------------------------------------------------------------- workload


def make_fixed_prompts(n: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    """Uniform input lengths in [min_len, max_len] (the draws this script made before --dataset)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, int(rng.integers(min_len, max_len + 1))).tolist() for _ in range(n)]


def make_workload(dataset: str, num_prompts: int, *, max_model_len: int, seed: int, vocab_size: int = BUNDLED_VOCAB,
                  min_input_len: int = 16, max_input_len: int = 256, output_len: int = 128) -> dict[str, Any]:
    """Seeded prompts (random token ids) and per-request output lengths, all fitting max_model_len."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if dataset == "sharegpt":
        prompts, input_lens, output_lens = sharegpt_requests(num_prompts, max_model_len=max_model_len, seed=seed,
                                                             vocab_size=vocab_size)
        what = f"ShareGPT-like lognormal lengths (means 160 / 340), clipped to max_model_len {max_model_len}"
    elif dataset == "fixed":
        check_fixed_lengths(min_input_len, max_input_len, output_len, max_model_len)
        prompts = make_fixed_prompts(num_prompts, min_input_len, max_input_len, vocab_size, seed)
        input_lens = [len(p) for p in prompts]
        output_lens = [output_len] * num_prompts
        what = f"input lengths {min_input_len}-{max_input_len}, {output_len} output tokens each"
    elif dataset == "short":
        # Issue 15's held-out shape: prompts of 20-300 words (27-400 tokens at SmolLM2's ~1.33 tokens
        # per English word), outputs of 16-192 tokens, both uniform.
        if max_model_len < 400 + 192:
            raise ValueError(f"short dataset: requests reach 592 tokens, more than --max-model-len {max_model_len}")
        rng = np.random.default_rng(seed)
        input_lens = [int(x) for x in rng.integers(27, 401, num_prompts)]
        output_lens = [int(x) for x in rng.integers(16, 193, num_prompts)]
        prompts = [rng.integers(3, vocab_size, n).tolist() for n in input_lens]
        what = "input lengths 27-400 (20-300 words), outputs 16-192, uniform"
    else:
        raise ValueError(f"unknown dataset {dataset!r} (sharegpt, fixed or short)")
    return {"dataset": dataset, "description": what, "prompts": prompts, "input_lens": input_lens,
            "output_lens": output_lens}


def rates(num_requests: int, input_tokens: int, output_tokens: int, seconds: float) -> dict[str, float]:
    return {"requests_per_s": num_requests / seconds, "output_tokens_per_s": output_tokens / seconds,
            "total_tokens_per_s": (input_tokens + output_tokens) / seconds}


# --------------------------------------------------------------------------- paxserve


def bench_paxserve(prompts: list[list[int]], output_lens: list[int], *, runs: int, max_num_seqs: int,
                   model: str | None = None, max_model_len: int = 1024, log_stats_interval: float = 5.0,
                   engine_args: dict[str, Any] | None = None) -> dict[str, Any]:
    """One Engine, one untimed warm-up pass over the workload (compiles the buckets it uses), then
    `runs` timed passes; the engine is freed before returning (its KV cache is large)."""
    from paxserve import Engine, SamplingParams

    engine = Engine(model, max_model_len=max_model_len, max_num_seqs=max_num_seqs, warmup=False,
                    log_stats_interval=log_stats_interval, **(engine_args or {}))
    try:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
        engine.generate(prompts, params, use_tqdm=False)
        times, generated, peak_usage = [], [], 0.0
        runner = engine.runner
        padding_before = (getattr(runner, "tokens_run", 0), getattr(runner, "tokens_real", 0))
        preempt_before = engine.stats.preemptions
        for run in range(runs):
            engine.reset_prefix_cache()  # the same prompts again would otherwise be served from the cache
            tokens = 0
            start = time.perf_counter()
            for i, (p, sp) in enumerate(zip(prompts, params)):
                engine.add_request(f"r{run}-{i}", p, sp)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        tokens += len(out.outputs[0].token_ids)
                peak_usage = max(peak_usage, engine.kv.usage)
            times.append(time.perf_counter() - start)
            generated.append(tokens)
        seconds = statistics.median(times)
        in_tokens, out_tokens = sum(map(len, prompts)), sum(output_lens)
        if any(g != out_tokens for g in generated):
            raise RuntimeError(f"paxserve generated {generated} tokens per run, {out_tokens} requested")
        return {"engine": "paxserve", "max_num_seqs": max_num_seqs, "num_prompts": len(prompts),
                "input_tokens": in_tokens, "output_tokens": out_tokens, "seconds": seconds, "all_seconds": times,
                **rates(len(prompts), in_tokens, out_tokens, seconds), "peak_kv_usage": peak_usage,
                "preemptions": engine.stats.preemptions - preempt_before, "kv_blocks": engine.plan.num_blocks - 1,
                "block_size": engine.plan.block_size, "buckets": len(engine.runner.compiled),
                "async_scheduling": getattr(engine.core, "async_scheduling", None),
                # Of the token slots the timed runs' forward steps computed, the share that was padding.
                "padding_share": 1 - (getattr(runner, "tokens_real", 0) - padding_before[1]) /
                max(1, getattr(runner, "tokens_run", 0) - padding_before[0])}
    finally:
        del engine
        gc.collect()


# --------------------------------------------------------------------------- transformers


def static_batches(output_lens: list[int], batch_size: int) -> list[tuple[int, int, int]]:
    """Static batching in arrival order: (start, stop, max_new_tokens) per batch, each batch running
    to its longest requested output."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return [(i, min(i + batch_size, len(output_lens)), max(output_lens[i : i + batch_size]))
            for i in range(0, len(output_lens), batch_size)]


def static_batching_tokens(output_lens: list[int], batch_size: int) -> tuple[int, int]:
    """(tokens generated, tokens requested) under static batching: every row of a batch generates
    the batch's longest requested output."""
    generated = sum((stop - start) * new for start, stop, new in static_batches(output_lens, batch_size))
    return generated, sum(output_lens)


def load_transformers_model(model: str | None = None):  # noqa: ANN201
    """The Hugging Face model for `model` (default: the bundled GGUF), float32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    from paxserve.models.bundled import default_model_path

    path = Path(model) if model else default_model_path()
    if path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def bench_transformers(model: Any, prompts: list[list[int]], output_lens: list[int], *, runs: int,
                       batch_sizes: list[int], warmup_tokens: int = 16) -> dict[str, Any]:
    """Static batching with `model.generate`: one run per batch size, then `runs - 1` more at the best
    one (the median includes its sweep run). Checks that every batch generated what the accounting says."""
    import torch

    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    def generate(batch: list[list[int]], new_tokens: int) -> int:
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, pad_token_id=pad)
        return (out.shape[1] - width) * len(batch)

    def run(batch_size: int) -> float:
        generated = 0
        start = time.perf_counter()
        for i, j, new_tokens in static_batches(output_lens, batch_size):
            generated += generate(prompts[i:j], new_tokens)
        seconds = time.perf_counter() - start
        expected = static_batching_tokens(output_lens, batch_size)[0]
        if generated != expected:
            raise RuntimeError(f"transformers generated {generated} tokens at batch size {batch_size}, "
                               f"static batching accounts for {expected}")
        return seconds

    generate(prompts[: batch_sizes[0]], min(warmup_tokens, max(output_lens)))  # warm-up
    sweep = {bs: run(bs) for bs in batch_sizes}
    best = min(sweep, key=sweep.get)
    times = [sweep[best]] + [run(best) for _ in range(runs - 1)]
    seconds = statistics.median(times)
    in_tokens, out_tokens = sum(map(len, prompts)), sum(output_lens)
    generated = {bs: static_batching_tokens(output_lens, bs)[0] for bs in batch_sizes}
    return {"engine": "transformers", "best_batch_size": best, "num_prompts": len(prompts), "input_tokens": in_tokens,
            "output_tokens": out_tokens, "generated_tokens": generated[best], "seconds": seconds, "all_seconds": times,
            **rates(len(prompts), in_tokens, out_tokens, seconds), "sweep_seconds": sweep,
            "sweep_output_tokens_per_s": {bs: out_tokens / s for bs, s in sweep.items()},
            "sweep_generated_tokens": generated}


# --------------------------------------------------------------------------- report


def _row_name(r: dict[str, Any]) -> str:
    if r["engine"] == "paxserve":
        mode = {True: ", async scheduling", False: ", synchronous scheduling"}.get(r.get("async_scheduling"), "") \
            if r.get("show_mode") else ""
        return f"paxserve (max_num_seqs={r['max_num_seqs']}{mode})"
    return f"transformers (static batching, batch size {r['best_batch_size']})"


def main_table(results: list[dict[str, Any]], num_prompts: int) -> str:
    rows = ["| engine | requests | requests/s | output tokens/s | total tokens/s | median s | runs s | notes |",
            "|---|---|---|---|---|---|---|---|"]
    for r in results:
        n = r["num_prompts"]
        which = str(n) if n == num_prompts else f"first {n} of {num_prompts}"
        if r["engine"] == "paxserve":
            notes = (f"KV {r['kv_blocks']} blocks x {r['block_size']}, peak usage {100 * r['peak_kv_usage']:.1f}%, "
                     f"preemptions {r['preemptions']}, {r['buckets']} compiled buckets, "
                     f"{100 * r.get('padding_share', 0):.1f}% of token slots padding")
        else:
            notes = (f"generated {r['generated_tokens']} tokens for {r['output_tokens']} requested "
                     f"({100 * r['output_tokens'] / r['generated_tokens']:.1f}% useful); sweep "
                     + ", ".join(f"{b}: {t:.1f}s" for b, t in r["sweep_seconds"].items()))
        rows.append(f"| {_row_name(r)} | {which} | {r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.1f} | "
                    f"{r['total_tokens_per_s']:.1f} | {r['seconds']:.1f} | "
                    f"{', '.join(f'{t:.1f}' for t in r['all_seconds'])} | {notes} |")
    return "\n".join(rows)


def ratio_lines(pax: dict[str, Any] | None, single: dict[str, Any] | None, hf: dict[str, Any] | None) -> list[str]:
    """Output-throughput ratios (rates, so a single-sequence run on a subset still compares)."""
    lines = []
    if pax and hf:
        lines.append(f"paxserve / transformers output throughput: "
                     f"{pax['output_tokens_per_s'] / hf['output_tokens_per_s']:.2f}x")
    if pax and single:
        subset = "" if single["num_prompts"] == pax["num_prompts"] else \
            f" (max_num_seqs=1 ran the first {single['num_prompts']} of {pax['num_prompts']} prompts; output tokens/s)"
        lines.append(f"paxserve (max_num_seqs={pax['max_num_seqs']}) / paxserve (max_num_seqs=1): "
                     f"{pax['output_tokens_per_s'] / single['output_tokens_per_s']:.2f}x{subset}")
    return lines


def static_batching_table(output_lens: list[int], batch_sizes: list[int]) -> str:
    rows = ["| batch size | batches | tokens generated | tokens requested | useful |", "|---|---|---|---|---|"]
    for bs in batch_sizes:
        generated, useful = static_batching_tokens(output_lens, bs)
        rows.append(f"| {bs} | {len(static_batches(output_lens, bs))} | {generated} | {useful} | "
                    f"{100 * useful / generated:.1f}% |")
    return "\n".join(rows)


def concurrency_table(pax: dict[int, float], hf: dict[int, float], notes: dict[int, str] | None = None) -> str:
    """Output tokens/s by max_num_seqs (paxserve) and batch size (transformers), one row per value."""
    notes = notes or {}
    rows = ["| max_num_seqs / batch size | paxserve output tokens/s | transformers output tokens/s |",
            "|---|---|---|"]
    for x in sorted(set(pax) | set(hf)):
        p = f"{pax[x]:.1f}{notes.get(x, '')}" if x in pax else ""
        h = f"{hf[x]:.1f}" if x in hf else ""
        rows.append(f"| {x} | {p} | {h} |")
    return "\n".join(rows)


def plot_concurrency(pax: dict[int, float], hf: dict[int, float], path: Path) -> str | None:
    """Output tokens/s vs max_num_seqs / batch size on a log2 x-axis; None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, data, marker in (("paxserve (max_num_seqs)", pax, "o"), ("transformers (static batch size)", hf, "s")):
        if data:
            xs = sorted(data)
            ax.plot(xs, [data[x] for x in xs], marker=marker, label=name)
    ax.set_xscale("log", base=2)
    ticks = sorted(set(pax) | set(hf))
    ax.set_xticks(ticks, [str(x) for x in ticks])
    ax.minorticks_off()
    ax.set_xlabel("max_num_seqs (paxserve) / batch size (transformers)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Offline throughput vs concurrency")
    ax.set_ylim(bottom=0)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return save_figure(plt, fig, path)


def _int_list(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"values must be >= 1: {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory or .gguf (default: the bundled SmolLM2)")
    parser.add_argument("--dataset", choices=("sharegpt", "fixed", "short"), default="sharegpt")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--min-input-len", type=int, default=16, help="fixed dataset")
    parser.add_argument("--max-input-len", type=int, default=256, help="fixed dataset")
    parser.add_argument("--output-len", type=int, default=128, help="fixed dataset")
    parser.add_argument("--vocab-size", type=int, default=BUNDLED_VOCAB, help="prompt ids are drawn below this")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                        help="paxserve's KV cache size (default: the engine's own plan)")
    parser.add_argument("--skip-single", action="store_true", help="leave out paxserve with max_num_seqs=1")
    parser.add_argument("--single-num-prompts", type=int, default=16,
                        help="max_num_seqs=1 runs the first N prompts only (0: all)")
    parser.add_argument("--concurrency-sweep", type=_int_list, default=[],
                        help="paxserve max_num_seqs values to sweep, e.g. 1,4,16,64 (default: none)")
    parser.add_argument("--sweep-runs", type=int, default=1, help="timed runs per sweep point (after a warm-up)")
    parser.add_argument("--hf-batch-sizes", type=_int_list, default=[8, 16, 32, 64])
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--other-scheduling", action="store_true",
                        help="also run paxserve with the other scheduling mode than its default for this device "
                             "(async vs synchronous), same workload")
    parser.add_argument("--log-stats-interval", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"),
                        help="where the concurrency plot goes")
    parser.add_argument("--json", default=None, help="write every figure to this file")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.sweep_runs < 1 or args.num_prompts < 1 or args.single_num_prompts < 0:
        parser.error("--runs, --sweep-runs and --num-prompts must be >= 1, --single-num-prompts >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("absl", "jax._src.xla_bridge"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    wl = make_workload(args.dataset, args.num_prompts, max_model_len=args.max_model_len, seed=args.seed,
                       vocab_size=args.vocab_size, min_input_len=args.min_input_len,
                       max_input_len=args.max_input_len, output_len=args.output_len)
    prompts, output_lens = wl["prompts"], wl["output_lens"]
    n = len(prompts)
    pax_common = dict(runs=args.runs, model=args.model, max_model_len=args.max_model_len,
                      log_stats_interval=args.log_stats_interval,
                      engine_args={"kv_cache_memory_bytes": args.kv_cache_memory_bytes}
                      if args.kv_cache_memory_bytes else None)
    start = time.perf_counter()

    pax = bench_paxserve(prompts, output_lens, max_num_seqs=args.max_num_seqs, **pax_common)
    other = None
    if args.other_scheduling:
        other = bench_paxserve(prompts, output_lens, max_num_seqs=args.max_num_seqs,
                               **{**pax_common, "engine_args": {**(pax_common["engine_args"] or {}),
                                                                "async_scheduling": not pax["async_scheduling"]}})
        pax["show_mode"] = other["show_mode"] = True  # two rows of the same engine: name their modes
    single = None
    if not args.skip_single or 1 in args.concurrency_sweep:
        k = args.single_num_prompts or n
        single = bench_paxserve(prompts[:k], output_lens[:k], max_num_seqs=1, **pax_common)
    sweep_pax: dict[int, dict[str, Any]] = {}
    for v in args.concurrency_sweep:
        if v == args.max_num_seqs:
            sweep_pax[v] = pax
        elif v == 1:
            sweep_pax[v] = single
        else:
            sweep_pax[v] = bench_paxserve(prompts, output_lens, max_num_seqs=v,
                                          **{**pax_common, "runs": args.sweep_runs})
    hf = None
    if not args.skip_transformers:
        model = load_transformers_model(args.model)
        hf = bench_transformers(model, prompts, output_lens, runs=args.runs, batch_sizes=args.hf_batch_sizes)
        del model
        gc.collect()
    elapsed = time.perf_counter() - start

    rows = [pax] + ([other] if other else []) + ([single] if single and not args.skip_single else []) + \
        ([hf] if hf else [])
    print(f"\nmachine: {platform.machine()}, {platform.processor() or platform.system()}, Python "
          f"{platform.python_version()}; dataset {args.dataset} (seed {args.seed}): {wl['description']}")
    print(f"Workload: {describe_lengths(wl['input_lens'], output_lens)}. Median of {args.runs} timed runs after a "
          f"warm-up; benchmark wall time {elapsed:.0f} s.\n")
    print(main_table(rows, n) + "\n")
    for line in ratio_lines(pax, single if not args.skip_single else None, hf):
        print(line)
    if other:
        on, off = (pax, other) if pax["async_scheduling"] else (other, pax)
        print(f"paxserve async / synchronous scheduling output throughput: "
              f"{on['output_tokens_per_s'] / off['output_tokens_per_s']:.2f}x")
    if hf:
        print("\nStatic batching in arrival order (transformers), tokens generated vs requested:\n")
        print(static_batching_table(output_lens, args.hf_batch_sizes))
    plot_path = None
    if args.concurrency_sweep:
        pax_rates = {v: r["output_tokens_per_s"] for v, r in sweep_pax.items()}
        hf_rates = hf["sweep_output_tokens_per_s"] if hf else {}
        notes = {v: f" (first {r['num_prompts']} prompts)" for v, r in sweep_pax.items() if r["num_prompts"] != n}
        print(f"\nOutput tokens/s vs concurrency (paxserve: {args.sweep_runs} timed run(s) per point after a warm-up, "
              f"max_num_seqs={args.max_num_seqs} from the main run; transformers: its batch-size sweep):\n")
        print(concurrency_table(pax_rates, hf_rates, notes))
        plot_path = plot_concurrency(pax_rates, hf_rates, Path(args.out_dir) / "throughput_vs_concurrency.png")
        print(f"\nPlot: {plot_path}" if plot_path else
              "\nPlot skipped: matplotlib is not importable (pip install -e .[bench]).")
    if args.json:
        report = {"machine": platform.machine(), "python": platform.python_version(), "args": vars(args),
                  "workload": {"dataset": args.dataset, "description": wl["description"],
                               "input_lens": wl["input_lens"], "output_lens": output_lens,
                               "input": length_summary(wl["input_lens"]), "output": length_summary(output_lens)},
                  "paxserve": pax, "paxserve_other_scheduling": other, "paxserve_single": single,
                  "transformers": hf,
                  "ratios": ratio_lines(pax, single, hf),
                  "paxserve_over_transformers": pax["output_tokens_per_s"] / hf["output_tokens_per_s"] if hf else None,
                  "paxserve_over_single": pax["output_tokens_per_s"] / single["output_tokens_per_s"] if single else None,
                  "concurrency_sweep": {"paxserve": {v: r["output_tokens_per_s"] for v, r in sweep_pax.items()},
                                        "transformers": hf["sweep_output_tokens_per_s"] if hf else {},
                                        "plot": plot_path},
                  "wall_seconds": elapsed}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
