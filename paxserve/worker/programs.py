"""The model runner's compiled programs: compiled ahead of time by shape key, kept on disk as
serialized executables, and compiled in the background while the engine serves with what it has.

Why not rely on `jax.jit` alone: a jitted function re-traces and re-lowers every shape in every new
process, even when JAX's persistent cache then finds the compiled result, which made each warm
start re-trace its buckets for seconds. Here each program is lowered from abstract shapes once, and
its executable is stored under a fingerprint of everything that shapes it (JAX and XLA versions, the
device kind and count, the model config, dtype, attention backend, parallel split, every argument's
shape, and the engine's own source). A later start lists what is stored (no loading) and loads an
executable, without tracing anything, the first time a step needs it: a start does not pay for every
shape any earlier start ever stored. A damaged or stale entry is recompiled, never trusted.

A step never waits behind background compiles it does not need: the program it asks for is built on
its own thread at once, even when it was queued for the background; only a build already under way is
waited for. The background worker takes keys a step will soon need (a covered step's own bucket, a
growing context's next width) before guesses (warm-up's larger batches, the next batch size), starts
a guess only while the steps are quiet (on a CPU they share the cores with the compiles), starts
nothing while a step builds its own program, and runs at the lowest thread priority.

Program kinds and keys: ("forward", T, S, B), ("decode", T, S, B) (a pure-decode step on the
decode-only kernel), ("all_logits", T, S, B) (prompt logprobs),
("sample", S) and ("score", T, S); speculative decoding's ("verify", T, S, B) and
("verify_sample", N), and an EAGLE-3 head's passes ("eagle3", T, S, B, hidden width, with head).
Lowering only ever sees abstract arguments (shapes, dtypes and placements), never the live params or
caches, so a background compile cannot touch arrays the step loop is donating.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import hashlib
import importlib.util
import logging
import os
import math
import sys
import threading
import time
import uuid
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

import jax

logger = logging.getLogger(__name__)

Key = tuple[Any, ...]
# key -> (lower(): the jax.stages.Lowered program, the call's argument tuple, an example output)
Spec = Callable[[Key], tuple[Callable[[], Any], tuple[Any, ...], Any]]

# The packages whose source traces into the programs (the server's does not).
_SOURCE_PACKAGES = ("paxserve", "paxserve.models", "paxserve.kernels")
_KINDS = ("forward", "decode", "sample", "all_logits", "score", "verify", "verify_sample", "eagle3")


def _package_folder(name: str) -> Path:
    spec = importlib.util.find_spec(name)  # finds without running the package (it may be heavy)
    assert spec is not None and spec.submodule_search_locations, name
    return Path(next(iter(spec.submodule_search_locations)))


def source_fingerprint() -> str:
    """sha256 of the Python source that traces into the programs (a code change makes new ones): the
    same for a checkout, an editable install, a wheel, or a checkout's import root of links. A
    subpackage listed on its own (or the server, whose code traces into nothing) is skipped inside
    its parent's folder, where a wheel puts it."""
    digest = hashlib.sha256()
    for name in _SOURCE_PACKAGES:
        folder = _package_folder(name)
        nested = {other.rpartition(".")[2] for other in (*_SOURCE_PACKAGES, "paxserve.server")
                  if other.rpartition(".")[0] == name}
        files = []
        for where, dirs, names in os.walk(folder, followlinks=True):
            relative = Path(where).relative_to(folder)
            dirs[:] = [d for d in dirs if d != "__pycache__" and not (relative == Path(".") and d in nested)]
            files += [relative / n for n in names if n.endswith(".py")]
        for path in sorted(files):
            digest.update(f"{name}/{path.as_posix()}".encode())
            digest.update((folder / path).read_bytes())
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
    may be called from the step loop while a background compile runs.

    A key has one builder at a time. `compile_later` queues it for the background worker; a `get` of
    a key that is queued but not started claims it and builds it on the calling thread at once (the
    worker skips a claimed key when it dequeues it), so a step never waits behind compiles it does
    not need; only a build already under way on another thread is waited for."""

    def __init__(self, spec: Spec, fingerprint: Callable[[str], str], store: Path | None, background: bool,
                 devices: list[Any] | None = None, quiet_s: float = 0.0) -> None:
        """`fingerprint(kind)`: everything that shapes a program of that kind; programs of engines
        that agree on it share stored entries. `quiet_s`: the background worker starts a guess
        (`compile_later(key, guess=True)`) only once no `get` has come for this long, i.e. while the
        steps are not running (on a CPU they and the compiles share the cores); 0: at once."""
        self._spec = spec
        self._fingerprint = fingerprint
        self._devices = devices or jax.devices()[:1]  # where a stored program is loaded to run
        self._store = store
        self._compiled: dict[Key, Any] = {}
        # Found in the store by `scan_store` and not loaded yet: the first `get` loads it (tens of ms),
        # so a start does not pay for every shape any earlier start ever stored.
        self._stored: set[Key] = set()
        self._lock = threading.Lock()
        # Keys someone is to build (queued for the worker) or is building; the future ends with the
        # program (None when that build failed or was dropped, for a waiter to build it itself).
        self._pending: dict[Key, concurrent.futures.Future] = {}
        self._started: set[Key] = set()  # pending keys whose build has begun, on whichever thread
        self._queue = _WorkQueue(quiet_s)
        if background:
            # Not a daemon: at exit the interpreter waits for the compile in progress (a daemon thread
            # inside XLA while the backend is torn down aborts the process); the worker stops as
            # soon as the main thread has ended.
            threading.Thread(target=_work, args=(self._queue, weakref.ref(self)), name="paxserve-compile").start()
        self.background = background
        self.num_loaded = 0  # read from the store
        self.num_compiled = 0  # compiled in this process (in the step loop or the background)

    def __contains__(self, key: Key) -> bool:
        """Whether `key` is to be had without compiling: loaded, compiled, or stored (loaded by `get`)."""
        return key in self._compiled or key in self._stored

    def keys(self) -> list[Key]:
        """Every key `in` this: the ones in memory, then the stored ones not loaded yet."""
        with self._lock:
            return [*self._compiled, *(key for key in self._stored if key not in self._compiled)]

    def queued_guesses(self) -> list[Key]:
        """The guesses waiting for quiet steps, in the order they will start."""
        return self._queue.guess_keys()

    def is_loaded(self, key: Key) -> bool:
        """Whether `key` is in memory (ready to run with no load or compile)."""
        return key in self._compiled

    @property
    def num_unloaded(self) -> int:
        """Stored programs found by `scan_store` that nothing has loaded yet."""
        return len(self._stored)

    # ---- the store ---------------------------------------------------------------------------------

    def scan_store(self) -> int:
        """Note every stored program of this fingerprint without loading any (a directory listing per
        kind): each then counts as available and is loaded by its first `get`. Returns how many were
        found that are not in memory."""
        if self._store is None:
            return 0
        found: set[Key] = set()
        for kind in _KINDS:
            try:
                entries = os.scandir(self._folder(kind))
            except OSError:  # no folder yet: nothing of this kind stored
                continue
            with entries:
                for entry in entries:
                    # Staging files start with "." and never match; a name that does not parse is skipped.
                    if entry.name.startswith(f"{kind}-") and entry.name.endswith(".xla"):
                        key = _parse_key(entry.name[: -len(".xla")])
                        if key is not None:
                            found.add(key)
        with self._lock:
            new = found - self._compiled.keys()
            self._stored |= new
        return len(new)

    def _folder(self, kind: str) -> Path:
        assert self._store is not None
        return self._store / hashlib.sha256(self._fingerprint(kind).encode()).hexdigest()[:32]

    def _path(self, key: Key) -> Path:
        return self._folder(key[0]) / f"{_key_name(key)}.xla"

    def _load(self, key: Key, path: Path) -> Any | None:
        """The stored program at `path`, or None (a damaged or stale entry is deleted)."""
        from jax.experimental.serialize_executable import deserialize_and_load

        try:
            _, args, example_out = self._spec(key)
            compiled = deserialize_and_load(path.read_bytes(), jax.tree.structure((args, {})),
                                            jax.tree.structure(example_out), execution_devices=self._devices)
        except Exception as e:  # noqa: BLE001 - a stale or damaged entry is compiled again, never fatal
            logger.warning("stored program %s is unusable (%s: %s); it will be compiled again", path.name,
                           type(e).__name__, str(e)[:200])
            path.unlink(missing_ok=True)
            return None
        with self._lock:
            self.num_loaded += 1
        return compiled

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
        """Load `key` from the store, or compile it (and store it). Only a key's claimant calls this."""
        if self._store is not None:
            # Also when `scan_store` did not see it: another process may have stored it since.
            path = self._path(key)
            if key in self._stored or path.exists():
                compiled = self._load(key, path)
                if compiled is not None:
                    return compiled
        start = time.perf_counter()
        lower, _, _ = self._spec(key)
        if self._store is None:
            compiled = lower().compile()
        else:
            compiled, storable = _compile_for_storing(lower(), self._devices[0].platform)
            if storable:
                self._save(key, compiled)
        with self._lock:
            self.num_compiled += 1
            ready = len(self._compiled) + 1
        logger.info("compiled %s in %.1fs (%d programs ready)", _key_name(key), time.perf_counter() - start, ready)
        return compiled

    def _build_claimed(self, key: Key, future: concurrent.futures.Future) -> Any:
        """Build `key`, which this thread has claimed (it is in `_started` with `future`), publish it
        and end the claim; a failure ends it too (waiters then build it themselves) and raises."""
        try:
            compiled = self._build(key)
        except BaseException:
            self._end_claim(key, future, None)
            raise
        self._end_claim(key, future, compiled)
        return compiled

    def _end_claim(self, key: Key, future: concurrent.futures.Future, compiled: Any | None) -> None:
        with self._lock:
            if compiled is not None:
                self._compiled[key] = compiled
            self._stored.discard(key)  # loaded, or found unusable and deleted
            if self._pending.get(key) is future:
                del self._pending[key]
            self._started.discard(key)
        future.set_result(compiled)

    def get(self, key: Key) -> Any:
        """The program for `key`, built now on this thread unless another thread is building it at
        this moment (then that build is waited for rather than repeated). A key only queued for the
        background is taken out of the worker's hands and built here, ahead of the queue."""
        self._queue.note_step()
        compiled = self._compiled.get(key)
        if compiled is not None:
            return compiled
        # A step waiting for its program is a busy step: no guess may start meanwhile.
        with self._queue.step_building():
            return self._get_slow(key)

    def _get_slow(self, key: Key) -> Any:
        while True:
            with self._lock:
                compiled = self._compiled.get(key)
                if compiled is not None:
                    return compiled
                future = self._pending.get(key)
                if future is None or key not in self._started:
                    if future is None:
                        future = concurrent.futures.Future()
                        self._pending[key] = future
                    self._started.add(key)
                    break
            compiled = future.result()
            if compiled is not None:
                return compiled
            # That build failed: claim the key and build it here, where a failure reaches the step.
        return self._build_claimed(key, future)

    def compile_later(self, key: Key, guess: bool = False) -> None:
        """Queue `key` for the background worker (build it now when there is none). A step will soon
        need it unless it is a `guess`: guesses wait until the queue holds nothing else and the steps
        are quiet (`quiet_s`). A stored key is only loaded, which is cheap, but off the step's thread."""
        if key in self._compiled:
            return
        if not self.background:
            self.get(key)
            return
        with self._lock:
            if key in self._compiled:
                return
            known = key in self._pending
            queued = known and key not in self._started
            if not known:
                future: concurrent.futures.Future = concurrent.futures.Future()
                self._pending[key] = future
        if queued and not guess:
            self._queue.promote(key)  # a guess a step now says it will need
        if not known:
            self._queue.put((key, future), guess)

    def _compile_queued(self, key: Key, future: concurrent.futures.Future) -> None:
        """The worker's turn at a queued key: skipped when a `get` claimed it meanwhile (built, or
        being built, on that thread) or `close` dropped it."""
        with self._lock:
            if self._pending.get(key) is not future or key in self._started:
                return
            self._started.add(key)
        try:
            self._build_claimed(key, future)
        except Exception as e:  # noqa: BLE001 - the step that needs it builds it again and reports
            logger.warning("background compile of %s failed: %s", _key_name(key), e)

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
                dropped = [(key, future) for key, future in self._pending.items() if key not in self._started]
                for key, _ in dropped:
                    del self._pending[key]
            for _, future in dropped:
                future.set_result(None)
            self._queue.stop()


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


