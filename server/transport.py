"""HTTP hardening below the app: header/keep-alive/body timeouts and JSON answers to parser errors.

    limits = TransportLimits(header_timeout_s=10, keepalive_timeout_s=5, body_timeout_s=30)
    runner = make_runner(app, limits, handler_cancellation=True, shutdown_timeout=5.0)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    ...
    body = await read_body(request, limits.body_timeout_s)     # in handlers, instead of request.read()

What aiohttp does not do by itself, and this module adds:
- a connection whose request headers are not complete within `header_timeout_s` (counted from the
  connection start, or from the end of the previous response on a keep-alive connection) is closed:
  slowloris clients sending a byte at a time, and clients that connect and send nothing;
- an idle keep-alive connection is closed after `keepalive_timeout_s` (aiohttp's own timer is off:
  it does not tell "idle" from "half-way through the headers", and starts at 3630 s);
- parser-level errors (garbage bytes, a malformed request line, a bad header, a line too long, bad
  chunked encoding) are answered with the OpenAI error envelope as JSON with `Connection: close`,
  not with aiohttp's text/plain page;
- `read_body` bounds the time to receive a body (408 and the connection closed after the answer).

How it plugs into aiohttp (the choice): `make_runner` returns a `web.AppRunner` subclass whose
`_make_server` (the hook BaseRunner declares for its subclasses; aiohttp's own AppRunner and
ServerRunner are its only implementations) lets AppRunner do the app start-up as usual and then
wraps the resulting `web.Server` in `_GuardedServer`, a `web.Server` subclass built only from that
server's public attributes (`request_handler`, `request_factory`, `handler_cancellation`). Its
protocol factory makes `_GuardedRequestHandler`, a `RequestHandler` subclass that overrides public
methods only: `connection_made`, `connection_lost`, `data_received` (to note bytes arriving),
`finish_response` (the end of each response) and `handle_error` (aiohttp's documented error-page
hook). The request factory is wrapped to learn when a request starts. A proxy protocol in front of
aiohttp's would need its own HTTP parser to know where requests end; a fork of RequestHandler.start()
would copy ~150 lines of aiohttp. The few private names read (all with getattr and a safe fallback):
`Server._kwargs` (the handler kwargs the app added: debug, handler_args) and
`RequestHandler._messages` (requests parsed but not yet started: a bad chunk that arrives after the
handler started is only visible there; without it that body ends in a 408 instead of a fast 400).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import (BadHttpMethod, BadStatusLine, ContentLengthError, HttpProcessingError,
                                     InvalidHeader, InvalidURLError, LineTooLong, TransferEncodingError)

from paxserve.server.errors import ProtocolError, error_response, internal_error

logger = logging.getLogger("paxserve.server")

_CLOSE = {"Connection": "close"}
# Statuses that server/errors.py's ERROR_TYPES does not name (reason phrase in CamelCase, as there).
_TYPES = {408: "RequestTimeout", 414: "URITooLong", 431: "RequestHeaderFieldsTooLarge"}
_AIOHTTP_KEEPALIVE_S = 3630.0  # aiohttp's own timer stays as its default backstop; ours closes first


@dataclass(slots=True)
class TransportLimits:
    # From the connection start (or the end of the previous response on a keep-alive connection)
    # until the request's headers are complete.
    header_timeout_s: float = 10.0
    # Idle keep-alive connections are closed after this (vLLM's --timeout-keep-alive default).
    keepalive_timeout_s: float = 5.0
    # To receive a whole request body once the headers are in (read_body).
    body_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "keepalive_timeout_s", "body_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ValueError(f"TransportLimits.{name}={value!r} must be a positive, finite number of seconds")
            setattr(self, name, float(value))


@dataclass(slots=True)
class TransportStats:
    """What the transport closed or refused, for logs and metrics (one per runner)."""
    header_timeouts: int = 0  # headers not complete in time (slowloris, or nothing sent at all)
    keepalive_closes: int = 0  # idle keep-alive connections closed
    body_timeouts: int = 0  # read_body gave up (408)
    bad_requests: int = 0  # parser-level errors answered with an envelope


def make_runner(app: web.Application, limits: TransportLimits | None = None, **runner_kwargs: Any) -> web.AppRunner:
    """A `web.AppRunner` for `app` that enforces `limits`; `runner_kwargs` go to AppRunner as usual
    (handler_cancellation, shutdown_timeout, access_log, ...). `runner.stats` counts what it closed."""
    if "keepalive_timeout" in runner_kwargs:
        raise TypeError("make_runner: set TransportLimits.keepalive_timeout_s instead of keepalive_timeout")
    return _GuardedRunner(app, limits or TransportLimits(), **runner_kwargs)


async def read_body(request: web.Request, timeout_s: float | None) -> bytes:
    """The whole request body, or ProtocolError 408 when it has not arrived within `timeout_s`
    (the connection is then closed after the answer, so a stalled half body cannot hold it).
    Too large a body still raises aiohttp's HTTPRequestEntityTooLarge (413 via error_middleware)."""
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except TimeoutError:
        _close_after_response(request)
        protocol = request.protocol
        if isinstance(protocol, _GuardedRequestHandler):
            protocol.px_stats.body_timeouts += 1
        logger.debug("request body from %s not received within %gs: answering 408", request.remote, timeout_s)
        raise ProtocolError(f"Request Timeout: the request body was not received within {timeout_s:g}s",
                            status=408, type=_TYPES[408], headers=dict(_CLOSE)) from None
    except HttpProcessingError as e:  # the pure-Python parser's payload errors (bad chunked encoding)
        _close_after_response(request)
        raise describe_parse_error(e) from None
    except web.RequestPayloadError as e:  # ... or the same, wrapped
        _close_after_response(request)
        raise ProtocolError(f"Invalid request body: {_detail(str(e.args[0]) if e.args else '') or 'malformed'}",
                            headers=dict(_CLOSE)) from None


