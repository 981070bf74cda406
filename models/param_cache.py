"""paxserve's on-disk param cache: a converted checkpoint's params, config and tokenizer in one
folder, written beside its final name and renamed into place, read back leaf by leaf against the
model's abstract params. A GGUF file's conversion is kept there (models/loader.py), keyed by the file,
the dtype and the converter version."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import jax
import numpy as np
import safetensors
import safetensors.numpy

logger = logging.getLogger(__name__)

# Bump when the params layout or a conversion changes, so stale cache entries are not reused.
# 4: the cache entry is a safetensors file (it was an orbax checkpoint, which took 1.3 s to restore
# the bundled model's 513 MiB and 0.35 s to import; this reads it in about 0.4 s).
# 5: GGUF linear weights kept quantized (their formats in the entry's config.json).
CONVERTER_VERSION = "5"  # 2: one decoder for every family (params pytree reshaped); 3: MoE stacks
_PARAMS_FILE = "params.safetensors"
# Leaves are stored as unsigned integers of their width, since safetensors' numpy side has no
# bfloat16; each leaf's real dtype is in the file's metadata.
_RAW = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """paxserve's on-disk cache: `cache_dir` if given, else $XDG_CACHE_HOME/paxserve (~/.cache/paxserve)."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "paxserve"


def cache_key(path: Path, dtype: np.dtype) -> str:
    st = path.stat()
    ident = f"{path}|{st.st_size}|{st.st_mtime_ns}|{dtype.name}|{CONVERTER_VERSION}"
    return hashlib.sha256(ident.encode()).hexdigest()[:24]


COMPLETE = "complete"  # written last, so a half-written entry is never read


def restore_cached(entry: Path, abstract_of: Callable[[dict[str, Any]], Any]) -> tuple[Any, dict, Any] | None:
    """(params, hf_config, tokenizer) from a cache entry, or None when there is no usable entry."""
    from transformers import AutoTokenizer

    if not (entry / COMPLETE).exists():
        return None
    try:
        hf_config = json.loads((entry / "config.json").read_text())
        params = _read_params(entry / _PARAMS_FILE, abstract_of(hf_config))
        tokenizer = AutoTokenizer.from_pretrained(str(entry / "tokenizer"), local_files_only=True)
        return params, hf_config, tokenizer
    except Exception as e:  # noqa: BLE001 - a damaged cache entry is rebuilt, never fatal
        logger.warning("param cache at %s is unreadable (%s); converting again", entry, e)
        # Unmarked, so the conversion's entry replaces it instead of leaving it to fail every start.
        (entry / COMPLETE).unlink(missing_ok=True)
        return None


def _write_params(path: Path, params: Any) -> None:
    leaves = jax.tree_util.tree_leaves_with_path(params)
    tensors, dtypes = {}, {}
    for key_path, leaf in leaves:
        name = jax.tree_util.keystr(key_path)
        array = np.ascontiguousarray(np.asarray(leaf))
        tensors[name] = array.view(_RAW[array.dtype.itemsize])
        dtypes[name] = array.dtype.name
    safetensors.numpy.save_file(tensors, str(path), metadata={"dtypes": json.dumps(dtypes)})


def _read_params(path: Path, abstract: Any) -> Any:
    """The params written by `_write_params`, checked leaf by leaf against the model's abstract
    params (name, shape and dtype): a mismatch raises, and the entry is converted again."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    out = []
    with safetensors.safe_open(str(path), framework="numpy") as f:
        dtypes = json.loads(f.metadata()["dtypes"])
        for key_path, spec in leaves:
            name = jax.tree_util.keystr(key_path)
            array = f.get_tensor(name).view(np.dtype(dtypes[name]))
            if array.shape != tuple(spec.shape) or array.dtype != spec.dtype:
                raise ValueError(f"{name} is {array.dtype.name}{list(array.shape)}, the model needs "
                                 f"{np.dtype(spec.dtype).name}{list(spec.shape)}")
            out.append(jax.numpy.asarray(array))
    return jax.tree_util.tree_unflatten(treedef, out)


def save_cached(entry: Path, params: Any, hf_config: dict[str, Any], tokenizer: Any) -> None:
    """Write the entry beside its final name and rename it into place, so that processes loading
    the same file at once (replicas starting together) never read or overwrite a half-written one:
    the first complete entry wins and the others drop theirs."""
    staging = entry.parent / f".{entry.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        staging.mkdir(parents=True)
        _write_params(staging / _PARAMS_FILE, params)
        (staging / "config.json").write_text(json.dumps(hf_config))
        tokenizer.save_pretrained(str(staging / "tokenizer"))
        (staging / COMPLETE).write_text("ok")
        if entry.exists() and not (entry / COMPLETE).exists():  # a damaged entry: replace it
            shutil.rmtree(entry, ignore_errors=True)
        try:
            staging.rename(entry)  # atomic; refused when another process's entry is already there
        except OSError:
            if not (entry / COMPLETE).exists():
                raise
    except Exception as e:  # noqa: BLE001 - caching is an optimisation; loading already succeeded
        logger.warning("could not write param cache to %s: %s", entry, e)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def file_lock(lock_path: Path, waiting: str) -> Iterator[None]:
    """Hold an advisory lock on `lock_path` (made if missing), logging `waiting` when another process
    holds it first; none where the platform has no `fcntl` or the folder cannot be written."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(lock_path, "a")  # noqa: SIM115 - held across the yield
    except OSError as e:  # a read-only cache: go on unlocked
        logger.debug("no lock at %s: %s", lock_path, e)
        yield
        return
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("%s", waiting)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextlib.contextmanager
def converting(entry: Path, path: Path) -> Iterator[None]:
    """Hold the conversion lock of a cache entry (a file lock beside the entries)."""
    with file_lock(entry.parent.with_name("params.locks") / entry.name,
                   f"another process is converting {path.name}: waiting for its param cache entry"):
        yield
