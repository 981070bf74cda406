"""`benchmarks/serving.py`: its statistics (numpy percentiles, vLLM's TTFT/TPOT), the seeded workload,
the table and plots, and the request loop end to end against a small fake streaming server (not
paxserve): TTFT/ITL collection, several rates and concurrencies, JSON output, errors counted."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import sys
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from aiohttp import web
from tests.helpers import app_in_thread, load_benchmark


serving = load_benchmark("serving")
Result = serving.Result

FIRST_DELAY = 0.05  # the fake server's time to first chunk
GAP = 0.01  # and between chunks
HTTP_400_TOKENS = 999  # max_tokens values that make the fake server misbehave
STREAM_ERROR_TOKENS = 998
SHORT_TOKENS = 7  # reports one token fewer than asked (no sharegpt length of the main test)
BODIES = web.AppKey("bodies", list)


# --------------------------------------------------------------------------- the fake server


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})


async def _completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    request.app[BODIES].append(body)
    n = body["max_tokens"]
    if n == HTTP_400_TOKENS:
        return web.json_response({"error": {"message": "max_tokens is too large", "type": "BadRequestError",
                                            "param": "max_tokens", "code": 400}}, status=400)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)

    async def send(obj: dict) -> None:
        await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

    await asyncio.sleep(FIRST_DELAY)
    if n == STREAM_ERROR_TOKENS:
        await send({"error": {"message": "boom", "type": "InternalServerError", "param": None, "code": 500}})
    else:
        reported = n - 1 if n == SHORT_TOKENS else n
        for i in range(reported):
            if i:
                await asyncio.sleep(GAP)
            await send({"id": "cmpl-1", "object": "text_completion", "model": "fake-model", "usage": None,
                        "choices": [{"index": 0, "text": f" t{i}", "logprobs": None,
                                     "finish_reason": "length" if i == reported - 1 else None}]})
        await send({"id": "cmpl-1", "object": "text_completion", "model": "fake-model", "choices": [],
                    "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": reported,
                              "total_tokens": len(body["prompt"]) + reported}})
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


@pytest.fixture(scope="module")
def fake_server():
    """An aiohttp server on a free port in a background thread; yields (base_url, received bodies)."""
    app = web.Application()
    app[BODIES] = []
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/v1/completions", _completions)
    with app_in_thread(app) as url:
        yield url, app[BODIES]


# --------------------------------------------------------------------------- statistics


def test_summary_is_numpy_percentiles() -> None:
    values = np.random.default_rng(0).lognormal(0, 1, 37).tolist()
    s = serving.summary(values)
    assert s["mean"] == pytest.approx(np.mean(values))
    for q in (50, 90, 99):
        assert s[f"p{q}"] == pytest.approx(np.percentile(values, q))
    assert serving.summary([1.0, 2.0, 3.0, 4.0]) == pytest.approx({"mean": 2.5, "p50": 2.5, "p90": 3.7, "p99": 3.97})
    assert serving.summary([]) == {}


def test_report_uses_vllm_definitions_and_each_requests_own_length() -> None:
    results = [
        Result(True, ttft=0.5, latency=2.5, output_tokens=11, prompt_tokens=7, itl=[0.1, 0.3], requested_tokens=11),
        Result(True, ttft=1.0, latency=1.0, output_tokens=1, prompt_tokens=5, itl=[], requested_tokens=1),
        Result(True, ttft=0.2, latency=4.2, output_tokens=5, prompt_tokens=3, itl=[1.0], requested_tokens=6),
        Result(False, error="HTTP 400: no", requested_tokens=9),
    ]
    r = serving.build_report(results, 4.0, model="m", request_rate=math.inf, concurrency=0, dataset="fixed")
    assert (r["completed"], r["errors"], r["error_samples"]) == (3, 1, ["HTTP 400: no"])
    assert r["request_rate"] == "inf" and r["concurrency"] == 0
    assert r["request_throughput"] == pytest.approx(3 / 4)
    assert r["output_token_throughput"] == pytest.approx(17 / 4)
    assert r["total_token_throughput"] == pytest.approx((17 + 15) / 4)
    assert r["requested_output_tokens"] == 11 + 1 + 6 + 9
    assert r["ttft_s"] == serving.summary([0.5, 1.0, 0.2])
    # TPOT = (latency - TTFT) / (output tokens - 1); a one-token request has none.
    assert r["tpot_s"] == serving.summary([2.0 / 10, 4.0 / 4])
    assert r["itl_s"] == serving.summary([0.1, 0.3, 1.0])
    assert r["e2e_s"] == serving.summary([2.5, 1.0, 4.2])
    assert r["wrong_token_counts"] == 1  # 5 of 6 asked; the others got their own lengths
    json.dumps(r, allow_nan=False)  # plain JSON, "inf" as a string


def test_workload_is_seeded_per_request_and_clipped() -> None:
    a = serving.make_requests("sharegpt", 100, max_model_len=256, seed=1)
    assert a == serving.make_requests("sharegpt", 100, max_model_len=256, seed=1)
    prompts, outs = a
    assert all(len(p) + o <= 256 and o >= 1 for p, o in zip(prompts, outs))
    assert len(set(outs)) > 10  # per-request lengths
    workload = sys.modules["workload"]
    assert [(len(p), o) for p, o in zip(prompts, outs)] == workload.sharegpt_lengths(100, max_model_len=256, seed=1)
    fixed_prompts, fixed_outs = serving.make_requests("fixed", 5, max_model_len=1024, seed=0, output_len=64)
    assert fixed_outs == [64] * 5 and all(16 <= len(p) <= 256 for p in fixed_prompts)
    with pytest.raises(ValueError, match="exceeds"):
        serving.make_requests("fixed", 5, max_model_len=200, seed=0, output_len=64)


def test_rate_and_concurrency_lists() -> None:
    assert serving.parse_rates("0.5,1,2,4,inf") == [0.5, 1.0, 2.0, 4.0, math.inf]
    assert serving.parse_rates("0") == [math.inf]
    assert serving.parse_concurrencies("1,4,16,64") == [1, 4, 16, 64]
    for bad in ("-1", "", "nan"):
        with pytest.raises(Exception):
            serving.parse_rates(bad)
    with pytest.raises(Exception):
        serving.parse_concurrencies("-2")
    gaps = serving.arrival_gaps(5000, 0)
    assert gaps == serving.arrival_gaps(5000, 0) and gaps[0] == 0.0
    assert np.mean(gaps[1:]) == pytest.approx(1.0, rel=0.05)


def _report(rate, concurrency: int, ttft: float) -> dict:
    results = [Result(True, ttft=ttft * k, latency=ttft * k + 1, output_tokens=11, prompt_tokens=4, itl=[0.1],
                      requested_tokens=11) for k in (1, 2, 3)]
    return serving.build_report(results, 5.0, model="m", request_rate=rate, concurrency=concurrency)


def test_markdown_table_rows() -> None:
    table = serving.markdown_table([_report(0.5, 64, 0.1), _report(math.inf, 0, 0.2),
                                    serving.build_report([Result(False, error="x")], 1.0, model="m",
                                                         request_rate=1.0, concurrency=4)])
    lines = table.splitlines()
    assert lines[0].startswith("| request rate | concurrency | completed | errors |") and len(lines) == 5
    assert lines[2].startswith("| 0.5 | 64 | 3 | 0 | 5.0 | 0.60 | 6.6 | 200.0 / 200.0 / 280.0 / 298.0 |")
    assert lines[3].startswith("| inf | no cap | 3 | 0 |")
    assert lines[4] == "| 1.0 | 4 | 0 | 1 | 1.0 | 0.00 | 0.0 | - / - / - / - | - / - / - / - | - / - | - / - |"


def test_plots_are_written_when_settings_vary(tmp_path: Path) -> None:
    by_rate = [_report(r, 64, 0.1 * i) for i, r in enumerate((0.5, 1.0, 2.0, math.inf), 1)]
    by_conc = [_report(math.inf, c, 0.1 * i) for i, c in enumerate((1, 4, 16, 0), 1)]
    notes = serving.write_plots(by_rate + by_conc, tmp_path)
    assert len(notes) == 2 and all(n.startswith("Plot: ") for n in notes)
    for name in ("serving_latency_vs_rate.png", "serving_throughput_vs_concurrency.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert serving.write_plots([_report(1.0, 4, 0.1)], tmp_path / "none") == []
    assert not (tmp_path / "none").exists()


# --------------------------------------------------------------------------- against the fake server


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_main_runs_each_setting_and_writes_json(fake_server, tmp_path: Path, capsys) -> None:
    url, bodies = fake_server
    bodies.clear()
    out_json = tmp_path / "reports.json"
    rc = serving.main(["--base-url", url, "--dataset", "sharegpt", "--max-model-len", "128", "--num-prompts", "4",
                       "--request-rate", "20,inf", "--concurrency", "1,4", "--json", str(out_json),
                       "--plot-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    reports = json.loads(out_json.read_text())
    assert [(r["concurrency"], r["request_rate"]) for r in reports] == [(1, 20.0), (1, "inf"), (4, 20.0), (4, "inf")]
    prompts, outs = serving.make_requests("sharegpt", 4, max_model_len=128, seed=0)
    assert len(bodies) == 16
    for k, body in enumerate(bodies):  # the same prompts, in order, with their own lengths, for every setting
        assert body["prompt"] == prompts[k % 4] and body["max_tokens"] == outs[k % 4]
        assert body["ignore_eos"] is True and body["stream"] is True and body["stream_options"]["include_usage"]
    for r in reports:
        assert (r["completed"], r["errors"], r["wrong_token_counts"], r["model"]) == (4, 0, 0, "fake-model")
        assert r["output_tokens"] == sum(outs) == r["requested_output_tokens"]
        assert FIRST_DELAY * 0.9 <= r["ttft_s"]["p50"] < 5
        assert r["itl_s"]["p50"] >= GAP * 0.8
        assert r["tpot_s"]["p50"] >= GAP * 0.8
        assert r["e2e_s"]["p50"] >= r["ttft_s"]["p50"]
    # Concurrency 1 runs the requests one after another: the run lasts at least their E2E latencies.
    assert reports[1]["duration_s"] >= 4 * (FIRST_DELAY * 0.9)
    assert "| 20.0 | 1 | 4 | 0 |" in out and "| inf | 4 | 4 | 0 |" in out
    assert (tmp_path / "serving_latency_vs_rate.png").stat().st_size > 0  # matplotlib is a test dependency
    assert (tmp_path / "serving_throughput_vs_concurrency.png").stat().st_size > 0


def test_server_errors_are_counted_not_raised(fake_server) -> None:
    url, _ = fake_server
    prompts = [[5, 6, 7]] * 4
    lens = [3, HTTP_400_TOKENS, STREAM_ERROR_TOKENS, SHORT_TOKENS]

    async def go(base: str) -> dict:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            return await serving.run_setting(session, base + "/v1/completions", "fake-model", prompts, lens, {},
                                             request_rate=math.inf, concurrency=0,
                                             gaps=serving.arrival_gaps(4, 0))

    r = asyncio.run(go(url))
    assert (r["completed"], r["errors"], r["wrong_token_counts"]) == (2, 2, 1)
    assert any(e.startswith("HTTP 400") and "too large" in e for e in r["error_samples"])
    assert any("boom" in e for e in r["error_samples"])
    # Nobody listening: every request fails, the run still reports.
    dead = asyncio.run(go(f"http://127.0.0.1:{_unused_port()}"))
    assert (dead["completed"], dead["errors"]) == (0, 4) and dead["ttft_s"] == {}
