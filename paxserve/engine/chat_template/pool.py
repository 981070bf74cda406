"""Chat templates rendered in a small pool of worker processes, so that any render can be stopped.

The sandbox in `template.py` enforces its time and size limits cooperatively, from inside the
render: it cannot interrupt one long call into C (sorting a huge list, big-integer arithmetic) and
a render's memory is the server's. Here each render runs in a worker process with an address-space
cap; a worker that has not answered by the time limit (plus a grace for the sandbox's own check to
fire first) is killed and replaced, whatever it was doing, and only its request fails.

Workers are fresh interpreters (never forked: the parent runs JAX's threads) that serve one render
at a time; callers are input-worker threads, never the step loop. A server starts them before it
listens (`start`); elsewhere they start on first use. A worker counts as started once it has said
it is ready, so its interpreter's start-up (seconds on a machine busy compiling) never counts
against a render's time limit.
"""

from __future__ import annotations

import logging
import os
import queue
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from paxserve.engine.chat_template.template import ChatTemplateError, RenderLimits, render_chat_template

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0  # a worker's interpreter start and imports, on a loaded machine
KILL_GRACE_S = 0.5  # the sandbox's own deadline check reports first, with a clearer message
DEFAULT_MEMORY_LIMIT_BYTES = 2 * 2**30  # a worker's address space beyond what it had at start


def _limit_memory(extra_bytes: int) -> None:
    try:
        import resource

        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + extra_bytes, vm + extra_bytes))
    except (ImportError, OSError, StopIteration, ValueError):  # not Linux: the time limit still holds
        pass


def serve(conn: Connection, limits: RenderLimits, memory_limit_bytes: int) -> None:
    """A worker process: say it is ready, then render what arrives until the pipe closes."""
    _limit_memory(memory_limit_bytes)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            template, messages, kwargs = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply: tuple[str, str] = ("ok", render_chat_template(template, messages, limits=limits, **kwargs))
        except ChatTemplateError as e:
            reply = ("error", str(e))
        except MemoryError:
            reply = ("error", "the chat template needs more memory than a render may use")
        except BaseException as e:  # noqa: BLE001 - the worker reports and goes on
            reply = ("error", f"the chat template failed: {type(e).__name__}")
        try:
            conn.send(reply)
        except MemoryError:
            conn.send(("error", "the chat template's output is too large"))


class _Worker:
    """One `python -m paxserve.engine.chat_template.worker` process, spoken to over its stdin and
    stdout. A fresh interpreter (not multiprocessing's spawn), so the caller's own main script is
    never imported again in the worker."""

    def __init__(self, limits: RenderLimits, memory_limit_bytes: int) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "paxserve.engine.chat_template.worker", repr(limits.timeout_s),
             str(limits.max_output_chars), str(memory_limit_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
        self.send_conn = Connection(os.dup(self.process.stdin.fileno()), readable=False)
        self.recv_conn = Connection(os.dup(self.process.stdout.fileno()), writable=False)
        self.process.stdin.close()
        self.process.stdout.close()

    def wait_ready(self) -> None:
        try:
            if self.recv_conn.poll(START_TIMEOUT_S) and self.recv_conn.recv()[0] == "ready":
                return
        except (EOFError, OSError):
            pass
        self.kill()
        raise ChatTemplateError(f"a chat-template renderer did not start within {START_TIMEOUT_S:g}s")

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=5)
        self.send_conn.close()
        self.recv_conn.close()


class RenderPool:
    """`render_chat_template` in up to `num_workers` killable processes (thread-safe)."""

    def __init__(self, num_workers: int = 2, limits: RenderLimits = RenderLimits(),
                 memory_limit_bytes: int = DEFAULT_MEMORY_LIMIT_BYTES) -> None:
        if num_workers < 1:
            raise ValueError(f"RenderPool.num_workers={num_workers} must be >= 1")
        self.limits = limits
        self.memory_limit_bytes = memory_limit_bytes
        self.num_workers = num_workers
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._started = 0
        self._closed = False
        self.num_killed = 0

    def start(self) -> None:
        """Start every worker now and wait until all are ready (they start side by side)."""
        with self._lock:
            missing = self.num_workers - self._started
            self._started = self.num_workers
        workers = [_Worker(self.limits, self.memory_limit_bytes) for _ in range(missing)]
        failed: ChatTemplateError | None = None
        for worker in workers:
            try:
                worker.wait_ready()
                self._give_back(worker)
            except ChatTemplateError as e:
                failed = e
                self._give_back(None)
        if failed is not None:
            raise failed
        logger.info("chat templates render in %d worker processes (%g s, %d MiB each, killed past their limits)",
                    self.num_workers, self.limits.timeout_s, self.memory_limit_bytes // 2**20)

    def _take(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise ChatTemplateError("the chat-template renderer is shut down")
            try:
                return self._idle.get_nowait()
            except queue.Empty:
                if self._started >= self.num_workers:
                    worker = None
                else:
                    self._started += 1
                    worker = _Worker(self.limits, self.memory_limit_bytes)
        if worker is None:
            return self._idle.get()
        try:  # outside the lock: others may start or take workers meanwhile
            worker.wait_ready()
        except ChatTemplateError:
            with self._lock:
                self._started -= 1
            raise
        return worker

    def _give_back(self, worker: _Worker | None) -> None:
        if worker is None:  # killed: its replacement starts on demand
            with self._lock:
                self._started -= 1
            return
        if self._closed:
            worker.kill()
        else:
            self._idle.put(worker)

    def render(self, template: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        """As `render_chat_template(template, messages, **kwargs)` with this pool's limits; a
        render still running at the time limit is killed (ChatTemplateError)."""
        worker: _Worker | None = self._take()
        assert worker is not None
        try:
            worker.send_conn.send((template, messages, kwargs))
            if not worker.recv_conn.poll(self.limits.timeout_s + KILL_GRACE_S):
                raise ChatTemplateError(f"the chat template ran past its time limit of {self.limits.timeout_s:g}s "
                                        "and was stopped")
            status, text = worker.recv_conn.recv()
        except ChatTemplateError:
            self._kill(worker)
            worker = None
            raise
        except (EOFError, OSError, BrokenPipeError):  # the worker died: the memory cap, or a crash
            self._kill(worker)
            worker = None
            raise ChatTemplateError("the chat template stopped its renderer (out of memory or a crash)") from None
        finally:
            self._give_back(worker)
        if status != "ok":
            raise ChatTemplateError(text)
        return text

    def _kill(self, worker: _Worker) -> None:
        start = time.perf_counter()
        worker.kill()
        self.num_killed += 1
        logger.warning("chat-template worker %s killed after a render past its limits (%.0f ms to stop)",
                       worker.process.pid, 1000 * (time.perf_counter() - start))

    def close(self) -> None:
        """Stop the idle workers now; busy ones stop when their render returns."""
        with self._lock:
            self._closed = True
        while True:
            try:
                self._idle.get_nowait().kill()
            except queue.Empty:
                return
