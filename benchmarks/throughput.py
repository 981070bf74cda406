"""Offline throughput: paxserve's Engine.generate next to transformers' generate, same prompts, same run.

    python benchmarks/throughput.py [--num-prompts 64] [--output-len 128] [--runs 3]

Prompts are random token ids with seeded, mixed lengths; every request produces exactly
`--output-len` tokens (ignore_eos / min_new_tokens), so both sides do the same work. transformers
runs static batches (left padding, each batch runs to its longest request) at several batch sizes and
the best is reported. Figures are medians over `--runs` timed runs after one untimed warm-up run.
"""

from __future__ import annotations

import argparse
import logging
import platform
import statistics
import time

import numpy as np


def make_prompts(n: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, int(rng.integers(min_len, max_len + 1))).tolist() for _ in range(n)]


def bench_paxserve(prompts: list[list[int]], output_len: int, runs: int, args: argparse.Namespace) -> dict:
    from paxserve import Engine, SamplingParams

    engine = Engine(args.model, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, warmup=False,
                    log_stats_interval=args.log_stats_interval)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    engine.generate(prompts, params, use_tqdm=False)  # compiles the buckets this workload uses
    times, peak_usage = [], 0.0
    preempt_before = engine.stats.preemptions
    for _ in range(runs):
        engine.reset_prefix_cache()  # the same prompts again would otherwise be served from the cache
        start = time.perf_counter()
        for i, p in enumerate(prompts):
            engine.add_request(f"b{i}", p, params)
        while engine.has_unfinished_requests():
            engine.step()
            peak_usage = max(peak_usage, engine.kv.usage)
        times.append(time.perf_counter() - start)
    return {"seconds": statistics.median(times), "all_seconds": times, "peak_kv_usage": peak_usage,
            "preemptions": engine.stats.preemptions - preempt_before, "kv_blocks": engine.plan.num_blocks - 1,
            "block_size": engine.plan.block_size, "buckets": len(engine.runner.buckets)}


def bench_transformers(prompts: list[list[int]], output_len: int, runs: int, batch_sizes: list[int]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from models.bundled import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    def run(batch_size: int) -> float:
        start = time.perf_counter()
        for i in range(0, len(prompts), batch_size):
            batch = prompts[i : i + batch_size]
            width = max(map(len, batch))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=output_len,
                               min_new_tokens=output_len, pad_token_id=pad)
        return time.perf_counter() - start

    run(batch_sizes[0])  # warm-up
    sweep = {bs: run(bs) for bs in batch_sizes}
    best = min(sweep, key=sweep.get)
    times = [sweep[best]] + [run(best) for _ in range(runs - 1)]
    return {"seconds": statistics.median(times), "all_seconds": times, "best_batch_size": best, "sweep": sweep}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint (default: the bundled SmolLM2; transformers "
                        "side supports only the bundled model)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--min-input-len", type=int, default=16)
    parser.add_argument("--max-input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--hf-batch-sizes", default="8,16,32,64")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--log-stats-interval", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("absl", "jax._src.xla_bridge"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    prompts = make_prompts(args.num_prompts, args.min_input_len, args.max_input_len, 49152, args.seed)
    in_tokens = sum(map(len, prompts))
    out_tokens = args.num_prompts * args.output_len
    rows = [("paxserve", bench_paxserve(prompts, args.output_len, args.runs, args))]
    if not args.skip_transformers:
        rows.append(("transformers", bench_transformers(prompts, args.output_len, args.runs,
                                                        [int(b) for b in args.hf_batch_sizes.split(",")])))
    print(f"\nmachine: {platform.machine()}, {platform.python_version()}; {args.num_prompts} prompts, "
          f"{in_tokens} input tokens (len {args.min_input_len}-{args.max_input_len}), {args.output_len} output "
          f"tokens each; median of {args.runs} runs")
    print("| engine | requests/s | output tokens/s | total tokens/s | median s | runs s | notes |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows:
        s = r["seconds"]
        notes = (f"KV {r['kv_blocks']} blocks x {r['block_size']}, peak usage {100 * r['peak_kv_usage']:.1f}%, "
                 f"preemptions {r['preemptions']}, {r['buckets']} compiled buckets" if name == "paxserve" else
                 f"static batching, best batch size {r['best_batch_size']} of sweep "
                 + ", ".join(f"{b}: {t:.1f}s" for b, t in r["sweep"].items()))
        print(f"| {name} | {args.num_prompts / s:.2f} | {out_tokens / s:.1f} | {(in_tokens + out_tokens) / s:.1f} | "
              f"{s:.1f} | {', '.join(f'{t:.1f}' for t in r['all_seconds'])} | {notes} |")
    if len(rows) == 2:
        print(f"paxserve / transformers output throughput: {rows[1][1]['seconds'] / rows[0][1]['seconds']:.2f}x")


if __name__ == "__main__":
    main()
