"""Serving load test: streaming completions against a running server, vLLM's metric definitions.

    paxserve serve --max-model-len 1024 &
    python benchmarks/serving.py --request-rate 0.25,0.5,1,2,inf     # Poisson arrivals, one run per rate
    python benchmarks/serving.py --concurrency 1,4,16,64              # all sent at once, N in flight at most

Each setting (every --concurrency x every --request-rate, in that order) runs in turn against the same
server with the same seeded prompts and per-request output lengths, and gives one report. Arrivals are
a Poisson process at --request-rate requests/s (the same seeded gaps, scaled, for every rate); `inf`
(or 0) sends every request at once. --concurrency caps the requests in flight (0: no cap).

Workload: `--dataset sharegpt` (default) draws ShareGPT-like lognormal lengths (input about 160 and
output about 340 tokens on average, long-tailed, clipped so that input + output <= --max-model-len;
benchmarks/workload.py); `--dataset fixed` draws input lengths uniformly in [--min-input-len,
--max-input-len] and asks --output-len tokens of every request. Prompts are random token ids; every
request asks for exactly its own output length (`ignore_eos`, greedy).

Metrics, as vLLM's benchmark_serving defines them: TTFT = first streamed chunk with a choice - send time;
ITL = gaps between successive such chunks; E2E latency = last such chunk - send time; TPOT = (E2E - TTFT)
/ (output tokens - 1), output tokens as the server's usage reports them. Percentiles are numpy's
(linear interpolation). Prints one markdown table row per setting; --json writes the list of reports;
with more than one rate (concurrency) run, writes `serving_latency_vs_rate.png`
(`serving_throughput_vs_concurrency.png`) under --plot-dir, when matplotlib is importable
(`pip install -e .[bench]`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from plotting import pyplot, save_figure  # noqa: E402
from workload import check_fixed_lengths, describe_lengths, sharegpt_requests  # noqa: E402


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    requested_tokens: int = 0


async def one_request(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], output_len: int,
                      headers: dict[str, str]) -> Result:
    """One streaming completion; never raises (errors come back as Result(ok=False))."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    last, ttft, itl, usage = start, None, [], None
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                return Result(False, error=f"HTTP {resp.status}: {(await resp.text())[:200]}",
                              requested_tokens=output_len)
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Result(False, error=str(chunk["error"])[:200], requested_tokens=output_len)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if chunk.get("choices"):  # text may be empty (held-back bytes, the finishing chunk)
                    now = time.perf_counter()
                    if ttft is None:
                        ttft = now - start
                    else:
                        itl.append(now - last)
                    last = now
    except Exception as e:  # noqa: BLE001 - connection errors, timeouts, malformed chunks: one failed request
        return Result(False, error=repr(e)[:200], requested_tokens=output_len)
    if ttft is None or usage is None:
        return Result(False, error="stream ended without a choice or without usage", requested_tokens=output_len)
    return Result(True, ttft=ttft, latency=last - start, output_tokens=usage["completion_tokens"],
                  prompt_tokens=usage["prompt_tokens"], itl=itl, requested_tokens=output_len)


