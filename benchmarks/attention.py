"""Where a model step's time goes: the bundled model's forward with and without attention.

    python benchmarks/attention.py [--runs 7]

Two step shapes, on the engine's real batch builder and the reference (XLA) attention that CPU
serving runs: a pure decode step of 64 sequences (contexts drawn around 200 tokens, block table
padded to 32 blocks of 16, as the engine pads it) and a mixed 2048-token step (32 decode tokens plus
prompt chunks of 16-255 tokens). Each is timed as the whole forward pass, and again with attention
replaced by the identity (the KV-cache write and every matmul kept), so the difference is what the
paged attention costs. Medians of --runs after a compile-and-warm-up call.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import paxserve.models.decoder as llama  # noqa: E402  (the one decoder; its `attention` is swapped for the timing)
from paxserve.kernels import KVCache  # noqa: E402
from paxserve.models.loader import load_model  # noqa: E402
from paxserve.worker.step_functions import attention_metadata as _metadata  # noqa: E402
from paxserve.worker.step_inputs import SeqChunk, build_batch, next_power_of_2  # noqa: E402

BLOCK = 16


def decode_chunks(rng: np.random.Generator, num_seqs: int, context: int, first_block: int) -> list[SeqChunk]:
    chunks = []
    for _ in range(num_seqs):
        c = int(rng.integers(context // 2, context * 3 // 2))
        n = -(-c // BLOCK)
        chunks.append(SeqChunk([5], c - 1, list(range(first_block, first_block + n))))
        first_block += n
    return chunks


def mixed_chunks(rng: np.random.Generator, num_tokens: int, num_decode: int) -> list[SeqChunk]:
    chunks = decode_chunks(rng, num_decode, 200, 1)
    block = 1 + sum(len(c.block_table) for c in chunks)
    left = num_tokens - num_decode
    while left > 0:
        n = min(left, int(rng.integers(16, 256)))
        chunks.append(SeqChunk([5] * n, 0, list(range(block, block + -(-n // BLOCK)))))
        block += -(-n // BLOCK)
        left -= n
    return chunks


def time_forward(model: Any, chunks: list[SeqChunk], pad_blocks_to: int | None, runs: int,
                 attention: Callable[..., Any] | None) -> float:
    cfg = model.config
    widest = max(len(c.block_table) for c in chunks)
    batch = build_batch(chunks, BLOCK, pad_tokens_to=next_power_of_2(sum(len(c.token_ids) for c in chunks)),
                        pad_seqs_to=next_power_of_2(len(chunks)), pad_blocks_to=pad_blocks_to or next_power_of_2(widest))
    num_blocks = 2 + sum(len(c.block_table) for c in chunks)
    kv = KVCache.zeros(cfg.num_layers, num_blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim, jnp.float32)
    original = llama.attention
    if attention is not None:
        llama.attention = attention
    try:
        step = jax.jit(lambda p, kv, i, pos, md: llama.forward(p, kv, i, pos, md, cfg), donate_argnums=(1,))
        args = (jnp.asarray(batch.input_ids), jnp.asarray(batch.positions), _metadata(batch))
        logits, kv = step(model.params, kv, *args)
        jax.block_until_ready(logits)
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            logits, kv = step(model.params, kv, *args)
            jax.block_until_ready(logits)
            times.append(time.perf_counter() - start)
    finally:
        llama.attention = original
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    model = load_model(None)
    rng = np.random.default_rng(args.seed)
    shapes = [("decode, 64 sequences, context ~200 (block table 32)", decode_chunks(rng, 64, 200, 1), 32),
              ("mixed, 2048 tokens (32 decode + prompt chunks)", mixed_chunks(rng, 2048, 32), None)]
    identity = lambda q, *a, **k: q  # noqa: E731
    print(f"machine: {jax.devices()[0].device_kind}, JAX {jax.__version__}; median of {args.runs} runs")
    print("| step | forward ms | without attention ms | attention ms | attention share |")
    print("|---|---|---|---|---|")
    for name, chunks, width in shapes:
        full = time_forward(model, chunks, width, args.runs, None)
        bare = time_forward(model, chunks, width, args.runs, identity)
        print(f"| {name} | {1000 * full:.1f} | {1000 * bare:.1f} | {1000 * (full - bare):.1f} | "
              f"{100 * (full - bare) / full:.0f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
