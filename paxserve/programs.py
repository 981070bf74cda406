"""The model runner's compiled programs: compiled ahead of time by shape key, kept on disk as
serialized executables, and compiled in the background while the engine serves with what it has.

Why not rely on `jax.jit` alone: a jitted function re-traces and re-lowers every shape in every new
process, even when JAX's persistent cache then finds the compiled result, which made each warm
start re-trace its buckets for seconds. Here each program is lowered from abstract shapes once, and
its executable is stored under a fingerprint of everything that shapes it (JAX and XLA versions, the
device kind and count, the model config, dtype, attention backend, parallel split, every argument's
shape, and the engine's own source). A later start loads the stored executables without tracing
anything. A damaged or stale entry is recompiled, never trusted.

Program kinds and keys: ("forward", T, S, B), ("all_logits", T, S, B) (prompt logprobs),
("sample", S) and ("score", T, S). Lowering only ever sees abstract arguments (shapes, dtypes and
placements), never the live params or caches, so a background compile cannot touch arrays the step
loop is donating.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import queue
import threading
import time
import uuid
import weakref
from pathlib import Path
from typing import Any, Callable

import jax

logger = logging.getLogger(__name__)

Key = tuple[Any, ...]
# key -> (lower(): the jax.stages.Lowered program, the call's argument tuple, an example output)
Spec = Callable[[Key], tuple[Callable[[], Any], tuple[Any, ...], Any]]

_SOURCE_DIRS = ("paxserve", "models", "pallas_kernels")


def source_fingerprint() -> str:
    """sha256 of the Python source that traces into the programs (a code change makes new ones)."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for directory in _SOURCE_DIRS:
        for path in sorted((root / directory).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def environment_fingerprint() -> str:
    """What else changes a compiled program: JAX and jaxlib, the backend and its devices, XLA flags."""
    import jaxlib

    devices = jax.devices()
    return "|".join([jax.__version__, jaxlib.__version__, devices[0].platform, devices[0].device_kind,
                     str(len(devices)), os.environ.get("XLA_FLAGS", "")])


def _key_name(key: Key) -> str:
    return "-".join(str(part) for part in key)


class Programs:
    """Compiled executables by key for one model runner. Not tied to a thread: `get` and `compile`
    may be called from the step loop while a background compile runs."""

    def __init__(self, spec: Spec, fingerprint: Callable[[str], str], store: Path | None, background: bool,
                 devices: list[Any] | None = None) -> None:
        """`fingerprint(kind)`: everything that shapes a program of that kind; programs of engines
        that agree on it share stored entries."""
        self._spec = spec
        self._fingerprint = fingerprint
        self._devices = devices or jax.devices()[:1]  # where a stored program is loaded to run
        self._store = store
        self._compiled: dict[Key, Any] = {}
        self._lock = threading.Lock()
        self._pending: dict[Key, concurrent.futures.Future] = {}
        self._queue: queue.SimpleQueue[tuple[Key, concurrent.futures.Future] | None] = queue.SimpleQueue()
        if background:
            # Not a daemon: at exit the interpreter waits for the compile in progress (a daemon thread
            # inside XLA while the backend is torn down aborts the process); the worker stops as
            # soon as the main thread has ended.
            threading.Thread(target=_work, args=(self._queue, weakref.ref(self)), name="paxserve-compile").start()
        self.background = background
        self.num_loaded = 0  # read from the store
        self.num_compiled = 0  # compiled in this process (in the step loop or the background)

    def __contains__(self, key: Key) -> bool:
        return key in self._compiled

    def keys(self) -> list[Key]:
        return list(self._compiled)

    # ---- the store ---------------------------------------------------------------------------------

    def load_stored(self) -> int:
        """Load every stored program of this fingerprint (no tracing); returns how many."""
        if self._store is None:
            return 0
        loaded = 0
        for kind in ("forward", "sample", "all_logits", "score"):
            folder = self._folder(kind)
            for path in sorted(folder.glob(f"{kind}-*.xla")) if folder.is_dir() else ():
                key = _parse_key(path.stem)
                if key is not None and key not in self._compiled and self._load(key, path):
                    loaded += 1
        return loaded

    def _folder(self, kind: str) -> Path:
        assert self._store is not None
        return self._store / hashlib.sha256(self._fingerprint(kind).encode()).hexdigest()[:32]

    def _path(self, key: Key) -> Path:
        return self._folder(key[0]) / f"{_key_name(key)}.xla"

    def _load(self, key: Key, path: Path) -> bool:
        from jax.experimental.serialize_executable import deserialize_and_load

        try:
            _, args, example_out = self._spec(key)
            compiled = deserialize_and_load(path.read_bytes(), jax.tree.structure((args, {})),
                                            jax.tree.structure(example_out), execution_devices=self._devices)
        except Exception as e:  # noqa: BLE001 - a stale or damaged entry is compiled again, never fatal
            logger.warning("stored program %s is unusable (%s: %s); it will be compiled again", path.name,
                           type(e).__name__, str(e)[:200])
            path.unlink(missing_ok=True)
            return False
        with self._lock:
            self._compiled.setdefault(key, compiled)
            self.num_loaded += 1
        return True

    def _save(self, key: Key, compiled: Any) -> None:
        if self._store is None:
            return
        from jax.experimental.serialize_executable import serialize

        try:
            payload, _, _ = serialize(compiled)
            path = self._path(key)
            path.parent.mkdir(parents=True, exist_ok=True)
            staging = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
            staging.write_bytes(payload)
            staging.replace(path)  # atomic: readers never see half a file
        except Exception as e:  # noqa: BLE001 - storing is an optimisation; the program is compiled already
            logger.warning("could not store compiled program %s: %s", _key_name(key), e)

    # ---- compiling ---------------------------------------------------------------------------------

    def _build(self, key: Key) -> Any:
        """Load `key` from the store, or compile it (and store it)."""
        if self._store is not None:
            path = self._path(key)
            if path.exists() and self._load(key, path):
                with self._lock:
                    self._pending.pop(key, None)
                return self._compiled[key]
        start = time.perf_counter()
        lower, _, _ = self._spec(key)
        if self._store is None:
            compiled = lower().compile()
        else:
            compiled, storable = _compile_for_storing(lower(), self._devices[0].platform)
            if storable:
                self._save(key, compiled)
        with self._lock:
            self._compiled[key] = compiled
            self._pending.pop(key, None)
            self.num_compiled += 1
        logger.info("compiled %s in %.1fs (%d programs ready)", _key_name(key), time.perf_counter() - start,
                    len(self._compiled))
        return compiled

    def get(self, key: Key) -> Any:
        """The program for `key`, compiled now if nobody has it yet (waiting for a background
        compile of the same key rather than compiling it twice)."""
        compiled = self._compiled.get(key)
        if compiled is not None:
            return compiled
        with self._lock:
            pending = self._pending.get(key)
        if pending is not None and pending.result() is not None:
            return self._compiled[key]
        return self._build(key)

    def compile_later(self, key: Key) -> None:
        """Queue `key` for the background worker (compile it now when there is none)."""
        if key in self._compiled:
            return
        if not self.background:
            self._build(key)
            return
        with self._lock:
            if key in self._pending or key in self._compiled:
                return
            future: concurrent.futures.Future = concurrent.futures.Future()
            self._pending[key] = future
        self._queue.put((key, future))

    def _compile_queued(self, key: Key, future: concurrent.futures.Future) -> None:
        if future.done():  # dropped by close()
            return
        try:
            future.set_result(self._build(key))
        except Exception as e:  # noqa: BLE001 - the step that needs it compiles it again and reports
            logger.warning("background compile of %s failed: %s", _key_name(key), e)
            with self._lock:
                self._pending.pop(key, None)
            future.set_result(None)

    def wait(self) -> None:
        """Block until every background compile has finished (tests, benchmarks, shutdown)."""
        while True:
            with self._lock:
                pending = list(self._pending.values())
            if not pending:
                return
            concurrent.futures.wait(pending)

    def close(self) -> None:
        """Stop the background worker after the compile it is running (queued ones are dropped)."""
        if self.background:
            self.background = False
            with self._lock:
                dropped, self._pending = list(self._pending.values()), {}
            for future in dropped:
                if not future.done():
                    future.set_result(None)
            self._queue.put(None)


class _CacheHits(threading.local):
    """JAX persistent-cache hits seen by this thread (JAX reports each as a monitoring event)."""

    count = 0


_CACHE_HITS = _CacheHits()


def _count_cache_hit(event: str, **kwargs: Any) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _CACHE_HITS.count += 1


jax.monitoring.register_event_listener(_count_cache_hit)


def _compile_for_storing(lowered: Any, platform: str) -> tuple[Any, bool]:
    """(executable, whether it may be stored): only what XLA itself compiled is. On XLA:CPU (JAX
    0.10) an executable that JAX loaded from its own persistent cache serializes into a program
    that fails when run ("Function wrapped_iota not found"), and programs compiled while that cache
    was on were seen to fail the same way with no cache hit reported: on CPU nothing is stored
    while it is configured (it spares this process the compiles anyway). The engine leaves that
    cache off, so this only happens where the embedding program turned it on."""
    hits = _CACHE_HITS.count
    compiled = lowered.compile()
    if platform == "cpu" and jax.config.jax_compilation_cache_dir:
        return compiled, False
    return compiled, _CACHE_HITS.count == hits


def _work(work: queue.SimpleQueue, owner: weakref.ref) -> None:
    """The background worker: compiles queued keys until told to stop, until its Programs is gone,
    or once the main thread has ended (after the compile in progress, never in the middle of one)."""
    while True:
        try:
            item = work.get(timeout=0.2)
        except queue.Empty:
            if threading.main_thread().is_alive() and owner() is not None:
                continue
            return
        programs = owner()
        if item is None or programs is None or not threading.main_thread().is_alive():
            return
        programs._compile_queued(*item)
        del programs  # no strong reference between items: an engine that is dropped can be collected


def _parse_key(name: str) -> Key | None:
    kind, *numbers = name.split("-")
    try:
        return (kind, *(int(n) for n in numbers))
    except ValueError:
        return None
