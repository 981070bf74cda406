"""The API key (--api-key) on /v1/*: sent as `Authorization: Bearer <key>` (OpenAI's clients) or as
`x-api-key: <key>` (Anthropic's)."""

from __future__ import annotations

import hashlib
import hmac
from typing import Awaitable, Callable

from aiohttp import web

from paxserve.server.errors import ProtocolError
from paxserve.server.state import STATE


def presented_key(request: web.Request) -> str | None:
    """The key the request carries, from either header."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("x-api-key")


@web.middleware
async def auth_middleware(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                          ) -> web.StreamResponse:
    key = request.app[STATE].settings.api_key
    if key and request.path.startswith("/v1"):
        given = presented_key(request)
        if given is None or not _same_secret(given, key):
            raise ProtocolError("Unauthorized: missing or invalid API key; send `Authorization: Bearer <key>` "
                                "(or `x-api-key: <key>`).", status=401)
    return await handler(request)


def _same_secret(given: str, key: str) -> bool:
    """Constant-time comparison that takes any header text: aiohttp hands non-ASCII header bytes
    over as surrogate escapes, which `str.encode()` alone would refuse (a 400 instead of a 401)."""
    def digest(text: str) -> bytes:
        return hashlib.sha256(text.encode("utf-8", "surrogateescape")).digest()

    return hmac.compare_digest(digest(given), digest(key))
