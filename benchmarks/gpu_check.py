"""The GPU check: what one H200 says about paxserve, in about 7 minutes, robust to whatever breaks.

    bash benchmarks/gpu_check.sh            # the real check: JAX_PLATFORMS=cuda, refuses to run without a GPU
    bash benchmarks/gpu_check.sh --smoke    # tiny shapes on any machine (on a CPU the kernels run interpreted)
    python benchmarks/gpu_check.py --only t,c   # some parts only (a rerun of what failed)

This file imports no JAX: it runs every part in its own process with its own timeout, so a compile
error, a hang or a sticky CUDA error (an illegal address poisons its whole process) costs that row
only. Parts write their rows to `$OUT/rows.jsonl` the moment they measure them and the full output
goes to `$OUT/gpu_check.log` as it comes, so a run killed at any point still returns what it
measured; the summary table is printed last (and written to `$OUT/summary.md`).

Parts, most valuable first, with the wall time each took on one H200 on 2026-12-04 (benchmarks/
RESULTS.md, "First GPU contact"; `--budget` skips a part that would not fit, and every process is
killed at its own limit):

  t  toolchain: jax/jaxlib/plugin versions, device, compute capability, ptxas found and its
     version, the CUDA root Mosaic GPU will use (set as CUDA_ROOT for the later parts when JAX's
     own choice has no ptxas), a first computation, GPU memory (pool and planned total next to
     nvidia-smi). Stops the check when JAX did not start a GPU backend.          ~27 s (limit 90)
  p  ceilings: copy bandwidth (read + write, 2 GiB) and bf16 matmul rate (8192^3, random data),
     what (b) and (c) are judged against.                                          ~9 s (limit 90)
  a  correctness: every Triton and Mosaic GPU kernel variant against the XLA reference, each case
     its own process, 4 at a time (float32: IEEE tolerance 1e-5, the kernels' dots are HIGHEST
     precision; 16-bit 2e-2, as the start-up self-check).                    ~70 s (limit 150 each)
  c  end to end: the Engine on a random-weight Llama-3-8B-shaped bf16 model, prefill and decode
     timed separately against the matmul rate and the copy bandwidth, async scheduling on and
     off, Mosaic GPU vs Triton vs the XLA reference side by side (three processes compile side
     by side, then take turns to time, the slow reference last; gpu_check_e2e.py).
                                                                             ~130 s (limit 270 each)
  b  kernel timings at Llama-3-8B attention shapes (decode 64x1k, 64x4k, 256x1k and a mixed
     step), one process per family: the decode-only kernels the engine runs on pure-decode steps
     are judged (>= 70% of the copy bandwidth, >= 1.0x JAX's own Pallas paged attention; Triton's,
     the first choice, fails the check when it misses), beside the ragged kernels of mixed steps.
                                                                             ~110 s (limit 120 each)
  q  quantization (gpu_check_quant.py): one decode step's linear layers at Llama-3-8B shapes with
     bfloat16, int8, fp8, fp8 x fp8 and 4-bit weights (int8 and 4-bit also on the Mosaic GPU
     weight-only kernel, after its self-check), and the Triton decode kernel on an fp8 KV cache
     against a bfloat16 one, next to the copy bandwidth.                       ~80 s (guess; limit 150)
  d  the MoE layer at Mixtral-8x7B shapes (gpu_check_moe.py); measured on 2026-12-04, so not in
     the default run (`--only d`).                                              ~65 s (limit 120)

Exit status: 0 when every row passed or only informs; 1 when a row failed, errored or timed out;
3 when there is no GPU (real run) and nothing was measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

HERE = Path(__file__).resolve().parent
# Last, for `benchmarks.*`: paxserve comes from gpu_check.sh's PYTHONPATH (benchmarks/checkout.py).
sys.path.append(str(HERE.parent))

from benchmarks.gpu_check_cases import (  # noqa: E402
    E2E_BACKENDS,
    KERNEL_CASES,
    SMOKE_E2E_BACKENDS,
    SMOKE_KERNEL_CASES,
    TIMING_FAMILIES,
)
from benchmarks.gpu_check_common import ROW_PREFIX, append_row, read_rows  # noqa: E402

PARTS = "tpacbqd"  # every part, in the order they run
DEFAULT_PARTS = "tpacbq"
EXPECTED_S = {"t": 27, "p": 9, "a": 70, "c": 130, "b": 110, "q": 80, "d": 65}  # on one H200, 2026-12-04 (q: a guess)
LIMIT_S = {"t": 90, "p": 90, "a": 150, "c": 270, "b": 120, "q": 150, "d": 120}
DEFAULT_BUDGET_S = 450.0  # the default parts (406 s) and some slack, inside the shell's 480 s backstop
SMOKE_LIMIT_S = 600  # a CPU interprets the kernels and compiles slowly; the test bounds the whole run


@dataclass
class Job:
    """One part process."""

    name: str
    part: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    tail: list[str] = field(default_factory=list)  # its last lines of output, for an error row


class Check:
    def __init__(self, out: Path, smoke: bool, budget: float, jobs: int) -> None:
        self.out, self.smoke, self.budget, self.jobs = out, smoke, budget, jobs
        self.rows_path = out / "rows.jsonl"
        self.log: IO[str] = open(out / "gpu_check.log", "a", buffering=1)
        self.start = time.monotonic()
        self.env = dict(os.environ)
        self._print_lock = threading.Lock()

    # ---- output ------------------------------------------------------------------------------------

    def say(self, text: str) -> None:
        with self._print_lock:
            print(text, flush=True)
            self.log.write(text + "\n")

    def row(self, part: str, check: str, result: str, note: str = "", status: str = "info") -> None:
        append_row(self.rows_path, part, check, result, note, status=status)
        self.say(f"[{part}] {check}: {result}  {note}")

    def rows(self) -> list[dict]:
        return read_rows(self.rows_path)

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    # ---- running parts -----------------------------------------------------------------------------

    def fits(self, part: str) -> bool:
        if self.smoke or self.elapsed() + EXPECTED_S[part] <= self.budget:
            return True
        self.row(part, "part", "skipped", f"{self.elapsed():.0f} s of the {self.budget:.0f} s budget spent; "
                 f"it needs about {EXPECTED_S[part]} s", status="skipped")
        return False

    def run(self, jobs: list[Job], concurrency: int) -> dict[str, int | None]:
        """Run jobs, `concurrency` at a time; returns each one's exit status (None: killed at its limit)."""
        pending, running, status = list(jobs), [], {}
        while pending or running:
            while pending and len(running) < concurrency:
                job = pending.pop(0)
                running.append((job, self._start(job), time.monotonic()))
            time.sleep(0.1)
            for item in list(running):
                job, (proc, reader), started = item
                limit = SMOKE_LIMIT_S if self.smoke else min(LIMIT_S[job.part],
                                                             max(30.0, self.budget + 30 - self.elapsed()))
                if proc.poll() is None and time.monotonic() - started < limit:
                    continue
                if proc.poll() is None:
                    _kill(proc)
                    status[job.name] = None
                    reader.join(5)
                    self.row(job.part, job.name, "TIMEOUT", f"killed after {limit:.0f} s; its log is in gpu_check.log",
                             status="error")
                else:
                    reader.join(5)
                    status[job.name] = proc.returncode
                    self._report_exit(job, proc, time.monotonic() - started)
                running.remove(item)
        return status

    def _start(self, job: Job) -> tuple[subprocess.Popen, threading.Thread]:
        self.say(f"--- {job.name}: started at {self.elapsed():.0f} s")
        argv = [sys.executable, *job.argv, "--rows", str(self.rows_path)] + (["--smoke"] if self.smoke else [])
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=HERE.parent,
                                env={**self.env, "PYTHONUNBUFFERED": "1", **job.env}, start_new_session=True)
        reader = threading.Thread(target=self._pump, args=(job, proc), daemon=True)
        reader.start()
        return proc, reader

    def _pump(self, job: Job, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            if line.startswith(ROW_PREFIX):
                record = json.loads(line[len(ROW_PREFIX):])
                self.say(f"[{record['part']}] {record['check']}: {record['result']}  {record['note']}")
                continue
            self.log.write(f"[{job.name}] {line}\n")
            job.tail = (job.tail + [line])[-4:]

    def _report_exit(self, job: Job, proc: subprocess.Popen, seconds: float) -> None:
        """A part that failed without a row saying so (a crash, an exception) gets an error row."""
        code = proc.returncode
        self.say(f"--- {job.name}: exit {code} after {seconds:.0f} s")
        reported = any(r["pid"] == proc.pid and r["status"] in ("fail", "error") for r in self.rows())
        if code != 0 and not reported:
            tail = " | ".join(line.strip()[:160] for line in job.tail if line.strip())
            self.row(job.part, job.name, f"ERROR exit {code}", tail or "no output", status="error")

    # ---- the parts -----------------------------------------------------------------------------------

    def toolchain(self) -> bool:
        """(t); False when there is no GPU to check."""
        status = self.run([Job("toolchain", "t", ["benchmarks/gpu_check_kernels.py", "toolchain"])], 1)
        root = next((r["result"] for r in reversed(self.rows()) if r.get("key") == "cuda_root"), None)
        if root and not self.env.get("CUDA_ROOT"):
            self.env["CUDA_ROOT"] = root
        return status.get("toolchain") != 3

    def all_parts(self, only: str) -> None:
        self.say(f"gpu_check: {'smoke run' if self.smoke else 'full run'}, out {self.out}, budget {self.budget:.0f} s; "
                 "expected " + ", ".join(f"{p} {EXPECTED_S[p]} s" for p in PARTS if p in only)
                 + f" = {sum(EXPECTED_S[p] for p in PARTS if p in only)} s")
        if "t" in only and not self.toolchain():
            self.row("t", "GPU check", "stopped", "no GPU backend: nothing else would measure a GPU", status="error")
            return
        no_prealloc = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}  # parts that share the GPU take what they use
        # A smoke run's timings mean nothing: every part that needs no partner goes into one queue
        # (longest first) instead of part after part, so no worker idles at a part's end.
        pool: list[Job] = []

        def launch(jobs: list[Job], concurrency: int) -> None:
            if self.smoke:
                pool.extend(jobs)
            else:
                self.run(jobs, concurrency)

        if "p" in only and self.fits("p"):
            launch([Job("ceilings", "p", ["benchmarks/gpu_check_kernels.py", "ceilings"], no_prealloc)], 1)
        if "a" in only and self.fits("a"):
            cases = SMOKE_KERNEL_CASES if self.smoke else KERNEL_CASES
            launch([Job(c.name, "a", ["benchmarks/gpu_check_kernels.py", "case", c.name], no_prealloc)
                    for c in cases], self.jobs)
        if "c" in only and self.fits("c"):
            lock = Path(tempfile.mkdtemp(prefix="gpu_check-c-")) / "timing.lock"  # not in $OUT: nothing to return
            # Three engines of 16 GiB weights + 16 GiB KV cache each fit side by side in 141 GB.
            share = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.28"}
            backends = SMOKE_E2E_BACKENDS if self.smoke else E2E_BACKENDS
            together = len(backends) if not self.smoke else min(self.jobs, len(backends))
            # Run as one batch even in a smoke run: the backends wait for each other to time.
            self.run([Job(f"e2e {b}", "c", ["benchmarks/gpu_check_e2e.py", b, "--lock", str(lock), "--peers",
                                            str(together)], share) for b in backends], together)
            shutil.rmtree(lock.parent, ignore_errors=True)
            self.compare_backends()
        if "b" in only and self.fits("b"):
            # One family at a time on a GPU, so no timing shares it.
            launch([Job(f"timing {f}", "b", ["benchmarks/gpu_check_kernels.py", "timing", f], no_prealloc)
                    for f in TIMING_FAMILIES], 1)
            if not self.smoke:
                self.judge_kernels()
        last = [Job(name, part, [script], no_prealloc) for part, name, script in (
            ("q", "quantization", "benchmarks/gpu_check_quant.py"), ("d", "moe", "benchmarks/gpu_check_moe.py"))
            if part in only]
        if self.smoke:
            pool.extend(last)
            self.run(sorted(pool, key=lambda job: -EXPECTED_S[job.part]), self.jobs)
            if "b" in only:
                self.judge_kernels()
            return
        for job in last:  # one at a time on a GPU: each times things
            if self.fits(job.part):
                self.run([job], 1)

    def compare_backends(self) -> None:
        values = {r["key"]: r["value"] for r in self.rows() if r.get("key", "") and r["key"].startswith("c:")}
        for phase in ("prefill", "decode"):
            cells = []
            for backend in SMOKE_E2E_BACKENDS if self.smoke else E2E_BACKENDS:
                on, off = values.get(f"c:{backend}:async:{phase}"), values.get(f"c:{backend}:sync:{phase}")
                cells.append(f"{backend} {on or 0:.0f}/{off or 0:.0f}")
            self.row("c", f"{phase} tok/s by backend (async/sync)", "; ".join(cells), "side by side, same workload")

    def judge_kernels(self) -> None:
        """The kernels the engine runs on pure-decode steps (each family's decode-only kernel; Triton
        is the first choice, Mosaic GPU the fallback on Hopper) against the targets, and what each
        gains over its family's ragged kernel, which mixed steps run."""
        values = {r["key"]: r["value"] for r in self.rows() if r.get("key", "") and r["key"].startswith("b:")}
        bw = next((r["value"] for r in reversed(self.rows()) if r.get("key") == "copy_bw"), None)
        for label in ("decode 64x1024", "decode 64x4096", "decode 256x1024"):
            jax_kernel = values.get(f"b:{label}:jax pallas paged_attention")
            batch, ctx = (int(x) for x in label.split()[1].split("x"))
            for family in ("triton", "mosaic"):
                decode, ragged = values.get(f"b:{label}:{family} decode-only"), values.get(f"b:{label}:{family} ragged")
                if decode is None or not bw:
                    continue
                share = 2 * batch * ctx * 8 * 128 * 2 / decode / bw
                vs_jax = jax_kernel / decode if jax_kernel else float("nan")
                met = share >= 0.7 and vs_jax >= 1.0
                first = family == "triton"  # the engine's first choice is held to the targets
                self.row("b", f"{label} {family} decode-only vs targets (>= 70% copy BW, >= 1.0x JAX)",
                         "met" if met else "not met",
                         f"{100 * share:.0f}% of copy BW, {vs_jax:.2f}x JAX's kernel"
                         + ("" if first else " (the fallback on Hopper: informs)"),
                         status="info" if met or self.smoke or not first else "fail")
                if ragged:
                    self.row("b", f"{label} {family} decode-only vs ragged", f"{ragged / decode:.2f}x",
                             "what the engine's pure-decode programs gain over the ragged kernel")

    def summary(self) -> int:
        rows = self.rows()
        table = [("part", "check", "result", "note")] + [(r["part"], r["check"], r["result"], r["note"][:110])
                                                          for r in rows]
        widths = [min(70, max(len(t[i]) for t in table)) for i in range(3)]
        lines = ["  ".join(t[i][:70].ljust(widths[i]) for i in range(3)) + "  " + t[3] for t in table]
        bad = [r for r in rows if r["status"] in ("fail", "error")]
        verdict = f"wall {self.elapsed():.0f} s; {len(bad)} row(s) failed or errored" if bad else \
            f"wall {self.elapsed():.0f} s; nothing failed"
        text = "\n".join(["", "=" * 30 + " gpu_check summary " + "=" * 30, *lines, verdict])
        (self.out / "summary.md").write_text("```\n" + text.strip() + "\n```\n")
        self.say(text)
        no_gpu = any(r["check"] == "GPU check" and r["result"] == "stopped" for r in rows)
        return 3 if no_gpu else (1 if bad else 0)


