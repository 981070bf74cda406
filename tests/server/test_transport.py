"""server/transport.py: header, keep-alive and body timeouts, and JSON envelopes for parser errors.

A tiny app (error_middleware + a POST handler that reads its body with read_body) runs under
make_runner on 127.0.0.1 in a background thread; raw sockets play the clients (slowloris, silent,
keep-alive, half body, garbage). Small timeouts keep the file at a few seconds.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time

import pytest
from aiohttp import web

from paxserve.server.errors import error_middleware
from paxserve.server.transport import TransportLimits, TransportStats, describe_parse_error, make_runner, read_body

LIMITS = TransportLimits(header_timeout_s=0.8, keepalive_timeout_s=0.4, body_timeout_s=0.8)
CLIENT_MAX_SIZE = 4096
SLACK_S = 1.0  # what the brief allows past each timeout on a loaded 2-core machine


class ServerThread:
    """The app on its own event loop in a daemon thread."""

    def __init__(self, limits: TransportLimits) -> None:
        self.limits = limits
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="transport-test-server", daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self) -> None:
        async def echo(request: web.Request) -> web.Response:
            body = await read_body(request, self.limits.body_timeout_s)
            return web.json_response({"received": len(body), "body": body.decode("utf-8", "replace")})

        async def ping(request: web.Request) -> web.Response:
            return web.json_response({"ok": True})

        async def slow(request: web.Request) -> web.Response:  # longer than every transport timeout
            await asyncio.sleep(self.limits.header_timeout_s + self.limits.keepalive_timeout_s)
            return web.json_response({"slow": True})

        app = web.Application(middlewares=[error_middleware], client_max_size=CLIENT_MAX_SIZE)
        app.router.add_post("/echo", echo)
        app.router.add_get("/ping", ping)
        app.router.add_get("/slow", slow)
        self.runner = make_runner(app, self.limits, handler_cancellation=True, shutdown_timeout=1.0,
                                  access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.port = self.runner.addresses[0][1]

    @property
    def stats(self) -> TransportStats:
        return self.runner.stats

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()

    def connect(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock


@pytest.fixture(scope="module")
def srv():
    server = ServerThread(LIMITS)
    yield server
    server.stop()


# ---- raw HTTP helpers -----------------------------------------------------------------------------

def read_response(sock: socket.socket, timeout: float = 5.0) -> tuple[int, dict[str, str], bytes]:
    """One response: (status, lower-cased headers, body). Raises if the connection closes first."""
    sock.settimeout(timeout)
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a full response: {buf!r}")
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return status, headers, body[:length]


def wait_closed(sock: socket.socket, timeout: float) -> float:
    """Seconds until the server closed `sock` (EOF or reset), reading and dropping what it sends."""
    start = time.monotonic()
    sock.settimeout(0.05)
    while time.monotonic() - start < timeout:
        try:
            if not sock.recv(65536):
                return time.monotonic() - start
        except socket.timeout:
            continue
        except (ConnectionResetError, BrokenPipeError):
            return time.monotonic() - start
    raise AssertionError(f"connection still open after {timeout}s")


def get_ping(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    sock.sendall(b"GET /ping HTTP/1.1\r\nHost: test\r\n\r\n")
    return read_response(sock)


def assert_envelope(status: int, headers: dict[str, str], body: bytes, expected: int) -> dict:
    assert status == expected, (status, headers, body)
    assert headers.get("content-type", "").startswith("application/json"), headers
    assert headers.get("connection", "").lower() == "close", headers
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == expected and isinstance(err["type"], str) and err["type"], err
    message = err["message"]
    assert message and len(message) < 300, err
    for leak in ("0x", "Traceback", "b'", "\n", "^"):
        assert leak not in message, err
    return err


# ---- TransportLimits and make_runner --------------------------------------------------------------

@pytest.mark.parametrize("field", ["header_timeout_s", "keepalive_timeout_s", "body_timeout_s"])
@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), "5", True, None])
def test_limits_are_validated(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        TransportLimits(**{field: value})


def test_limits_defaults() -> None:
    limits = TransportLimits()
    assert (limits.header_timeout_s, limits.keepalive_timeout_s, limits.body_timeout_s) == (10.0, 5.0, 30.0)


def test_make_runner_refuses_aiohttp_keepalive_timeout() -> None:
    with pytest.raises(TypeError, match="keepalive_timeout_s"):
        make_runner(web.Application(), LIMITS, keepalive_timeout=75)


# ---- normal traffic ---------------------------------------------------------------------------------

def test_post_with_body_is_echoed(srv: ServerThread) -> None:
    with srv.connect() as sock:
        body = b'{"hello": "world"}'
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        status, _, payload = read_response(sock)
        assert status == 200 and json.loads(payload) == {"received": len(body), "body": body.decode()}
        # chunked bodies are fine too
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
        status, _, payload = read_response(sock)
        assert status == 200 and json.loads(payload)["body"] == "hello world"


def test_keepalive_connection_used_promptly_serves_many_requests(srv: ServerThread) -> None:
    with srv.connect() as sock:
        for _ in range(5):
            status, headers, body = get_ping(sock)
            assert status == 200 and json.loads(body) == {"ok": True}
            assert headers.get("connection", "").lower() != "close"
            time.sleep(LIMITS.keepalive_timeout_s / 4)
        # then left idle: closed by the keep-alive timer (shorter than the header timeout here)
        closes = srv.stats.keepalive_closes
        elapsed = wait_closed(sock, LIMITS.keepalive_timeout_s + SLACK_S)
        assert LIMITS.keepalive_timeout_s - 0.1 <= elapsed < LIMITS.header_timeout_s, elapsed
        assert srv.stats.keepalive_closes == closes + 1


def test_pipelined_requests_are_all_answered(srv: ServerThread) -> None:
    with srv.connect() as sock:
        sock.sendall(b"GET /ping HTTP/1.1\r\nHost: t\r\n\r\n" * 2 + b"POST /echo HTTP/1.1\r\nHost: t\r\n"
                     b"Content-Length: 3\r\n\r\nabc")
        data, deadline = b"", time.monotonic() + 5
        while data.count(b"HTTP/1.1 200 OK\r\n") < 3 and time.monotonic() < deadline:
            data += sock.recv(65536)
        assert data.count(b"HTTP/1.1 200 OK\r\n") == 3 and data.endswith(b'"body": "abc"}'), data


def test_slow_handler_and_slow_body_within_limits_are_not_cut(srv: ServerThread) -> None:
    """No transport timer runs while a request is being handled; a body trickling in within
    body_timeout_s is read whole."""
    with srv.connect() as sock:
        sock.sendall(b"GET /slow HTTP/1.1\r\nHost: t\r\n\r\n")
        status, _, body = read_response(sock)
        assert status == 200 and json.loads(body) == {"slow": True}
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 9\r\n\r\n")
        for part in (b"abc", b"def", b"ghi"):
            time.sleep(LIMITS.body_timeout_s / 5)
            sock.sendall(part)
        status, _, body = read_response(sock)
        assert status == 200 and json.loads(body)["body"] == "abcdefghi"


def test_slow_headers_after_a_response_get_the_header_timeout(srv: ServerThread) -> None:
    """On a keep-alive connection, a next request started in time has until header_timeout_s
    (from the end of the previous response) to finish its headers; then 408 and close."""
    with srv.connect() as sock:
        assert get_ping(sock)[0] == 200
        done = time.monotonic()
        time.sleep(LIMITS.keepalive_timeout_s / 2)
        sock.sendall(b"GET /ping HTTP/1.1\r\nHo")  # started within the keep-alive time, then stalls
        status, headers, body = read_response(sock, timeout=LIMITS.header_timeout_s + SLACK_S)
        elapsed = time.monotonic() - done
        assert LIMITS.header_timeout_s - 0.1 <= elapsed <= LIMITS.header_timeout_s + SLACK_S, elapsed
        err = assert_envelope(status, headers, body, 408)
        assert "headers" in err["message"]
        wait_closed(sock, SLACK_S)


# ---- slowloris and silent connections ----------------------------------------------------------------

def test_slowloris_connections_are_closed_while_others_are_served(srv: ServerThread, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="paxserve.server")
    before = srv.stats.header_timeouts
    socks, opened = [], []
    start = time.monotonic()
    for _ in range(50):
        s = srv.connect()
        opened.append(time.monotonic())
        s.sendall(b"GET /ping HTTP/1.1\r\nHost: t\r\nX-Slow: ")
        s.setblocking(False)
        socks.append(s)
    closed_at: dict[int, float] = {}  # seconds from each connection's start
    served_meanwhile = False
    try:
        while len(closed_at) < len(socks) and time.monotonic() - start < LIMITS.header_timeout_s + SLACK_S:
            for i, s in enumerate(socks):
                if i in closed_at:
                    continue
                try:
                    s.send(b"a")  # one byte at a time, never finishing the headers
                    while True:  # drain: EOF means closed; the 408 may come first
                        data = s.recv(65536)
                        if not data:
                            closed_at[i] = time.monotonic() - opened[i]
                            break
                except (BlockingIOError, InterruptedError):
                    pass
                except (ConnectionResetError, BrokenPipeError):
                    closed_at[i] = time.monotonic() - opened[i]
            if not served_meanwhile and time.monotonic() - start > LIMITS.header_timeout_s / 3:
                with srv.connect() as fresh:  # a normal client on a fresh connection is still served
                    assert get_ping(fresh)[0] == 200
                served_meanwhile = True
            time.sleep(0.05)
    finally:
        for s in socks:
            s.close()
    assert served_meanwhile
    assert len(closed_at) == len(socks), f"{len(socks) - len(closed_at)} slowloris connections still open"
    assert min(closed_at.values()) >= LIMITS.header_timeout_s - 0.1, sorted(closed_at.values())[:3]
    assert max(closed_at.values()) <= LIMITS.header_timeout_s + SLACK_S
    assert srv.stats.header_timeouts >= before + len(socks)
    lines = [r.getMessage() for r in caplog.records if "request headers not complete" in r.getMessage()]
    assert len(lines) >= len(socks) and all(r.levelno == logging.DEBUG for r in caplog.records
                                            if "request headers not complete" in r.getMessage())
    assert "so far" in lines[-1]


def test_connection_that_sends_nothing_is_closed(srv: ServerThread) -> None:
    with srv.connect() as sock:
        elapsed = wait_closed(sock, LIMITS.header_timeout_s + SLACK_S)
    # a fresh connection gets the header timeout, not the (shorter) keep-alive one
    assert LIMITS.header_timeout_s - 0.1 <= elapsed <= LIMITS.header_timeout_s + SLACK_S, elapsed


# ---- bodies ---------------------------------------------------------------------------------------------

def test_half_body_gets_408_and_the_connection_is_closed(srv: ServerThread) -> None:
    before = srv.stats.body_timeouts
    with srv.connect() as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n" + b'{"a": 1234')
        start = time.monotonic()
        status, headers, body = read_response(sock, timeout=LIMITS.body_timeout_s + SLACK_S)
        assert time.monotonic() - start <= LIMITS.body_timeout_s + SLACK_S
        err = assert_envelope(status, headers, body, 408)
        assert err["type"] == "RequestTimeout" and "body" in err["message"]
        wait_closed(sock, SLACK_S)
    assert srv.stats.body_timeouts == before + 1


def test_body_over_client_max_size_is_413_envelope(srv: ServerThread) -> None:
    with srv.connect() as sock:
        body = b"x" * (CLIENT_MAX_SIZE + 100)
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        status, headers, payload = read_response(sock)
    assert status == 413 and headers["content-type"].startswith("application/json")
    err = json.loads(payload)["error"]
    assert err["code"] == 413 and err["type"] == "RequestEntityTooLarge" and "too large" in err["message"]


# ---- parser errors --------------------------------------------------------------------------------------

MALFORMED = {
    "garbage bytes": ([b"\x00\x01\x02garbage\xff\r\n\r\n"], 400, "request line"),
    "tls on plain port": ([b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03"], 400, "HTTPS"),
    "bad request line": ([b"GET / HTTP/1.1 extra\r\nHost: t\r\n\r\n"], 400, "request line"),
    "bad http version": ([b"GET / HTTP/x.y\r\nHost: t\r\n\r\n"], 400, "request line"),
    "header without colon": ([b"GET / HTTP/1.1\r\nHost: t\r\nBad Header\r\n\r\n"], 400, "header"),
    "bad content-length": ([b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: abc\r\n\r\n"], 400, "Content-Length"),
    "header line too long": ([b"GET / HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n"], 431, "header"),
    "request line too long": ([b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: t\r\n\r\n"], 414, "line"),
    "too many headers": ([b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(200)) + b"\r\n"],
                         431, "headers"),
    "bad chunk size": ([b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n"],
                       400, "chunk"),
    "bad chunk after the headers": ([b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
                                     b"3\r\nabc\r\n", b"nothex\r\nxyz\r\n0\r\n\r\n"], 400, "chunk"),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_parser_errors_get_json_envelope_and_close(srv: ServerThread, name: str) -> None:
    parts, expected, named = MALFORMED[name]
    before = srv.stats.bad_requests
    with srv.connect() as sock:
        start = time.monotonic()
        for i, part in enumerate(parts):
            if i:
                time.sleep(0.1)  # the handler is already reading the body when the bad bytes come
            sock.sendall(part)
        status, headers, body = read_response(sock)
        assert time.monotonic() - start < LIMITS.body_timeout_s  # answered at once, not by a timeout
        err = assert_envelope(status, headers, body, expected)
        assert named.lower() in err["message"].lower(), err
        wait_closed(sock, SLACK_S)
    assert srv.stats.bad_requests == before + 1


def test_describe_parse_error_plain_words() -> None:
    from aiohttp.http_exceptions import BadHttpMessage, InvalidHeader, LineTooLong

    err = describe_parse_error(InvalidHeader(b"X-\x00Bad"))
    assert err.status == 400 and err.message == "Invalid request header: Invalid HTTP header"
    err = describe_parse_error(BadHttpMessage("Missing 'Host' header in request."))
    assert err.message == "Invalid request header: Missing 'Host' header in request"
    assert describe_parse_error(LineTooLong(b"x" * 100, 8190), request_line_done=True).status == 431
    assert describe_parse_error(LineTooLong(b"x" * 100, 8190), request_line_done=False).status == 414
    assert describe_parse_error(BadHttpMessage("Too many headers received")).status == 431


# ---- afterwards ------------------------------------------------------------------------------------------

def test_still_serving_after_all_of_that(srv: ServerThread) -> None:
    for _ in range(3):
        with srv.connect() as sock:
            status, _, body = get_ping(sock)
            assert status == 200 and json.loads(body) == {"ok": True}
    with srv.connect() as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\nok")
        status, _, body = read_response(sock)
        assert status == 200 and json.loads(body)["body"] == "ok"
    assert len(srv.runner.server.connections) <= 2  # the abusive ones are all gone


def test_cleanup_is_not_held_by_idle_or_slow_connections() -> None:
    server = ServerThread(TransportLimits(header_timeout_s=30, keepalive_timeout_s=30, body_timeout_s=30))
    socks = [server.connect() for _ in range(5)]
    try:
        for s in socks[:3]:
            s.sendall(b"GET /ping HTTP/1.1\r\nHost: t\r\nX-Slow: a")
        assert get_ping(socks[3])[0] == 200  # an idle keep-alive connection
        start = time.monotonic()
        server.stop()
        assert time.monotonic() - start < 3.0
        for s in socks:
            wait_closed(s, 1.0)
    finally:
        for s in socks:
            s.close()