def summary(values: list[float]) -> dict[str, float]:
    """Mean and the 50th/90th/99th percentiles (numpy's linear interpolation); {} for no values."""
    if not values:
        return {}
    a = np.asarray(values, dtype=float)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def tpot(r: Result) -> float | None:
    """Time per output token after the first: (latency - TTFT) / (output tokens - 1)."""
    return (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else None


def rate_label(rate: float) -> float | str:
    """A request rate as JSON can carry it: the number, or "inf" for all at once."""
    return rate if math.isfinite(rate) else "inf"


def build_report(results: list[Result], duration: float, *, model: str, request_rate: float, concurrency: int,
                 dataset: str = "") -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpots = [t for t in map(tpot, ok) if t is not None]
    return {
        "model": model, "dataset": dataset, "request_rate": rate_label(request_rate), "concurrency": concurrency,
        "num_prompts": len(results), "completed": len(ok), "errors": len(results) - len(ok),
        "error_samples": sorted({r.error for r in results if not r.ok})[:5], "duration_s": duration,
        "requested_output_tokens": sum(r.requested_tokens for r in results), "output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in ok)) / duration,
        "ttft_s": summary([r.ttft for r in ok]), "tpot_s": summary(tpots),
        "itl_s": summary([x for r in ok for x in r.itl]), "e2e_s": summary([r.latency for r in ok]),
        "wrong_token_counts": sum(1 for r in ok if r.output_tokens != r.requested_tokens),
    }


# --------------------------------------------------------------------------- workload and settings


def make_requests(dataset: str, num_prompts: int, *, max_model_len: int, seed: int, vocab_size: int = 49152,
                  min_input_len: int = 16, max_input_len: int = 256,
                  output_len: int = 64) -> tuple[list[list[int]], list[int]]:
    """Seeded prompts (random token ids) and per-request output lengths."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if dataset == "sharegpt":
        prompts, _, output_lens = sharegpt_requests(num_prompts, max_model_len=max_model_len, seed=seed,
                                                    vocab_size=vocab_size)
        return prompts, output_lens
    if dataset == "fixed":  # the draws this script made before --dataset
        check_fixed_lengths(min_input_len, max_input_len, output_len, max_model_len)
        rng = random.Random(seed)
        prompts = [[rng.randrange(3, vocab_size) for _ in range(rng.randint(min_input_len, max_input_len))]
                   for _ in range(num_prompts)]
        return prompts, [output_len] * num_prompts
    raise ValueError(f"unknown dataset {dataset!r} (sharegpt or fixed)")


def parse_rates(text: str) -> list[float]:
    """"0.5,1,inf" -> [0.5, 1.0, inf]; 0 means all at once too."""
    rates = []
    for part in str(text).split(","):
        if part.strip():
            r = float(part)
            if r < 0 or math.isnan(r):
                raise argparse.ArgumentTypeError(f"request rates must be >= 0 or inf: {text!r}")
            rates.append(r if r > 0 else math.inf)
    if not rates:
        raise argparse.ArgumentTypeError("no request rate given")
    return rates


def parse_concurrencies(text: str) -> list[int]:
    """"1,4,16" -> [1, 4, 16]; 0 means no cap."""
    values = [int(part) for part in str(text).split(",") if part.strip()]
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"concurrencies must be >= 0: {text!r}")
    return values


def arrival_gaps(n: int, seed: int) -> list[float]:
    """Unit-rate exponential gaps before requests 1..n-1 (request 0 goes at once); divided by the rate."""
    rng = np.random.default_rng(seed + 2)
    return [0.0] + rng.exponential(1.0, max(0, n - 1)).tolist()


async def run_setting(session: aiohttp.ClientSession, url: str, model: str, prompts: list[list[int]],
                      output_lens: list[int], headers: dict[str, str], *, request_rate: float, concurrency: int,
                      gaps: list[float], dataset: str = "") -> dict[str, Any]:
    limit = asyncio.Semaphore(concurrency or len(prompts))

    async def bounded(p: list[int], n: int) -> Result:
        async with limit:
            return await one_request(session, url, model, p, n, headers)

    start = time.perf_counter()
    tasks = []
    for p, n, gap in zip(prompts, output_lens, gaps):
        if math.isfinite(request_rate) and gap > 0:
            await asyncio.sleep(gap / request_rate)
        tasks.append(asyncio.create_task(bounded(p, n)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    return build_report(list(results), duration, model=model, request_rate=request_rate, concurrency=concurrency,
                        dataset=dataset)


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    prompts, output_lens = make_requests(args.dataset, args.num_prompts, max_model_len=args.max_model_len,
                                         seed=args.seed, vocab_size=args.vocab_size, min_input_len=args.min_input_len,
                                         max_input_len=args.max_input_len, output_len=args.output_len)
    print(f"Workload ({args.dataset}, seed {args.seed}): {describe_lengths([len(p) for p in prompts], output_lens)}",
          flush=True)
    gaps = arrival_gaps(len(prompts), args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    reports = []
    async with aiohttp.ClientSession(timeout=timeout) as session:
        model = args.model
        if model is None:
            async with session.get(args.base_url + "/v1/models", headers=headers) as resp:
                model = (await resp.json())["data"][0]["id"]
        url = args.base_url + "/v1/completions"
        for concurrency in args.concurrency:
            for rate in args.request_rate:
                report = await run_setting(session, url, model, prompts, output_lens, headers, request_rate=rate,
                                           concurrency=concurrency, gaps=gaps, dataset=args.dataset)
                print(f"rate {report['request_rate']}, concurrency {concurrency or 'no cap'}: {report['completed']} "
                      f"completed, {report['errors']} errors in {report['duration_s']:.1f} s", flush=True)
                reports.append(report)
    return reports


# --------------------------------------------------------------------------- report


def _ms(stats: dict[str, float], *keys: str) -> str:
    return " / ".join(f"{1000 * stats[k]:.1f}" if k in stats else "-" for k in keys)


def markdown_table(reports: list[dict[str, Any]]) -> str:
    rows = ["| request rate | concurrency | completed | errors | duration s | req/s | output tok/s | "
            "TTFT mean / p50 / p90 / p99 ms | TPOT mean / p50 / p90 / p99 ms | ITL p50 / p99 ms | E2E p50 / p99 ms |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in reports:
        rows.append(
            f"| {r['request_rate']} | {r['concurrency'] or 'no cap'} | {r['completed']} | {r['errors']} | "
            f"{r['duration_s']:.1f} | {r['request_throughput']:.2f} | {r['output_token_throughput']:.1f} | "
            f"{_ms(r['ttft_s'], 'mean', 'p50', 'p90', 'p99')} | {_ms(r['tpot_s'], 'mean', 'p50', 'p90', 'p99')} | "
            f"{_ms(r['itl_s'], 'p50', 'p99')} | {_ms(r['e2e_s'], 'p50', 'p99')} |")
    return "\n".join(rows)


def _groups(reports: list[dict[str, Any]], key: str) -> dict[Any, list[dict[str, Any]]]:
    groups: dict[Any, list[dict[str, Any]]] = {}
    for r in reports:
        groups.setdefault(r[key], []).append(r)
    return groups


def plot_latency_vs_rate(reports: list[dict[str, Any]], path: Path) -> str | None:
    """TTFT, TPOT and E2E p50/p90/p99 vs request rate (3 subplots, log2 x; `inf` drawn at twice the
    largest finite rate); one set of lines per concurrency. None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    finite = sorted({float(r["request_rate"]) for r in reports if r["request_rate"] != "inf"})
    inf_x = 2 * finite[-1] if finite else 1.0

    def x(r: dict[str, Any]) -> float:
        return inf_x if r["request_rate"] == "inf" else float(r["request_rate"])

    groups = _groups(reports, "concurrency")
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (metric, title) in zip(axes, (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "E2E latency"))):
        for conc, group in groups.items():
            group = sorted(group, key=x)
            for q, style in (("p50", "-o"), ("p90", "--s"), ("p99", ":^")):
                pts = [(x(r), r[metric][q]) for r in group if q in r[metric]]
                label = q if len(groups) == 1 else f"{q}, concurrency {conc or 'no cap'}"
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
        ticks = finite + ([inf_x] if any(r["request_rate"] == "inf" for r in reports) else [])
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [f"{t:g}" for t in finite] + (["inf"] if len(ticks) > len(finite) else []))
        ax.minorticks_off()
        ax.set_xlabel("request rate (requests/s)")
        ax.set_ylabel("seconds")
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(plt, fig, path)


