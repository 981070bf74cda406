"""Soak test: a running `paxserve serve` under client misbehaviour. The server must never die because of a client.

    paxserve serve --max-model-len 1024 &
    python benchmarks/soak.py --duration 600 --num-clients 64 --server-pid $!

Workload: --num-clients concurrent clients, each looping over requests for --duration seconds. Each
request draws a ShareGPT-like prompt and output length (benchmarks/workload.py's lognormal model,
seeded per client from --seed, clipped to the model's context; max_tokens <= --max-tokens). Half go to
/v1/completions (random token-id prompts), half to /v1/chat/completions (random English words); 85%
stream (with usage), 15% do not; 10% ask n=2, 15% logprobs, half ignore_eos (those must come back with
exactly max_tokens tokens per choice, or what the context leaves).

With probability --disconnect-prob a client cuts the request on purpose: half of those by a client
timeout drawn log-uniformly in [1 ms, --max-cut-delay] (short ones cut while the request is still
queued, before any event), the other half (streams only) by closing the connection after a random
number of SSE events. A deliberate cut counts as a cut, never as an error (and a request meant to be
cut that finishes first is judged as a normal one). 429 with Retry-After counts as rejected (the client
waits that long, 5 s at most). Everything else is an error: another non-2xx status, a stream that ends
without `data: [DONE]`, an in-band error event, a choice without a finish_reason, missing usage, a
token count other than asked (ignore_eos: exact, logprobs included; otherwise at most max_tokens per
choice), a refused or reset connection, no answer within --request-timeout.

Every --sample-interval seconds: the server's RSS (--server-pid, else the process listening on the
port, else skipped), /health (anything but 200 starts an engine death event), the /metrics gauges
paxserve:num_requests_running / num_requests_waiting / kv_cache_usage_perc, and the request counts
so far; one progress line each. At the end the clients stop (requests still in flight are cut and
counted as stopped), the gauges must return to 0 within --drain-timeout; then a markdown summary, --json
(summary and every sample) and --plot (RSS, KV usage and running requests over time). RSS growth is
the linear-fit slope (MiB/min) over the second half of the run. Exit status 0 only when there were no
errors, no engine deaths and the gauges returned to 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import aiohttp
import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from plotting import pyplot, save_figure  # noqa: E402
from soak_plan import MIN_CUT_DELAY, Plan, absorb, check_answer, make_plan  # noqa: E402,F401 (tests use them)

GAUGES = {"running": "paxserve:num_requests_running", "waiting": "paxserve:num_requests_waiting",
          "kv_usage": "paxserve:kv_cache_usage_perc"}

@dataclass
class Stats:
    started: int = 0
    completed: int = 0
    cut: int = 0
    rejected: int = 0
    errors: int = 0
    stopped: int = 0  # in flight when the clients were stopped
    output_tokens: int = 0
    cut_kinds: Counter = field(default_factory=Counter)
    error_kinds: Counter = field(default_factory=Counter)

    def counts(self) -> dict[str, int]:
        return {k: v for k, v in asdict(self).items() if isinstance(v, int)}


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {metric name: value summed over its label sets}."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, rest = line.split("{", 1)
            rest = rest.rsplit("}", 1)[-1]
        else:
            name, _, rest = line.partition(" ")
        try:
            values[name.strip()] = values.get(name.strip(), 0.0) + float(rest.split()[0])
        except (ValueError, IndexError):
            continue
    return values


def slope_per_min(times_s: list[float], values: list[float | None]) -> float | None:
    """Least-squares slope of values against time, per minute (None values left out; None if < 2 times)."""
    pts = [(t / 60.0, v) for t, v in zip(times_s, values) if v is not None]
    if len({t for t, _ in pts}) < 2:
        return None
    return float(np.polyfit([t for t, _ in pts], [v for _, v in pts], 1)[0])


def second_half_slope(times_s: list[float], values: list[float | None]) -> float | None:
    """The slope over the samples from the middle of the time range on (warm-up growth left out)."""
    if not times_s:
        return None
    mid = (times_s[0] + times_s[-1]) / 2
    late = [(t, v) for t, v in zip(times_s, values) if t >= mid]
    return slope_per_min([t for t, _ in late], [v for _, v in late])


def find_server_process(pid: int | None, base_url: str) -> psutil.Process | None:
    """The process with --server-pid, else the one listening on the URL's port, else None."""
    try:
        if pid:
            return psutil.Process(pid)
        port = urlparse(base_url).port or 80
        for c in psutil.net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                return psutil.Process(c.pid)
    except (psutil.Error, OSError):
        pass
    return None


