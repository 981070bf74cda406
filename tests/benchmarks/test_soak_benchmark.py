"""`benchmarks/soak.py`: its helpers (request plans, answer checks, Prometheus parsing, the RSS slope) and
short soaks against an in-process fake OpenAI-shaped server (not paxserve): deliberate cuts counted as
cuts, server faults as errors with a failing exit status, /health turning 503 as an engine death."""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import time
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web
from tests.helpers import app_in_thread, load_benchmark

soak = load_benchmark("soak")

MODEL, MAX_MODEL_LEN = "fake-model", 512
FIRST_DELAY, GAP = 0.03, 0.003  # the fake's time to the first event, and between tokens
MODE = web.AppKey("mode", dict)


def _mode(**faults) -> dict:
    base = {"fail_prob": 0.0, "reject_prob": 0.0, "drop_prob": 0.0, "short_prob": 0.0, "unhealthy_from": None}
    return {**base, **faults}


# --------------------------------------------------------------------------- the fake server


def _logprobs(chat: bool, k: int) -> dict:
    if chat:
        return {"content": [{"token": " t", "logprob": -0.5, "bytes": [32, 116], "top_logprobs": []}] * k}
    return {"tokens": [" t"] * k, "token_logprobs": [-0.5] * k, "top_logprobs": [{" t": -0.5}] * k,
            "text_offset": list(range(k))}


def _choice(chat: bool, index: int, text: str, logprobs: dict | None, finish: str | None, chunk: bool) -> dict:
    if not chat:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    content = {"delta": {"content": text} if text else {}} if chunk else {"message": {"role": "assistant",
                                                                                     "content": text}}
    return {"index": index, **content, "logprobs": logprobs, "finish_reason": finish}


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    state, rng = request.app[MODE], request.app[MODE]["rng"]
    body = await request.json()
    state["bodies"].append(body)
    state["running"] += 1
    try:
        r = rng.random()
        if r < state["fail_prob"]:
            return web.json_response({"error": {"message": "boom", "type": "InternalServerError", "param": None,
                                                "code": 500}}, status=500)
        if r < state["fail_prob"] + state["reject_prob"]:
            return web.json_response({"error": {"message": "busy", "type": "RateLimitError", "param": None,
                                                "code": 429}}, status=429, headers={"Retry-After": "0"})
        n, lp = body.get("n", 1), bool(body.get("logprobs"))
        tokens = body["max_tokens"] - (rng.random() < state["short_prob"])
        prompt_tokens = len(body["messages"][0]["content"].split()) + 10 if chat else len(body["prompt"])
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n * tokens,
                 "total_tokens": prompt_tokens + n * tokens}
        kind = "chat.completion" if chat else "text_completion"
        await asyncio.sleep(FIRST_DELAY)
        if not body.get("stream"):
            choices = [_choice(chat, i, " t" * tokens, _logprobs(chat, tokens) if lp else None, "length", False)
                       for i in range(n)]
            return web.json_response({"id": "x", "object": kind, "model": MODEL, "choices": choices, "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        drop_at = tokens // 2 if rng.random() < state["drop_prob"] else None
        try:
            for t in range(tokens):
                if t == drop_at:
                    await resp.write_eof()  # the stream ends without [DONE]
                    return resp
                for i in range(n):
                    choice = _choice(chat, i, " t", _logprobs(chat, 1) if lp else None,
                                     "length" if t == tokens - 1 else None, True)
                    chunk = {"id": "x", "object": kind + ".chunk", "model": MODEL, "choices": [choice]}
                    await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                await asyncio.sleep(GAP)
            if body.get("stream_options", {}).get("include_usage"):
                last = {"id": "x", "object": kind + ".chunk", "model": MODEL, "choices": [], "usage": usage}
                await resp.write(b"data: " + json.dumps(last).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:  # the client cut
            pass
        return resp
    finally:
        state["running"] -= 1


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, False)


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _generate(request, True)


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model",
                                                          "max_model_len": MAX_MODEL_LEN}]})


async def _health(request: web.Request) -> web.Response:
    since = request.app[MODE]["unhealthy_from"]
    return web.Response(status=503 if since is not None and time.monotonic() >= since else 200)


async def _metrics(request: web.Request) -> web.Response:
    running = request.app[MODE]["running"]
    lines = ["# HELP paxserve:num_requests_running Number of requests in model execution batches.",
             "# TYPE paxserve:num_requests_running gauge",
             f'paxserve:num_requests_running{{model_name="{MODEL}"}} {float(running)}',
             f'paxserve:num_requests_waiting{{model_name="{MODEL}"}} 0.0',
             f'paxserve:kv_cache_usage_perc{{model_name="{MODEL}"}} {running / 100}',
             f'paxserve:prompt_tokens_total{{model_name="{MODEL}"}} 1234.0']
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


@pytest.fixture(scope="module")
def fake_server():
    """An aiohttp server on a free port in a background thread; yields (base_url, mode dict to set faults in)."""
    app = web.Application()
    app[MODE] = {**_mode(), "rng": random.Random(0), "bodies": [], "running": 0}
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat)
    with app_in_thread(app) as url:
        yield url, app[MODE]