def _lower_priority() -> None:
    """Make the calling thread the last to get a core (nice 19) when the steps want them; Linux applies
    a priority to one thread, given its id. Elsewhere, or when not allowed, the thread keeps its own.
    It helps only a little (40-token answers beside background compiles: 3.2-3.5 s instead of 3.7-3.9 s,
    1.6 s alone, 2-core CPU): the worker itself only traces and lowers, about a tenth of a compile's
    CPU time; XLA compiles on threads of its own, made before the worker, at their normal priority."""
    if sys.platform != "linux":
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except OSError as e:
        logger.debug("background compiles keep the normal priority: %s", e)


_Item = tuple[Key, concurrent.futures.Future]


class _WorkQueue:
    """The background worker's keys: the ones steps will soon need first, in the order asked, then
    guesses, each of which starts only after no step has asked for a program for `quiet_s`. Nothing
    starts while a step is building (or waiting for) its own program. Shared by a Programs and its
    worker, which holds it (and not the Programs) strongly."""

    def __init__(self, quiet_s: float) -> None:
        self.quiet_s = quiet_s
        self._ready = threading.Condition()
        self._soon: collections.deque[_Item] = collections.deque()
        self._guesses: collections.deque[_Item] = collections.deque()
        self._guess_keys: set[Key] = set()  # the keys in `_guesses`
        self._stopped = False
        self._last_step = -math.inf  # time.monotonic() of the last `note_step`
        self._steps_building = 0  # `get`s building or waiting for their program right now

    def note_step(self) -> None:
        # A bare store, no lock: this runs in every step; a stale read costs the worker one more look.
        self._last_step = time.monotonic()

    @contextlib.contextmanager
    def step_building(self) -> Iterator[None]:
        with self._ready:
            self._steps_building += 1
        try:
            yield
        finally:
            with self._ready:
                self._steps_building -= 1
                self._last_step = time.monotonic()
                self._ready.notify()

    def put(self, item: _Item, guess: bool) -> None:
        with self._ready:
            if guess:
                self._guesses.append(item)
                self._guess_keys.add(item[0])
            else:
                self._soon.append(item)
            self._ready.notify()

    def promote(self, key: Key) -> None:
        """Move a queued guess to the end of the keys needed soon (no-op for any other key)."""
        if key not in self._guess_keys:  # the common case, every step: no lock, no scan
            return
        with self._ready:
            for item in self._guesses:
                if item[0] == key:
                    self._guesses.remove(item)
                    self._guess_keys.discard(key)
                    self._soon.append(item)
                    self._ready.notify()
                    return

    def guess_keys(self) -> list[Key]:
        with self._ready:
            return [item[0] for item in self._guesses]

    def stop(self) -> None:
        with self._ready:
            self._stopped = True
            self._ready.notify()

    def take(self, timeout: float) -> _Item | None | Literal[False]:
        """The next key to build; None once stopped; False when nothing was due within `timeout`."""
        deadline = time.monotonic() + timeout
        with self._ready:
            while True:
                if self._stopped:
                    return None
                now = time.monotonic()
                wait = deadline - now
                # While a step builds its own program, another compile would only slow that one down.
                if self._soon and not self._steps_building:
                    return self._soon.popleft()
                if self._guesses and not self._steps_building:
                    quiet_for = now - self._last_step
                    if quiet_for >= self.quiet_s:
                        item = self._guesses.popleft()
                        self._guess_keys.discard(item[0])
                        return item
                    wait = min(wait, self.quiet_s - quiet_for)
                if deadline <= now:
                    return False
                self._ready.wait(wait)


def _work(work: _WorkQueue, owner: weakref.ref) -> None:
    """The background worker: compiles queued keys until told to stop, until its Programs is gone,
    or once the main thread has ended (after the compile in progress, never in the middle of one)."""
    _lower_priority()
    while True:
        item = work.take(timeout=0.2)
        if item is False:
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
