"""Load, disconnects, admission control and shutdown of a real `paxserve serve` process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable

import aiohttp
import openai
import pytest

from conftest import MODEL_NAME, SMALL_ARGS, assert_error, paxserve_command, start_server

RUNNING = "paxserve:num_requests_running"
KV_USAGE = "paxserve:kv_cache_usage"
PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "My favourite food is"]


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def wait_freed(server, timeout: float = 5.0) -> None:
    """/metrics shows no running request and no KV block in use within `timeout` seconds."""
    state = {}

    def freed() -> bool:
        state["running"], state["kv"] = server.metric(RUNNING), server.metric(KV_USAGE)
        return state["running"] == 0 and state["kv"] == 0

    try:
        wait_until(freed, timeout, "the request to be aborted and its KV blocks freed")
    except AssertionError as e:
        raise AssertionError(f"{e}; last /metrics: {state}") from None


def test_listening_line_is_logged_on_stderr(server) -> None:
    assert server.listening_stream == "stderr", \
        f"'paxserve listening on {server.url}' must be logged on stderr, it came on {server.listening_stream}"


def test_server_runs_as_started_and_says_which_pages_its_kv_cache_gets(server) -> None:
    """No restart with huge pages (they made start-up 3x slower here, benchmarks/RESULTS.md): the
    environment is the one it was given, and the log says how to opt in."""
    from paxserve.server.huge_pages import thp_mode

    environ = Path(f"/proc/{server.proc.pid}/environ").read_bytes().split(b"\0")
    theirs = [e.decode().split("=", 1)[1] for e in environ if e.startswith(b"GLIBC_TUNABLES=")]
    ours = [os.environ["GLIBC_TUNABLES"]] if "GLIBC_TUNABLES" in os.environ else []
    assert theirs == ours, "the server changed its own GLIBC_TUNABLES"
    log = server.stderr_text()
    if thp_mode() == "madvise" and "glibc.malloc.hugetlb" not in "".join(ours):
        assert "memory: 4 KiB pages for host buffers" in log
        assert "GLIBC_TUNABLES=glibc.malloc.hugetlb=1 opts in to huge pages" in log
    assert "memory:" in log
    assert log.count("paxserve listening on") == 1


# ---- load ------------------------------------------------------------------------------------------


def test_32_concurrent_streams_all_complete_with_exact_token_counts(server) -> None:
    server.wait_idle()
    client = server.async_client()

    async def one(i: int) -> tuple[tuple, str, str | None, int | None]:
        max_tokens = 8 + i % 8
        common = dict(model=MODEL_NAME, max_tokens=max_tokens, temperature=0.0, stream=True,
                      stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, finish, usage = "", None, None
        if i % 2:
            stream = await client.chat.completions.create(
                messages=[{"role": "user", "content": PROMPTS[i % 4]}], **common)
            async for chunk in stream:
                usage = chunk.usage or usage
                for c in chunk.choices:
                    text += c.delta.content or ""
                    finish = c.finish_reason or finish
        else:
            stream = await client.completions.create(prompt=PROMPTS[i % 4], **common)
            async for chunk in stream:
                usage = chunk.usage or usage
                for c in chunk.choices:
                    text += c.text
                    finish = c.finish_reason or finish
        assert usage is not None, f"request {i} got no usage chunk"
        assert usage.prompt_tokens + usage.completion_tokens == usage.total_tokens
        return (i % 8, max_tokens), text, finish, usage.completion_tokens

    async def main():
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(32))), timeout=240)
        finally:
            await client.close()

    results = asyncio.run(main())
    by_key = defaultdict(set)
    for (key, max_tokens), text, finish, completion_tokens in results:
        assert completion_tokens == max_tokens and finish == "length", (key, completion_tokens, finish)
        assert text
        by_key[key].add(text)
    # Requests with the same greedy prompt in the same batch get the same answer.
    assert all(len(texts) == 1 for texts in by_key.values()), dict(by_key)
    wait_freed(server)


# ---- disconnects -----------------------------------------------------------------------------------


def stream_then_drop(server, path: str, body: dict, counts: Callable[[bytes], bool], lines: int) -> tuple[float, float]:
    """Stream `body` from `path` until `lines` SSE lines that `counts` accepts came, read the running
    requests and KV usage while still connected, then drop the connection mid-stream."""
    async def run() -> tuple[float, float]:
        async with aiohttp.ClientSession() as session:
            resp = await session.post(f"{server.url}{path}", json=body, headers=server.auth_headers())
            assert resp.status == 200, await resp.text()
            seen = 0
            async for line in resp.content:
                seen += counts(line)
                if seen >= lines:
                    break
            # Still connected: the request runs and holds KV blocks.
            busy = await asyncio.to_thread(server.metric, RUNNING), await asyncio.to_thread(server.metric, KV_USAGE)
            resp.close()
            return busy

    return asyncio.run(run())


def test_client_disconnecting_mid_stream_aborts_and_frees_its_blocks(server) -> None:
    server.wait_idle()
    body = {"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    running, kv = stream_then_drop(server, "/v1/completions", body, lambda line: line.startswith(b"data: "), 3)
    assert running == 1 and kv > 0, (running, kv)
    wait_freed(server)
    # The server goes on serving.
    assert server.client().completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2).usage.completion_tokens


STORY = "Write a very long story about a dragon and a knight, with many chapters."


@pytest.mark.parametrize("path, body", [
    ("/v1/responses", {"input": STORY, "max_output_tokens": 400}),
    ("/v1/messages", {"messages": [{"role": "user", "content": STORY}], "max_tokens": 400}),
], ids=["responses", "messages"])
def test_disconnecting_from_a_responses_or_messages_stream_frees_its_blocks(server, path, body) -> None:
    server.wait_idle()
    body = {"model": MODEL_NAME, "temperature": 0, "stream": True, **body}
    running, kv = stream_then_drop(server, path, body, lambda line: line.startswith(b"data: ") and b"delta" in line, 4)
    assert running == 1 and kv > 0, (running, kv)
    wait_freed(server)


def test_non_streaming_client_timing_out_aborts_and_frees_its_blocks(server) -> None:
    server.wait_idle()
    errors: list[BaseException] = []

    def call() -> None:
        try:
            # 4 s: enough to be running even when its prefill compiles cold, far less than 480 tokens take.
            server.client(timeout=4.0).completions.create(
                model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=480, temperature=0, extra_body={"ignore_eos": True})
        except BaseException as e:  # noqa: BLE001 - checked below
            errors.append(e)

    thread = threading.Thread(target=call)
    thread.start()
    seen_running = 0.0
    while thread.is_alive():
        seen_running = max(seen_running, server.metric(RUNNING))
        time.sleep(0.05)
    thread.join()
    assert len(errors) == 1 and isinstance(errors[0], openai.APITimeoutError), errors
    assert seen_running == 1, "the request should have been running before the client gave up"
    wait_freed(server)


# ---- admission control and the API key from the environment ----------------------------------------

ENV_KEY = "sk-from-the-environment"


CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@pytest.fixture(scope="module")
def queue_server(tmp_path_factory):
    """One sequence at a time and one queued request; the API key comes from PAXSERVE_API_KEY, the
    model is served under its default name, and chats use a plain --chat-template file."""
    template = tmp_path_factory.mktemp("template") / "plain.jinja"
    template.write_text(CHAT_TEMPLATE)
    srv = start_server([*SMALL_ARGS, "--max-num-seqs", "1", "--max-num-queued-reqs", "1", "--disable-log-stats",
                        "--chat-template", str(template)],
                       api_key=ENV_KEY, env={"PAXSERVE_API_KEY": ENV_KEY})
    yield srv
    srv.stop()


def test_api_key_from_the_environment_and_the_default_model_name(queue_server) -> None:
    assert_error(queue_server.get("/v1/models", auth=False), 401)
    models = queue_server.client().models.list()
    assert len(models.data) == 1
    name = models.data[0].id
    assert name
    out = queue_server.client().completions.create(model=name, prompt="Hi", max_tokens=2)
    assert out.model == name and out.usage.completion_tokens >= 1


def test_chat_template_flag_renders_the_messages(queue_server) -> None:
    name = queue_server.get("/v1/models").json()["data"][0]["id"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    out = queue_server.client().chat.completions.create(model=name, messages=messages, max_tokens=2)
    rendered = "system: Be brief.\nuser: Hi there\nassistant:"
    tokens = queue_server.post("/tokenize", {"model": name, "prompt": rendered}).json()["tokens"]
    assert out.usage.prompt_tokens == len(tokens)


def test_queue_cap_answers_429_with_retry_after(queue_server) -> None:
    name = queue_server.get("/v1/models").json()["data"][0]["id"]
    body = {"model": name, "prompt": PROMPTS[0], "max_tokens": 64, "temperature": 0, "ignore_eos": True}

    async def burst() -> list[tuple[int, dict, dict]]:
        async with aiohttp.ClientSession() as session:
            async def one(i: int):
                req = {**body, "stream": True} if i % 3 == 2 else body
                async with session.post(f"{queue_server.url}/v1/completions", json=req,
                                        headers=queue_server.auth_headers()) as resp:
                    raw = await resp.read()
                    return resp.status, dict(resp.headers), raw, req.get("stream", False)
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(6))), timeout=180)

    results = asyncio.run(burst())
    statuses = [r[0] for r in results]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(429) >= 1 and statuses.count(200) >= 1, statuses
    for status, headers, raw, streamed in results:
        if status == 429:
            assert float(headers["Retry-After"]) >= 0, headers
            error = json.loads(raw)["error"]
            assert {"message", "type", "param", "code"} <= set(error) and error["message"]
        elif streamed:
            assert raw.rstrip().endswith(b"data: [DONE]")
            usage = [json.loads(line[6:]) for line in raw.decode().splitlines()
                     if line.startswith("data: {")][-1].get("usage")
            assert usage is None or usage["completion_tokens"] == 64
        else:
            assert json.loads(raw)["usage"]["completion_tokens"] == 64
    # Once the queue drains, requests are admitted again.
    out = queue_server.client().completions.create(model=name, prompt="Hi", max_tokens=2)
    assert out.usage.completion_tokens >= 1


# ---- shutdown --------------------------------------------------------------------------------------


# SIGINT goes to the same handler (server/serve.py registers both in one loop): one signal is enough here.
@pytest.mark.parametrize("sig", [signal.SIGTERM], ids=["SIGTERM"])
def test_signal_ends_in_flight_streams_and_exits_cleanly(sig: int) -> None:
    srv = start_server([*SMALL_ARGS, "--max-num-seqs", "4"])
    try:
        body = {"model": srv.get("/v1/models").json()["data"][0]["id"], "prompt": PROMPTS[0], "max_tokens": 400,
                "temperature": 0, "ignore_eos": True, "stream": True}

        async def scenario() -> float:
            started = [asyncio.Event() for _ in range(3)]

            async def stream(i: int, session: aiohttp.ClientSession) -> None:
                try:
                    async with session.post(f"{srv.url}/v1/completions", json=body) as resp:
                        assert resp.status == 200
                        async for line in resp.content:
                            if line.startswith(b"data: "):
                                started[i].set()
                except (aiohttp.ClientError, ConnectionError):
                    pass  # the server may cut an aborted stream; it must not hang

            async with aiohttp.ClientSession() as session:
                tasks = [asyncio.create_task(stream(i, session)) for i in range(3)]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), timeout=120)
                t0 = time.monotonic()
                srv.send_signal(sig)
                await asyncio.wait_for(asyncio.gather(*tasks), timeout=15)  # every in-flight stream ends
                return t0

        t0 = asyncio.run(scenario())
        try:
            code = srv.wait(timeout=max(0.1, t0 + 10 - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server was still running 10s after {sig.name}:\n{srv.stderr_tail()}")
        assert code in (0, -sig, 128 + sig), (code, srv.stderr_tail())
        assert "Traceback" not in srv.stderr_text(), srv.stderr_tail()
        with pytest.raises(OSError):
            socket.create_connection((srv.host, srv.port), timeout=2).close()
    finally:
        srv.kill()


# ---- the command line ------------------------------------------------------------------------------

SERVE_FLAGS = ["--model", "--host", "--port", "--served-model-name", "--api-key", "--dtype", "--max-model-len",
               "--gpu-memory-utilization", "--kv-cache-memory-bytes", "--num-gpu-blocks-override", "--block-size",
               "--max-num-seqs", "--max-num-batched-tokens", "--enable-prefix-caching", "--no-enable-prefix-caching",
               "--tensor-parallel-size", "--enable-expert-parallel", "--seed", "--chat-template", "--max-logprobs", "--max-num-queued-reqs",
               "--disable-log-stats", "--log-level", "--warmup", "--no-warmup", "--shutdown-timeout",
               "--trust-request-chat-template", "--max-stop-strings", "--timeout-keep-alive", "--http-header-timeout",
               "--http-body-timeout", "--enable-auto-tool-choice", "--tool-call-parser", "--reasoning-parser",
               "--enable-tokenizer-info-endpoint"]


def test_help_explains_serve_and_every_flag() -> None:
    top = subprocess.run([*paxserve_command(), "--help"], capture_output=True, text=True, timeout=120)
    assert top.returncode == 0 and "serve" in top.stdout, top.stderr
    serve = subprocess.run([*paxserve_command(), "serve", "--help"], capture_output=True, text=True, timeout=120)
    assert serve.returncode == 0, serve.stderr
    missing = [flag for flag in SERVE_FLAGS if flag not in serve.stdout]
    assert not missing, f"`paxserve serve --help` does not explain {missing}"
    assert "PAXSERVE_API_KEY" in serve.stdout and "8000" in serve.stdout
