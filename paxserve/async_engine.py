"""Asyncio front of the Engine: one background thread runs the step loop; each request streams its
outputs through its own asyncio queue.

The engine is not thread-safe, so only the loop thread touches it: callers send commands (add,
abort) through a queue and wait on futures, which also carries validation errors back to them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from paxserve.engine import Engine, Prompt
from paxserve.outputs import RequestOutput
from paxserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The step loop stopped with an error; no request can be served any more."""


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="paxserve-engine", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)

    def _submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        if not self.is_alive:
            raise EngineDeadError(f"the engine loop has stopped: {self.error!r}")
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def command() -> None:
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - delivered to the caller
                fut.set_exception(e)

        self._commands.put(command)
        self._wake.set()
        return fut

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run `fn(engine)` on the loop thread (for stats, tokenization checks and the like)."""
        return await asyncio.wrap_future(self._submit(lambda: fn(self.engine)))

    async def generate(
        self, request_id: str, prompt: Prompt, params: SamplingParams | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; raises ValueError for invalid input before anything streams.
        Leaving the iteration early (a client disconnect) aborts the request and frees its blocks."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())

        def add() -> None:
            self.engine.add_request(request_id, prompt, params)
            self._streams[request_id] = stream

        await asyncio.wrap_future(self._submit(add))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        def do() -> None:
            self._streams.pop(request_id, None)
            self.engine.abort(request_id)

        if self.is_alive:
            self._submit(do)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        if isinstance(item, BaseException) or item.finished:
            del self._streams[request_id]
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening
            self.engine.abort(request_id)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                while True:
                    try:
                        self._commands.get_nowait()()
                    except queue.Empty:
                        break
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                for out in self.engine.step():
                    self._deliver(out.request_id, out)
        except BaseException as e:  # noqa: BLE001 - reported to every waiting request and to /health
            logger.exception("engine loop died")
            self.error = e
            dead = EngineDeadError(f"the engine loop has stopped: {e!r}")
            while True:  # let queued commands finish (adds register streams that then get `dead`)
                try:
                    self._commands.get_nowait()()
                except queue.Empty:
                    break
                except BaseException:  # noqa: BLE001 - the engine is already dead
                    continue
            for rid in list(self._streams):
                self._deliver(rid, dead)
