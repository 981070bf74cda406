"""The side-by-side table of benchmarks/vs_llamacpp.sh's GuideLLM reports.

    python benchmarks/vs_llamacpp_table.py [benchmarks/results/vs_llamacpp]

For each server, round and stream count: GuideLLM's own figures for its successful requests (output
tokens per second over the run, the median of the requests' inter-token latencies, the median time
to first token) and the request count. Then, per stream count, the median over the rounds that
completed requests of each server and paxserve's ratio to llama.cpp. Markdown on stdout.
"""

from __future__ import annotations

import gzip
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any


def _streams(benchmark: dict[str, Any]) -> int:
    strategy = benchmark["config"]["strategy"]
    return int(strategy.get("streams") or strategy.get("max_concurrency"))


def _figures(benchmark: dict[str, Any]) -> dict[str, float]:
    metrics = benchmark["metrics"]

    def of(name: str, stat: str) -> float:
        return float(metrics[name]["successful"][stat])

    return {"tok/s": of("output_tokens_per_second", "mean"), "itl": of("inter_token_latency_ms", "median"),
            "ttft": of("time_to_first_token_ms", "median"), "requests": len(benchmark["requests"]["successful"])}


def read(folder: Path) -> dict[tuple[str, int], list[tuple[int, dict[str, float]]]]:
    """(server, streams) -> [(round, figures)]."""
    runs: dict[tuple[str, int], list[tuple[int, dict[str, float]]]] = defaultdict(list)
    for path in sorted([*folder.glob("*-round*.json"), *folder.glob("*-round*.json.gz")]):
        server, _, round_part = path.name.split(".")[0].partition("-round")
        text = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        for benchmark in json.loads(text)["benchmarks"]:
            runs[(server, _streams(benchmark))].append((int(round_part), _figures(benchmark)))
    return runs


def main() -> None:
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "results" / "vs_llamacpp"
    runs = read(folder)
    print("| server | streams | round | requests | output tok/s | ITL p50 ms | TTFT p50 ms |")
    print("|---|---|---|---|---|---|---|")
    for (server, streams), rows in sorted(runs.items()):
        for r, f in sorted(rows):
            print(f"| {server} | {streams} | {r} | {f['requests']} | {f['tok/s']:.1f} | {f['itl']:.1f} | {f['ttft']:.0f} |")
    print()
    print("| streams | output tok/s paxserve / llama.cpp | ITL p50 ms paxserve vs llama.cpp | TTFT p50 ms paxserve vs llama.cpp |")
    print("|---|---|---|---|")
    for streams in sorted({s for _, s in runs}):
        done = {server: [f for _, f in runs.get((server, streams), []) if f["requests"]]  # rounds with answers
                for server in ("paxserve", "llamacpp")}
        med = {server: {k: statistics.median(f[k] for f in rows) for k in ("tok/s", "itl", "ttft")}
               for server, rows in done.items() if rows}
        if len(med) < 2:
            continue
        p, q = med["paxserve"], med["llamacpp"]
        print(f"| {streams} | **{p['tok/s'] / q['tok/s']:.2f}x** ({p['tok/s']:.1f} vs {q['tok/s']:.1f}) | "
              f"{p['itl']:.1f} vs {q['itl']:.1f} ({p['itl'] / q['itl']:.2f}x) | {p['ttft']:.0f} vs {q['ttft']:.0f} |")


if __name__ == "__main__":
    main()
