"""The processes of a multi-host engine: JAX's multi-controller runtime, the step-plan channel and
the heartbeats that tell each rank when another is gone.

Rank 0 runs the scheduler and the KV-block bookkeeping; every rank owns its devices' share of the
weights and of the KV cache and runs the same compiled programs in the same order. What a worker
needs to do that is the plan of each device call rank 0 makes (the padded batch arrays and sampling
rows, `paxserve.distributed.worker_loop`), which goes through the key-value store of JAX's coordination service:
small messages (a few KiB per step), in order, with no second transport to set up. The device
collectives themselves (the all-reduces of tensor parallelism) run over NCCL on GPUs, gloo on CPUs.

Liveness: every rank writes a counter to the store every `heartbeat_timeout_s / 4` seconds and
watches the others' (rank 0 all workers, a worker rank 0). A counter that stops moving for
`heartbeat_timeout_s`, or a store that cannot be reached, calls the rank's `on_lost` once: rank 0
then fails its requests and exits (the server answers 503 meanwhile), a worker exits. JAX's own
heartbeat, which aborts a process with a fatal log, is set well beyond this one as a backstop.
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import threading
import time
import zlib
from typing import Any, Callable

from paxserve.config import ClusterConfig
from paxserve.distributed.rendezvous import Rendezvous

logger = logging.getLogger(__name__)

_PREFIX = "paxserve"
# Plan messages live in folders of this many; rank 0 deletes a folder (one call) when it starts the
# folder after next, so at least this many messages stay behind the newest. Workers cannot fall that
# far behind: each engine step sends at most two, and every forward waits on all ranks in its
# collectives, so a worker is never more than the steps in flight (two) behind.
_FOLDER = 64
_POLL_MS = 1000  # a worker's wait for the next plan message between liveness checks
# One counter per process: engines built one after another in the same processes (tests, tools) get
# their own channels, in the same order on every rank.
_engines = itertools.count()


class WorkerLostError(RuntimeError):
    """Another rank of the engine died or stopped answering; this one cannot go on."""


def _client() -> Any:
    from jax._src import distributed  # the runtime's client: the only way to its key-value store

    return distributed.global_state.client


class Cluster:
    """This process's place in a started multi-host runtime (`join`)."""

    def __init__(self, config: ClusterConfig, client: Any,
                 on_lost: Callable[[WorkerLostError], None] | None = None) -> None:
        """`client`: the runtime's (JAX's distributed client: its key-value calls); `on_lost`: see
        `on_lost()`. The heartbeats start at once."""
        self.config = config
        self.rank = config.node_rank
        self.nnodes = config.nnodes
        self._client = client
        self._lost = threading.Event()
        self._on_lost: Callable[[WorkerLostError], None] = on_lost or _exit_on_loss
        self._heartbeat = threading.Thread(target=self._beat_and_watch, name="paxserve-heartbeat", daemon=True)
        self._heartbeat.start()

    @staticmethod
    def is_started() -> bool:
        """Whether this process already runs JAX's distributed runtime."""
        return _client() is not None

    @classmethod
    def join(cls, config: ClusterConfig, settings_digest: str) -> "Cluster":
        """Meet the other ranks (naming any that does not come), then start JAX's distributed runtime
        over all of them. Must run before anything starts a JAX backend. A process joins once; a
        later engine in it reuses the runtime (with the same config)."""
        import jax

        client = _client()
        if client is not None:
            cluster = _joined.get("cluster")
            if cluster is None or cluster.config != config:
                raise ValueError("JAX's distributed runtime is already started in this process with other settings; "
                                 "one process joins one multi-host engine group")
            return cluster
        Rendezvous(config).meet(settings_digest)
        # CPU devices exchange collectives over gloo (JAX's default CPU runtime has none across
        # processes); GPUs use NCCL whatever this says.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        start = time.perf_counter()
        jax.distributed.initialize(f"{config.master_addr}:{config.master_port + 1}", config.nnodes, config.node_rank,
                                   initialization_timeout=max(int(config.init_timeout_s), 1),
                                   heartbeat_timeout_seconds=max(30, int(3 * config.heartbeat_timeout_s)),
                                   # A clean exit waits this long for the other ranks at most.
                                   shutdown_timeout_seconds=max(10, int(2 * config.heartbeat_timeout_s)))
        logger.info("multi-host: node rank %d of %d joined JAX's distributed runtime at %s:%d in %.1fs; %d devices "
                    "in all, %d here", config.node_rank, config.nnodes, config.master_addr, config.master_port + 1,
                    time.perf_counter() - start, jax.device_count(), jax.local_device_count())
        cluster = cls(config, _client())
        _joined["cluster"] = cluster
        return cluster

    def on_lost(self, callback: Callable[[WorkerLostError], None]) -> None:
        """What to do when another rank is lost (called once, on the heartbeat thread). Default:
        log and exit the process with status 1."""
        self._on_lost = callback

    def channel(self) -> "PlanChannel":
        """The channel of the next engine built in this process (the same on every rank)."""
        return PlanChannel(self, f"{_PREFIX}/engine{next(_engines)}")

    # ---- liveness ------------------------------------------------------------------------------

    @property
    def lost(self) -> bool:
        return self._lost.is_set()

    def _watched(self) -> list[int]:
        return [r for r in range(self.nnodes) if r != self.rank] if self.rank == 0 else [0]

    def _beat_and_watch(self) -> None:
        timeout = self.config.heartbeat_timeout_s
        period = timeout / 4
        seen: dict[int, tuple[str | None, float]] = {r: (None, time.monotonic()) for r in self._watched()}
        for beat in itertools.count():
            try:
                self._client.key_value_set(f"{_PREFIX}/alive/{self.rank}", str(beat), allow_overwrite=True)
                now = time.monotonic()
                for rank, (last, since) in seen.items():
                    value = _try_get(self._client, f"{_PREFIX}/alive/{rank}")
                    if value != last:
                        seen[rank] = (value, now)
                    elif now - since > timeout:
                        self._lose(WorkerLostError(
                            f"node rank {rank} stopped answering: no heartbeat for {now - since:.0f}s "
                            f"(--distributed-heartbeat-timeout {timeout:g})"))
                        return
            except Exception as e:  # noqa: BLE001 - the coordination service itself is unreachable
                self._lose(WorkerLostError(f"the coordination service on node rank 0 cannot be reached "
                                           f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"))
                return
            time.sleep(period)

    def _lose(self, error: WorkerLostError) -> None:
        if self._lost.is_set():
            return
        self._lost.set()
        logger.critical("multi-host (node rank %d): %s", self.rank, error)
        try:
            self._on_lost(error)
        except Exception:  # noqa: BLE001 - a broken callback must not keep the process alive
            logger.exception("the lost-rank callback failed")
            os._exit(1)


_joined: dict[str, Cluster] = {}  # the process's one cluster (JAX's runtime is per process)


def _exit_on_loss(error: WorkerLostError) -> None:
    """The default reaction: nothing on this rank can finish without the lost one."""
    logging.shutdown()
    os._exit(1)


def _try_get(client: Any, key: str) -> str | None:
    try:
        return client.key_value_try_get(key)
    except Exception as e:  # noqa: BLE001 - NOT_FOUND: that rank has not written yet
        if "NOT_FOUND" in str(e) or "not found" in str(e).lower():
            return None
        raise


class PlanChannel:
    """Rank 0's device calls, in order, to every worker of one engine."""

    def __init__(self, cluster: Cluster, namespace: str) -> None:
        self.cluster = cluster
        self._namespace = namespace
        self._next = 0

    def _key(self, index: int) -> str:
        return f"{self._namespace}/plan/{index // _FOLDER}/{index}"

    def gather(self, name: str, value: str) -> list[str]:
        """Every rank's `value` for `name`, by rank (each rank of the engine calls it with the same
        name, at start-up)."""
        client, rank, config = self.cluster._client, self.cluster.rank, self.cluster.config
        key = f"{self._namespace}/gather/{name}"
        client.key_value_set(f"{key}/{rank}", value)
        try:
            return [client.blocking_key_value_get(f"{key}/{r}", int(config.init_timeout_s * 1000))
                    for r in range(self.cluster.nnodes)]
        except Exception as e:  # noqa: BLE001 - the runtime's errors name no rank: say which step waited
            raise WorkerLostError(f"node rank {rank}: not every rank reached start-up step {name!r} within "
                                  f"{config.init_timeout_s:.0f}s ({str(e).splitlines()[0]})") from None

    def send(self, message: tuple) -> int:
        """Rank 0: publish the next message (plain data: numpy arrays, dataclasses of them); returns
        its size in bytes as sent."""
        payload = zlib.compress(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL), 1)
        client = self.cluster._client
        client.key_value_set_bytes(self._key(self._next), payload)
        folder, index = divmod(self._next, _FOLDER)
        if index == 0 and folder >= 2:
            client.key_value_delete(f"{self._namespace}/plan/{folder - 2}")  # the folder and every key in it
        self._next += 1
        return len(payload)

    def receive(self) -> tuple:
        """A worker: the next message, waiting as long as rank 0 is alive (WorkerLostError once it is
        not)."""
        client = self.cluster._client
        while True:
            if self.cluster.lost:
                raise WorkerLostError("node rank 0 is gone")
            try:
                payload = client.blocking_key_value_get_bytes(self._key(self._next), _POLL_MS)
            except Exception as e:  # noqa: BLE001 - a timeout is an idle rank 0; anything else is fatal
                if "DEADLINE_EXCEEDED" in str(e):
                    continue
                raise WorkerLostError(f"the plan channel from node rank 0 broke: {str(e).splitlines()[0]}") from None
            self._next += 1
            return pickle.loads(zlib.decompress(payload))
