"""Clients that give up early, misbehave or read slowly must never hurt a real `paxserve serve` process.

Every test on a long-lived server ends with the same proof that it recovered (the autouse `recovers`
fixture runs `assert_recovered`): /health is 200, the greedy reference completion answers with the
text it had before any scenario, the running / waiting / KV-cache gauges drain to 0, and the server
logged no error or traceback during the test. Clients: the official `openai` client (max_retries=0),
aiohttp, and raw sockets where a client has to misbehave on purpose.

Servers: the shared session `server` (API key) wherever no flag is needed; `fresh_server` (module:
--http-header-timeout 1 --http-body-timeout 1 --trust-request-chat-template, no API key), whose first
test fires a storm while nothing is compiled yet; and one server per drain test (--shutdown-timeout).
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import subprocess
import threading
import time
import uuid
from typing import Any

import aiohttp
import numpy as np
import openai
import pytest

try:  # the HTTP library this openai client is built on
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

from conftest import MODEL_NAME, SMALL_ARGS, Response, ServerProcess, assert_error, metric_value, start_server

PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "My favourite food is"]
REF_PROMPT = "The capital of France is"
REF_TOKENS = 8
RUNNING = "paxserve:num_requests_running"
PAUSED = "paxserve:num_requests_paused"
GEN_TOKENS = "paxserve:generation_tokens"
# What no error message may ever show a client: memory addresses and tracebacks.
LEAK = re.compile(r"0x[0-9a-fA-F]+|Traceback")


# ---- helpers ---------------------------------------------------------------------------------------


def model_of(srv: ServerProcess) -> str:
    return srv.get("/v1/models").json()["data"][0]["id"]


def assert_clean(text: str) -> None:
    assert not LEAK.search(text), f"an error message leaks internals: {text[:500]!r}"


def assert_envelope(resp: Any, status: int, **kwargs: Any) -> dict:
    err = assert_error(resp, status, **kwargs)
    assert_clean(err["message"])
    return err


def sync_client(srv: ServerProcess, timeout: float = 120.0) -> openai.OpenAI:
    """No connection reuse: `fresh_server` closes idle keep-alive connections after 1 s, and a
    request sent on one just as it closes would be a client-side race, not a server bug."""
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=srv.api_key or "unused", max_retries=0, timeout=timeout,
                         http_client=httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)))


def async_client(srv: ServerProcess, timeout: float = 120.0) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key=srv.api_key or "unused", max_retries=0,
                              timeout=timeout,
                              http_client=httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0,
                                                                                max_connections=200)))


def greedy_text(srv: ServerProcess, model: str) -> str:
    with sync_client(srv) as client:
        out = client.completions.create(model=model, prompt=REF_PROMPT, max_tokens=REF_TOKENS, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == REF_TOKENS
    return out.choices[0].text


# Log lines that mean something went wrong inside the server while a scenario ran.
BAD_LOG = re.compile(r"Traceback| ERROR | CRITICAL |never retrieved|Task was destroyed|Unclosed")


def log_mark(srv: ServerProcess) -> int:
    return len(srv.stderr_text())


def assert_recovered(srv: ServerProcess, model: str, ref: str, since: int = 0, idle_timeout: float = 30.0) -> None:
    """/health 200, the greedy reference answers as before, nothing left running, waiting or in KV,
    and nothing went wrong in the server's log since `since` (a log_mark)."""
    srv.wait_idle(idle_timeout)
    health = srv.get("/health", auth=False)
    assert health.status == 200, (health, srv.stderr_tail())
    assert greedy_text(srv, model) == ref
    srv.wait_idle(10.0)
    assert srv.proc is not None and srv.proc.poll() is None
    bad = [ln for ln in srv.stderr_text()[since:].splitlines() if BAD_LOG.search(ln)]
    assert not bad, "\n".join(bad[:20])


def aborted(srv: ServerProcess) -> float:
    return srv.metric("paxserve:request_success", 'finished_reason="abort"')


def ended(srv: ServerProcess) -> float:
    """Samples that reached the engine and ended, for any reason (aborted ones included)."""
    return srv.metric("paxserve:request_success")


# ---- raw HTTP ----------------------------------------------------------------------------------------


