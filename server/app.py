"""The aiohttp application: routes, API-key check, and the small endpoints.

    app = create_app(async_engine, settings)
    web.run_app(app, handler_cancellation=True)  # serve.run_server does this with signals and logs

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (GET / DELETE
/v1/responses/{id} with the store), POST /v1/messages and /v1/messages/count_tokens (Anthropic's),
GET /v1/models[/{model}], GET /health,
GET /metrics, POST /tokenize, POST /detokenize, GET /version, and GET /tokenizer_info when
enabled.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

import paxserve
from paxserve.engine.client import EngineClient
from paxserve.server.auth import auth_middleware
from paxserve.server.errors import ProtocolError, error_middleware, from_value_error
from paxserve.server.generation_spec import check_model, check_request_chat_template, template_messages
from paxserve.server.handlers import chat_completions, completions
from paxserve.server.lora import add_routes as add_lora_routes
from paxserve.server.messages_handler import add_routes as add_messages_routes
from paxserve.server.response_store import ResponseStore
from paxserve.server.responses_handler import add_routes as add_responses_routes
from paxserve.server.metrics import ServerMetrics
from paxserve.server.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeRequest, parse_body
from paxserve.server.request_body import read_json
from paxserve.server.settings import ServerSettings
from paxserve.server.state import STATE, ServerState

logger = logging.getLogger("paxserve.server")


def create_app(async_engine: EngineClient, settings: ServerSettings | None = None) -> web.Application:
    """An app serving `async_engine`. Limits left unset in `settings` (max_model_len, vocab_size,
    max_num_seqs, sampling defaults) are the engine's."""
    settings = settings or ServerSettings()
    limits = async_engine.limits
    if settings.max_model_len is None:
        settings.max_model_len = limits.max_model_len
    if settings.vocab_size is None:
        settings.vocab_size = limits.vocab_size
    if settings.max_num_seqs is None:
        settings.max_num_seqs = limits.max_num_seqs
    if settings.sampling_defaults is None:
        settings.sampling_defaults = dict(limits.sampling_defaults)
    info = {"block_size": str(limits.block_size), "num_gpu_blocks": str(limits.num_gpu_blocks),
            "enable_prefix_caching": str(limits.enable_prefix_caching)}
    metrics = ServerMetrics(settings.model_name, settings.max_model_len, info)
    if settings.lora_modules is not None:
        settings.lora_modules.base_model_name = settings.model_name
    app = web.Application(middlewares=[error_middleware, auth_middleware],
                          client_max_size=settings.client_max_size)
    responses = ResponseStore(settings.response_store_size) if settings.enable_response_store else None
    app[STATE] = ServerState(async_engine, settings, metrics, created=int(time.time()), responses=responses)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_endpoint)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/version", version)
    add_responses_routes(app)
    add_messages_routes(app)
    add_lora_routes(app, settings.lora_modules)
    if settings.enable_tokenizer_info_endpoint:
        app.router.add_get("/tokenizer_info", tokenizer_info)
    app.on_shutdown.append(_abort_in_flight)
    return app


async def _abort_in_flight(app: web.Application) -> None:
    """on_shutdown (the listening sockets are already closed): end every in-flight request now."""
    state = app[STATE]
    state.shutting_down = True
    if state.runs:
        logger.info("shutting down: aborting %d in-flight requests", len(state.runs))
    for run in list(state.runs):
        run.shutdown()


# ---- models, health, metrics, version ---------------------------------------------------------

def _model_card(state: ServerState, name: str) -> dict[str, Any]:
    """A served model's card; an adapter's names its base model as `parent` and its directory as `root`."""
    lora = state.settings.lora(name) if name not in state.settings.served_model_names else None
    return {
        "id": name, "object": "model", "created": state.created, "owned_by": "paxserve",
        "root": lora.lora_path if lora is not None else state.settings.model_root or name,
        "parent": state.settings.lora_modules.parent(name) if lora is not None else None,
        "max_model_len": state.settings.max_model_len,
        "permission": [{
            "id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": state.created,
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
            "group": None, "is_blocking": False,
        }],
    }


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    names = [*state.settings.served_model_names,
             *(() if state.settings.lora_modules is None else state.settings.lora_modules.adapters)]
    return web.json_response({"object": "list", "data": [_model_card(state, name) for name in names]})


