"""POST /v1/responses, and GET / DELETE /v1/responses/{id} (--enable-response-store).

A response runs as one chat turn (responses_request.py translates the body; chat_turn.py reads the
output), streamed as OpenAI's typed events or answered whole; both are built by the same
ResponseBuilder, so the object a non-streamed request gets is the streamed one's last event's.
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from paxserve.outputs import RequestOutput
from paxserve.server.auth import presented_key
from paxserve.server.chat_turn import TurnUsage, answer_turn
from paxserve.server.errors import ProtocolError
from paxserve.server.generation import GenerationRun
from paxserve.server.generation_spec import GenerationSpec, chat_spec
from paxserve.server.handlers import serve_generation
from paxserve.server.protocol import ChatCompletionRequest, parse_body
from paxserve.server.request_body import read_json
from paxserve.server.response_store import StoredResponse, owner_of
from paxserve.server.responses_events import ResponseBuilder, new_id
from paxserve.server.responses_request import (ResponsesRequest, chat_body, check_supported, input_messages,
                                               output_messages, renamed)
from paxserve.server.state import STATE, ServerState


def _history(state: ServerState, req: ResponsesRequest, owner: str) -> list[dict[str, Any]]:
    """The earlier turns `previous_response_id` names, as chat messages (its instructions are not
    carried over, as OpenAI's)."""
    if req.previous_response_id is None:
        return []
    if state.responses is None:
        raise ProtocolError("`previous_response_id` needs the response store: start the server with "
                            "--enable-response-store", param="previous_response_id")
    previous = state.responses.get(owner, req.previous_response_id)
    if previous is None:
        raise ProtocolError(f"Previous response with id '{req.previous_response_id}' not found.",
                            param="previous_response_id", status=404)
    return previous.conversation + output_messages(previous.response["output"])


def _echoed(state: ServerState, req: ResponsesRequest, spec: GenerationSpec, stored: bool) -> dict[str, Any]:
    """The request fields a response repeats."""
    return {
        "model": state.settings.response_model(spec.model), "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {},
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": req.reasoning.effort if req.reasoning else None,
                      "summary": req.reasoning.summary if req.reasoning else None},
        "store": stored, "temperature": spec.params.temperature, "top_p": spec.params.top_p,
        "text": {"format": (req.text.format if req.text and req.text.format else {"type": "text"})},
        "tool_choice": req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none"),
        "tools": list(req.tools or []), "top_logprobs": req.top_logprobs, "truncation": "disabled",
        "user": req.user, "safety_identifier": req.safety_identifier, "prompt_cache_key": req.prompt_cache_key,
        "service_tier": "default",
    }


def parse_responses_request(body: dict[str, Any], state: ServerState, owner: str
                            ) -> tuple[ResponsesRequest, GenerationSpec, list[dict[str, Any]]]:
    """A /v1/responses body -> (the request, its chat spec, the conversation it continues and adds)."""
    req = parse_body(ResponsesRequest, body)
    check_supported(req)
    conversation = _history(state, req, owner) + input_messages(req.input)
    try:
        spec = chat_spec(parse_body(ChatCompletionRequest, chat_body(req, conversation)), state.settings)
    except ProtocolError as e:
        raise renamed(e) from None
    return req, spec, conversation


async def create_response(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    state = request.app[STATE]
    owner = owner_of(presented_key(request))
    req, spec, conversation = parse_responses_request(await read_json(request, state), state, owner)
    stored = state.responses is not None and req.store is not False
    builder = ResponseBuilder(new_id("resp"), _echoed(state, req, spec, stored), TurnUsage(0))

    async def respond(run: GenerationRun, first: tuple[int, RequestOutput]) -> web.StreamResponse:
        builder.usage.prompt_tokens = len(run.prompts[0].token_ids)
        resp = await answer_turn(request, spec, run, first, builder, bool(req.stream))
        if stored and builder.status in ("completed", "incomplete"):  # not failed, nor cut off by the client
            state.responses.put(owner, StoredResponse(builder.response(), conversation))
        return resp

    return await serve_generation(request, state, spec, arrival, respond=respond, run_id=builder.id, rename=renamed)


def _store_or_404(request: web.Request) -> tuple[ServerState, str, str]:
    state = request.app[STATE]
    response_id = request.match_info["response_id"]
    if state.responses is None:
        raise ProtocolError(f"Response with id '{response_id}' not found: this server keeps no responses (start it "
                            "with --enable-response-store)", param="response_id", status=404)
    return state, response_id, owner_of(presented_key(request))


async def get_response(request: web.Request) -> web.Response:
    state, response_id, owner = _store_or_404(request)
    stored = state.responses.get(owner, response_id)
    if stored is None:
        raise ProtocolError(f"Response with id '{response_id}' not found.", param="response_id", status=404)
    return web.json_response(stored.response)


async def delete_response(request: web.Request) -> web.Response:
    state, response_id, owner = _store_or_404(request)
    if not state.responses.delete(owner, response_id):
        raise ProtocolError(f"Response with id '{response_id}' not found.", param="response_id", status=404)
    return web.json_response({"id": response_id, "object": "response.deleted", "deleted": True})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