def http_bytes(method: str, path: str, body: bytes | None = None, headers: list[tuple[bytes, bytes]] = (),
               close: bool = True) -> bytes:
    lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: 127.0.0.1"]
    lines += [k + b": " + v for k, v in headers]
    if body is not None:
        lines.append(b"Content-Length: %d" % len(body))
    if close:
        lines.append(b"Connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n" + (body or b"")


def dechunk(data: bytes) -> bytes:
    out, i = b"", 0
    while True:
        j = data.index(b"\r\n", i)
        size = int(data[i:j].split(b";")[0], 16)
        if size == 0:
            return out
        out += data[j + 2:j + 2 + size]
        i = j + 2 + size + 2


class RawResponse(Response):
    """A response parsed from the raw bytes of a connection."""

    def __init__(self, raw: bytes) -> None:
        head, _, rest = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        assert lines[0].startswith("HTTP/1."), raw[:300]
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        if headers.get("transfer-encoding", "").lower() == "chunked":
            rest = dechunk(rest)
        elif "content-length" in headers:
            rest = rest[:int(headers["content-length"])]
        super().__init__(int(lines[0].split()[1]), headers, rest)


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (or resets) the connection."""
    chunks = []
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def raw_exchange(srv: ServerProcess, data: bytes, timeout: float = 30.0) -> bytes:
    """Send `data` on a new connection and read until the server closes it."""
    with socket.create_connection((srv.host, srv.port), timeout=timeout) as sock:
        sock.sendall(data)
        return read_until_closed(sock)


def raw_request(srv: ServerProcess, method: str, path: str, body: Any = None, *,
                headers: list[tuple[bytes, bytes]] | None = None, auth: bool = True) -> RawResponse:
    hdrs = list(headers or [])
    if auth and srv.api_key:
        hdrs.append((b"Authorization", f"Bearer {srv.api_key}".encode()))
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    return RawResponse(raw_exchange(srv, http_bytes(method, path, data, hdrs)))


JSON = [(b"Content-Type", b"application/json")]


# ---- fixtures ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ref(server) -> str:
    """The shared server's greedy reference text, taken before any scenario of this file."""
    return greedy_text(server, MODEL_NAME)


STOPPED: set[int] = set()  # ports of module servers that a test stopped on purpose


@pytest.fixture(autouse=True)
def recovers(request):
    """After every test on `server` or `fresh_server`: assert_recovered (health, the greedy
    reference, idle gauges, a clean log during the test)."""
    names = [n for n in ("server", "fresh_server") if n in request.fixturenames]
    if not names:
        yield
        return
    reference = request.getfixturevalue("ref")
    servers = [request.getfixturevalue(n) for n in names]
    marks = [log_mark(srv) for srv in servers]
    yield
    for srv, mark in zip(servers, marks):
        if srv.port not in STOPPED:
            assert_recovered(srv, model_of(srv), reference, since=mark)


@pytest.fixture(scope="module")
def fresh_server(tmp_path_factory: pytest.TempPathFactory):
    """Nothing compiled (--no-warmup, no request served yet when its first test starts, and compiled
    programs kept in a folder of its own, so nothing an earlier run stored), short transport
    timeouts, request chat templates trusted, no API key."""
    srv = start_server([*SMALL_ARGS, "--max-num-seqs", "16", "--http-header-timeout", "1", "--http-body-timeout", "1",
                        "--trust-request-chat-template", "--disable-log-stats",
                        "--compilation-cache-dir", str(tmp_path_factory.mktemp("fresh-programs"))])
    yield srv
    srv.stop()


# ---- 1-3: cancel storms and scrapes that time out ------------------------------------------------------


async def _stream_completion(client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int,
                             started: asyncio.Event) -> dict[str, Any]:
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    out: dict[str, Any] = {"finish": None, "usage": None, "fingerprints_ok": True, "text": "", "first_token_at": None}
    async for chunk in stream:
        started.set()
        out["fingerprints_ok"] &= isinstance(chunk.system_fingerprint, str) and bool(chunk.system_fingerprint)
        out["usage"] = chunk.usage or out["usage"]
        for c in chunk.choices:
            if c.text and out["first_token_at"] is None:
                out["first_token_at"] = time.monotonic()
            out["text"] += c.text
            out["finish"] = c.finish_reason or out["finish"]
    assert out["usage"] is not None
    return out


async def _doomed(client: openai.AsyncOpenAI, model: str, i: int, timeout: float, max_tokens: int) -> str:
    """One request whose client gives up after `timeout` s: 'ok', 'timeout' or 'connection', never a status."""
    kind = i % 6
    messages = [{"role": "user", "content": PROMPTS[i % 4]}]
    try:
        if kind == 0:
            await client.completions.create(model=model, prompt=PROMPTS[i % 4], max_tokens=max_tokens,
                                            extra_body={"ignore_eos": True}, timeout=timeout)
        elif kind == 1:
            stream = await client.completions.create(model=model, prompt=PROMPTS[i % 4], max_tokens=max_tokens,
                                                     stream=True, extra_body={"ignore_eos": True}, timeout=timeout)
            async for _ in stream:
                pass
        elif kind == 2:
            await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                 extra_body={"ignore_eos": True}, timeout=timeout)
        elif kind == 3:
            stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                          stream=True, extra_body={"ignore_eos": True},
                                                          timeout=timeout)
            async for _ in stream:
                pass
        elif kind == 4:  # fan-out: 3 prompts x n=2 as 3 engine requests
            await client.completions.create(model=model, prompt=PROMPTS[:3], n=2, max_tokens=max_tokens,
                                            extra_body={"ignore_eos": True}, timeout=timeout)
        else:
            stream = await client.chat.completions.create(model=model, messages=messages, n=2, max_tokens=max_tokens,
                                                          stream=True, logprobs=True, top_logprobs=2,
                                                          extra_body={"ignore_eos": True}, timeout=timeout)
            async for _ in stream:
                pass
        return "ok"
    except openai.APITimeoutError:
        return "timeout"
    except openai.APIConnectionError:
        return "connection"