def _soak(url: str, mode: dict, tmp_path: Path, *extra: str, duration: float = 3.0, **faults) -> tuple[int, dict]:
    mode.update(_mode(**faults))
    mode["bodies"].clear()
    argv = ["--base-url", url, "--num-clients", "8", "--duration", str(duration), "--sample-interval", "0.5",
            "--max-tokens", "12", "--max-cut-delay", "0.3", "--drain-timeout", "5", "--server-pid", str(os.getpid()),
            "--json", str(tmp_path / "soak.json"), "--plot", str(tmp_path / "soak.png"), *extra]
    rc = soak.main(argv)
    return rc, json.loads((tmp_path / "soak.json").read_text())


# --------------------------------------------------------------------------- soaks against the fake


def test_cuts_and_rejections_are_not_errors(fake_server, tmp_path: Path, capsys) -> None:
    url, mode = fake_server
    rc, result = _soak(url, mode, tmp_path, "--disconnect-prob", "0.5", reject_prob=0.05)
    out = capsys.readouterr().out
    s = result["summary"]
    assert rc == 0, out
    assert (s["errors"], s["engine_deaths"], s["drained"]) == (0, 0, True), s["error_kinds"]
    assert s["completed"] > 20 and s["cut"] > 20 and s["rejected"] > 0 and s["output_tokens_per_s"] > 0
    assert s["cut_kinds"].get("timeout before the first event", 0) > 0  # some cut before a byte of the answer
    assert s["cut_kinds"].get("closed after some events", 0) > 0
    assert s["started"] == s["completed"] + s["cut"] + s["rejected"] + s["errors"] + s["stopped"]
    bodies = mode["bodies"]  # the workload mix reached the server
    assert {"messages" in b for b in bodies} == {True, False}
    assert {b["stream"] for b in bodies} == {True, False} and {b["ignore_eos"] for b in bodies} == {True, False}
    assert any(b["n"] == 2 for b in bodies) and any(b.get("logprobs") for b in bodies)
    assert all(1 <= b["max_tokens"] <= 12 for b in bodies)
    samples = result["samples"]
    assert len(samples) >= 6 and samples[-1]["phase"] == "end" and samples[-1]["running"] == 0
    assert all(x["rss_mib"] > 0 and x["health"] == 200 for x in samples)
    assert any(x["running"] > 0 for x in samples if x["phase"] == "run")
    assert s["rss_min_mib"] <= s["rss_end_mib"] <= s["rss_max_mib"]
    assert (tmp_path / "soak.png").stat().st_size > 0
    assert "| errors | 0 |" in out and "| running / waiting / KV usage back to 0 | yes" in out and "PASS" in out
    assert "[    0.0 s] rss " in out  # a progress line per sample


def test_server_faults_are_errors_and_fail_the_soak(fake_server, tmp_path: Path, capsys) -> None:
    url, mode = fake_server
    rc, result = _soak(url, mode, tmp_path, "--disconnect-prob", "0", fail_prob=0.1, drop_prob=0.15,
                       short_prob=0.15)
    out = capsys.readouterr().out
    s = result["summary"]
    assert rc == 1, out
    assert s["errors"] > 0 and s["cut"] == 0 and s["completed"] > 0 and s["drained"]
    kinds = " ".join(s["error_kinds"])
    assert "HTTP 500" in kinds and "stream ended without data: [DONE]" in kinds and "wrong token count" in kinds
    assert "FAIL" in out


def test_health_503_counts_an_engine_death(fake_server, tmp_path: Path) -> None:
    url, mode = fake_server
    rc, result = _soak(url, mode, tmp_path, "--disconnect-prob", "0.2", duration=2.5,
                       unhealthy_from=time.monotonic() + 1.0)
    s = result["summary"]
    mode["unhealthy_from"] = None
    assert rc == 1
    assert s["engine_deaths"] == 1 and s["unhealthy_samples"] >= 2 and s["errors"] == 0
    assert [x["health"] for x in result["samples"]][-1] == 503


