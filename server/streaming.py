"""Server-sent events as OpenAI streams them: `data: {json}\\n\\n` chunks ending in `data: [DONE]`."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from paxserve.server.errors import ProtocolError

DONE = b"data: [DONE]\n\n"


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


async def start_stream(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(status=200, headers={
        "Content-Type": "text/event-stream; charset=utf-8",
        "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no",  # nginx and friends must not buffer the stream
    })
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    return resp


async def send_event(resp: web.StreamResponse, obj: dict[str, Any]) -> None:
    await resp.write(b"data: " + dumps(obj).encode("utf-8") + b"\n\n")


async def send_done(resp: web.StreamResponse) -> None:
    await resp.write(DONE)
    await resp.write_eof()


async def send_error(resp: web.StreamResponse, err: ProtocolError) -> None:
    """An error after the stream started: an error event, then [DONE]."""
    await send_event(resp, err.envelope())
    await send_done(resp)


async def send_typed_event(resp: web.StreamResponse, obj: dict[str, Any]) -> None:
    """An event named by its `type` (`event: <type>` then `data: {json}`), as the Responses API and
    Anthropic's Messages API stream; neither ends with [DONE]."""
    await resp.write(f"event: {obj['type']}\ndata: {dumps(obj)}\n\n".encode("utf-8"))