async def _scrape_and_give_up(srv: ServerProcess, i: int) -> None:
    """A /metrics scrape abandoned after 1 ms (aiohttp), or sent and dropped at once (raw socket: the
    server surely sees the request, and its handler's connection is gone)."""
    if i % 2:
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.001)) as session:
                async with session.get(f"{srv.url}/metrics") as resp:
                    await resp.read()
        except (asyncio.TimeoutError, aiohttp.ClientError):
            pass
    else:
        reader, writer = await asyncio.open_connection(srv.host, srv.port)
        writer.write(http_bytes("GET", "/metrics", close=False))
        await writer.drain()
        await asyncio.sleep(0.001)
        writer.transport.abort()


async def _storm(srv: ServerProcess, model: str, timeouts: list[float], *, storm_max_tokens: int,
                 num_streams: int = 8, stream_tokens: int = 40, scrapes: int = 0,
                 wait_for_streams: bool = True) -> tuple[list, list[str]]:
    client = async_client(srv, timeout=240.0)
    try:
        started = [asyncio.Event() for _ in range(num_streams)]
        streams = [asyncio.create_task(_stream_completion(client, model, PROMPTS[i % 4], stream_tokens, started[i]))
                   for i in range(num_streams)]
        if wait_for_streams:  # the streams are running when the storm comes
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), timeout=120)
        doomed = [asyncio.create_task(_doomed(client, model, i, t, storm_max_tokens)) for i, t in enumerate(timeouts)]
        scraping = [asyncio.create_task(_scrape_and_give_up(srv, i)) for i in range(scrapes)]
        outcomes = await asyncio.wait_for(asyncio.gather(*doomed), timeout=120)
        await asyncio.wait_for(asyncio.gather(*scraping), timeout=60)
        results = await asyncio.wait_for(asyncio.gather(*streams), timeout=240)
        return results, outcomes
    finally:
        await client.close()


def _check_storm(results: list[dict], outcomes: list[str], stream_tokens: int) -> None:
    for r in results:
        assert r["usage"].completion_tokens == stream_tokens and r["finish"] == "length", r
        assert r["text"] and r["fingerprints_ok"], r
    assert set(outcomes) <= {"ok", "timeout", "connection"}, outcomes
    assert outcomes.count("timeout") + outcomes.count("connection") >= len(outcomes) // 2, outcomes


STORM_TIMEOUTS = [float(t) for t in np.geomspace(0.001, 0.5, 50)]


@pytest.mark.parametrize("timeouts, storm_max_tokens", [(STORM_TIMEOUTS, 20), ([0.5] * 50, 400)],
                         ids=["1ms-500ms-short", "500ms-long"])
def test_cancel_storm_while_streams_run(server, ref, timeouts: list[float], storm_max_tokens: int) -> None:
    # This server compiles a batch's program in the step that first needs it (no background
    # compiles): a storm that meets such a compile waits seconds for it, and every client with a
    # shorter timeout gives up first. The storm then runs once more, on the programs it compiled.
    for attempt in (1, 2):
        server.wait_idle()
        aborted_before, ended_before = aborted(server), ended(server)
        results, outcomes = asyncio.run(_storm(server, MODEL_NAME, timeouts, storm_max_tokens=storm_max_tokens))
        _check_storm(results, outcomes, 40)
        server.wait_idle()
        # Long answers: none can finish in 0.5 s, so many were queued or running when cancelled.
        # Short answers may finish before their client gives up (a fast machine); either way many
        # storm requests reached the engine rather than dying while being parsed. The 8 streams
        # are one sample each.
        reached = (aborted(server) - aborted_before if storm_max_tokens >= 400
                   else ended(server) - ended_before - len(results))
        if reached >= (25 if storm_max_tokens >= 400 else 5):
            break
    assert reached >= (25 if storm_max_tokens >= 400 else 5), f"{reached} storm requests reached the engine"