def describe_parse_error(exc: BaseException, request_line_done: bool = True) -> ProtocolError:
    """The envelope for an aiohttp parser error: the status it means and the problem in plain words
    (no tracebacks, no echo of raw bytes). `request_line_done`: whether the request line had ended
    before the error (a line too long is then a header, 431; else the request line, 414)."""
    if isinstance(exc, LineTooLong):
        limit = exc.args[1] if len(exc.args) > 1 else "the limit of"
        if request_line_done:
            return ProtocolError(f"Request header line too long: more than {limit} bytes", status=431,
                                 type=_TYPES[431], headers=dict(_CLOSE))
        return ProtocolError(f"Request line too long: more than {limit} bytes", status=414, type=_TYPES[414],
                             headers=dict(_CLOSE))
    message = getattr(exc, "message", "") or str(exc)
    detail = _detail(message)
    if isinstance(exc, BadHttpMethod):
        if "HTTPS" in message:
            text = "Received TLS (HTTPS) traffic on a plain-HTTP port"
        else:
            text = "Malformed request line: invalid HTTP method"
    elif isinstance(exc, BadStatusLine):
        text = "Malformed request line" + (f": {detail}" if detail else "")
    elif isinstance(exc, InvalidURLError):
        text = "Invalid request target (URL)" + (f": {detail}" if detail else "")
    elif isinstance(exc, TransferEncodingError) or "chunk" in detail.lower():
        text = "Invalid chunked transfer encoding" + (f": {detail}" if detail else "")
    elif isinstance(exc, ContentLengthError):
        text = "Request body shorter than its Content-Length"
    elif "too many headers" in detail.lower():
        return ProtocolError("Too many request headers", status=431, type=_TYPES[431], headers=dict(_CLOSE))
    elif isinstance(exc, InvalidHeader) and _TOKEN.match(getattr(exc, "hdr", "") or ""):
        text = f"Invalid request header: {exc.hdr}"
    elif isinstance(exc, InvalidHeader) or any(w in detail.lower() for w in ("header", "content-length",
                                                                              "transfer-encoding")):
        text = "Invalid request header" + (f": {detail}" if detail else "")
    else:
        text = "Malformed HTTP request" + (f": {detail}" if detail else "")
    status = getattr(exc, "code", 400)
    status = status if isinstance(status, int) and 400 <= status < 500 else 400
    return ProtocolError(text, status=status, type=_TYPES.get(status), headers=dict(_CLOSE))


# ---- internals ------------------------------------------------------------------------------------

_TOKEN = re.compile(r"^[A-Za-z0-9-]{1,64}$")  # a header name, safe to echo
_QUOTED = re.compile(r"""(?::\s*|^)b?['"].*$""")  # ": 'raw bytes'" or a line that is only the bytes


def _detail(message: str) -> str:
    """The first meaningful line of a parser message, without quoted raw bytes or the ^ pointer
    (ProtocolError's sanitize() drops memory addresses and paths on top)."""
    for line in str(message).splitlines():
        line = _QUOTED.sub("", line.strip()).strip().rstrip(":.").strip()
        if line and not line.lower().startswith(("bad status line", "400, message")) and line != "^":
            return line.encode("ascii", "backslashreplace").decode()[:200]
    return ""


