"""Start-up rendezvous of a multi-host engine, before JAX's distributed runtime is started.

JAX's `jax.distributed.initialize` waits for every process and, when one never comes, aborts the
whole process with a fatal log that names nobody. So the ranks meet here first, over one plain TCP
socket on rank 0's `--master-port`: each worker says who it is (its rank and a digest of the
settings that must agree); rank 0 waits until every rank 1..N-1 has, up to a timeout, then tells
each one to go on (or why not). Only then does anyone start JAX's runtime, whose coordination
service listens on the next port. A missing rank, a rank given twice, or a rank started with other
settings is named in the error on rank 0 and on the worker.

Pure Python (sockets and JSON lines); nothing here imports JAX.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from paxserve.config import ClusterConfig

logger = logging.getLogger(__name__)

_RETRY_S = 0.25  # a worker's pause between attempts to reach rank 0


class RendezvousError(RuntimeError):
    """The ranks could not all meet (the message says which one and why)."""


class Rendezvous:
    """One rank's side of the meeting, for a `ClusterConfig` (which has checked the ranks, the port
    and the timeout)."""

    def __init__(self, config: ClusterConfig) -> None:
        if not config.is_multi_host:
            raise ValueError(f"a rendezvous needs nnodes >= 2, got {config.nnodes}")
        self.nnodes, self.node_rank = config.nnodes, config.node_rank
        self.master_addr, self.master_port = config.master_addr, config.master_port
        self.timeout_s = config.init_timeout_s

    def meet(self, digest: str) -> None:
        """Block until every rank is here with the same `digest`, or raise RendezvousError."""
        if self.node_rank == 0:
            self._lead(digest)
        else:
            self._join(digest)

    # ---- rank 0 ----------------------------------------------------------------------------------

    def _lead(self, digest: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        waiting: dict[int, socket.socket] = {}
        problems: list[str] = []
        try:
            server = socket.create_server(("", self.master_port), reuse_port=False)
        except OSError as e:
            raise RendezvousError(f"rank 0 cannot listen on port {self.master_port} for the other ranks: {e}") from None
        logger.info("rank 0: waiting up to %.0fs for node ranks 1..%d on port %d", self.timeout_s, self.nnodes - 1,
                    self.master_port)
        with server:
            while len(waiting) < self.nnodes - 1 and not problems:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                server.settimeout(min(left, 5.0))
                try:
                    conn, peer = server.accept()
                except socket.timeout:
                    missing = [r for r in range(1, self.nnodes) if r not in waiting]
                    logger.info("rank 0: still waiting for node rank(s) %s (%.0fs left)",
                                ", ".join(map(str, missing)), max(deadline - time.monotonic(), 0))
                    continue
                hello = _read_line(conn, deadline)
                rank, problem = self._check(hello, digest, waiting, peer[0])
                if problem is not None:
                    problems.append(problem)
                    _send_line(conn, {"ok": False, "error": problem})
                    conn.close()
                    continue
                waiting[rank] = conn
                logger.info("rank 0: node rank %d joined from %s", rank, peer[0])
            missing = [r for r in range(1, self.nnodes) if r not in waiting]
            if not problems and missing:
                problems.append(f"node rank(s) {', '.join(map(str, missing))} of {self.nnodes} did not join within "
                                f"{self.timeout_s:.0f}s (start them with --node-rank, --nnodes {self.nnodes}, "
                                f"--master-addr set to this host and --master-port {self.master_port})")
            reply = {"ok": not problems, "error": "; ".join(problems)}
            for conn in waiting.values():
                _send_line(conn, reply)
                conn.close()
        if problems:
            raise RendezvousError(reply["error"])

    def _check(self, hello: dict | None, digest: str, waiting: dict[int, socket.socket],
               host: str) -> tuple[int, str | None]:
        if hello is None or not isinstance(hello.get("rank"), int):
            return -1, f"a process at {host} spoke on the rendezvous port but did not say its rank"
        rank = hello["rank"]
        if hello.get("nnodes") != self.nnodes:
            return rank, f"node rank {rank} at {host} was started with --nnodes {hello.get('nnodes')}, rank 0 with " \
                         f"--nnodes {self.nnodes}"
        if not 1 <= rank < self.nnodes:
            return rank, f"a process at {host} says it is node rank {rank}; ranks 1..{self.nnodes - 1} join rank 0"
        if rank in waiting:
            return rank, f"node rank {rank} joined twice (again from {host}): give every host its own --node-rank"
        if hello.get("digest") != digest:
            return rank, (f"node rank {rank} at {host} was started with other engine settings than rank 0 (they "
                          f"must be the same on every rank): {_differences(hello.get('digest'), digest)}")
        return rank, None

    # ---- ranks 1..N-1 ----------------------------------------------------------------------------

    def _join(self, digest: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        last_error: OSError | None = None
        while time.monotonic() < deadline:
            try:
                conn = socket.create_connection((self.master_addr, self.master_port),
                                                timeout=min(5.0, max(deadline - time.monotonic(), 0.1)))
            except OSError as e:
                last_error = e
                time.sleep(_RETRY_S)
                continue
            with conn:
                _send_line(conn, {"rank": self.node_rank, "nnodes": self.nnodes, "digest": digest})
                logger.info("node rank %d: reached rank 0 at %s:%d; waiting for the other ranks", self.node_rank,
                            self.master_addr, self.master_port)
                # Rank 0 answers when everyone is here or its own timeout ends: wait a little longer.
                reply = _read_line(conn, time.monotonic() + self.timeout_s + 30.0)
            if reply is None:
                raise RendezvousError(f"rank 0 at {self.master_addr}:{self.master_port} closed the rendezvous "
                                      "without an answer")
            if not reply.get("ok"):
                raise RendezvousError(f"rank 0 refused to start: {reply.get('error')}")
            return
        raise RendezvousError(f"rank 0 did not answer at {self.master_addr}:{self.master_port} within "
                              f"{self.timeout_s:.0f}s ({last_error})")


def settings_digest(settings: dict) -> str:
    """The settings every rank must share, as one comparable string (JSON, sorted keys)."""
    return json.dumps(settings, sort_keys=True, default=str)


def _differences(theirs: object, ours: str) -> str:
    """The settings that differ, as `name: worker's value vs rank 0's`."""
    try:
        a, b = json.loads(theirs), json.loads(ours)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return f"{theirs!r} vs {ours!r}"
    names = sorted(set(a) | set(b))
    return "; ".join(f"{n}: {a.get(n)!r} vs {b.get(n)!r}" for n in names if a.get(n) != b.get(n))


def _send_line(conn: socket.socket, message: dict) -> None:
    try:
        conn.sendall(json.dumps(message).encode() + b"\n")
    except OSError:
        pass  # the peer is gone; it learns nothing more, and the caller reports its own side


def _read_line(conn: socket.socket, deadline: float) -> dict | None:
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or len(data) > 1 << 20:
            return None
        conn.settimeout(left)
        try:
            chunk = conn.recv(65536)
        except (OSError, socket.timeout):
            return None
        if not chunk:
            return None
        data += chunk
    try:
        message = json.loads(data)
    except ValueError:
        return None
    return message if isinstance(message, dict) else None
