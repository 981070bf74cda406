"""One HTTP generation request as engine requests: fan-out over prompts, one merged output queue,
abort on every early exit.

A completions request with k prompts becomes k engine requests (the engine handles n per request);
choice index = prompt_index * n + sample_index. Each engine request is pumped by a task from
`AsyncEngine.generate` into one asyncio queue. Closing the run (the handler returned, raised, or was
cancelled because the client went away) cancels the pumps and aborts every engine request that has
not finished; the abort is queued to the engine thread at once and takes effect before its next step.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from paxserve.outputs import RequestOutput
from paxserve.sampling_params import SamplingParams
from server.errors import ProtocolError, from_value_error
from server.metrics import RequestTracker, ServerMetrics
from server.prompts import PromptInput

logger = logging.getLogger("paxserve.server")


class ServerShutdown(Exception):
    """Put into a run's queue when the server stops while the request is in flight."""


def engine_failure(async_engine: Any, e: BaseException) -> ProtocolError:
    if not async_engine.is_alive:
        return ProtocolError(f"The engine has stopped and cannot serve requests: {async_engine.error!r}", status=503)
    return ProtocolError(f"Internal server error: {type(e).__name__}: {e}", status=500)


class GenerationRun:
    def __init__(self, async_engine: Any, metrics: ServerMetrics, prefix: str, prompts: list[PromptInput],
                 params: SamplingParams, arrival: float) -> None:
        self.async_engine = async_engine
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.prompts = prompts
        self.params = params
        self.created = int(time.time())
        self.queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()
        self.engine_ids = [f"{self.id}-{i}" for i in range(len(prompts))]
        self.trackers: list[RequestTracker] = [metrics.tracker(arrival) for _ in prompts]
        self.finished = [False] * len(prompts)
        self._tasks: list[asyncio.Task] = []
        self._closed = False

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._pump(i), name=f"pump {rid}") for i, rid in enumerate(self.engine_ids)]

    async def _pump(self, i: int) -> None:
        try:
            async for out in self.async_engine.generate(self.engine_ids[i], self.prompts[i].token_ids, self.params):
                self.trackers[i].on_output(out)
                if out.finished:
                    self.finished[i] = True
                self.queue.put_nowait((i, out))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the handler
            self.queue.put_nowait((i, e))

    async def next(self) -> tuple[int, RequestOutput]:
        i, item = await self.queue.get()
        if isinstance(item, ServerShutdown):
            raise item
        if isinstance(item, ValueError):
            raise from_value_error(item, "prompt")
        if isinstance(item, BaseException):
            raise engine_failure(self.async_engine, item)
        return i, item

    @property
    def done(self) -> bool:
        return all(self.finished)

    def shutdown(self) -> None:
        """The server is stopping: wake the handler, which ends the response, and abort."""
        self.queue.put_nowait((-1, ServerShutdown("The server is shutting down; the request was aborted.")))
        self.close()

    def close(self) -> None:
        """Abort what has not finished (idempotent; safe inside a cancelled handler: nothing awaits)."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        for i, rid in enumerate(self.engine_ids):
            if not self.finished[i]:
                # Also covers a pump cancelled while its add was in flight: commands run in order,
                # so this abort follows the add on the engine thread.
                try:
                    self.async_engine.abort(rid)
                except RuntimeError:  # the engine loop died meanwhile: nothing left to free
                    pass
                self.trackers[i].on_abort(self.params.n)
