"""Start-up of `paxserve serve` on the bundled model: cold (empty cache) and warm (a second start).

    python benchmarks/startup.py [--runs 3] [--json PATH] [-- extra serve flags]

Each run is a fresh `paxserve serve` process with default flags (plus any given after `--`), timed
from launch to its "paxserve listening on" line (ready), then to the end of a first chat request
(16 tokens, greedy) and a second one of another length. Cold runs start from an empty cache folder
(XDG_CACHE_HOME: the GGUF is dequantized and every program compiled); each warm run is a new
process on the folder the cold run filled. The log lines tell what was loaded and what was compiled
before ready, during the first request and during the second. Medians over --runs.

The servers run without PYTHONDONTWRITEBYTECODE (set on the developer machines): as on a user's
machine, Python writes the bytecode of what it imports once and later starts read it (with the
variable set, every start compiles ~2400 modules: about 4 s here). So only the first cold run of a
fresh environment pays that; "cold" means an empty cache folder, not an empty bytecode cache.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

COMPILED = re.compile(r"compiled (\w+-[\d-]+) in")
READY = re.compile(r"step programs ready in [\d.]+s: (\d+) loaded from the program store, (\d+) compiled now")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _chat(port: int, prompt: str) -> float:
    body = json.dumps({"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": prompt}],
                       "max_tokens": 16, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        json.loads(response.read())
    return time.perf_counter() - start


def run_once(cache: Path, extra: list[str], log_path: Path | None = None) -> dict[str, Any]:
    port = _free_port()
    lines: list[str] = []
    ready = threading.Event()
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "paxserve.cli", "serve", "--port", str(port), *extra],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"},
                                 "XDG_CACHE_HOME": str(cache)})

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if "paxserve listening on" in line:
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        if not ready.wait(600):
            raise RuntimeError("the server did not start:\n" + "".join(lines[-30:]))
        ready_s = time.perf_counter() - start
        before_first = len(lines)
        first_s = _chat(port, "What is the capital of France?")
        before_second = len(lines)
        second_s = _chat(port, "Write one sentence about the sea, the sky and the mountains in spring.")
        time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(60)
    log = "".join(lines)
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text(log)
    loaded, compiled_at_start = (int(x) for x in READY.search(log).groups()) if READY.search(log) else (0, 0)
    return {"ready_s": ready_s, "first_request_s": first_s, "second_request_s": second_s,
            "programs_loaded": loaded, "compiled_at_start": compiled_at_start,
            "compiled_before_ready": len(COMPILED.findall("".join(lines[:before_first]))),
            "compiled_in_first_request": COMPILED.findall("".join(lines[before_first:before_second])),
            "compiled_in_second_request": COMPILED.findall("".join(lines[before_second:]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--log-dir", type=Path, help="keep each server's log here (cold-1.log, warm-1.log, ...)")
    ap.add_argument("extra", nargs="*", help="flags for paxserve serve (after --)")
    args = ap.parse_args()
    results: dict[str, list[dict[str, Any]]] = {"cold": [], "warm": []}
    for i in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            for kind in ("cold", "warm"):
                log = args.log_dir / f"{kind}-{i + 1}.log" if args.log_dir else None
                results[kind].append(run_once(Path(tmp), args.extra, log))
        print(f"run {i + 1}: cold {results['cold'][-1]}\n       warm {results['warm'][-1]}", flush=True)
    print("| start | ready s (median) | first request s | second request s | programs loaded | compiled before "
          "ready | compiled in first request |")
    print("|---|---|---|---|---|---|---|")
    for kind, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in ("ready_s", "first_request_s", "second_request_s")}
        each = ", ".join(f"{r['ready_s']:.1f}" for r in runs)
        print(f"| {kind} | {med['ready_s']:.1f} ({each}) | "
              f"{med['first_request_s']:.2f} | {med['second_request_s']:.2f} | "
              f"{', '.join(str(r['programs_loaded']) for r in runs)} | "
              f"{', '.join(str(r['compiled_before_ready']) for r in runs)} | "
              f"{'; '.join(' '.join(r['compiled_in_first_request']) or 'none' for r in runs)} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