async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    name = check_model(request.match_info["model"], state.settings)
    return web.json_response(_model_card(state, name))


async def health(request: web.Request) -> web.Response:
    """200 while serving; 503 once the engine has died or the server is draining (load balancers
    take it out of rotation). Never waits on the engine."""
    request.app[STATE].check_serving()
    return web.Response(status=200)


async def metrics_endpoint(request: web.Request) -> web.Response:
    """The snapshot the step loop published after its last step: a scrape never waits on the loop."""
    state = request.app[STATE]
    state.metrics.update_engine(state.async_engine.snapshot.as_dict())
    return web.Response(body=state.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": paxserve.__version__})


# ---- tokenizer endpoints ----------------------------------------------------------------------

async def _on_worker(state: ServerState, fn: Callable[..., Any], *args: Any) -> Any:
    """Tokenizer work runs on an input worker, never on the step loop."""
    state.check_serving()
    try:
        return await state.async_engine.run_input(fn, *args)
    except ProtocolError:
        raise
    except ValueError as e:
        raise from_value_error(e) from None


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's /tokenize: {"prompt": str} or {"messages": [...]} -> {"count", "max_model_len", "tokens"}."""
    state = request.app[STATE]
    body = await read_json(request, state)
    inputs = state.async_engine.input_processor
    if body.get("messages") is not None:
        chat = parse_body(TokenizeChatRequest, body)
        check_model(chat.model, state.settings)
        messages = template_messages(chat)
        template = check_request_chat_template(chat, state.settings) or state.settings.chat_template

        def run() -> tuple[list[int], list[str] | None]:
            text = inputs.render_chat(messages, chat_template=template,
                                      add_generation_prompt=chat.add_generation_prompt,
                                      continue_final_message=chat.continue_final_message,
                                      template_kwargs=chat.chat_template_kwargs)
            ids = inputs.tokenize(text, add_special_tokens=chat.add_special_tokens, param="messages")
            return ids, inputs.tokenizer.convert_ids_to_tokens(ids) if chat.return_token_strs else None
    else:
        req = parse_body(TokenizeRequest, body)
        check_model(req.model, state.settings)

        def run() -> tuple[list[int], list[str] | None]:
            ids = inputs.tokenize(req.prompt, add_special_tokens=req.add_special_tokens)  # needs a tokenizer
            return ids, inputs.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None

    ids, strs = await _on_worker(state, run)
    return web.json_response({"count": len(ids), "max_model_len": state.settings.max_model_len, "tokens": ids,
                              "token_strs": strs})


async def detokenize(request: web.Request) -> web.Response:
    """vLLM's /detokenize: {"tokens": [ids]} -> {"prompt": text}."""
    state = request.app[STATE]
    req = parse_body(DetokenizeRequest, await read_json(request, state))
    check_model(req.model, state.settings)
    inputs = state.async_engine.input_processor

    def run() -> str:
        ids = inputs.check_token_ids(req.tokens, "tokens") if req.tokens else []
        return inputs.require_tokenizer("tokens").decode(ids)

    return web.json_response({"prompt": await _on_worker(state, run)})


_INFO_FIELDS = ("bos_token", "eos_token", "pad_token", "unk_token", "bos_token_id", "eos_token_id", "pad_token_id",
                "add_bos_token", "add_eos_token", "padding_side", "clean_up_tokenization_spaces")


async def tokenizer_info(request: web.Request) -> web.Response:
    """vLLM's /tokenizer_info: the tokenizer's class, special tokens and flags, the chat template the
    server applies and the longest sequence it serves."""
    state = request.app[STATE]
    tok = state.async_engine.input_processor.require_tokenizer("tokenizer")
    info: dict[str, Any] = {"tokenizer_class": type(tok).__name__}
    for name in _INFO_FIELDS:
        value = getattr(tok, name, None)
        if value is None or isinstance(value, (str, int, bool)):
            info[name] = value
    info["chat_template"] = state.settings.chat_template or getattr(tok, "chat_template", None)
    info["model_max_length"] = state.settings.max_model_len
    return web.json_response(info)