def test_metrics_scrapes_that_time_out_while_streams_run(server, ref) -> None:
    server.wait_idle()
    results, outcomes = asyncio.run(_storm(server, MODEL_NAME, [], storm_max_tokens=1, num_streams=2,
                                           stream_tokens=30, scrapes=20))
    _check_storm(results, outcomes, 30)
    resp = server.get("/metrics", auth=False)
    assert resp.status == 200 and f"{RUNNING}{{" in resp.text



def test_storm_and_scrapes_during_compilation_on_a_fresh_server(fresh_server, server, ref) -> None:
    """Fired right after start-up (--no-warmup): the requests time out while new shapes compile."""
    model = model_of(fresh_server)
    assert fresh_server.metric("paxserve:prompt_tokens") == 0, "this test needs a server that served nothing yet"
    fired = time.monotonic()
    results, outcomes = asyncio.run(_storm(fresh_server, model, STORM_TIMEOUTS, storm_max_tokens=20, scrapes=20,
                                           wait_for_streams=False))
    _check_storm(results, outcomes, 40)
    # The scenario really happened during compilation: the first token of any stream came after the
    # last storm request had given up.
    first_token = min(r["first_token_at"] for r in results) - fired
    assert first_token > max(STORM_TIMEOUTS), f"first token after {first_token:.2f}s: nothing was compiling"
    resp = fresh_server.get("/metrics", auth=False)
    assert resp.status == 200 and f"{RUNNING}{{" in resp.text
    # They reached the engine before their clients gave up (46 of 50 here): parsing, tokenizing and
    # rendering (in workers started before the server listened) kept up with the storm.
    assert aborted(fresh_server) >= 5, f"{aborted(fresh_server)} storm requests reached the engine"



# ---- 4: raw-socket abuse ---------------------------------------------------------------------------------


def test_slowloris_connections_are_closed_while_requests_are_served(fresh_server) -> None:
    model = model_of(fresh_server)
    socks: list[tuple[socket.socket, float]] = []
    for _ in range(50):
        sock = socket.create_connection((fresh_server.host, fresh_server.port), timeout=5)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        sock.setblocking(False)
        socks.append((sock, time.monotonic()))
    served: list[Any] = []

    def normal_requests() -> None:
        for _ in range(3):
            served.append(fresh_server.get("/health", auth=False).status)
            served.append(fresh_server.post("/v1/completions", {"model": model, "prompt": "Hi", "max_tokens": 2},
                                            timeout=30).status)

    worker = threading.Thread(target=normal_requests)
    worker.start()
    closed_after: dict[int, float] = {}
    replies: dict[int, bytes] = {}
    deadline = time.monotonic() + 6.0
    while len(closed_after) < len(socks) and time.monotonic() < deadline:
        for i, (sock, t0) in enumerate(socks):
            if i in closed_after:
                continue
            try:
                data = sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                if i not in replies:
                    try:
                        sock.send(b"a")  # one more header byte: a client that is slow, not silent
                    except (BlockingIOError, InterruptedError):
                        pass
                    except (ConnectionResetError, BrokenPipeError):
                        closed_after[i] = time.monotonic() - t0
                continue
            except ConnectionResetError:
                data = b""
            if data:
                replies[i] = replies.get(i, b"") + data
                continue
            closed_after[i] = time.monotonic() - t0
        time.sleep(0.2)
    worker.join(60)
    for sock, _ in socks:
        sock.close()
    assert len(closed_after) == len(socks), f"only {len(closed_after)} of {len(socks)} slowloris connections closed"
    assert max(closed_after.values()) <= 3.0, sorted(closed_after.values())
    for reply in replies.values():  # a slow client that sent bytes is told why
        resp = RawResponse(reply)
        assert_envelope(resp, 408)
    assert served == [200] * 6, served
    assert fresh_server.get("/health", auth=False).status == 200


def test_half_body_gets_408_or_a_close_within_the_body_timeout(fresh_server) -> None:
    model = model_of(fresh_server)
    body = json.dumps({"model": model, "prompt": "Hi", "max_tokens": 2}).encode()
    head = http_bytes("POST", "/v1/completions", None, JSON, close=False)
    head = head[:-2] + b"Content-Length: 1000\r\n\r\n"
    with socket.create_connection((fresh_server.host, fresh_server.port), timeout=10) as sock:
        t0 = time.monotonic()
        sock.sendall(head + body[:10])
        data = read_until_closed(sock)
        elapsed = time.monotonic() - t0
    assert 0.8 <= elapsed <= 1.0 + 3.0, elapsed
    if data:
        assert_envelope(RawResponse(data), 408)
    assert fresh_server.get("/health", auth=False).status == 200


