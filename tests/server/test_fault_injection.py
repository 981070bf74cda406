"""Failing engine steps seen through the HTTP API: only the requests in a failing step fail (500,
or an in-band error event then [DONE] when streaming), everything else keeps being served. The app
runs in-process (a real TCP port, the official openai client) over the tiny random Llama, so the
test can make chosen steps raise; then an engine whose loop dies makes /health answer 503."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import aiohttp
import numpy as np
import openai
import pytest

from paxserve import AsyncEngine, Engine
from paxserve.server.app import create_app
from paxserve.server.settings import ServerSettings
from paxserve.server.transport import TransportLimits, make_runner
from tests.helpers import app_in_thread
from tests.paxserve.test_engine import TEST_ENGINE_ARGS, tiny_dir  # noqa: F401

MODEL = "tiny"
PROMPT = [5, 17, 300, 4000, 42, 7, 99, 1234]


@dataclass
class Live:
    url: str
    engine: Engine
    async_engine: AsyncEngine
    faults: "Faults"

    def client(self, timeout: float = 60.0) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=timeout)

    def metric(self, name: str) -> float:
        import urllib.request

        text = urllib.request.urlopen(f"{self.url}/metrics", timeout=10).read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name) and not line.startswith("#"))

    def wait_idle(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            snap = self.async_engine.snapshot
            if snap.num_requests_running == snap.num_requests_waiting == 0 and snap.kv_cache_usage == 0:
                return
            assert time.monotonic() < deadline, f"still busy: {snap}"
            time.sleep(0.05)


class Faults:
    """Wraps the runner's `collect` (where a device fault surfaces: waiting for a step's results):
    raises on the steps chosen by `arm`, counting from the arm."""

    def __init__(self, engine: Engine) -> None:
        self.real = engine.runner.collect
        self.engine = engine
        self.lock = threading.Lock()
        self.plan: set[int] = set()
        self.lose_kv = False
        self.calls = 0
        self.injected = 0
        engine.runner.collect = self.collect

    def arm(self, steps: set[int], lose_kv: bool = False) -> None:
        with self.lock:
            self.plan, self.lose_kv, self.calls = set(steps), lose_kv, 0

    def collect(self, step):  # noqa: ANN001, ANN201
        with self.lock:
            call, self.calls = self.calls, self.calls + 1
            fail = call in self.plan
        if fail:
            self.injected += 1
            if self.lose_kv:
                self.engine.runner.kv_cache.k.delete()
            raise RuntimeError("injected fault in /secret/path/model.py at 0xdeadbeef")
        return self.real(step)


@pytest.fixture(scope="module")
def live(tiny_dir: Path) -> Iterator[Live]:  # noqa: F811
    engine = Engine(str(tiny_dir), **TEST_ENGINE_ARGS)
    faults = Faults(engine)
    async_engine = AsyncEngine(engine.parts)
    app = create_app(async_engine, ServerSettings(served_model_names=[MODEL]))
    with app_in_thread(app, lambda a: make_runner(a, TransportLimits())) as url:
        yield Live(url, engine, async_engine, faults)
    async_engine.shutdown()


def greedy(live: Live) -> str:
    return live.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                            extra_body={"ignore_eos": True}).choices[0].text


def no_leak(message: str) -> None:
    assert "0x" not in message and "/secret" not in message and "injected" not in message, message
    assert "Traceback" not in message


def test_a_failing_step_is_a_500_and_the_next_request_is_served(live: Live) -> None:
    before = greedy(live)
    failures = live.metric("paxserve:engine_step_failures_total")
    live.faults.arm({0})
    with pytest.raises(openai.InternalServerError) as err:
        live.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    body = err.value.body
    assert err.value.status_code == 500 and body["code"] == 500 and body["type"] == "InternalServerError"
    no_leak(body["message"])
    assert live.metric("paxserve:engine_step_failures_total") == failures + 1
    assert live.metric('paxserve:request_success_total{finished_reason="error"') >= 1
    live.wait_idle()
    assert greedy(live) == before


def test_a_failing_step_mid_stream_sends_an_error_event_then_done(live: Live) -> None:
    live.faults.arm({3})

    async def stream() -> list[str]:
        async with aiohttp.ClientSession() as session:
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 20, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            async with session.post(f"{live.url}/v1/completions", json=body) as resp:
                assert resp.status == 200
                return [line.decode().strip() for line in (await resp.read()).splitlines() if line.strip()]

    lines = asyncio.run(stream())
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert any("choices" in e for e in events[:-1]), "some tokens streamed before the failure"
    error = events[-1]["error"]
    assert error["code"] == 500
    no_leak(error["message"])
    live.wait_idle()


def test_faults_at_random_steps_under_load_fail_only_their_requests(live: Live) -> None:
    before = greedy(live)
    rng = np.random.default_rng(5)
    # Sixteen requests of 3 to 18 tokens arrive together; a step failing after the shorter ones are
    # done must fail the rest and only the rest.
    fail_at = int(rng.integers(8, 13))
    live.faults.arm({fail_at})
    injected_before = live.faults.injected

    async def one(i: int, client: openai.AsyncOpenAI) -> str:
        prompt = [int(t) for t in rng.integers(3, 49152, 4 + i % 7)]
        kwargs = dict(model=MODEL, prompt=prompt, max_tokens=3 + i, temperature=0, extra_body={"ignore_eos": True})
        try:
            if i % 2:
                out = await client.completions.create(**kwargs)
                assert out.usage.completion_tokens == kwargs["max_tokens"]
                return "ok"
            stream = await client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
            usage = None
            async for chunk in stream:
                usage = chunk.usage or usage
            assert usage.completion_tokens == kwargs["max_tokens"]
            return "ok"
        except openai.InternalServerError as e:
            no_leak(e.body["message"])
            return "500"
        except openai.APIError as e:  # the in-band error event of a stream
            no_leak(str(e.body or e.message))
            return "stream error"

    async def burst() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(i, client) for i in range(16)))
        finally:
            await client.close()

    results = asyncio.run(burst())
    assert live.faults.injected > injected_before, "no fault was injected: the test proves nothing"
    assert results.count("ok") >= 1 and results.count("ok") < len(results), results
    live.faults.arm(set())
    live.wait_idle()
    assert greedy(live) == before


def test_a_dead_engine_turns_health_503_and_refuses_requests(live: Live) -> None:
    """Last: it kills the module's engine on purpose (a bug outside the step's own isolation)."""
    import urllib.error
    import urllib.request

    assert urllib.request.urlopen(f"{live.url}/health", timeout=10).status == 200

    def broken_step() -> list:
        raise RuntimeError("scheduler bug at 0xdeadbeef")

    live.engine.core.step = broken_step  # the loop thread calls it on the next request
    with pytest.raises(openai.APIStatusError) as err:
        live.client(timeout=30).completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
    assert err.value.status_code == 503
    no_leak(err.value.body["message"])
    assert not live.async_engine.is_alive
    with pytest.raises(urllib.error.HTTPError) as health:
        urllib.request.urlopen(f"{live.url}/health", timeout=10)
    assert health.value.code == 503
    no_leak(json.loads(health.value.read())["error"]["message"])
