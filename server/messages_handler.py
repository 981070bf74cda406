"""Anthropic's POST /v1/messages and /v1/messages/count_tokens.

A message runs as one chat turn (messages_request.py translates the body; chat_turn.py reads the
output), streamed as Anthropic's events or answered whole, both built by the same MessageBuilder.
Errors here (and every other failure under /v1/messages) have Anthropic's shape (errors.py); the API
key may come as `x-api-key`, as Anthropic's clients send it.
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from paxserve.outputs import RequestOutput
from paxserve.server.chat_turn import TurnUsage, answer_turn
from paxserve.server.errors import ProtocolError
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
from paxserve.server.tools import parse_tools


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
        return await answer_turn(request, spec, run, first, builder, bool(req.stream))

    return await serve_generation(request, state, spec, arrival, respond=respond)


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
