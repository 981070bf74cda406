"""One assistant turn of a chat-shaped request, as the APIs that are not Chat Completions read it: the
Responses API and Anthropic's Messages API each translate their body into a chat request (one prompt,
n = 1), run it like /v1/chat/completions, and build their own objects from these pieces.

Each piece is what one engine output added, already through the request's reasoning and tool-call
parsers (the same ChoiceStream a streamed chat completion uses). Both APIs build their answer from
the pieces whether or not the client streams, so a non-streamed answer is the streamed one's final
object by construction: `answer_turn` runs the same builder for both.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol

from aiohttp import web

from paxserve.outputs import RequestOutput
from paxserve.server import responses as R
from paxserve.server.errors import ProtocolError, internal_error
from paxserve.server.generation import GenerationRun, ServerShutdown
from paxserve.server.generation_spec import GenerationSpec
from paxserve.server.streaming import send_typed_event, start_stream

logger = logging.getLogger("paxserve.server")


@dataclass(slots=True)
class TurnPiece:
    reasoning: str = ""  # text the reasoning parser split off
    content: str = ""  # answer text
    calls: list[dict[str, Any]] = field(default_factory=list)  # chat tool-call deltas (index, id, function)
    num_tokens: int = 0  # tokens this output added
    finish_reason: str | None = None  # "stop", "length", "abort" (None: more to come)
    stop_reason: int | str | None = None  # the stop string or token that ended it
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # chat's logprobs content entries, if asked


@dataclass(slots=True)
class TurnUsage:
    """Token counts of one turn. `reasoning_tokens` counts the tokens of outputs that added only
    reasoning text (a step that ends the thinking and starts the answer counts as answer)."""

    prompt_tokens: int
    output_tokens: int = 0
    reasoning_tokens: int = 0
    cached_tokens: int = 0

    def add(self, piece: TurnPiece) -> None:
        self.output_tokens += piece.num_tokens
        self.cached_tokens = piece.cached_tokens
        if piece.reasoning and not piece.content and not piece.calls:
            self.reasoning_tokens += piece.num_tokens


async def turn_pieces(spec: GenerationSpec, run: GenerationRun,
                      first: tuple[int, RequestOutput]) -> AsyncIterator[TurnPiece]:
    """The pieces of the run's one choice, until it finishes (ProtocolError 503 on shutdown)."""
    parsed = spec.output.stream() if spec.output.active else None
    item = first
    while True:
        _, out = item
        for o in out.outputs:
            final = o.finish_reason is not None
            if parsed is not None:
                delta = parsed.feed(o.text, final=final)
            else:
                delta = {"content": o.text} if o.text else {}
            logprobs = R.chat_logprobs(o.logprobs, o.token_ids, spec.logprobs, spec.tokens_as_ids,
                                       spec.logprob_token_ids)["content"] \
                if spec.logprobs is not None and o.logprobs else []
            yield TurnPiece(delta.get("reasoning", ""), delta.get("content", ""), list(delta.get("tool_calls", ())),
                            len(o.token_ids), o.finish_reason, o.stop_reason, out.num_cached_tokens, logprobs)
        if out.finished:
            return
        try:
            item = await run.next()
        except ServerShutdown as e:
            raise ProtocolError(str(e), status=503) from None


@dataclass(slots=True)
class CallDraft:
    """A tool call as its fragments arrive."""

    call_id: str
    name: str
    arguments: str = ""


def call_updates(piece: TurnPiece, calls: dict[int, CallDraft]) -> list[tuple[int, CallDraft, str, bool]]:
    """(index, call, new argument text, whether the call is new) for each fragment in `piece`, with
    `calls` updated."""
    updates = []
    for fragment in piece.calls:
        index = fragment["index"]
        function = fragment.get("function", {})
        args = function.get("arguments") or ""
        new = index not in calls
        if new:
            calls[index] = CallDraft(fragment.get("id") or f"call_{index}", function.get("name") or "")
        calls[index].arguments += args
        updates.append((index, calls[index], args, new))
    return updates


class TurnBuilder(Protocol):
    """An API's answer built from a turn's pieces: each call returns the stream events it makes."""

    def start(self) -> list[dict[str, Any]]: ...

    def feed(self, piece: TurnPiece) -> list[dict[str, Any]]: ...

    def finish(self, finish_reason: str | None, stop_reason: int | str | None) -> list[dict[str, Any]]: ...

    def fail(self, err: ProtocolError) -> list[dict[str, Any]]: ...

    def final(self) -> dict[str, Any]: ...


async def _build(spec: GenerationSpec, run: GenerationRun, first: tuple[int, RequestOutput], builder: TurnBuilder,
                 emit: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
    for event in builder.start():
        await emit(event)
    finish = stop = None
    async for piece in turn_pieces(spec, run, first):
        if piece.finish_reason is not None:
            finish, stop = piece.finish_reason, piece.stop_reason
        for event in builder.feed(piece):
            await emit(event)
    for event in builder.finish(finish, stop):
        await emit(event)


async def _drop(event: dict[str, Any]) -> None:
    pass


async def answer_turn(request: web.Request, spec: GenerationSpec, run: GenerationRun,
                      first: tuple[int, RequestOutput], builder: TurnBuilder, stream: bool) -> web.StreamResponse:
    """The turn as typed SSE events, or as the builder's final object. Once the stream has started,
    a failure is the builder's own failure events; a client that goes away ends it quietly (closing
    the run aborts the request)."""
    if not stream:
        await _build(spec, run, first, builder, _drop)
        return web.json_response(builder.final())
    resp = await start_stream(request)

    async def send(event: dict[str, Any]) -> None:
        await send_typed_event(resp, event)

    try:
        await _build(spec, run, first, builder, send)
        await resp.write_eof()
    except ConnectionError:
        logger.debug("client disconnected from %s", run.id)
    except Exception as e:  # noqa: BLE001 - the 200 is sent: the failure is the stream's last event
        if not isinstance(e, ProtocolError):
            logger.exception("error while streaming %s", run.id)
        err = e if isinstance(e, ProtocolError) else internal_error()
        try:
            for event in builder.fail(err):
                await send(event)
            await resp.write_eof()
        except ConnectionError:
            pass
    return resp
