"""One HTTP generation request as engine requests: fan-out over prompts, one merged, bounded output
queue, abort on every early exit.

A completions request with k prompts becomes k engine requests (the engine handles n per request);
choice index = prompt_index * n + sample_index. Each engine request streams deltas from
`AsyncEngine.generate` through a pump task into one queue of at most k items, so a handler that
stops reading (a slow client) stops the pumps, and the engine pauses the request rather than
buffering. Closing the run (the handler returned, raised, or was cancelled because the client went
away) cancels the pumps, which abort their engine requests; nothing awaits, so it is safe anywhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

from paxserve.engine.client import EngineClient
from paxserve.outputs import RequestOutput
from paxserve.sampling_params import SamplingParams
from paxserve.server.errors import ProtocolError, engine_stopped, from_value_error, internal_error
from paxserve.server.metrics import RequestTracker, ServerMetrics
from paxserve.server.prompts import PromptInput

logger = logging.getLogger("paxserve.server")


class ServerShutdown(Exception):
    """Put into a run's queue when the server stops while the request is in flight."""


def new_run_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def engine_failure(async_engine: EngineClient, e: BaseException) -> ProtocolError:
    if not async_engine.is_alive:
        return engine_stopped()
    logger.error("a request failed in the engine", exc_info=e)
    return internal_error()


class GenerationRun:
    def __init__(self, async_engine: EngineClient, metrics: ServerMetrics, run_id: str, prompts: list[PromptInput],
                 params: SamplingParams, arrival: float) -> None:
        self.async_engine = async_engine
        self.id = run_id
        self.prompts = prompts
        self.params = params
        self.arrival = arrival
        self.created = int(time.time())
        self.queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue(maxsize=len(prompts))
        self.engine_ids = [f"{self.id}-{i}" for i in range(len(prompts))]
        self.trackers: list[RequestTracker] = [metrics.tracker(arrival, params.n, p.request.max_tokens)
                                               for p in prompts]
        self.finished = [False] * len(prompts)
        self._tasks: list[asyncio.Task] = []
        self._closed = False

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._pump(i), name=f"pump {rid}") for i, rid in enumerate(self.engine_ids)]

    async def _pump(self, i: int) -> None:
        stream = self.async_engine.generate(self.engine_ids[i], self.prompts[i].request)
        try:
            async with contextlib.aclosing(stream):  # leaving early aborts the engine request at once
                async for out in stream:
                    self.trackers[i].on_output(out)
                    if out.finished:
                        self.finished[i] = True
                    await self.queue.put((i, out))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the handler
            await self.queue.put((i, e))

    async def next(self) -> tuple[int, RequestOutput]:
        i, item = await self.queue.get()
        if isinstance(item, ServerShutdown):
            raise item
        if isinstance(item, ValueError):
            raise from_value_error(item, "prompt")
        if isinstance(item, BaseException):
            raise engine_failure(self.async_engine, item)
        if item.error is not None:  # a failed engine step ended it: a 500, the server goes on
            raise ProtocolError(item.error, status=500)
        return i, item

    def shutdown(self) -> None:
        """The server is stopping: wake the handler, which ends the response, and abort."""
        self.close()
        while not self.queue.empty():  # make room: the handler must see the shutdown next
            self.queue.get_nowait()
        self.queue.put_nowait((-1, ServerShutdown("The server is shutting down; the request was aborted.")))

    def close(self) -> None:
        """Abort what has not finished (idempotent; safe inside a cancelled handler: nothing awaits)."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        for i, rid in enumerate(self.engine_ids):
            if not self.finished[i]:
                # A pump cancelled before its request was registered has nothing to abort; one
                # cancelled later aborts through its generator; this covers a pump not yet started.
                self.async_engine.abort(rid)
                self.trackers[i].on_abort(self.params.n)