def rss_mib(proc: psutil.Process | None) -> float | None:
    try:
        return proc.memory_info().rss / 2**20 if proc is not None else None
    except psutil.Error:
        return None


class Soak:
    def __init__(self, args: argparse.Namespace, session: aiohttp.ClientSession, model: str, max_model_len: int,
                 headers: dict[str, str]) -> None:
        self.args, self.session, self.model, self.headers = args, session, model, headers
        self.max_model_len = max_model_len
        self.base = args.base_url.rstrip("/")
        self.proc = find_server_process(args.server_pid, args.base_url)
        self.stats = Stats()
        self.samples: list[dict[str, Any]] = []
        self.deaths = self.unhealthy_samples = 0
        self.healthy = True

    # ---------------------------------------------------------------- clients

    async def client(self, cid: int) -> None:
        rng = np.random.default_rng([self.args.seed, cid])
        a = self.args
        while True:
            plan = make_plan(rng, model=self.model, max_model_len=self.max_model_len, max_tokens=a.max_tokens,
                             vocab_size=a.vocab_size, disconnect_prob=a.disconnect_prob, max_cut_delay=a.max_cut_delay)
            self.stats.started += 1
            try:
                kind, detail, tokens = await self.attempt(plan)
            except asyncio.CancelledError:
                self.stats.stopped += 1
                raise
            if kind == "completed":
                self.stats.completed += 1
                self.stats.output_tokens += tokens
            elif kind == "cut":
                self.stats.cut += 1
                self.stats.cut_kinds[detail] += 1
            elif kind == "rejected":
                self.stats.rejected += 1
                try:
                    wait = min(max(float(detail), 0.0), 5.0)
                except ValueError:
                    wait = 1.0
                await asyncio.sleep(wait + 0.05)
            else:
                self.stats.errors += 1
                self.stats.error_kinds[detail[:160]] += 1
                await asyncio.sleep(0.1)  # a dead server must not make the clients spin

    async def attempt(self, plan: Plan) -> tuple[str, str, int]:
        """(kind, detail, tokens): completed/cut/rejected/error; never raises but CancelledError."""
        progress = {"events": 0}
        deadline = asyncio.timeout(plan.cut_after if plan.cut == "timeout" else None)
        try:
            async with deadline:
                return await self.exchange(plan, progress)
        except TimeoutError:
            if deadline.expired():
                return "cut", "timeout mid-stream" if progress["events"] else "timeout before the first event", 0
            return "error", f"no answer within --request-timeout {self.args.request_timeout:g} s", 0
        except aiohttp.ClientConnectorError as e:
            return "error", f"cannot connect: {e.os_error!r}", 0
        except (aiohttp.ClientError, OSError, ValueError) as e:  # reset, server disconnected, bad payload or JSON
            return "error", f"{type(e).__name__}: {e}", 0
        except Exception as e:  # noqa: BLE001 - a malformed answer (a chunk of the wrong shape): an error too
            return "error", f"unexpected {type(e).__name__}: {e}", 0

    async def exchange(self, plan: Plan, progress: dict[str, int]) -> tuple[str, str, int]:
        url = self.base + ("/v1/chat/completions" if plan.chat else "/v1/completions")
        finishes: dict[int, str] = {}
        logprob_counts: dict[int, int] = {}
        async with self.session.post(url, json=plan.body, headers=self.headers) as resp:
            if resp.status == 429 and "Retry-After" in resp.headers:
                return "rejected", resp.headers["Retry-After"], 0
            if not 200 <= resp.status < 300:
                return "error", f"HTTP {resp.status}: {(await resp.text())[:120]}", 0
            if not plan.body["stream"]:
                data = await resp.json()
                if "error" in data:
                    return "error", f"error in a 2xx answer: {str(data['error'])[:120]}", 0
                absorb(data.get("choices") or [], finishes, logprob_counts, plan.chat)
                usage = data.get("usage")
            else:
                usage, done = None, False
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        done = True
                        break
                    progress["events"] += 1
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        return "error", f"in-band error event: {str(chunk['error'])[:120]}", 0
                    absorb(chunk.get("choices") or [], finishes, logprob_counts, plan.chat)
                    usage = chunk.get("usage") or usage
                    if plan.cut == "events" and progress["events"] >= plan.cut_after:
                        resp.close()
                        return "cut", "closed after some events", 0
                if not done:
                    return "error", "stream ended without data: [DONE]", 0
        problem, tokens = check_answer(plan, finishes, logprob_counts, usage, self.max_model_len)
        return ("error", problem, tokens) if problem else ("completed", "", tokens)

    # ---------------------------------------------------------------- sampling

    async def get(self, path: str) -> tuple[int | None, str]:
        try:
            async with self.session.get(self.base + path, headers=self.headers,
                                        timeout=aiohttp.ClientTimeout(total=10)) as resp:
                return resp.status, await resp.text()
        except (aiohttp.ClientError, OSError, TimeoutError):
            return None, ""

    async def gauges(self) -> dict[str, float | None]:
        status, text = await self.get("/metrics")
        values = parse_metrics(text) if status == 200 else {}
        return {key: values.get(name) for key, name in GAUGES.items()}

    async def sample(self, t: float, phase: str) -> dict[str, Any]:
        health, _ = await self.get("/health")
        s = {"t_s": round(t, 3), "phase": phase, "rss_mib": rss_mib(self.proc), "health": health,
             **await self.gauges(), **self.stats.counts()}
        if health != 200:
            self.unhealthy_samples += 1
            self.deaths += self.healthy  # a new death event when it was healthy before
        self.healthy = health == 200
        self.samples.append(s)
        rss = "-" if s["rss_mib"] is None else f"{s['rss_mib']:.1f}"
        kv = "-" if s["kv_usage"] is None else f"{100 * s['kv_usage']:.1f}%"
        run, wait = ("-" if s[k] is None else f"{s[k]:g}" for k in ("running", "waiting"))
        print(f"[{t:7.1f} s] rss {rss} MiB | health {health or 'down'} | running {run} waiting {wait} kv {kv} | "
              f"started {s['started']} completed {s['completed']} cut {s['cut']} rejected {s['rejected']} "
              f"errors {s['errors']}", flush=True)
        return s

    async def drain(self) -> tuple[bool, float]:
        """Whether running, waiting and KV usage all went back to 0 within --drain-timeout, and how long it took."""
        start = time.monotonic()
        while True:
            g = await self.gauges()
            if all(v is not None and abs(v) < 1e-9 for v in g.values()):
                return True, time.monotonic() - start
            if time.monotonic() - start >= self.args.drain_timeout:
                return False, time.monotonic() - start
            await asyncio.sleep(0.2)

    # ---------------------------------------------------------------- the run

    async def run(self) -> dict[str, Any]:
        a = self.args
        who = f"pid {self.proc.pid}" if self.proc else "not found: RSS skipped"
        print(f"Soak: {a.num_clients} clients for {a.duration:g} s against {self.base} (model {self.model}, "
              f"max_model_len {self.max_model_len}, disconnect prob {a.disconnect_prob}); server process {who}",
              flush=True)
        start = time.monotonic()
        tasks = [asyncio.create_task(self.client(i)) for i in range(a.num_clients)]
        k = 0
        while True:
            t = time.monotonic() - start
            await self.sample(t, "run")
            if t >= a.duration:
                break
            k += 1
            await asyncio.sleep(max(0.0, min(k * a.sample_interval, a.duration) - (time.monotonic() - start)))
        run_s = time.monotonic() - start
        for task in tasks:
            task.cancel()
        for r in await asyncio.gather(*tasks, return_exceptions=True):
            if not isinstance(r, asyncio.CancelledError):
                print(f"a client failed: {r!r}", flush=True)
        drained, drain_s = await self.drain()
        await self.sample(time.monotonic() - start, "end")
        return {"config": vars(a), "summary": self.summary(run_s, drained, drain_s), "samples": self.samples}

    def summary(self, run_s: float, drained: bool, drain_s: float) -> dict[str, Any]:
        st, run = self.stats, [s for s in self.samples if s["phase"] == "run"]
        rss = [s["rss_mib"] for s in self.samples if s["rss_mib"] is not None]
        return {
            "duration_s": run_s, "clients": self.args.num_clients, "model": self.model, **st.counts(),
            "engine_deaths": self.deaths, "unhealthy_samples": self.unhealthy_samples,
            "output_tokens_per_s": st.output_tokens / run_s if run_s > 0 else 0.0,
            "rss_start_mib": rss[0] if rss else None, "rss_min_mib": min(rss) if rss else None,
            "rss_max_mib": max(rss) if rss else None, "rss_end_mib": rss[-1] if rss else None,
            "rss_slope_second_half_mib_per_min": second_half_slope([s["t_s"] for s in run],
                                                                   [s["rss_mib"] for s in run]),
            "drained": drained, "drain_s": drain_s, "cut_kinds": dict(st.cut_kinds),
            "error_kinds": dict(st.error_kinds.most_common(10)),
        }


