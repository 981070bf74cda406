"""Asyncio front of the engine, for the server: three kinds of threads, each with one job.

- Input workers (a small pool) render chat templates, tokenize and validate: the slow,
  request-specific work, never on the step loop.
- The step loop thread owns the EngineCore: it applies plain commands (add, abort, pause,
  resume, finish) and runs steps. Commands are fire-and-forget data, never callables or futures,
  so a caller that is cancelled at any moment cannot hurt the loop; a command that fails hurts
  only its own request. After every step it publishes an `EngineSnapshot` for /metrics and
  /health, which therefore never wait on the loop.
- The output thread owns the OutputProcessor: detokenization, stop strings, logprob text; it
  hands each request's outputs to that request's stream on the caller's event loop.

Each stream holds at most one pending (merged) delta. When a reader falls more than
`max_pending_tokens` behind, its request is paused (not scheduled, and the first to give up KV
blocks) until the reader catches up, so memory stays flat behind a slow client.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, AsyncIterator, Callable, TypeVar

from paxserve.core.interface import EngineCoreRequest, EngineSnapshot
from paxserve.engine.build import EngineParts
from paxserve.engine.input_processor import Prompt
from paxserve.outputs import RequestOutput
from paxserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")
IDLE_WAIT_S = 0.5  # how long the idle loop sleeps between checks when nothing wakes it


class EngineDeadError(RuntimeError):
    """The step loop stopped with an error; no request can be served any more."""


@dataclass(frozen=True, slots=True)
class _Command:
    kind: str  # "add" | "abort" | "pause" | "resume" | "finish"
    request_id: str
    request: EngineCoreRequest | None = None
    sample_ids: tuple[str, ...] = ()


class _Stream:
    """One request's outputs on its caller's event loop: a single pending output that later deltas
    merge into, so a slow reader costs one growing delta, never a queue of copies."""

    def __init__(self, owner: AsyncEngine, request_id: str, engine_id: str, kind: RequestOutputKind,
                 loop: asyncio.AbstractEventLoop, max_pending_tokens: int) -> None:
        self.owner = owner
        self.request_id = request_id  # the caller's id
        self.engine_id = engine_id  # this incarnation's id inside the engine
        self.kind = kind
        self.loop = loop
        self.max_pending_tokens = max_pending_tokens
        self.pending: RequestOutput | None = None
        self.error: BaseException | None = None
        self.ready = asyncio.Event()
        self.paused = False

    def put(self, item: RequestOutput | BaseException) -> None:  # on self.loop
        if isinstance(item, BaseException):
            self.error = item
        elif self.pending is None or self.kind != RequestOutputKind.DELTA:
            self.pending = item  # cumulative outputs replace each other
        else:
            self.pending.merge_delta(item)
        self.ready.set()
        # Only merged deltas grow with the reader's lag; cumulative outputs replace each other.
        if (not self.paused and self.kind == RequestOutputKind.DELTA and self.pending is not None
                and not self.pending.finished and self.pending.num_output_tokens > self.max_pending_tokens):
            self.paused = True
            self.owner._send(_Command("pause", self.engine_id))

    async def get(self) -> RequestOutput:
        while self.pending is None and self.error is None:
            self.ready.clear()
            await self.ready.wait()
        if self.pending is None:
            raise self.error  # type: ignore[misc]
        out, self.pending = self.pending, None
        if self.paused:
            self.paused = False
            self.owner._send(_Command("resume", self.engine_id))
        return out


class AsyncEngine:
    def __init__(self, parts: EngineParts, *, num_input_workers: int = 2, max_pending_tokens: int = 256) -> None:
        """Serve `parts` (from `build_engine_parts`, or an `Engine`'s `.parts`; an `Engine` itself is
        taken for its parts, and its caller must not drive it from then on)."""
        if num_input_workers < 1:
            raise ValueError(f"AsyncEngine.num_input_workers={num_input_workers} must be >= 1")
        if max_pending_tokens < 1:
            raise ValueError(f"AsyncEngine.max_pending_tokens={max_pending_tokens} must be >= 1")
        parts = getattr(parts, "parts", parts)  # an Engine's
        if parts.is_worker:
            raise ValueError("AsyncEngine serves requests on node rank 0; node ranks 1..N-1 call Engine.run_worker()")
        self.parts = parts
        self.input_processor = parts.input_processor
        self.limits = parts.limits
        self.max_pending_tokens = max_pending_tokens
        self._core = parts.core
        self._output_processor = parts.output_processor
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._to_outputs: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        # Inside the engine each request runs under an id of its own incarnation, so outputs still in
        # flight for an aborted request can never reach a new request that reuses its id.
        self._serial = itertools.count()
        self._streams: dict[str, _Stream] = {}  # engine id -> stream
        self._active: dict[str, str] = {}  # caller's request id -> engine id
        self._lock = threading.Lock()  # guards both (caller loops, the step and output threads)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._death_callbacks: list[Callable[[BaseException], None]] = []
        self.error: BaseException | None = None
        self.snapshot: EngineSnapshot = parts.core.snapshot()
        self._pool = ThreadPoolExecutor(num_input_workers, thread_name_prefix="paxserve-input")
        self._step_thread = threading.Thread(target=self._guard, args=(self._step_loop,), name="paxserve-engine",
                                             daemon=True)
        self._output_thread = threading.Thread(target=self._guard, args=(self._output_loop,),
                                               name="paxserve-output", daemon=True)
        self._step_thread.start()
        self._output_thread.start()
        if parts.cluster is not None:
            # A lost worker leaves the step thread waiting on a collective that never completes, or
            # failing: either way the engine is dead, and every waiting request is told so now.
            parts.cluster.on_lost(self._die)

    # ---- state ---------------------------------------------------------------------------------

    @property
    def is_alive(self) -> bool:
        return self.error is None and self._step_thread.is_alive() and self._output_thread.is_alive()

    def on_death(self, callback: Callable[[BaseException], None]) -> None:
        """Call `callback(error)` once (from the dying thread, or now if already dead) if the
        engine stops with an error."""
        with self._lock:
            error = self.error
            if error is None:
                self._death_callbacks.append(callback)
        if error is not None:
            callback(error)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop both threads (a step under way finishes first, up to `timeout` seconds); streams
        still open end with EngineDeadError."""
        self._stop.set()
        self._wake.set()
        self._to_outputs.put(("stop", None))
        self._step_thread.join(timeout=timeout)
        self._output_thread.join(timeout=timeout)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.input_processor.close()
        with self._lock:
            open_streams = list(self._streams)
        for engine_id in open_streams:
            self._deliver(engine_id, EngineDeadError("the engine was shut down"))

    def _check_alive(self) -> None:
        if not self.is_alive:
            raise EngineDeadError("the engine has stopped and cannot serve requests")

    # ---- the public, cancellation-safe API -----------------------------------------------------

    async def run_input(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run request-specific work (rendering, tokenizing) on an input worker. Cancelling the
        caller only drops the result: the work itself changes no shared state."""
        self._check_alive()
        return await asyncio.get_running_loop().run_in_executor(self._pool, partial(fn, *args, **kwargs))

    async def generate(self, request_id: str, prompt: Prompt | EngineCoreRequest, params: SamplingParams | None = None,
                       *, cache_salt: str | None = None, arrival_time: float | None = None,
                       lora_request: Any = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (in its params' output kind). Invalid input raises
        ValueError before anything streams; an `EngineCoreRequest` (made by `input_processor.process`
        on an input worker, as the server does) is trusted as it is. A `lora_request`
        (paxserve.LoRARequest) runs the request on that adapter (read on an input worker). Leaving early (a client gone, a cancelled task)
        aborts the request and frees its blocks; no moment of cancellation is unsafe."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        engine_id = f"{request_id}\x1f{next(self._serial)}"
        if isinstance(prompt, EngineCoreRequest):  # processed on the caller's input worker already
            request = replace(prompt, request_id=engine_id)
        else:
            params = params or self.input_processor.default_sampling_params()
            request = await self.run_input(self.input_processor.process, engine_id, prompt, params,
                                           cache_salt=cache_salt, arrival_time=arrival_time,
                                           lora_request=lora_request, priority=priority)
        stream = self._register(request_id, request)
        finished = False
        try:
            while True:
                out = await stream.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self._abort(engine_id)

    def abort(self, request_id: str) -> None:
        """End a request now (from any thread, at any moment; unknown ids are ignored)."""
        with self._lock:
            engine_id = self._active.get(request_id)
        if engine_id is not None:
            self._abort(engine_id)

    def _abort(self, engine_id: str) -> None:
        with self._lock:
            stream = self._streams.pop(engine_id, None)
            if stream is not None and self._active.get(stream.request_id) == engine_id:
                del self._active[stream.request_id]
        if stream is None or not self.is_alive:
            return
        self._send(_Command("abort", engine_id))
        self._to_outputs.put(("abort", engine_id))

    def _register(self, request_id: str, request: EngineCoreRequest) -> _Stream:
        stream = _Stream(self, request_id, request.request_id, request.output_kind, asyncio.get_running_loop(),
                         self.max_pending_tokens)
        with self._lock:
            if self.error is not None or self._stop.is_set():  # under the lock _die lists the streams under
                raise EngineDeadError("the engine has stopped and cannot serve requests")
            if request_id in self._active:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._active[request_id] = request.request_id
            self._streams[request.request_id] = stream
        # The output thread learns of the request before the step loop can produce anything for it.
        self._to_outputs.put(("add", request))
        self._send(_Command("add", request.request_id, request=request))
        return stream

    def _send(self, command: _Command) -> None:
        self._commands.put(command)
        self._wake.set()

    # ---- delivery (from the loop threads) ------------------------------------------------------

    def _deliver(self, engine_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            stream = self._streams.get(engine_id)
            if stream is not None and (isinstance(item, BaseException) or item.finished):
                del self._streams[engine_id]
                if self._active.get(stream.request_id) == engine_id:
                    del self._active[stream.request_id]
        if stream is None:
            return
        if isinstance(item, RequestOutput):
            item.request_id = stream.request_id  # the caller's id, not the incarnation's
        try:
            stream.loop.call_soon_threadsafe(stream.put, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening
            self._send(_Command("abort", engine_id))
            self._to_outputs.put(("abort", engine_id))

    # ---- the step loop -------------------------------------------------------------------------

    def _apply(self, command: _Command) -> None:
        core = self._core
        try:
            if command.kind == "add":
                core.add_request(command.request)  # type: ignore[arg-type]
            elif command.kind == "abort":
                core.abort_request(command.request_id)
            elif command.kind in ("pause", "resume"):
                core.set_paused(command.request_id, command.kind == "pause")
            elif command.kind == "finish":
                core.finish_samples(list(command.sample_ids))
        except Exception as e:  # noqa: BLE001 - one request's problem, delivered to it alone
            if command.kind != "add":
                raise
            self._to_outputs.put(("abort", command.request_id))
            self._deliver(command.request_id, e if isinstance(e, ValueError) else
                          RuntimeError("the engine could not queue this request"))

    def _step_loop(self) -> None:
        core = self._core
        while not self._stop.is_set():
            while True:
                try:
                    self._apply(self._commands.get_nowait())
                except queue.Empty:
                    break
            ran = False
            if core.has_unfinished_requests():
                outputs = core.step()
                ran = core.last_num_scheduled > 0 or core.has_step_in_flight
                if outputs:
                    self._to_outputs.put(("outputs", outputs))
            self.snapshot = core.snapshot()
            if not ran:
                # Idle, or everything left is paused or cannot be admitted: wait for a command.
                self._wake.wait(timeout=IDLE_WAIT_S)
                self._wake.clear()

    # ---- the output thread ---------------------------------------------------------------------

    def _output_loop(self) -> None:
        processor = self._output_processor
        while True:
            kind, payload = self._to_outputs.get()
            if kind == "stop":
                return
            if kind == "add":
                processor.add_request(payload)
            elif kind == "abort":
                processor.abort_request(payload)
            elif kind == "outputs":
                processed = processor.process(payload)
                if processed.samples_to_finish:
                    self._send(_Command("finish", "", sample_ids=tuple(processed.samples_to_finish)))
                for request_id in processed.requests_to_abort:
                    self._send(_Command("abort", request_id))
                for out in processed.request_outputs:
                    self._deliver(out.request_id, out)

    # ---- death ---------------------------------------------------------------------------------

    def _guard(self, loop_fn: Callable[[], None]) -> None:
        try:
            loop_fn()
        except BaseException as e:  # noqa: BLE001 - reported to every waiting request and to /health
            logger.critical("the engine's %s thread died; no request can be served any more",
                            threading.current_thread().name, exc_info=e)
            self._die(e)

    def _die(self, error: BaseException) -> None:
        with self._lock:
            if self.error is not None:
                return
            self.error = error
            streams = list(self._streams)
            callbacks = list(self._death_callbacks)
        self._stop.set()
        self._wake.set()
        self._to_outputs.put(("stop", None))
        dead = EngineDeadError("the engine has stopped and cannot serve requests")
        for engine_id in streams:
            self._deliver(engine_id, dead)
        for callback in callbacks:
            try:
                callback(error)
            except Exception:  # noqa: BLE001 - a broken callback must not hide the death
                logger.exception("an engine death callback failed")

