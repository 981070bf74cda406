"""The aiohttp application: routes, API-key check, and the small endpoints.

    app = create_app(async_engine, settings)
    web.run_app(app, handler_cancellation=True)  # serve.run_server does this with signals and logs

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models[/{model}], GET /health,
GET /metrics, POST /tokenize, POST /detokenize, GET /version, and GET /tokenizer_info when
enabled.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
import uuid
from typing import Any, Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

import paxserve
from paxserve.server.errors import ProtocolError, error_middleware, from_value_error
from paxserve.server.handlers import chat_completions, completions
from paxserve.server.metrics import ServerMetrics
from paxserve.server.protocol import check_model, check_request_chat_template, get_bool, get_dict, parse_messages, token_ids
from paxserve.server.request_body import read_json
from paxserve.server.settings import ServerSettings
from paxserve.server.state import STATE, ServerState

logger = logging.getLogger("paxserve.server")


def create_app(async_engine: Any, settings: ServerSettings | None = None) -> web.Application:
    """An app serving `async_engine` (a paxserve AsyncEngine). Limits left unset in `settings`
    (max_model_len, vocab_size, max_num_seqs) are read from the engine."""
    settings = settings or ServerSettings()
    engine = async_engine.engine
    if settings.max_model_len is None:
        settings.max_model_len = engine.max_model_len
    if settings.vocab_size is None:
        settings.vocab_size = engine.model_config.vocab_size
    if settings.max_num_seqs is None:
        settings.max_num_seqs = engine.config.max_num_seqs
    if settings.sampling_defaults is None:
        settings.sampling_defaults = dict(getattr(engine, "sampling_defaults", None) or {})
    info = {}
    plan = getattr(engine, "plan", None)
    if plan is not None:
        info = {"block_size": str(plan.block_size), "num_gpu_blocks": str(plan.num_blocks),
                "enable_prefix_caching": str(engine.config.enable_prefix_caching)}
    metrics = ServerMetrics(settings.model_name, settings.max_model_len, info)
    app = web.Application(middlewares=[error_middleware, _auth_middleware],
                          client_max_size=settings.client_max_size)
    app[STATE] = ServerState(async_engine, settings, metrics, created=int(time.time()))
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_endpoint)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/version", version)
    if settings.enable_tokenizer_info_endpoint:
        app.router.add_get("/tokenizer_info", tokenizer_info)
    app.on_shutdown.append(_abort_in_flight)
    return app


@web.middleware
async def _auth_middleware(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                           ) -> web.StreamResponse:
    key = request.app[STATE].settings.api_key
    if key and request.path.startswith("/v1"):
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not _same_secret(token.strip(), key):
            raise ProtocolError("Unauthorized: missing or invalid API key; send `Authorization: Bearer <key>`.",
                                status=401)
    return await handler(request)


def _same_secret(given: str, key: str) -> bool:
    """Constant-time comparison that takes any header text: aiohttp hands non-ASCII header bytes
    over as surrogate escapes, which `str.encode()` alone would refuse (a 400 instead of a 401)."""
    def digest(text: str) -> bytes:
        return hashlib.sha256(text.encode("utf-8", "surrogateescape")).digest()

    return hmac.compare_digest(digest(given), digest(key))


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
    return {
        "id": name, "object": "model", "created": state.created, "owned_by": "paxserve",
        "root": state.settings.model_root or name, "parent": None, "max_model_len": state.settings.max_model_len,
        "permission": [{
            "id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": state.created,
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
            "group": None, "is_blocking": False,
        }],
    }


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response({"object": "list",
                              "data": [_model_card(state, name) for name in state.settings.served_model_names]})


async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    name = request.match_info["model"]
    if name not in state.settings.served_model_names:
        raise ProtocolError(f"The model `{name}` does not exist.", param="model", status=404)
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
    check_model(body, state.settings)
    inputs = state.async_engine.input_processor
    return_strs = bool(get_bool(body, "return_token_strs", False))
    if body.get("messages") is not None:
        messages = parse_messages(body["messages"])
        add_generation_prompt = bool(get_bool(body, "add_generation_prompt", True))
        continue_final = bool(get_bool(body, "continue_final_message", False))
        add_special = bool(get_bool(body, "add_special_tokens", False))
        template = check_request_chat_template(body, state.settings)
        template_kwargs = get_dict(body, "chat_template_kwargs") or {}

        def run() -> tuple[list[int], list[str] | None]:
            text = inputs.render_chat(messages, chat_template=template or state.settings.chat_template,
                                      add_generation_prompt=add_generation_prompt,
                                      continue_final_message=continue_final, template_kwargs=template_kwargs)
            ids = inputs.tokenize(text, add_special_tokens=add_special, param="messages")
            return ids, inputs.tokenizer.convert_ids_to_tokens(ids) if return_strs else None
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise ProtocolError("`prompt` (a string) or `messages` is required", param="prompt")
        add_special = bool(get_bool(body, "add_special_tokens", True))

        def run() -> tuple[list[int], list[str] | None]:
            ids = inputs.tokenize(prompt, add_special_tokens=add_special)  # refuses a model without tokenizer
            return ids, inputs.tokenizer.convert_ids_to_tokens(ids) if return_strs else None

    ids, strs = await _on_worker(state, run)
    return web.json_response({"count": len(ids), "max_model_len": state.settings.max_model_len, "tokens": ids,
                              "token_strs": strs})


async def detokenize(request: web.Request) -> web.Response:
    """vLLM's /detokenize: {"tokens": [ids]} -> {"prompt": text}."""
    state = request.app[STATE]
    body = await read_json(request, state)
    check_model(body, state.settings)
    if body.get("tokens") is None:
        raise ProtocolError("`tokens` is required", param="tokens")
    ids = token_ids(body["tokens"], "tokens", state.settings.vocab_size, allow_empty=True)
    inputs = state.async_engine.input_processor
    text = await _on_worker(state, lambda: inputs.require_tokenizer("tokens").decode(ids))
    return web.json_response({"prompt": text})


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
