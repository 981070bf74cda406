"""The MoE layer's time against a dense MLP of the same active size, and against `lax.ragged_dot`.

    python benchmarks/moe.py [--runs 7] [--passes 3] [--hidden 512] [--width 768] [--tokens 8 256 2048]

For each token count (8: a decode step; 256 and 2048: prefill chunks), number of experts E and top-k:
- `moe`: paxserve's layer (models/moe.py: route, sort by expert, tiled per-expert matmuls);
- `dense k*I`: one gated MLP of width k * I, the same multiply-adds a token's k experts need;
- `ragged_dot`: the same sort and combine around `jax.lax.ragged_dot` (XLA's lowering on this
  platform), for comparison.
The claim to see: where the products are compute-bound (many rows per expert), `moe` grows with k
like the dense column and not with E. Where they are bound by reading weights (decode), any MoE
reads each expert a token picked once, so its cost follows the experts touched, at most
min(E, tokens * k), never all E; the column `touched` counts them. Float32, random weights, routing
from a random router. Each cell: the median over --passes interleaved passes (every configuration
once per pass, so a slow spell of a shared machine hits all of them alike) of the median of --runs
calls after a compile-and-warm-up call.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after the checkout of gpu_check.sh

from paxserve.models.layers import mlp  # noqa: E402
from paxserve.models.moe import MoEParams, moe_mlp, route  # noqa: E402


def ragged_dot_moe(x: jax.Array, p: MoEParams, top_k: int) -> jax.Array:
    """The same layer (first layer of `p`) with `lax.ragged_dot` doing the grouped products."""
    weights, experts = route(x, p.router_w[0], top_k, True)
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=p.router_w.shape[-1]).astype(jnp.int32)
    h = jax.lax.ragged_dot(x[order // top_k], p.experts_up_w[0], sizes, preferred_element_type=jnp.float32)
    gate, up = jnp.split(h.astype(x.dtype), 2, axis=-1)
    y = jax.lax.ragged_dot(jax.nn.silu(gate) * up, p.experts_down_w[0], sizes, preferred_element_type=jnp.float32)
    y = jnp.zeros_like(y).at[order].set(y).reshape(x.shape[0], top_k, -1)
    return jnp.einsum("tk,tkh->th", weights, y).astype(x.dtype)


def _median_ms(fn: Callable[..., Any], args: tuple, runs: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def measure(tokens: int, num_experts: int, top_k: int, hidden: int, width: int, runs: int,
            ragged: bool) -> dict[str, float]:
    rng = np.random.default_rng(num_experts * 100 + top_k)
    f32 = lambda *shape: jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[-2]), jnp.float32)  # noqa: E731
    p = MoEParams(router_w=f32(1, hidden, num_experts), experts_up_w=f32(1, num_experts, hidden, 2 * width),
                  experts_down_w=f32(1, num_experts, width, hidden))
    x = jnp.asarray(rng.normal(size=(tokens, hidden)), jnp.float32)
    layer = jnp.int32(0)
    moe = jax.jit(lambda x, p: moe_mlp(x, p, layer, top_k=top_k, renormalize=True, weights_in_dtype=False,
                                       act="silu"))
    dense_up, dense_down = f32(hidden, 2 * top_k * width), f32(top_k * width, hidden)
    dense = jax.jit(lambda x, u, d: mlp(x, u, None, d, None, act="silu", gated=True))
    out = {"moe": _median_ms(moe, (x, p), runs), "dense": _median_ms(dense, (x, dense_up, dense_down), runs)}
    out["touched"] = len(np.unique(np.asarray(route(x, p.router_w[0], top_k, True)[1])))
    if ragged:
        out["ragged_dot"] = _median_ms(jax.jit(lambda x, p: ragged_dot_moe(x, p, top_k)), (x, p), runs)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--width", type=int, default=768, help="each expert's intermediate size I")
    ap.add_argument("--tokens", type=int, nargs="+", default=[8, 256, 2048])
    ap.add_argument("--experts", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--top-k", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--ragged-max-rows", type=int, default=8192,
                    help="time lax.ragged_dot only where tokens * experts <= this (it may compute every expert)")
    args = ap.parse_args(argv)
    configs = [(t, e, k) for t in args.tokens for e in args.experts for k in args.top_k]
    results: dict[tuple[int, int, int], list[dict[str, float]]] = {c: [] for c in configs}
    for n in range(args.passes):
        for t, e, k in configs:
            results[(t, e, k)].append(measure(t, e, k, args.hidden, args.width, args.runs,
                                              t * e <= args.ragged_max_rows))
        print(f"pass {n + 1}/{args.passes} done", file=sys.stderr, flush=True)
    print(f"# {platform.node()} {jax.devices()[0].platform} ({jax.device_count()} device(s)), JAX {jax.__version__}, "
          f"hidden {args.hidden}, expert width {args.width}, float32, median of {args.passes} passes x {args.runs} runs")
    print("| tokens | experts | top-k | touched | moe ms | dense k*I ms | moe / dense | ragged_dot ms |")
    print("|---|---|---|---|---|---|---|---|")
    for (t, e, k), passes in results.items():
        med = {key: statistics.median(p[key] for p in passes) for key in passes[0]}
        ragged = f"{med['ragged_dot']:.2f}" if "ragged_dot" in med else "-"
        print(f"| {t} | {e} | {k} | {passes[0]['touched']} | {med['moe']:.2f} | {med['dense']:.2f} | "
              f"{med['moe'] / med['dense']:.2f} | {ragged} |")


if __name__ == "__main__":
    main()
