"""`paxserve serve`: build the Engine from the CLI flags, run it on its own thread (AsyncEngine),
serve the app until SIGINT/SIGTERM, then stop accepting, abort in-flight requests and exit."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from server.settings import DEFAULT_MODEL_NAME, ServerSettings

logger = logging.getLogger("paxserve.server")
SHUTDOWN_TIMEOUT_S = 5.0  # after this, handlers still running at shutdown are cancelled


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
        dtype=args.dtype, max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes, num_gpu_blocks_override=args.num_gpu_blocks_override,
        block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=args.enable_prefix_caching,
        tensor_parallel_size=args.tensor_parallel_size, seed=args.seed, warmup=args.warmup,
        attention_backend=args.attention_backend,
        **({"log_stats_interval": 0} if args.disable_log_stats else {}),
    )


def build_settings(args: argparse.Namespace, model_root: str | None, chat_template: str | None) -> ServerSettings:
    names = args.served_model_name or [args.model or DEFAULT_MODEL_NAME]
    return ServerSettings(
        served_model_names=list(names), model_root=model_root,
        api_key=args.api_key or os.environ.get("PAXSERVE_API_KEY") or None, max_logprobs=args.max_logprobs,
        max_num_queued_reqs=args.max_num_queued_reqs, chat_template=chat_template,
        log_requests=args.enable_log_requests,
    )


def run_server(args: argparse.Namespace) -> int:
    """Blocking: serve until a signal. Invalid flags or models raise ValueError (the CLI prints it)."""
    from paxserve.async_engine import AsyncEngine  # JAX comes in here, not at import time
    from paxserve.engine import Engine

    chat_template = _chat_template(args.chat_template)  # fail on a bad template before loading anything
    start = time.perf_counter()
    logger.info("paxserve %s: loading %s", _version(), args.model or f"the bundled {DEFAULT_MODEL_NAME}")
    engine = Engine(args.model, **engine_kwargs(args))
    ready = time.perf_counter() - start
    if chat_template is None and engine.tokenizer is not None and not engine.tokenizer.chat_template:
        logger.warning("the model has no chat template: /v1/chat/completions will answer 400 (pass --chat-template)")
    plan = engine.plan
    logger.info(
        "engine ready in %.1fs: weights loaded in %.1fs%s, decode buckets compiled in %.1fs%s", ready,
        engine.model.load_seconds, " (from cache)" if engine.model.from_cache else "",
        getattr(engine, "warmup_seconds", 0.0), "" if args.warmup else " (--no-warmup: compiling on first use)")
    logger.info("KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB); max_model_len %d; max concurrency %.2fx; "
                "max_num_seqs %d; prefix caching %s", plan.num_blocks, plan.block_size, plan.num_tokens,
                plan.num_bytes / 2**30, engine.max_model_len, plan.max_concurrency, engine.config.max_num_seqs,
                "on" if engine.config.enable_prefix_caching else "off")
    settings = build_settings(args, engine.model.source, chat_template)
    async_engine = AsyncEngine(engine)
    try:
        asyncio.run(_serve(async_engine, settings, args.host, args.port))
    except OSError as e:  # the port is taken, the host is not ours, ...
        raise ValueError(f"cannot listen on {args.host or '0.0.0.0'}:{args.port}: {e}") from None
    finally:
        async_engine.shutdown()
    logger.info("paxserve stopped")
    return 0


def _version() -> str:
    import paxserve

    return paxserve.__version__


async def _serve(async_engine: Any, settings: ServerSettings, host: str | None, port: int) -> None:
    from server.app import create_app

    app = create_app(async_engine, settings)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
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

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        await stop.wait()
        logger.info("received %s: shutting down (no new connections; aborting in-flight requests)", received[0])
    finally:
        started = time.perf_counter()
        await runner.cleanup()
        logger.info("HTTP server stopped in %.1fs", time.perf_counter() - started)
