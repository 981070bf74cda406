"""Per-app state: the engine, settings, metrics, runs in flight and admission control. No globals."""

from __future__ import annotations

from dataclasses import dataclass, field
from aiohttp import web

from paxserve.engine.client import EngineClient
from paxserve.server.errors import ProtocolError, engine_stopped
from paxserve.server.generation import GenerationRun
from paxserve.server.metrics import ServerMetrics
from paxserve.server.response_store import ResponseStore
from paxserve.server.settings import ServerSettings


@dataclass(slots=True)
class ServerState:
    async_engine: EngineClient
    settings: ServerSettings
    metrics: ServerMetrics
    created: int
    runs: set[GenerationRun] = field(default_factory=set)
    num_inflight_seqs: int = 0  # sequences (prompts x n) accepted and not finished
    shutting_down: bool = False  # draining or stopping: new work is refused with 503
    responses: ResponseStore | None = None  # the Responses API's store, with --enable-response-store

    def check_serving(self) -> None:
        if not self.async_engine.is_alive:
            raise engine_stopped()
        if self.shutting_down:
            raise ProtocolError("The server is shutting down and accepts no new requests.", status=503,
                                headers={"Connection": "close"})

    def admit(self, num_seqs: int) -> None:
        """Reserve room for `num_seqs` sequences, or 429 when more than --max-num-queued-reqs would be
        left waiting for a batch slot (sequences in flight beyond --max-num-seqs). Pair with release()."""
        cap = self.settings.max_num_queued_reqs
        if cap is not None and self.num_inflight_seqs > 0:
            waiting = self.num_inflight_seqs + num_seqs - (self.settings.max_num_seqs or 0)
            if waiting > cap:
                raise ProtocolError(
                    f"The server is overloaded: {self.num_inflight_seqs} sequences are in flight and at most "
                    f"{cap} may wait for one of the {self.settings.max_num_seqs} batch slots "
                    "(--max-num-queued-reqs). Retry later.", status=429, headers={"Retry-After": "1"})
        self.num_inflight_seqs += num_seqs

    def release(self, num_seqs: int) -> None:
        self.num_inflight_seqs -= num_seqs


STATE: web.AppKey[ServerState] = web.AppKey("paxserve_state", ServerState)