@pytest.mark.parametrize("garbage", [
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(32)) + b"\r\n\r\n",
    b"GARBAGE GARBAGE GARBAGE\r\n\r\n",
    b"\x00\xff\xfe\xfd\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
], ids=["tls", "words", "binary", "bad-content-length"])
def test_garbage_bytes_get_a_json_4xx_envelope(fresh_server, garbage: bytes) -> None:
    resp = RawResponse(raw_exchange(fresh_server, garbage))
    assert 400 <= resp.status < 500, resp
    assert_envelope(resp, resp.status)
    assert resp.headers.get("connection", "").lower() == "close", resp.headers
    assert fresh_server.get("/health", auth=False).status == 200


def test_a_request_chat_template_is_rendered_when_trusted(fresh_server) -> None:
    model = model_of(fresh_server)
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}=>"
    messages = [{"role": "user", "content": "Hello there"}]
    with sync_client(fresh_server) as client:
        out = client.chat.completions.create(model=model, messages=messages, max_tokens=2,
                                             extra_body={"chat_template": template})
    expected = fresh_server.post("/tokenize", {"model": model, "prompt": "[user] Hello there\n=>",
                                               "add_special_tokens": False}).json()["tokens"]
    assert out.usage.prompt_tokens == len(expected)
    rendered = fresh_server.post("/tokenize", {"model": model, "messages": messages, "chat_template": template})
    assert rendered.status == 200 and rendered.json()["tokens"] == expected, rendered


def test_shutdown_without_drain_ends_a_stream_with_an_in_band_503(fresh_server) -> None:
    """New in this file (test_lifecycle covers that streams end): what the client sees is an error
    event with the 503 envelope and then [DONE], not a silent cut. Runs last: it stops fresh_server."""
    model = model_of(fresh_server)
    STOPPED.add(fresh_server.port)
    body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}

    async def scenario() -> tuple[bytes, float]:
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{fresh_server.url}/v1/completions", json=body) as resp:
                assert resp.status == 200
                data = b""
                t0 = None
                try:
                    async for line in resp.content:
                        data += line
                        if t0 is None and line.startswith(b"data: "):
                            t0 = time.monotonic()
                            fresh_server.send_signal(signal.SIGTERM)
                except aiohttp.ClientError:
                    pass
                return data, time.monotonic() - t0

    data, took = asyncio.run(asyncio.wait_for(scenario(), timeout=120))
    assert took < 5.0, took
    events = [ln[6:] for ln in data.decode().splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])
    assert set(error) == {"error"} and error["error"]["code"] == 503, error
    assert_clean(error["error"]["message"])
    assert fresh_server.wait(timeout=10) == 0
    assert "Traceback" not in fresh_server.stderr_text(), fresh_server.stderr_tail()


# ---- 5: HTTP semantics -------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["Bearer clé".encode("utf-8"), "Bearer clé".encode("latin-1"),
                                 b"Bearer \xff\xfe", "Bearer ключ".encode("utf-8")],
                         ids=["utf8", "latin1", "invalid-utf8", "cyrillic"])
def test_a_non_ascii_api_key_is_401_not_400(server, key: bytes) -> None:
    for method, path, body in (("GET", "/v1/models", None),
                               ("POST", "/v1/completions", {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1})):
        resp = raw_request(server, method, path, body, headers=[(b"Authorization", key), *JSON], auth=False)
        assert_envelope(resp, 401)
    assert server.get("/health", auth=False).status == 200


def test_content_type_must_say_json(server) -> None:
    body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1}
    for path in ("/v1/completions", "/tokenize"):
        for ctype in (b"text/plain", b"application/x-www-form-urlencoded", b"multipart/form-data; boundary=x"):
            resp = raw_request(server, "POST", path, body, headers=[(b"Content-Type", ctype)])
            assert_envelope(resp, 415)
    for headers in ([(b"Content-Type", b"application/json; charset=utf-8")], [(b"Content-Type", b"APPLICATION/JSON")],
                    []):
        resp = raw_request(server, "POST", "/v1/completions", body, headers=headers)
        assert resp.status == 200, (headers, resp)
        assert resp.json()["usage"]["completion_tokens"] == 1


