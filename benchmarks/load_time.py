"""Load time of a model: converting the checkpoint (empty param cache) vs. from the param cache.

    python benchmarks/load_time.py [--model PATH] [--runs 3]

Each run is a fresh process, so JAX and library start-up are included as a user sees them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile

_CHILD = """
import json, sys, time
start = time.perf_counter()
from paxserve.models import load_model
m = load_model(sys.argv[1] if sys.argv[1] != "-" else None, cache_dir=sys.argv[2])
print(json.dumps({"load_seconds": m.load_seconds, "process_seconds": time.perf_counter() - start,
                  "from_cache": m.from_cache}))
"""


def run_once(model: str, cache_dir: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, model, cache_dir], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="-", help="checkpoint path (default: the bundled model)")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    first, cached = [], []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as cache:
            first.append(run_once(args.model, cache))
            cached.append(run_once(args.model, cache))
    assert not any(r["from_cache"] for r in first) and all(r["from_cache"] for r in cached)
    med = lambda rows, key: statistics.median(r[key] for r in rows)  # noqa: E731
    print("| load | load_model() median s | whole process median s | runs |")
    print("|---|---|---|---|")
    print(f"| first (convert) | {med(first, 'load_seconds'):.2f} | {med(first, 'process_seconds'):.2f} | {args.runs} |")
    print(f"| cached | {med(cached, 'load_seconds'):.2f} | {med(cached, 'process_seconds'):.2f} | {args.runs} |")
    print(f"ratio first/cached (load_model): {med(first, 'load_seconds') / med(cached, 'load_seconds'):.1f}x")


if __name__ == "__main__":
    main()
