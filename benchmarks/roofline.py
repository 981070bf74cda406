"""Roofline of this machine and where the engine's decode steps sit on it.

    python benchmarks/roofline.py [--batch-sizes 1,16,64] [--runs 10]

Measures (medians of --runs): the float32 matrix-product peak (a jitted N x N x N `jnp.dot`), the
memory bandwidth (a jitted elementwise pass over a large array, in place: one read and one write per
element),
then the time of the bundled model's pure decode steps at each batch size, reported as achieved
FLOP/s (2 x matmul parameters x batch, plus attention) and bytes/s (weights + KV read per step), each
as a fraction of the measured peak.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def timed(fn, *args, runs: int) -> float:  # noqa: ANN001
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_peak(n: int, runs: int) -> float:
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n), np.float32))
    f = jax.jit(lambda x, y: jnp.dot(x, y, precision=jax.lax.Precision.HIGHEST))
    return 2 * n**3 / timed(f, a, a, runs=runs)


def bandwidth(num_bytes: int, runs: int) -> float:
    """The input is donated and the output fed back, so every pass reuses one buffer: without that,
    each call would fault in a fresh output allocation and measure the page-fault rate instead."""
    f = jax.jit(lambda v: v * 0.5 + 1.0, donate_argnums=0)
    x = jax.block_until_ready(f(jnp.ones(num_bytes // 4, jnp.float32)))
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        x = jax.block_until_ready(f(x))
        times.append(time.perf_counter() - start)
    return 2 * num_bytes / statistics.median(times)


def decode_steps(engine, batch: int, prompt_len: int, steps: int) -> float:  # noqa: ANN001
    """Median seconds of steps where every scheduled request decodes one token."""
    from paxserve import SamplingParams

    rng = np.random.default_rng(batch)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"roof-{batch}-{i}", rng.integers(3, 49152, prompt_len).tolist(), params)
    times = []
    while engine.has_unfinished_requests():
        decoding = all(r.num_computed_tokens == r.num_tokens - 1 for r in engine.scheduler.running) and \
            len(engine.scheduler.running) == batch
        start = time.perf_counter()
        engine.step()
        if decoding:
            times.append(time.perf_counter() - start)
    return statistics.median(times[2:])  # the first decode steps may compile a new bucket


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--matmul-n", type=int, default=2048)
    parser.add_argument("--bandwidth-mib", type=int, default=512)
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    from paxserve import Engine

    peak = matmul_peak(args.matmul_n, args.runs)
    bw = bandwidth(args.bandwidth_mib * 2**20, args.runs)
    engine = Engine(max_model_len=1024, max_num_seqs=max(int(b) for b in args.batch_sizes.split(",")),
                    warmup=False, log_stats_interval=0)
    cfg = engine.model_config
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(engine.model.params))
    # Matmul parameters touched per token: every layer's weights plus the LM head (not the embedding lookup).
    layer_params = sum(x.size for x in jax.tree_util.tree_leaves(engine.model.params.layers))
    matmul_params = layer_params + cfg.vocab_size * cfg.hidden_size
    print(f"machine: {jax.devices()[0].device_kind}, float32 matmul peak {peak / 1e9:.1f} GFLOP/s "
          f"(N={args.matmul_n}), memory bandwidth {bw / 1e9:.1f} GB/s ({args.bandwidth_mib} MiB pass); "
          f"model weights {weight_bytes / 2**20:.0f} MiB, {matmul_params / 1e6:.1f}M matmul params")
    print("| batch | decode step ms | tokens/s | GFLOP/s | % of matmul peak | GB/s | % of bandwidth |")
    print("|---|---|---|---|---|---|---|")
    for b in (int(x) for x in args.batch_sizes.split(",")):
        seconds = decode_steps(engine, b, args.prompt_len, args.decode_steps)
        context = args.prompt_len + args.decode_steps // 2  # mean context over the measured steps
        attn_flops = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context * b
        flops = 2 * matmul_params * b + attn_flops
        kv_bytes = context * b * cfg.kv_bytes_per_token * engine.model.dtype.itemsize
        moved = weight_bytes + kv_bytes
        print(f"| {b} | {1000 * seconds:.1f} | {b / seconds:.1f} | {flops / seconds / 1e9:.1f} | "
              f"{100 * flops / seconds / peak:.1f}% | {moved / seconds / 1e9:.2f} | {100 * moved / seconds / bw:.1f}% |")


if __name__ == "__main__":
    main()