def plot_throughput_vs_concurrency(reports: list[dict[str, Any]], path: Path) -> str | None:
    """Output tokens/s and TTFT p50 vs concurrency (log2 x; no cap drawn at the number of prompts);
    one line per request rate. None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None

    def x(r: dict[str, Any]) -> int:
        return r["concurrency"] or r["num_prompts"]

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    groups = _groups(reports, "request_rate")
    for rate, group in groups.items():
        group = sorted(group, key=x)
        label = None if len(groups) == 1 else f"rate {rate}"
        ax1.plot([x(r) for r in group], [r["output_token_throughput"] for r in group], "-o", label=label)
        pts = [(x(r), r["ttft_s"]["p50"]) for r in group if "p50" in r["ttft_s"]]
        ax2.plot([p[0] for p in pts], [p[1] for p in pts], "-o", label=label)
    ticks = sorted({x(r) for r in reports})
    for ax, ylabel, title in ((ax1, "output tokens/s", "Output throughput"), (ax2, "seconds", "TTFT p50")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        if len(groups) > 1:
            ax.legend(fontsize=8)
    return save_figure(plt, fig, path)


def write_plots(reports: list[dict[str, Any]], plot_dir: Path) -> list[str]:
    """The plots the reports call for (more than one rate / concurrency); messages for the output."""
    notes = []
    wanted = []
    if len({r["request_rate"] for r in reports}) > 1:
        wanted.append((plot_latency_vs_rate, plot_dir / "serving_latency_vs_rate.png"))
    if len({r["concurrency"] for r in reports}) > 1:
        wanted.append((plot_throughput_vs_concurrency, plot_dir / "serving_throughput_vs_concurrency.png"))
    for fn, path in wanted:
        written = fn(reports, path)
        notes.append(f"Plot: {written}" if written else
                     f"Plot {path.name} skipped: matplotlib is not importable (pip install -e .[bench]).")
    return notes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="served model name (default: the first in /v1/models)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--dataset", choices=("sharegpt", "fixed"), default="sharegpt")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=parse_concurrencies, default=[64],
                        help="requests in flight at most, a comma list (0 = no cap); default 64")
    parser.add_argument("--request-rate", type=parse_rates, default=[math.inf],
                        help="Poisson arrivals per second, a comma list (inf or 0 = all at once); default inf")
    parser.add_argument("--max-model-len", type=int, default=1024, help="sharegpt lengths fit this")
    parser.add_argument("--min-input-len", type=int, default=16, help="fixed dataset")
    parser.add_argument("--max-input-len", type=int, default=256, help="fixed dataset")
    parser.add_argument("--output-len", type=int, default=64, help="fixed dataset")
    parser.add_argument("--vocab-size", type=int, default=49152)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per request at most")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the list of reports to this file")
    parser.add_argument("--plot-dir", default=str(Path(__file__).resolve().parent / "results"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reports = asyncio.run(run(args))
    print()
    print(markdown_table(reports))
    for r in reports:
        if r["error_samples"] or r["wrong_token_counts"]:
            print(f"rate {r['request_rate']}, concurrency {r['concurrency'] or 'no cap'}: errors {r['error_samples']}, "
                  f"{r['wrong_token_counts']} requests with a token count other than requested")
    for note in write_plots(reports, Path(args.plot_dir)):
        print(note)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(reports, indent=2))
        print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