def test_more_stop_strings_than_the_cap_is_400(server) -> None:
    base = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1}
    ok = server.post("/v1/completions", {**base, "stop": [f"stop{i}" for i in range(32)]})
    assert ok.status == 200, ok
    for path, body in (("/v1/completions", base),
                       ("/v1/chat/completions", {"model": MODEL_NAME, "max_tokens": 1,
                                                 "messages": [{"role": "user", "content": "Hi"}]})):
        assert_envelope(server.post(path, {**body, "stop": [f"stop{i}" for i in range(33)]}), 400, param="stop")
    assert_envelope(server.post("/v1/completions", {**base, "stop": ["x" * 1025]}), 400, param="stop")


def test_a_request_chat_template_is_refused_unless_trusted(server) -> None:
    chat = {"model": MODEL_NAME, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
    for extra in ({"chat_template": "{{ messages[0]['content'] }}"},
                  {"chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}):
        err = assert_envelope(server.post("/v1/chat/completions", {**chat, **extra}), 400, param="chat_template")
        assert "--trust-request-chat-template" in err["message"], err
    err = assert_envelope(server.post("/tokenize", {"model": MODEL_NAME, "messages": chat["messages"],
                                                    "chat_template": "{{ 'x' }}"}), 400, param="chat_template")
    assert "--trust-request-chat-template" in err["message"], err


def test_n2_at_temperature_0_gives_two_identical_greedy_choices(server, client, ref) -> None:
    out = client.completions.create(model=MODEL_NAME, prompt=REF_PROMPT, max_tokens=REF_TOKENS, temperature=0, n=2,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [ref, ref]
    assert out.usage.completion_tokens == 2 * REF_TOKENS


def test_cached_tokens_are_reported_in_usage(server, client) -> None:
    salt = uuid.uuid4().hex[:8]  # a prompt no earlier test sent
    prompt = f"Note {salt}: " + "the quick brown fox jumps over the lazy dog and runs far away. " * 6
    num_prompt = len(server.post("/tokenize", {"model": MODEL_NAME, "prompt": prompt}).json()["tokens"])
    assert num_prompt > 3 * 16
    first = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1, temperature=0)
    assert first.usage.prompt_tokens_details is not None and first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 2 * 16 <= cached < num_prompt, (cached, num_prompt)
    # The same through chat, and in the final usage chunk of a stream.
    messages = [{"role": "user", "content": prompt}]
    fresh_chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1)
    assert fresh_chat.usage.prompt_tokens_details.cached_tokens >= 0
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1, stream=True,
                                            stream_options={"include_usage": True})
    usage = [c.usage for c in stream if c.usage is not None][-1]
    assert usage.prompt_tokens_details.cached_tokens >= 2 * 16, usage
    raw = server.post("/v1/completions", {"model": MODEL_NAME, "prompt": f"Fresh {uuid.uuid4().hex}", "max_tokens": 1})
    assert raw.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_system_fingerprint_is_a_string_everywhere(server, client) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    for out in (client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2),
                client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2)):
        assert isinstance(out.system_fingerprint, str) and out.system_fingerprint, out
    for path, body in (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {"messages": messages})):
        resp = server.post(path, {"model": MODEL_NAME, "max_tokens": 3, "stream": True,
                                  "stream_options": {"include_usage": True}, **body})
        events = [json.loads(ln[6:]) for ln in resp.text.splitlines() if ln.startswith("data: {")]
        assert len(events) >= 3
        assert all(isinstance(e.get("system_fingerprint"), str) and e["system_fingerprint"] for e in events), events


# ---- 6: stop strings and min_tokens ------------------------------------------------------------------------


def test_min_tokens_holds_back_a_stop_string_in_its_first_tokens(server, client) -> None:
    prompt, k = "Once upon a time", 12
    full = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=40, temperature=0, logprobs=0,
                                     extra_body={"ignore_eos": True})
    text, tokens = full.choices[0].text, full.choices[0].logprobs.tokens
    assert len(tokens) == 40
    head = "".join(tokens[:k])
    # A stop string that occurs in the first k tokens' text but not at its very start.
    stop = next(t for t in tokens[2:k] if t.strip() and len(t.strip()) >= 2 and text.find(t) > 0)
    cut = text.find(stop)
    assert cut < len(head)
    without = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=40, temperature=0, stop=[stop],
                                        extra_body={"ignore_eos": True})
    assert without.choices[0].text == text[:cut] and without.choices[0].finish_reason == "stop", (stop, without)
    held = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=40, temperature=0, stop=[stop],
                                     extra_body={"ignore_eos": True, "min_tokens": k})
    got = held.choices[0].text
    assert len(got) > cut and held.usage.completion_tokens >= k, (stop, cut, got)
    assert text.startswith(got), (got, text)
    if held.choices[0].finish_reason == "stop":  # cut only at an occurrence after the first k tokens
        assert text[len(got):].startswith(stop) and len(got) >= len(head) - len(stop) + 1, (stop, got)


