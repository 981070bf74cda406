"""Anthropic's POST /v1/messages and /v1/messages/count_tokens.

A message runs as one chat turn (messages_request.py translates the body; chat_turn.py reads the
output), streamed as Anthropic's events or answered whole, both built by the same MessageBuilder.
Errors here (and every other failure under /v1/messages) have Anthropic's shape (errors.py); the API
key may come as `x-api-key`, as Anthropic's clients send it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from aiohttp import web

from paxserve.outputs import RequestOutput
from paxserve.server.chat_turn import TurnUsage, turn_pieces
from paxserve.server.errors import ProtocolError, anthropic_envelope, internal_error
from paxserve.server.generation import GenerationRun
from paxserve.server.generation_spec import (GenerationSpec, chat_spec, check_model, check_request_chat_template,
                                             template_messages)
from paxserve.server.messages_events import MessageBuilder
from paxserve.server.messages_request import CountTokensRequest, MessagesRequest, chat_body, check_supported
from paxserve.server.handlers import serve_generation
from paxserve.server.protocol import ChatCompletionRequest, parse_body
from paxserve.server.request_body import read_json
from paxserve.server.settings import ServerSettings
from paxserve.server.state import STATE
from paxserve.server.streaming import send_typed_event, start_stream
from paxserve.server.tools import parse_tools

logger = logging.getLogger("paxserve.server")


def parse_messages_request(body: dict[str, Any], settings: ServerSettings) -> tuple[MessagesRequest, GenerationSpec]:
    """A /v1/messages body -> (the request, its chat spec)."""
    req = parse_body(MessagesRequest, body)
    check_supported(req)
    return req, chat_spec(parse_body(ChatCompletionRequest, chat_body(req)), settings)


async def create_message(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    state = request.app[STATE]
    req, spec = parse_messages_request(await read_json(request, state), state.settings)

    async def respond(run: GenerationRun, first: tuple[int, RequestOutput]) -> web.StreamResponse:
        usage = TurnUsage(len(run.prompts[0].token_ids), cached_tokens=first[1].num_cached_tokens)
        builder = MessageBuilder(state.settings.response_model(spec.model), usage)
        if req.stream:
            return await _stream(request, spec, run, first, builder)
        finish = stop = None
        async for piece in turn_pieces(spec, run, first):
            builder.feed(piece)
            if piece.finish_reason is not None:
                finish, stop = piece.finish_reason, piece.stop_reason
        builder.finish(finish, stop)
        return web.json_response(builder.message())

    return await serve_generation(request, state, spec, arrival, respond=respond)


async def _stream(request: web.Request, spec: GenerationSpec, run: GenerationRun, first: tuple[int, RequestOutput],
                  builder: MessageBuilder) -> web.StreamResponse:
    resp = await start_stream(request)
    try:
        for event in builder.start():
            await send_typed_event(resp, event)
        finish = stop = None
        async for piece in turn_pieces(spec, run, first):
            if piece.finish_reason is not None:
                finish, stop = piece.finish_reason, piece.stop_reason
            for event in builder.feed(piece):
                await send_typed_event(resp, event)
        for event in builder.finish(finish, stop):
            await send_typed_event(resp, event)
        await resp.write_eof()
    except ConnectionError:  # the client went away; closing the run aborts the request
        logger.debug("client disconnected from %s", run.id)
    except Exception as e:  # noqa: BLE001 - the 200 is sent: Anthropic's error event ends the stream
        if not isinstance(e, ProtocolError):
            logger.exception("error while streaming %s", run.id)
        err = e if isinstance(e, ProtocolError) else internal_error()
        try:
            await send_typed_event(resp, anthropic_envelope(err))
            await resp.write_eof()
        except ConnectionError:
            pass
    return resp


async def count_tokens(request: web.Request) -> web.Response:
    """The prompt's token count as the model's chat template renders it (tools included)."""
    state = request.app[STATE]
    state.check_serving()
    req = parse_body(CountTokensRequest, await read_json(request, state))
    check_supported(req)
    chat = parse_body(ChatCompletionRequest, chat_body(req))
    check_model(chat.model, state.settings)
    tools = parse_tools(chat, state.settings).tools or None
    messages = template_messages(chat)
    template = check_request_chat_template(chat, state.settings) or state.settings.chat_template
    inputs = state.async_engine.input_processor

    def run() -> int:
        text = inputs.render_chat(messages, chat_template=template, tools=tools,
                                  template_kwargs=chat.chat_template_kwargs)
        return len(inputs.tokenize(text, add_special_tokens=False, param="messages"))

    try:
        count = await state.async_engine.run_input(run)
    except ValueError as e:
        raise ProtocolError(str(e), param="messages") from None
    return web.json_response({"input_tokens": count})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/messages", create_message)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