def test_no_server_is_exit_status_2(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert soak.main(["--base-url", f"http://127.0.0.1:{port}", "--duration", "1", "--json", ""]) == 2


def test_server_process_is_found_by_port(fake_server) -> None:
    url, _ = fake_server
    proc = soak.find_server_process(None, url)
    if proc is None:
        pytest.skip("psutil cannot map listening sockets to processes here")
    assert proc.pid == os.getpid() and soak.rss_mib(proc) > 0
    assert soak.rss_mib(None) is None


# --------------------------------------------------------------------------- helpers


def test_rss_slope_on_synthetic_data() -> None:
    t = np.arange(0, 601, 5.0)  # 10 minutes, a sample every 5 s
    warm = np.minimum(t, 300) / 60 * 40  # +40 MiB/min while warming up (first half), then...
    rss = 1000 + warm + np.where(t > 300, (t - 300) / 60 * 0.5, 0)  # ... +0.5 MiB/min
    assert soak.slope_per_min(list(t), list(1000 + 3 * t / 60)) == pytest.approx(3.0)
    assert soak.second_half_slope(list(t), list(rss)) == pytest.approx(0.5, abs=1e-6)
    noisy = rss + np.random.default_rng(0).normal(0, 2, t.size)
    assert soak.second_half_slope(list(t), list(noisy)) == pytest.approx(0.5, abs=0.5)
    assert soak.slope_per_min(list(t), [1000.0] * t.size) == pytest.approx(0.0, abs=1e-9)
    assert soak.slope_per_min([0.0, 60.0, 120.0], [None, 5.0, 7.0]) == pytest.approx(2.0)  # gaps left out
    assert soak.slope_per_min([0.0, 60.0], [None, 5.0]) is None and soak.second_half_slope([], []) is None


def test_parse_metrics() -> None:
    text = ('# HELP paxserve:num_requests_running x\n# TYPE paxserve:num_requests_running gauge\n'
            'paxserve:num_requests_running{model_name="a"} 3.0\npaxserve:num_requests_running{model_name="b"} 1.0\n'
            'paxserve:kv_cache_usage_perc{model_name="a",x="}"} 0.25\nprocess_resident_memory_bytes 1.5e+08\n'
            'bad line\n')
    values = soak.parse_metrics(text)
    assert values["paxserve:num_requests_running"] == 4.0 and values["paxserve:kv_cache_usage_perc"] == 0.25
    assert values["process_resident_memory_bytes"] == 1.5e8 and "bad" not in values


def _plan(n: int = 1, max_tokens: int = 10, ignore_eos: bool = True, logprobs: bool = False):  # noqa: ANN202
    return soak.Plan(False, {}, n, max_tokens, ignore_eos, logprobs)


def test_check_answer() -> None:
    usage = {"prompt_tokens": 5, "completion_tokens": 20}
    assert soak.check_answer(_plan(2), {0: "length", 1: "length"}, {}, usage, 100) == ("", 20)
    assert "wrong token count" in soak.check_answer(_plan(2), {0: "length", 1: "length"}, {},
                                                    {**usage, "completion_tokens": 19}, 100)[0]
    assert "without a finish_reason" in soak.check_answer(_plan(2), {0: "length"}, {}, usage, 100)[0]
    assert soak.check_answer(_plan(), {0: "length"}, {}, None, 100)[0] == "no usage in the answer"
    # The context leaves 4 tokens: that is what ignore_eos must give.
    assert soak.check_answer(_plan(), {0: "length"}, {}, {"prompt_tokens": 96, "completion_tokens": 4}, 100)[0] == ""
    assert "finish_reason" in soak.check_answer(_plan(2), {0: "stop", 1: "length"}, {}, usage, 100)[0]
    assert "logprobs" in soak.check_answer(_plan(2, logprobs=True), {0: "length", 1: "length"}, {0: 10, 1: 9},
                                           usage, 100)[0]
    # Without ignore_eos an early stop is fine, more than asked is not.
    free = _plan(2, ignore_eos=False)
    assert soak.check_answer(free, {0: "stop", 1: "length"}, {}, {**usage, "completion_tokens": 13}, 100)[0] == ""
    assert "at most" in soak.check_answer(free, {0: "stop", 1: "length"}, {}, {**usage, "completion_tokens": 21},
                                          100)[0]


def test_plans_are_seeded_and_fit_the_context() -> None:
    def draw(seed: int) -> list:
        rng = np.random.default_rng([seed, 0])
        return [soak.make_plan(rng, model="m", max_model_len=256, max_tokens=64, vocab_size=1000,
                               disconnect_prob=0.3, max_cut_delay=3.0) for _ in range(2000)]

    plans = draw(0)
    assert [p.body for p in plans[:50]] == [p.body for p in draw(0)[:50]]
    assert all(1 <= p.max_tokens <= 64 for p in plans)
    assert all(len(p.body["prompt"]) + p.max_tokens <= 256 and all(3 <= i < 1000 for i in p.body["prompt"])
               for p in plans if not p.chat)
    assert all(len(p.body["messages"][0]["content"].split()) * 2 + p.max_tokens <= 256 for p in plans if p.chat)
    cuts = [p for p in plans if p.cut]
    assert 0.25 < len(cuts) / len(plans) < 0.35
    timeouts = [p.cut_after for p in cuts if p.cut == "timeout"]
    assert min(timeouts) < 0.01 and max(timeouts) > 1.0 and all(0.001 <= x <= 3.0 for x in timeouts)
    assert all(p.body["stream"] and 1 <= p.cut_after <= p.max_tokens for p in cuts if p.cut == "events")
    for share, test in ((0.5, lambda p: p.chat), (0.85, lambda p: p.body["stream"]), (0.1, lambda p: p.n == 2),
                        (0.15, lambda p: p.logprobs), (0.5, lambda p: p.ignore_eos)):
        assert abs(sum(map(test, plans)) / len(plans) - share) < 0.05