# ---- 7: drain on SIGTERM -------------------------------------------------------------------------------------


async def _read_sse(session: aiohttp.ClientSession, url: str, body: dict, started: asyncio.Event) -> dict:
    out = {"events": [], "done": False, "error": None, "ended": None}
    try:
        async with session.post(url, json=body) as resp:
            assert resp.status == 200
            async for line in resp.content:
                if line.startswith(b"data: "):
                    started.set()
                    payload = line[6:].strip()
                    if payload == b"[DONE]":
                        out["done"] = True
                    else:
                        out["events"].append(json.loads(payload))
    except (aiohttp.ClientError, ConnectionError) as e:
        out["error"] = e
    out["ended"] = time.monotonic()
    return out


def _tokens_of(events: list[dict]) -> tuple[int | None, str | None, list[dict]]:
    usage = next((e["usage"] for e in reversed(events) if e.get("usage")), None)
    finishes = [c.get("finish_reason") for e in events for c in e.get("choices", []) if c.get("finish_reason")]
    errors = [e for e in events if "error" in e]
    return (usage or {}).get("completion_tokens"), (finishes[-1] if finishes else None), errors


def test_sigterm_drains_in_flight_streams_with_a_shutdown_timeout() -> None:
    srv = start_server([*SMALL_ARGS, "--max-num-seqs", "4", "--shutdown-timeout", "20", "--disable-log-stats"])
    try:
        model = model_of(srv)
        body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 60, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        checks: dict[str, Any] = {}

        async def scenario() -> list[dict]:
            started = [asyncio.Event() for _ in range(3)]
            async with aiohttp.ClientSession() as session:
                tasks = [asyncio.create_task(_read_sse(session, f"{srv.url}/v1/completions", body, started[i]))
                         for i in range(3)]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), timeout=120)
                checks["signal_at"] = time.monotonic()
                srv.send_signal(signal.SIGTERM)
                # While the three drain: /health and new requests get 503.
                deadline = time.monotonic() + 3
                health = None
                while time.monotonic() < deadline:
                    health = await asyncio.to_thread(srv.get, "/health", auth=False, timeout=5)
                    if health.status == 503:
                        break
                    await asyncio.sleep(0.05)
                checks["health"] = health
                checks["new"] = await asyncio.to_thread(srv.post, "/v1/completions",
                                                        {"model": model, "prompt": "Hi", "max_tokens": 2}, timeout=10)
                checks["chat"] = await asyncio.to_thread(
                    srv.post, "/v1/chat/completions",
                    {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}, timeout=10)
                checks["in_flight_during_checks"] = sum(not t.done() for t in tasks)
                return await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)

        results = asyncio.run(scenario())
        assert checks["in_flight_during_checks"] == 3, "the streams ended before the drain checks ran"
        assert checks["health"].status == 503, checks["health"]
        assert_envelope(checks["new"], 503)
        assert_envelope(checks["chat"], 503)
        for r in results:
            completion_tokens, finish, errors = _tokens_of(r["events"])
            assert r["error"] is None and r["done"] and not errors, r
            assert completion_tokens == 60 and finish == "length", (completion_tokens, finish)
        last_end = max(r["ended"] for r in results)
        try:
            code = srv.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 10s after the drain ended:\n{srv.stderr_tail()}")
        assert code == 0, srv.stderr_tail()
        assert time.monotonic() - last_end < 10
        assert "Traceback" not in srv.stderr_text(), srv.stderr_tail()
    finally:
        srv.kill()


