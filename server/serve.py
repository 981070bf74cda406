"""`paxserve serve`: build the Engine from the CLI flags, run it on its own threads (AsyncEngine),
serve the app until SIGINT/SIGTERM, then drain (--shutdown-timeout), abort what is left and exit.

If the engine dies anyway, /health answers 503 at once and the process exits with status 1 within
EXIT_DEADLINE_S seconds, so that a supervisor (systemd, Kubernetes) restarts it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from paxserve.server.settings import DEFAULT_MODEL_NAME, ServerSettings
from paxserve.server.transport import TransportLimits, make_runner

if TYPE_CHECKING:  # the app's modules load when serving starts, after the engine
    from paxserve.engine.client import EngineClient
    from paxserve.server.state import ServerState

logger = logging.getLogger("paxserve.server")
HANDLER_GRACE_S = 2.0  # after the in-flight requests were aborted, handlers get this long to end
EXIT_DEADLINE_S = 5.0  # an engine death ends the process within this, whatever still hangs
DRAIN_POLL_S = 0.05


def _chat_template(value: str | None) -> str | None:
    """--chat-template is a file path or the Jinja template itself (as vLLM accepts)."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a readable file nor a Jinja template")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        dtype=args.dtype, quantization=args.quantization, quantization_check=args.quantization_check,
        kv_cache_dtype=args.kv_cache_dtype, calculate_kv_scales=args.calculate_kv_scales,
        speculative_config=args.speculative_config, max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes, num_gpu_blocks_override=args.num_gpu_blocks_override,
        block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=args.enable_prefix_caching,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel, seed=args.seed, warmup=args.warmup, enforce_eager=args.enforce_eager,
        compile_in_background=args.compile_in_background, compilation_cache_dir=args.compilation_cache_dir,
        async_scheduling=args.async_scheduling,
        attention_backend=args.attention_backend, generation_config=args.generation_config,
        tokenizer=args.tokenizer, trust_remote_code=args.trust_remote_code, revision=args.revision,
        tokenizer_revision=args.tokenizer_revision, download_dir=args.download_dir,
        nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr, master_port=args.master_port,
        distributed_init_timeout=args.distributed_init_timeout,
        distributed_heartbeat_timeout=args.distributed_heartbeat_timeout,
        scheduling_policy=args.scheduling_policy, enable_lora=args.enable_lora, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        **({"log_stats_interval": 0} if args.disable_log_stats else {}),
    )


def build_settings(args: argparse.Namespace, model_root: str | None, chat_template: str | None) -> ServerSettings:
    names = args.served_model_name or [args.model or DEFAULT_MODEL_NAME]
    return ServerSettings(
        served_model_names=list(names), model_root=model_root,
        api_key=args.api_key or os.environ.get("PAXSERVE_API_KEY") or None, max_logprobs=args.max_logprobs,
        max_num_queued_reqs=args.max_num_queued_reqs, chat_template=chat_template,
        trust_request_chat_template=args.trust_request_chat_template, max_stop_strings=args.max_stop_strings,
        body_timeout_s=args.http_body_timeout, log_requests=args.enable_log_requests,
        enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser, enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids, enable_response_store=args.enable_response_store, response_store_size=args.response_store_size,
        lora_modules=_lora_modules(names[0], args),
    )


def _lora_modules(base_model_name: str, args: argparse.Namespace) -> Any:
    from paxserve.server.lora import LoraModules

    return LoraModules(base_model_name, args.allow_runtime_lora_updating) if args.enable_lora else None


def transport_limits(args: argparse.Namespace) -> TransportLimits:
    return TransportLimits(header_timeout_s=args.http_header_timeout, keepalive_timeout_s=args.timeout_keep_alive,
                           body_timeout_s=args.http_body_timeout)


