"""Reading a request's JSON body: the Content-Type must say JSON, and the body must arrive in time."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from paxserve.server.errors import ProtocolError
from paxserve.server.protocol import parse_json_body
from paxserve.server.transport import read_body

if TYPE_CHECKING:
    from paxserve.server.state import ServerState

_JSON_TYPES = ("application/json",)


def check_json_content_type(request: web.Request) -> None:
    """415 for a body declared as anything but JSON (`application/json`, `application/*+json`). A
    request with no Content-Type at all is read as JSON, as most HTTP clients' defaults expect."""
    if "Content-Type" not in request.headers:
        return
    mime = request.content_type.lower()  # without parameters such as charset
    if mime in _JSON_TYPES or (mime.startswith("application/") and mime.endswith("+json")):
        return
    raise ProtocolError(f"Unsupported Content-Type {mime!r}: send the body as JSON with "
                        "`Content-Type: application/json` (curl: -H 'Content-Type: application/json').", status=415)


async def read_json(request: web.Request, state: ServerState) -> dict[str, Any]:
    check_json_content_type(request)
    return parse_json_body(await read_body(request, state.settings.body_timeout_s))
