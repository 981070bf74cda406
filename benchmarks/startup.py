"""Start-up of `paxserve serve` on the bundled model, and the first answers after it: cold (empty
cache folder) and warm (a second start), optionally side by side with another source tree.

    python benchmarks/startup.py [--runs 3] [--baseline-tree PATH] [--json PATH] [--log-dir DIR]
                                 [-- extra serve flags]

Each run is a fresh `paxserve serve` process with default flags (plus any given after `--`), timed
from launch to its "paxserve listening on" line (ready). Then, from that line, a first chat answer of
exactly 40 tokens (greedy, `ignore_eos`) is timed to its last token, and after it a second one (another
prompt, 40 tokens). Cold runs start from an empty cache folder (XDG_CACHE_HOME: the GGUF is
dequantized, the program store is empty and every program is compiled); each warm run is a new process
on the folder its cold run filled. The log lines tell what was loaded and what was compiled before
ready and during each answer. Medians over --runs.

--baseline-tree PATH runs the same measurement on another checkout (e.g. `git worktree add /tmp/base
<commit>`) in the same invocation: every tree's servers start in, and with PYTHONPATH set to, that
tree's import root (`benchmarks/checkout.py`: the tree itself before the namespaced install), so
each imports its own tree's code. Trees alternate within each run (and which
goes first alternates between runs), so both see the same machine state.

The servers run without PYTHONDONTWRITEBYTECODE (set on the developer machines): as on a user's
machine, Python writes the bytecode of what it imports and later starts read it (with the variable
set, every start compiles ~2400 modules: about 4 s here). Each tree's own folders are byte-compiled
before the first run, so no tree's first cold run pays for it; "cold" means an empty cache folder,
not an empty bytecode cache.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkout import import_root, package_dirs  # noqa: E402  (a sibling script, importable from anywhere)

ROOT = Path(__file__).resolve().parent.parent
COMPILED = re.compile(r"compiled (\w+-[\d-]+) in")
# The engine's warm-up line; the "more stored programs found" part only exists since programs load lazily.
READY = re.compile(r"step programs ready in [\d.]+s: (\d+) loaded from the program store, (\d+) compiled now"
                   r"(?:; (\d+) more stored programs found)?")
LISTENING = "paxserve listening on"
ANSWER_TOKENS = 40
PROMPTS = ("What is the capital of France?",
           "Write one sentence about the sea, the sky and the mountains in spring.")
SOURCE_FOLDERS = ("paxserve", "models", "pallas_kernels", "server")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_env(tree: Path, cache: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = str(import_root(tree))  # this tree's packages ahead of any installed (editable) copy
    if cache is not None:
        env["XDG_CACHE_HOME"] = str(cache)
    return env


def prepare_tree(tree: Path) -> None:
    """Check that a server started on `tree` imports that tree's code, and byte-compile it."""
    models = "paxserve.models" if package_dirs(tree) else "models"
    code = f"import paxserve, {models} as m; print(paxserve.__file__, m.__file__)"
    found = subprocess.run([sys.executable, "-c", code],
                           cwd=import_root(tree), env=_server_env(tree), capture_output=True, text=True,
                           check=True).stdout.split()
    if not all(Path(path).resolve().is_relative_to(tree.resolve()) for path in found):
        raise SystemExit(f"a server started on {tree} would import {found}, not that tree's code")
    subprocess.run([sys.executable, "-m", "compileall", "-q", *SOURCE_FOLDERS], cwd=tree, env=_server_env(tree),
                   stdout=subprocess.DEVNULL, check=False)


def _chat(port: int, prompt: str) -> int:
    """One non-streamed chat answer (the response ends with its last token); returns its token count."""
    body = json.dumps({"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": prompt}],
                       "max_tokens": ANSWER_TOKENS, "temperature": 0, "ignore_eos": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=900) as response:
        return int(json.loads(response.read())["usage"]["completion_tokens"])