def run_server(args: argparse.Namespace) -> int:
    """Blocking: serve until a signal. Invalid flags or models raise ValueError (the CLI prints it)."""
    from paxserve.config import EngineConfig

    EngineConfig(model=args.model, **engine_kwargs(args))  # invalid settings fail before JAX is imported
    if args.headless and args.node_rank == 0:
        raise ValueError("--headless is for node ranks 1..nnodes-1: node rank 0 serves the API")
    chat_template = _chat_template(args.chat_template)  # fail on a bad template before loading anything
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json or mistral)")
    if not args.enable_lora and (args.lora_modules or args.allow_runtime_lora_updating):
        raise ValueError("--lora-modules and --allow-runtime-lora-updating serve LoRA adapters: add --enable-lora")
    names = args.served_model_name or [args.model or DEFAULT_MODEL_NAME]
    lora_names = [m.name for m in args.lora_modules or ()]
    clash = sorted(set(lora_names) & set(names)) or sorted({n for n in lora_names if lora_names.count(n) > 1})
    if clash:
        raise ValueError(f"--lora-modules: {clash[0]!r} names two models (an adapter and the base model, or two "
                         "adapters)")
    for module in args.lora_modules or ():  # the files' presence now, before minutes of loading; the rest once read
        missing = [f for f in ("adapter_config.json", "adapter_model.safetensors") if not (Path(module.path) / f).is_file()]
        if missing:
            raise ValueError(f"--lora-modules {module.name}={module.path}: {' and '.join(missing)} not found (a PEFT "
                             "adapter directory holds both)")
    from paxserve.engine.async_engine import AsyncEngine  # JAX comes in here, not at import time
    from paxserve.engine.llm_engine import Engine

    start = time.perf_counter()
    logger.info("paxserve %s: loading %s", _version(), args.model or f"the bundled {DEFAULT_MODEL_NAME}")
    engine = Engine(args.model, **engine_kwargs(args))
    ready = time.perf_counter() - start
    if engine.is_worker:
        logger.info("node rank %d ready in %.1fs: headless, running node rank 0's steps", args.node_rank, ready)
        engine.run_worker()
        logger.info("paxserve stopped (node rank 0 closed the engine)")
        return 0
    if chat_template is None and engine.tokenizer is not None and not engine.tokenizer.chat_template:
        logger.warning("the model has no chat template: /v1/chat/completions will answer 400 (pass --chat-template)")
    plan = engine.plan
    logger.info(
        "engine ready in %.1fs: weights loaded in %.1fs%s, step programs loaded or compiled in %.1fs%s", ready,
        engine.model.load_seconds, " (from cache)" if engine.model.from_cache else "",
        getattr(engine, "warmup_seconds", 0.0), "" if args.warmup else " (--no-warmup: compiling on first use)")
    logger.info("KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB); max_model_len %d; max concurrency %.2fx; "
                "max_num_seqs %d; prefix caching %s", plan.num_blocks, plan.block_size, plan.num_tokens,
                plan.num_bytes / 2**30, engine.max_model_len, plan.max_concurrency, engine.config.max_num_seqs,
                "on" if engine.config.enable_prefix_caching else "off")
    settings = build_settings(args, engine.model.source, chat_template)
    if settings.lora_modules is not None:  # the served names may be the model's hub id, as vLLM users give it
        engine.input_processor.lora.base_models = (args.model, *settings.served_model_names)
    for module in args.lora_modules or ():
        lora = settings.lora_modules.new(module.name, module.path)
        settings.lora_modules.serve(lora, module.base_model_name)
        try:
            engine.add_lora(lora)  # read and checked now: an adapter that cannot serve stops the start
        except ValueError as e:
            raise ValueError(f"--lora-modules {module.name}={module.path}: {e}") from None
    if settings.lora_modules is not None:
        logger.info("LoRA: serving %d adapters (%s) on %s; runtime loading %s", len(settings.lora_modules.adapters),
                    ", ".join(settings.lora_modules.adapters) or "none yet", settings.model_name,
                    "on (/v1/load_lora_adapter)" if settings.lora_modules.runtime_updating else "off")
    limits = transport_limits(args)
    async_engine = AsyncEngine(engine.parts)
    try:
        async_engine.input_processor.start()
        code = asyncio.run(serve(async_engine, settings, args.host, args.port, limits, args.shutdown_timeout))
    except OSError as e:  # the port is taken, the host is not ours, ...
        raise ValueError(f"cannot listen on {args.host or '0.0.0.0'}:{args.port}: {e}") from None
    finally:
        # A dead engine's threads are gone or stuck in a step: do not wait for them.
        async_engine.shutdown(timeout=30.0 if async_engine.is_alive else 0.5)
        engine.close()  # multi-host: the workers stop with it
    if code == 0:
        logger.info("paxserve stopped")
    else:
        logger.critical("paxserve stopped because its engine died (exit status %d)", code)
    return code