def _kill(proc: subprocess.Popen) -> None:
    """Stop a part's whole process group: SIGINT first (Python prints where it was), then SIGKILL."""
    for sig, wait in ((signal.SIGINT, 5), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(wait)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; any machine (kernels interpreted on a CPU)")
    ap.add_argument("--out", type=Path, help="where rows.jsonl, gpu_check.log and summary.md go (default: $OUT, "
                    "else a new temporary folder)")
    ap.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds: a part that would not fit is skipped")
    ap.add_argument("--jobs", type=int, help="kernel cases run at a time (default 4; 2 with --smoke)")
    ap.add_argument("--only", help=f"parts to run, e.g. 't,c' (default: {DEFAULT_PARTS}; with --smoke, all of "
                    f"{PARTS})")
    args = ap.parse_args()
    out = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(tempfile.mkdtemp(prefix="gpu_check-")))
    out.mkdir(parents=True, exist_ok=True)
    if not args.smoke:
        # The CUDA backend or nothing: a JAX that fell back to CPU would spend the lease interpreting.
        os.environ.setdefault("JAX_PLATFORMS", "cuda")
    check = Check(out, args.smoke, args.budget, args.jobs or (2 if args.smoke else 4))
    try:
        check.all_parts((args.only or (PARTS if args.smoke else DEFAULT_PARTS)).replace(",", ""))
    except KeyboardInterrupt:
        check.row("-", "interrupted", "ERROR", "stopped from outside; rows so far are kept", status="error")
    sys.exit(check.summary())


if __name__ == "__main__":
    main()