def run_once(tree: Path, cache: Path, extra: list[str], log_path: Path | None = None) -> dict[str, Any]:
    """One server start on `cache` from `tree`'s code, and its first two answers."""
    port = _free_port()
    lines: list[str] = []
    ready_at: list[float] = []
    ready = threading.Event()
    start = time.perf_counter()
    cli = "paxserve.cli" if (tree / "paxserve" / "cli.py").exists() else "paxserve.server.cli"  # as ab_serving.sh
    proc = subprocess.Popen([sys.executable, "-m", cli, "serve", "--port", str(port), *extra],
                            cwd=import_root(tree), env=_server_env(tree, cache), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if LISTENING in line and not ready.is_set():
                ready_at.append(time.perf_counter())
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        if not ready.wait(900):
            raise RuntimeError("the server did not start:\n" + "".join(lines[-30:]))
        before_first = len(lines)
        tokens = [_chat(port, PROMPTS[0])]
        first_done = time.perf_counter()
        before_second = len(lines)
        tokens.append(_chat(port, PROMPTS[1]))
        second_done = time.perf_counter()
        time.sleep(0.2)  # the log lines of the second answer's last step
    except Exception:
        print("the server's last log lines:\n" + "".join(lines[-40:]), file=sys.stderr)
        raise
    finally:
        proc.terminate()
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            log_path.write_text("".join(lines))
    log = "".join(lines)
    if tokens != [ANSWER_TOKENS, ANSWER_TOKENS]:
        print(f"warning: the answers had {tokens} tokens, not {ANSWER_TOKENS} each", file=sys.stderr)
    match = READY.search(log)
    loaded, compiled_at_start, left = (int(x or 0) for x in match.groups()) if match else (0, 0, 0)
    return {"ready_s": ready_at[0] - start, "first_answer_s": first_done - ready_at[0],
            "second_answer_s": second_done - first_done, "programs_loaded": loaded,
            "compiled_at_start": compiled_at_start, "stored_left_for_first_use": left,
            "compiled_before_ready": len(COMPILED.findall("".join(lines[:before_first]))),
            "compiled_in_first_answer": COMPILED.findall("".join(lines[before_first:before_second])),
            "compiled_in_second_answer": COMPILED.findall("".join(lines[before_second:]))}


def _median(runs: list[dict[str, Any]], field: str) -> float:
    return statistics.median(len(r[field]) if isinstance(r[field], list) else r[field] for r in runs)


def print_table(results: dict[str, dict[str, list[dict[str, Any]]]]) -> None:
    print(f"\nmedians over {max(len(r) for t in results.values() for r in t.values())} runs; answers of "
          f"{ANSWER_TOKENS} tokens, timed from ready (the first) and from the first's end (the second)\n")
    print("| tree | start | ready s | first answer s | second answer s | programs loaded before ready | "
          "compiled before ready | compiled during the first answer |")
    print("|---|---|---|---|---|---|---|---|")
    for tree, kinds in results.items():
        for kind, runs in kinds.items():
            print(f"| {tree} | {kind} | {_median(runs, 'ready_s'):.1f} | {_median(runs, 'first_answer_s'):.2f} | "
                  f"{_median(runs, 'second_answer_s'):.2f} | {_median(runs, 'programs_loaded'):g} | "
                  f"{_median(runs, 'compiled_before_ready'):g} | {_median(runs, 'compiled_in_first_answer'):g} |")
    print()
    for tree, kinds in results.items():
        cold, warm = _median(kinds["cold"], "first_answer_s"), _median(kinds["warm"], "first_answer_s")
        print(f"{tree}: the cold start's first answer takes {cold / warm:.1f}x a warm start's (goal: within 2x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--baseline-tree", type=Path,
                    help="another checkout to measure side by side (e.g. a `git worktree add` of an older commit)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--log-dir", type=Path, help="keep each server's log here (new-cold-1.log, ...)")
    ap.add_argument("extra", nargs="*", help="flags for paxserve serve (after --)")
    args = ap.parse_args()
    trees = {"new": ROOT}
    if args.baseline_tree is not None:
        if not (args.baseline_tree / "paxserve" / "programs.py").is_file():
            raise SystemExit(f"{args.baseline_tree} is not a paxserve checkout")
        trees = {"baseline": args.baseline_tree.resolve(), **trees}
    for path in trees.values():
        prepare_tree(path)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {name: {"cold": [], "warm": []} for name in trees}
    for i in range(args.runs):
        order = list(trees) if i % 2 == 0 else list(reversed(trees))
        for name in order:
            with tempfile.TemporaryDirectory() as tmp:
                for kind in ("cold", "warm"):
                    log = args.log_dir / f"{name}-{kind}-{i + 1}.log" if args.log_dir else None
                    run = run_once(trees[name], Path(tmp), args.extra, log)
                    results[name][kind].append(run)
                    print(f"run {i + 1} {name} {kind}: {json.dumps(run)}", flush=True)
    print_table(results)
    if args.json:
        args.json.write_text(json.dumps({"trees": {k: str(v) for k, v in trees.items()}, "results": results},
                                        indent=1))


if __name__ == "__main__":
    main()