def _version() -> str:
    import paxserve

    return paxserve.__version__


async def serve(async_engine: EngineClient, settings: ServerSettings, host: str | None, port: int,
                limits: TransportLimits | None = None, shutdown_timeout: float = 0.0) -> int:
    """Serve until a signal or an engine death; return the process exit status (0, or 1 after a death)."""
    from paxserve.server.app import create_app
    from paxserve.server.state import STATE

    app = create_app(async_engine, settings)
    state = app[STATE]
    runner = make_runner(app, limits or TransportLimits(), handler_cancellation=True, shutdown_timeout=HANDLER_GRACE_S)
    await runner.setup()
    bind_host = host or "0.0.0.0"  # one IPv4 socket, so --port 0 gives one port
    site = web.TCPSite(runner, bind_host, port, reuse_address=True)
    await site.start()
    bound_port = runner.addresses[0][1]
    shown_host = "127.0.0.1" if bind_host in ("0.0.0.0", "::", "") else bind_host
    if ":" in shown_host:
        shown_host = f"[{shown_host}]"
    url = f"http://{shown_host}:{bound_port}"
    logger.info("Serving %s on %s (API at %s/v1)", settings.model_name, url, url)
    if settings.api_key:
        logger.info("API key required on /v1/* (Authorization: Bearer <key>)")
    logger.info("paxserve listening on %s", url)  # the line scripts and tests wait for (stderr)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    received: list[str] = []

    def on_signal(sig: signal.Signals) -> None:
        received.append(sig.name)
        stop.set()
        for s in (signal.SIGINT, signal.SIGTERM):  # a second signal kills at once
            loop.remove_signal_handler(s)

    def on_engine_death(_error: BaseException) -> None:  # on the dying engine thread
        # The process must end even if something below hangs: a supervisor restarts it.
        backstop = threading.Timer(EXIT_DEADLINE_S - 0.5, os._exit, args=(1,))
        backstop.daemon = True  # a clean exit before the deadline need not wait for it
        backstop.start()
        loop.call_soon_threadsafe(stop.set)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    async_engine.on_death(on_engine_death)
    dead = False
    try:
        await stop.wait()
        dead = not async_engine.is_alive
        if dead:
            logger.critical("the engine died: /health answers 503 and the server exits with status 1 so that its "
                            "supervisor restarts it")
        elif shutdown_timeout > 0 and state.num_inflight_seqs:
            await _drain(state, received[0], shutdown_timeout)
        else:
            logger.info("received %s: shutting down (no new connections; aborting in-flight requests)", received[0])
    finally:
        state.shutting_down = True
        started = time.perf_counter()
        await runner.cleanup()
        logger.info("HTTP server stopped in %.1fs", time.perf_counter() - started)
    return 1 if dead else 0


async def _drain(state: ServerState, signal_name: str, timeout: float) -> None:
    """Refuse new requests (503, /health too) and let the ones in flight finish, up to `timeout`."""
    state.shutting_down = True
    logger.info("received %s: draining %d in-flight sequences for up to %.0fs (new requests get 503; a second "
                "signal stops at once)", signal_name, state.num_inflight_seqs, timeout)
    deadline = time.monotonic() + timeout
    while state.num_inflight_seqs and time.monotonic() < deadline:
        await asyncio.sleep(DRAIN_POLL_S)
    if state.num_inflight_seqs:
        logger.info("drain timed out after %.0fs: aborting the %d sequences still in flight", timeout,
                    state.num_inflight_seqs)
    else:
        logger.info("drained: every in-flight request finished")