def _close_after_response(request: web.BaseRequest) -> None:
    protocol = request.protocol
    if isinstance(protocol, _GuardedRequestHandler):
        protocol.px_close_after_response = True
    elif protocol is not None:
        protocol.close()  # plain aiohttp: no keep-alive after this response (lingering still applies)


def _raw_response(err: ProtocolError) -> bytes:
    body = json.dumps(err.envelope()).encode()
    head = (f"HTTP/1.1 {err.status} {HTTPStatus(err.status).phrase}\r\n"
            "Content-Type: application/json; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode() + body


class _GuardedRunner(web.AppRunner):
    __slots__ = ("limits", "stats", "_px_kwargs")

    def __init__(self, app: web.Application, limits: TransportLimits, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.limits = limits
        self.stats = TransportStats()
        self._px_kwargs = {k: v for k, v in kwargs.items() if k not in ("handle_signals", "shutdown_timeout",
                                                                         "handler_cancellation")}

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()  # app start-up and freeze, exactly as AppRunner does
        handler_kwargs = dict(getattr(plain, "_kwargs", None) or self._px_kwargs)
        return _GuardedServer(plain.request_handler, request_factory=plain.request_factory,
                              handler_cancellation=plain.handler_cancellation, limits=self.limits,
                              stats=self.stats, **handler_kwargs)


class _GuardedServer(web.Server):
    def __init__(self, handler: Any, *, request_factory: Any, limits: TransportLimits, stats: TransportStats,
                 handler_cancellation: bool = False, **kwargs: Any) -> None:
        inner = request_factory

        def factory(message: Any, payload: Any, protocol: Any, writer: Any, task: Any) -> web.BaseRequest:
            if isinstance(protocol, _GuardedRequestHandler):
                protocol.px_request_started(payload)
            return inner(message, payload, protocol, writer, task)

        super().__init__(handler, request_factory=factory, handler_cancellation=handler_cancellation, **kwargs)
        self.px_limits = limits
        self.px_stats = stats
        self.px_handler_kwargs = {k: v for k, v in kwargs.items() if k != "loop"}
        self.px_loop = asyncio.get_running_loop()

    def __call__(self) -> web.RequestHandler:
        kwargs = dict(self.px_handler_kwargs, keepalive_timeout=_AIOHTTP_KEEPALIVE_S)  # ours replaces it
        return _GuardedRequestHandler(self, loop=self.px_loop, px_limits=self.px_limits, px_stats=self.px_stats,
                                      **kwargs)


class _GuardedRequestHandler(web.RequestHandler):
    """Per connection. Idle phase (no request being handled): from connection_made, and from the end
    of each response; a timer closes the connection when the phase lasts too long. Busy phase: from
    the request factory call (headers parsed) to the end of the response; no timer (the body has
    read_body's, the handler its own)."""

    __slots__ = ("px_limits", "px_stats", "px_close_after_response", "_px_loop", "_px_handle", "_px_busy",
                 "_px_fresh", "_px_idle_since", "_px_got_bytes", "_px_num_bytes", "_px_first_newline", "_px_payload")

    def __init__(self, manager: web.Server, *, loop: asyncio.AbstractEventLoop, px_limits: TransportLimits,
                 px_stats: TransportStats, **kwargs: Any) -> None:
        super().__init__(manager, loop=loop, **kwargs)
        self._px_loop = loop
        self.px_limits = px_limits
        self.px_stats = px_stats
        self.px_close_after_response = False
        self._px_handle: asyncio.TimerHandle | None = None
        self._px_busy = False
        self._px_fresh = True  # no response sent yet on this connection
        self._px_idle_since = 0.0
        self._px_got_bytes = False  # bytes of the next request arrived in this idle phase
        self._px_num_bytes = 0  # ... how many, and where the first newline was (request line end)
        self._px_first_newline: int | None = None
        self._px_payload: Any = None  # the body stream of the request being handled

    # -- phases --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._px_idle()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._px_cancel()
        self._px_payload = None
        super().connection_lost(exc)

    def px_request_started(self, payload: Any) -> None:
        self._px_cancel()
        self._px_busy = True
        self._px_payload = payload

    async def finish_response(self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
                              ) -> tuple[web.StreamResponse, bool]:
        if self.px_close_after_response and hasattr(resp, "force_close"):
            resp.force_close()  # "Connection: close" on HTTP/1.1 (when not prepared yet) and no keep-alive
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self._px_busy = False
            self._px_payload = None
            self._px_fresh = False
            if self.px_close_after_response:
                self.force_close()  # the answer is in the transport's buffer (flushed before closing); skip lingering
            else:
                self._px_idle()

    def _px_idle(self) -> None:
        self._px_cancel()
        if self.transport is None:
            return
        limits = self.px_limits
        self._px_idle_since = self._px_loop.time()
        self._px_got_bytes = False
        self._px_num_bytes = 0
        self._px_first_newline = None
        first = limits.header_timeout_s if self._px_fresh else min(limits.header_timeout_s,
                                                                  limits.keepalive_timeout_s)
        self._px_handle = self._px_loop.call_at(self._px_idle_since + first, self._px_on_timer)

    def _px_cancel(self) -> None:
        if self._px_handle is not None:
            self._px_handle.cancel()
            self._px_handle = None

    def _px_on_timer(self) -> None:
        self._px_handle = None
        if self.transport is None or self._px_busy:
            return
        if getattr(self, "_messages", None):
            return  # a request is parsed and about to start (the factory call is one loop step away)
        limits = self.px_limits
        header_deadline = self._px_idle_since + limits.header_timeout_s
        peer = self.transport.get_extra_info("peername")
        if self._px_fresh or self._px_got_bytes:
            now = self._px_loop.time()
            if now < header_deadline - 1e-3:  # bytes came after the keep-alive check was set: their turn
                self._px_handle = self._px_loop.call_at(header_deadline, self._px_on_timer)
                return
            self.px_stats.header_timeouts += 1
            logger.debug("closing connection from %s: request headers not complete within %gs (%s bytes "
                         "received; %d such connections closed so far)", peer, limits.header_timeout_s,
                         self._px_num_bytes, self.px_stats.header_timeouts)
            if self._px_got_bytes:  # tell a slow but real client why (an idle one gets a plain close)
                err = ProtocolError(f"Request Timeout: the request headers were not complete within "
                                    f"{limits.header_timeout_s:g}s", status=408, type=_TYPES[408])
                try:
                    self.transport.write(_raw_response(err))
                except Exception:  # noqa: BLE001 - closing anyway
                    pass
        else:
            self.px_stats.keepalive_closes += 1
            logger.debug("closing idle keep-alive connection from %s after %gs", peer, limits.keepalive_timeout_s)
        self.force_close()

    # -- input --

    def data_received(self, data: bytes) -> None:
        if data and not self._px_busy:
            self._px_got_bytes = True
            if self._px_first_newline is None:
                i = data.find(b"\n")
                if i >= 0:
                    self._px_first_newline = self._px_num_bytes + i
            self._px_num_bytes += len(data)
        super().data_received(data)
        payload = self._px_payload
        if payload is not None and self._px_busy and not payload.is_eof():
            exc = self._px_queued_parse_error()
            if exc is not None:  # the body of the running request is broken: fail its read now
                self._px_payload = None
                self.px_close_after_response = True
                self.px_stats.bad_requests += 1
                err = describe_parse_error(exc)
                logger.debug("bad request body from %s: %s", self.peername, err.message)
                payload.set_exception(err)

    def _px_queued_parse_error(self) -> BaseException | None:
        messages = getattr(self, "_messages", None)
        if not messages:
            return None
        exc = getattr(messages[-1][0], "exc", None)
        return exc if isinstance(exc, HttpProcessingError) else None

    # -- errors aiohttp answers itself --

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """aiohttp's error page hook (parser errors, and handler failures no middleware caught),
        answered with the JSON envelope and Connection: close."""
        if request.writer.output_size > 0:
            raise ConnectionError("Response is sent already, cannot send another response with the error message")
        if isinstance(exc, HttpProcessingError):
            first_newline = self._px_first_newline
            line_done = first_newline is not None and first_newline <= self.max_line_size
            err = describe_parse_error(exc, request_line_done=line_done)
            self.px_stats.bad_requests += 1
            logger.debug("bad request from %s: %d %s", request.remote, err.status, err.message)
        elif status == 504:
            err = ProtocolError("Gateway Timeout: the request handler timed out", status=504, type="GatewayTimeout",
                                headers=dict(_CLOSE))
        else:
            logger.error("error handling request from %s", request.remote, exc_info=exc)
            err = internal_error()
            err.headers = dict(_CLOSE)
        resp = error_response(err)
        resp.force_close()
        return resp


__all__ = ["TransportLimits", "TransportStats", "describe_parse_error", "make_runner", "read_body"]
