"""Decode attention on XLA:CPU: the engine's reference against other ways to write it in `jnp`.

    python benchmarks/decode_attention.py [--seqs 64] [--context 200] [--runs 7]

One layer's attention as a pure decode step runs it (one query token per sequence), with SmolLM2's
shapes (9 query / 3 KV heads of 64, blocks of 16), contexts drawn from context/2 .. 3*context/2, the
block table padded to a power of two and its pages in random order. Each variant runs inside a
30-layer `fori_loop` with the layer index traced, as in the model, and is reported per layer (median
of --runs after a compile-and-warm-up call) with its largest difference from the reference. The
"gathers only" and "products only" rows are the column loop with the other half removed: they say
where its time goes, and compute nothing meaningful.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from paxserve.kernels.metadata import AttentionMetadata  # noqa: E402
from paxserve.kernels.reference import ragged_paged_attention_reference  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16
SCALE = HEAD_DIM**-0.5


def reference(q, kc, vc, layer, md):  # noqa: ANN001, ANN201
    return ragged_paged_attention_reference(q, kc, vc, layer, md, sm_scale=SCALE)


def dense(q, kc, vc, layer, md):  # noqa: ANN001, ANN201
    """Gather the whole padded block table at once, then one masked softmax per sequence."""
    s_, w = md.block_tables.shape
    k = kc[layer, md.block_tables].reshape(s_, w * BLOCK, KV_HEADS, HEAD_DIM)
    v = vc[layer, md.block_tables].reshape(s_, w * BLOCK, KV_HEADS, HEAD_DIM)
    visible = jnp.arange(w * BLOCK)[None, :] < md.context_lens[:, None]
    s = jnp.einsum("skgd,slkd->skgl", q.reshape(s_, KV_HEADS, -1, HEAD_DIM), k) * SCALE
    s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
    p = jnp.exp(s - jnp.max(s, -1, keepdims=True))
    out = jnp.einsum("skgl,slkd->skgd", p, jnp.where(visible[:, :, None, None], v, 0.0))
    return (out / jnp.sum(p, -1)[..., None]).reshape(q.shape)


def column_loop(q, kc, vc, layer, md, part: str = "both", chunk: int = 32):  # noqa: ANN001, ANN201
    """Iteration j takes the j-th chunk of every sequence (pages past a context read the null block,
    which stays in cache) and merges it into a per-sequence running softmax: no scatter."""
    s_, w = md.block_tables.shape
    pages = chunk // BLOCK
    tables = jnp.pad(md.block_tables, ((0, 0), (0, -w % pages)))
    qq = q.reshape(s_, KV_HEADS, -1, HEAD_DIM)
    fixed = jnp.tile(kc[0, 1][None], (s_, pages, 1, 1))  # the same keys for every sequence and chunk

    def body(j, state):  # noqa: ANN001, ANN202
        m0, l0, o0 = state
        ids = jax.lax.dynamic_slice_in_dim(tables, j * pages, pages, axis=1)
        live = (j * chunk + jnp.arange(pages) * BLOCK)[None, :] < md.context_lens[:, None]
        ids = jnp.where(live, ids, 0)
        if part == "products":
            k = v = fixed + j
        else:
            k = kc[layer, ids].reshape(s_, chunk, KV_HEADS, HEAD_DIM)
            v = vc[layer, ids].reshape(s_, chunk, KV_HEADS, HEAD_DIM)
        if part == "gathers":
            return m0, l0, o0 + (k[:, :3].sum(1) + v[:, :3].sum(1))[:, :, None, :]
        visible = (j * chunk + jnp.arange(chunk))[None, :] < md.context_lens[:, None]
        s = jnp.where(visible[:, None, None, :], jnp.einsum("skgd,slkd->skgl", qq, k) * SCALE, -jnp.inf)
        m = jnp.maximum(m0, jnp.max(s, -1))
        safe = jnp.where(jnp.isfinite(m), m, 0.0)
        p = jnp.exp(s - safe[..., None])
        rescale = jnp.exp(m0 - safe)
        v = jnp.where(visible[:, :, None, None], v, 0.0)
        return m, l0 * rescale + p.sum(-1), o0 * rescale[..., None] + jnp.einsum("skgl,slkd->skgd", p, v)

    shape = qq.shape[:-1]
    state = (jnp.full(shape, -jnp.inf), jnp.zeros(shape), jnp.zeros(qq.shape))
    _, total, out = jax.lax.fori_loop(0, (jnp.max(md.context_lens) + chunk - 1) // chunk, body, state)
    return (out / jnp.where(total > 0, total, 1.0)[..., None]).reshape(q.shape)


VARIANTS: dict[str, Callable] = {
    "reference (the engine's: work items of 32 keys merged by scatter)": reference,
    "dense (whole padded table gathered at once)": dense,
    "column loop, 32-key chunks": column_loop,
    "column loop, 64-key chunks": lambda *a: column_loop(*a, chunk=64),
    "column loop, gathers only": lambda *a: column_loop(*a, part="gathers"),
    "column loop, products only": lambda *a: column_loop(*a, part="products"),
}


def inputs(seqs: int, context: int, seed: int) -> tuple:
    rng = np.random.default_rng(seed)
    lens = rng.integers(max(1, context // 2), context * 3 // 2 + 1, seqs).astype(np.int32)
    blocks = -(-lens // BLOCK)
    width = 1 << int(blocks.max() - 1).bit_length()
    num_blocks = 1 + int(blocks.sum())
    ids = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((seqs, width), np.int32)
    for i, start in enumerate(np.concatenate([[0], np.cumsum(blocks)[:-1]])):
        tables[i, :blocks[i]] = ids[start:start + blocks[i]]
    md = AttentionMetadata(slot_mapping=jnp.zeros(seqs, jnp.int32), block_tables=jnp.asarray(tables),
                           context_lens=jnp.asarray(lens), query_start_loc=jnp.arange(seqs + 1, dtype=jnp.int32),
                           logits_indices=jnp.arange(seqs, dtype=jnp.int32))
    cache = (LAYERS, num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    kc = jnp.asarray(rng.standard_normal(cache, np.float32))
    vc = jnp.asarray(rng.standard_normal(cache, np.float32))
    q = jnp.asarray(rng.standard_normal((seqs, HEADS, HEAD_DIM), np.float32))
    return q, kc, vc, md, int(lens.sum())


def time_variant(fn: Callable, args: tuple, runs: int) -> tuple[float, jax.Array]:
    """Seconds per layer (median), and the output of the 30-layer loop."""
    def step(q, kc, vc, md):  # noqa: ANN001, ANN202
        # Each layer's query depends on the last layer's output, so no layer can be skipped.
        return jax.lax.fori_loop(0, LAYERS, lambda i, acc: acc + fn(q + 1e-3 * acc, kc, vc, i, md), jnp.zeros_like(q))

    step = jax.jit(step)
    out = jax.block_until_ready(step(*args))
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(step(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times) / LAYERS, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    q, kc, vc, md, tokens = inputs(args.seqs, args.context, args.seed)
    kv_bytes = tokens * KV_HEADS * HEAD_DIM * 2 * 4
    print(f"machine: {jax.devices()[0].device_kind}, JAX {jax.__version__}; {args.seqs} sequences, {tokens} tokens of "
          f"context, block table {md.block_tables.shape[1]} blocks; K/V read per layer {kv_bytes / 1e6:.1f} MB; "
          f"median of {args.runs}")
    print("| variant | ms per layer | vs reference | max abs difference |")
    print("|---|---|---|---|")
    base, expected = time_variant(reference, (q, kc, vc, md), args.runs)
    for name, fn in VARIANTS.items():
        seconds, out = (base, expected) if fn is reference else time_variant(fn, (q, kc, vc, md), args.runs)
        exact = "gathers only" not in name and "products only" not in name
        diff = f"{float(jnp.max(jnp.abs(out - expected))):.1e}" if exact else "(not attention)"
        print(f"| {name} | {1000 * seconds:.2f} | {base / seconds:.2f}x | {diff} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
