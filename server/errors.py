"""The OpenAI error envelope and the middleware that turns every failure into it.

Every error the server sends, unknown paths and wrong methods included, is
`{"error": {"message", "type", "param", "code"}}` with `code` = the HTTP status (as vLLM does);
under /v1/messages it is Anthropic's `{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Awaitable, Callable

from aiohttp import web

logger = logging.getLogger("paxserve.server")

# OpenAI SDK exception names where one exists; otherwise the HTTP reason phrase in CamelCase.
ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    409: "ConflictError",
    413: "RequestEntityTooLarge",
    415: "UnsupportedMediaType",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailable",
}

# What must never reach a client: memory addresses (`<Future at 0x7f...>`), file paths, tracebacks.
_ADDRESS = re.compile(r"\s*(?:at )?0x[0-9a-fA-F]{4,}")
_PATH = re.compile(r"/(?:home|usr|tmp|opt|root|var|etc|lib|lib64|srv|mnt|proc|work|Users|private|nix)(?:/[\w.@+-]+)+"
                   r"|[A-Za-z]:\\[\w.@+\\ -]+")
MAX_MESSAGE_CHARS = 2000


def sanitize(message: str) -> str:
    """A message safe to show a client: the first lines before any traceback, without memory
    addresses or file paths, cut to a sane length."""
    message = message.split("Traceback (most recent call last)")[0]
    message = _ADDRESS.sub("", message)
    message = _PATH.sub("<path>", message)
    message = message.strip() or "error"
    return message if len(message) <= MAX_MESSAGE_CHARS else message[:MAX_MESSAGE_CHARS] + "..."


class ProtocolError(Exception):
    """A request the server refuses, with the field to blame and the HTTP status to send."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, type: str | None = None,
                 code: int | str | None = None, headers: dict[str, str] | None = None) -> None:
        message = sanitize(message)
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.type = type or ERROR_TYPES.get(status, "APIError")
        self.code = status if code is None else code
        self.headers = headers or {}

    def envelope(self) -> dict[str, Any]:
        return error_envelope(self.message, self.type, self.param, self.code)


def error_envelope(message: str, type: str, param: str | None, code: int | str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# HTTP status -> Anthropic's error type.
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         529: "overloaded_error"}


def anthropic_envelope(err: ProtocolError) -> dict[str, Any]:
    kind = ANTHROPIC_ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def is_anthropic(request: web.Request) -> bool:
    return request.path.startswith("/v1/messages")


def error_response(err: ProtocolError, request: web.Request | None = None) -> web.Response:
    body = anthropic_envelope(err) if request is not None and is_anthropic(request) else err.envelope()
    return web.json_response(body, status=err.status, headers=err.headers, dumps=json.dumps)


def from_value_error(e: ValueError, default_param: str | None = None,
                     renames: dict[str, str] | None = None) -> ProtocolError:
    """A ValueError from SamplingParams or the input processor as a 400 naming the field: their
    RequestError carries it (`param`); `renames` maps engine field names to the names the client
    used (max_tokens -> max_completion_tokens, prompt -> messages)."""
    param = getattr(e, "param", None) or default_param
    return ProtocolError(str(e), param=(renames or {}).get(param, param) if param is not None else None)


def from_http_exception(e: web.HTTPException, request: web.Request) -> ProtocolError:
    status = e.status
    if status == 404:
        message = f"Not Found: no route for {request.path}"
    elif status == 405:
        allowed = ", ".join(sorted(getattr(e, "allowed_methods", ()) or ()))
        message = f"Method Not Allowed: {request.method} {request.path}" + (f" (allowed: {allowed})" if allowed else "")
    elif status == 413:
        message = f"Request body too large: {e.text or 'over the limit'}"
    else:
        message = e.text or e.reason
    headers = {k: v for k, v in e.headers.items() if k.lower() in ("allow", "retry-after")}
    return ProtocolError(message, status=status, headers=headers)


@web.middleware
async def error_middleware(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                           ) -> web.StreamResponse:
    try:
        return await handler(request)
    except ProtocolError as e:
        return error_response(e, request)
    except web.HTTPException as e:
        if e.status < 400:  # redirects and the like pass through
            raise
        return error_response(from_http_exception(e, request), request)
    except ValueError as e:
        return error_response(from_value_error(e), request)
    except Exception:  # noqa: BLE001 - the server stays up; the client gets a 500 envelope
        logger.exception("unexpected error while serving %s %s", request.method, request.path)
        return error_response(internal_error(), request)


def engine_stopped() -> ProtocolError:
    """The 503 for any request once the engine has died (the process is about to exit)."""
    return ProtocolError("The engine has stopped and cannot serve requests; the server is exiting so that its "
                         "supervisor can restart it.", status=503)


def internal_error() -> ProtocolError:
    """A 500 that says nothing about the server's insides (the log has the traceback)."""
    return ProtocolError("Internal server error; the server is still running (details are in its log).", status=500)