def test_a_drain_that_times_out_cuts_the_stream_and_exits() -> None:
    srv = start_server([*SMALL_ARGS, "--max-num-seqs", "4", "--shutdown-timeout", "2", "--disable-log-stats"])
    try:
        model = model_of(srv)
        body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}

        async def scenario() -> tuple[dict, float]:
            started = asyncio.Event()
            async with aiohttp.ClientSession() as session:
                task = asyncio.create_task(_read_sse(session, f"{srv.url}/v1/completions", body, started))
                await asyncio.wait_for(started.wait(), timeout=120)
                t0 = time.monotonic()
                srv.send_signal(signal.SIGTERM)
                return await asyncio.wait_for(task, timeout=30), t0

        result, t0 = asyncio.run(scenario())
        cut_after = result["ended"] - t0
        assert 1.8 <= cut_after <= 2.0 + 4.0, cut_after
        tokens = sum(len(c.get("text", "")) > 0 for e in result["events"] for c in e.get("choices", []))
        completion_tokens, finish, errors = _tokens_of(result["events"])
        assert completion_tokens is None or completion_tokens < 400
        assert finish != "length" and tokens < 400, (finish, tokens)
        if result["done"]:  # ended in-band: the last event is the 503 envelope
            assert errors and errors[-1]["error"]["code"] == 503, result["events"][-2:]
            assert_clean(errors[-1]["error"]["message"])
        try:
            code = srv.wait(timeout=max(0.1, t0 + 10 - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 10s after SIGTERM:\n{srv.stderr_tail()}")
        assert code == 0, srv.stderr_tail()
        assert "drain timed out" in srv.stderr_text()
        assert "Traceback" not in srv.stderr_text(), srv.stderr_tail()
    finally:
        srv.kill()


# ---- 8: a slow reader is paused, not buffered --------------------------------------------------------------

# Measured on the 2-core test machine: behind a client that reads nothing (SO_RCVBUF 4096), Linux
# queues ~115 KB in the server's send buffer when the peer's MSS is clamped to 536 (without the clamp
# it autotunes the loopback send buffer to ~3.9 MB), aiohttp/asyncio hold another 64-128 KB, so
# ~190 KB of SSE are written before the handler blocks; the engine then pauses the request once 256
# more tokens are pending (AsyncEngine.max_pending_tokens). A single logprobs=5 sequence (~510 bytes
# a token) would need ~620 tokens for that, more than max_model_len 512 allows: a lone 400- or
# 500-token stream is never paused here (measured). So the test uses n=8 samples (one engine request,
# one stream, 8 tokens a step, ~435 bytes a token): backpressure engages at ~690 of the 960 tokens.
SLOW_N, SLOW_MAX_TOKENS = 8, 120


def test_a_slow_reader_pauses_its_request_and_then_gets_everything(server, ref) -> None:
    server.wait_idle()
    body = json.dumps({"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": SLOW_MAX_TOKENS, "n": SLOW_N,
                       "temperature": 0, "ignore_eos": True, "logprobs": 5, "stream": True}).encode()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small receive window
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)  # small segments: a small server send buffer
    sock.connect((server.host, server.port))
    total = SLOW_N * SLOW_MAX_TOKENS
    try:
        gen0 = server.metric(GEN_TOKENS)
        sock.sendall(http_bytes("POST", "/v1/completions", body,
                                [(b"Authorization", f"Bearer {server.api_key}".encode()), *JSON]))
        history: list[tuple[float, float, float]] = []  # (t, generated, paused)
        t0 = time.monotonic()

        def sample() -> tuple[float, float, float]:
            samples = server.metrics()
            history.append((time.monotonic() - t0, metric_value(samples, GEN_TOKENS) - gen0,
                            metric_value(samples, PAUSED)))
            return history[-1]

        stalled = False
        while time.monotonic() - t0 < 60:
            t, generated, paused = sample()
            if generated >= total:
                break
            flat_since = min((h[0] for h in history if h[1] == generated), default=t)
            # Backpressure: the request is paused, or (engine side unseen) nothing more was generated
            # for 4 s well into the stream (longer than a compilation of a new shape takes here).
            if paused > 0 or (generated >= 300 and t - flat_since >= 4.0):
                time.sleep(1.5)
                _, later, _ = sample()
                stalled = later == generated  # it stays stopped while the reader reads nothing
                break
            time.sleep(0.25)
        generated_at_stall = history[-1][1]
        assert stalled and generated_at_stall < total - 100, \
            f"no backpressure: the reader read nothing and generation went on: {history[::4]}"
        assert max(p for _, _, p in history) in (0, SLOW_N), history  # all samples are paused together
        # Now read everything.
        sock.settimeout(120)
        data = b""
        while not data.endswith(b"\r\n0\r\n\r\n"):
            chunk = sock.recv(1 << 16)
            assert chunk, "the server closed the stream early"
            data += chunk
    finally:
        sock.close()
    resp = RawResponse(data)
    assert resp.status == 200
    payloads = [ln[6:] for ln in resp.text.split("\n") if ln.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    per_choice = [0] * SLOW_N
    finishes = [None] * SLOW_N
    for p in payloads[:-1]:
        event = json.loads(p)
        assert "error" not in event, event
        for c in event["choices"]:
            per_choice[c["index"]] += len(c["logprobs"]["tokens"])
            finishes[c["index"]] = c["finish_reason"] or finishes[c["index"]]
    assert per_choice == [SLOW_MAX_TOKENS] * SLOW_N and finishes == ["length"] * SLOW_N, (per_choice, finishes)

