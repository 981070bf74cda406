"""What every gpu_check part shares: its rows (printed, and appended as JSON lines to the run's
rows file the moment they are measured, so a part killed later still leaves them), timing, and the
random ragged paged-attention problems."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROW_PREFIX = "@@row "  # how the orchestrator tells a row from the rest of a part's output


class Rows:
    """Rows of one part, appended to `path` (one JSON object per line; O_APPEND keeps lines of
    concurrent parts whole)."""

    def __init__(self, path: Path | None, part: str) -> None:
        self.path = path
        self.part = part

    def __call__(self, check: str, result: str, note: str = "", *, status: str = "info",
                 value: float | None = None, key: str | None = None) -> None:
        """status: pass, fail, error, info or n/a; `value`/`key`: a number later parts read back."""
        record = append_row(self.path, self.part, check, result, note, status=status, value=value, key=key)
        print(ROW_PREFIX + json.dumps(record), flush=True)

    def value(self, key: str) -> float | None:
        """The latest value an earlier part recorded under `key`."""
        return read_value(self.path, key)


def read_rows(path: Path | None) -> list[dict[str, Any]]:
    """Every whole row in the rows file (a line cut by a killed writer is skipped)."""
    if path is None or not path.exists():
        return []
    found = []
    for line in path.read_text().splitlines():
        try:
            found.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return found


def append_row(path: Path | None, part: str, check: str, result: str, note: str = "", *, status: str = "info",
               value: float | None = None, key: str | None = None) -> dict[str, Any]:
    """The row as a record, appended to `path` (one JSON object per line; O_APPEND keeps lines of
    concurrent writers whole)."""
    record = {"part": part, "check": check, "result": result, "note": note, "status": status, "value": value,
              "key": key, "pid": os.getpid(), "time": time.time()}
    if path is not None:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
    return record


def read_value(path: Path | None, key: str) -> float | None:
    """The latest value recorded under `key`."""
    found = None
    for record in read_rows(path):
        if record.get("key") == key and record.get("value") is not None:
            found = float(record["value"])
    return found


def timed(fn: Callable[[], Any], *, min_time: float, reps: int) -> float:
    """Median seconds per call of `fn` after a warm-up call (several calls per sample when fast)."""
    import jax

    jax.block_until_ready(fn())
    start = time.perf_counter()
    jax.block_until_ready(fn())
    once = time.perf_counter() - start
    n = max(1, int(min_time / max(once, 1e-7)))
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        out = None
        for _ in range(n):
            out = fn()
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / n)
    return float(np.median(samples))


def ragged_problem(rng: np.random.Generator, *, num_seqs: int, block_size: int, num_kv_heads: int, group: int,
                   head_dim: int, dtype: Any, max_ctx: int, decode_only: bool = False) -> dict[str, Any]:
    """A step's inputs after its K/V write: 2 layers (layer 0 finite garbage), shuffled pages, every
    unused page and the null block NaN, one padding sequence and three padding tokens (none of
    either for decode-only problems, whose kernels take exactly one token per sequence)."""
    import jax.numpy as jnp

    from paxserve.kernels.metadata import AttentionMetadata

    ctx = rng.integers(1, max_ctx + 1, num_seqs)
    q_lens = np.ones(num_seqs, int) if decode_only else np.where(
        rng.random(num_seqs) < 0.5, 1, [int(rng.integers(1, c + 1)) for c in ctx])
    blocks = [-(-int(c) // block_size) + int(rng.integers(0, 2)) for c in ctx]
    width = 1 << max(0, (max(blocks) - 1).bit_length())
    num_blocks = 1 + sum(blocks) + 2
    ids = rng.permutation(np.arange(1, num_blocks))
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    k = np.full(shape, np.nan, np.float32)
    v = np.full(shape, np.nan, np.float32)
    k[0], v[0] = rng.standard_normal(shape[1:]), rng.standard_normal(shape[1:])
    tables = np.zeros((num_seqs + 1, width), np.int32)
    start = 0
    for s, (c, n) in enumerate(zip(ctx, blocks)):
        tables[s, :n] = ids[start:start + n]
        start += n
        pos = np.arange(int(c))
        k[1, tables[s, pos // block_size], pos % block_size] = rng.standard_normal((len(pos), num_kv_heads, head_dim))
        v[1, tables[s, pos // block_size], pos % block_size] = rng.standard_normal((len(pos), num_kv_heads, head_dim))
    num_tokens = int(q_lens.sum())
    t_pad = num_seqs if decode_only else num_tokens + 3
    s_pad = num_seqs if decode_only else num_seqs + 1
    qsl = np.zeros(s_pad + 1, np.int32)
    qsl[1:num_seqs + 1] = np.cumsum(q_lens)
    qsl[num_seqs + 1:] = num_tokens
    ctx_lens = np.zeros(s_pad, np.int32)
    ctx_lens[:num_seqs] = ctx
    q = rng.standard_normal((t_pad, num_kv_heads * group, head_dim)).astype(np.float32)
    md = AttentionMetadata(slot_mapping=jnp.zeros((t_pad,), jnp.int32), block_tables=jnp.asarray(tables[:s_pad]),
                           context_lens=jnp.asarray(ctx_lens), query_start_loc=jnp.asarray(qsl),
                           logits_indices=jnp.zeros((s_pad,), jnp.int32))
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return dict(q=cast(q), k=cast(k), v=cast(v), md=md, num_tokens=num_tokens)


def rel_error(out: Any, ref: Any, n: int) -> tuple[float, bool]:
    """(max|out - ref| / max|ref| over the first n rows, whether those are finite and the padding
    rows after them exact zeros)."""
    o, r = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    ok = bool(np.all(np.isfinite(o[:n])) and np.all(o[n:] == 0))
    scale = float(np.max(np.abs(r[:n]))) or 1.0
    return float(np.max(np.abs(o[:n] - r[:n])) / scale) if np.all(np.isfinite(o[:n])) else math.inf, ok


def one_line(error: BaseException, limit: int = 160) -> str:
    text = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    return f"{type(error).__name__}: {text[:limit]}"


def add_repo_to_path() -> None:
    """The parts run as scripts from a plain checkout (the GPU image has no package registry): the
    root goes last, for `benchmarks.*`; paxserve comes from gpu_check.sh's PYTHONPATH, whose import
    root maps the checkout's folders to their installed names (benchmarks/checkout.py)."""
    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.append(root)


def run_part(part: str, doc: str | None, measures: list[Callable[..., None]]) -> None:
    """A part process's main: `--smoke` and `--rows`, then each `measure(smoke, row, timed, copy
    bandwidth or None)` in turn, `row(part, check, result, note)` marking FAIL rows as failed and
    PASS rows as passed; a measure that raises leaves an error row, the next one still runs, and
    the process exits 1 (its error row already says why)."""
    import argparse

    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--rows", type=Path)
    args = ap.parse_args()
    rows = Rows(args.rows, part)

    def row(_part: str, what: str, result: str, note: str = "") -> None:
        rows(what, result, note, status="fail" if result.startswith("FAIL") else "pass" if result == "PASS"
             else "info")

    failed = False
    for measure in measures:
        try:
            measure(args.smoke, row, timed, rows.value("copy_bw"))
        except Exception as e:  # noqa: BLE001 - one measurement failing must not hide the next
            rows(measure.__name__, "ERROR", one_line(e), status="error")
            failed = True
    if failed:
        sys.exit(1)