RSS_KEYS = ("start", "min", "max", "end")


def _mib(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def markdown_summary(s: dict[str, Any]) -> str:
    slope = s["rss_slope_second_half_mib_per_min"]
    rows = [("duration", f"{s['duration_s']:.1f} s"), ("clients", s["clients"]), ("requests started", s["started"]),
            ("completed", s["completed"]), ("cut (deliberately)", s["cut"]), ("rejected (429)", s["rejected"]),
            ("errors", s["errors"]), ("stopped in flight at the end", s["stopped"]),
            ("engine deaths (/health not 200)", s["engine_deaths"]),
            ("output tokens/s", f"{s['output_tokens_per_s']:.1f}"),
            ("RSS start / min / max / end MiB", " / ".join(_mib(s[f"rss_{k}_mib"]) for k in RSS_KEYS)),
            ("RSS slope, second half", "-" if slope is None else f"{slope:+.2f} MiB/min"),
            ("running / waiting / KV usage back to 0", f"{'yes' if s['drained'] else 'NO'} ({s['drain_s']:.1f} s)")]
    return "\n".join(["| metric | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows])


def plot_soak(samples: list[dict[str, Any]], path: Path) -> str | None:
    """Server RSS (top) and KV usage with running/waiting requests (bottom) over time; None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    t = [s["t_s"] / 60 for s in samples]

    def col(key: str, scale: float = 1.0) -> list[float]:
        return [math.nan if s[key] is None else scale * s[key] for s in samples]

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    ax1.plot(t, col("rss_mib"), "-o", markersize=3)
    ax1.set_ylabel("server RSS (MiB)")
    ax1.set_title("Soak: server memory, KV-cache usage and running requests")
    ax2.plot(t, col("kv_usage", 100.0), "-", color="tab:green", label="KV-cache usage %")
    ax2.set_ylim(0, 105)
    ax2.set_ylabel("KV-cache usage (%)")
    ax2.set_xlabel("minutes")
    ax3 = ax2.twinx()
    ax3.plot(t, col("running"), "-", color="tab:orange", label="running requests")
    ax3.plot(t, col("waiting"), "--", color="tab:red", label="waiting requests")
    ax3.set_ylim(bottom=0)
    ax3.set_ylabel("requests")
    lines = ax2.get_lines() + ax3.get_lines()
    ax2.legend(lines, [ln.get_label() for ln in lines], fontsize=8, loc="upper left")
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
    return save_figure(plt, fig, path)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    connector = aiohttp.TCPConnector(limit=args.num_clients + 8)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.request_timeout),
                                     connector=connector) as session:
        try:
            async with session.get(args.base_url.rstrip("/") + "/v1/models", headers=headers) as resp:
                card = (await resp.json())["data"][0]
        except Exception as e:  # noqa: BLE001 - no server, or not an OpenAI one
            raise RuntimeError(f"cannot list the models at {args.base_url}/v1/models: {e!r}") from None
        model = args.model or card["id"]
        max_model_len = args.max_model_len or int(card.get("max_model_len") or 1024)
        return await Soak(args, session, model, max_model_len, headers).run()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the running server")
    p.add_argument("--api-key", default=None, help="sent as a bearer token (paxserve serve --api-key)")
    p.add_argument("--model", default=None, help="served model name (default: the first in /v1/models)")
    p.add_argument("--num-clients", type=int, default=64, help="concurrent clients, each looping (default 64)")
    p.add_argument("--duration", type=float, default=600.0, help="seconds the clients run (default 600)")
    p.add_argument("--seed", type=int, default=0, help="seeds every client's requests (client i: [seed, i])")
    p.add_argument("--max-tokens", type=int, default=256, help="max_tokens of a request at most (default 256)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="the server's context length (default: /v1/models' max_model_len, else 1024)")
    p.add_argument("--vocab-size", type=int, default=49152, help="token ids of completion prompts lie below it")
    p.add_argument("--disconnect-prob", type=float, default=0.3, help="chance a request is cut on purpose (0.3)")
    p.add_argument("--max-cut-delay", type=float, default=3.0, help="longest cutting client timeout, seconds (3)")
    p.add_argument("--sample-interval", type=float, default=5.0, help="seconds between samples (default 5)")
    p.add_argument("--server-pid", type=int, default=None,
                   help="process whose RSS to sample (default: the one listening on --base-url's port, if found)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds the gauges get to return to 0 after the clients stop (default 30)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="a request with no answer by then is an error")
    p.add_argument("--json", default=str(Path(__file__).resolve().parent / "results" / "soak.json"),
                   help="write the summary and all samples here (default benchmarks/results/soak.json)")
    p.add_argument("--plot", default=str(Path(__file__).resolve().parent / "results" / "soak_rss_kv.png"),
                   help="the RSS / KV usage plot (default benchmarks/results/soak_rss_kv.png)")
    args = p.parse_args(argv)
    if args.num_clients < 1 or args.duration <= 0 or args.max_tokens < 1 or args.sample_interval <= 0:
        p.error("--num-clients and --max-tokens must be >= 1, --duration and --sample-interval > 0")
    if not 0 <= args.disconnect_prob <= 1 or args.max_cut_delay <= MIN_CUT_DELAY:
        p.error(f"--disconnect-prob must be in [0, 1] and --max-cut-delay > {MIN_CUT_DELAY}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = asyncio.run(run(args))
    except RuntimeError as e:
        print(e, flush=True)
        return 2
    s = result["summary"]
    print()
    print(markdown_summary(s))
    for kind, count in s["error_kinds"].items():
        print(f"error x{count}: {kind}")
    written = plot_soak(result["samples"], Path(args.plot))
    print(f"Plot: {written}" if written else "Plot skipped: matplotlib is not importable (pip install -e .[bench]).")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"JSON: {args.json}")
    ok = s["errors"] == 0 and s["engine_deaths"] == 0 and s["drained"]
    print("PASS" if ok else "FAIL: errors, engine deaths or gauges not back to 0", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
