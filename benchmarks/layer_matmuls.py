"""The decoder layers' matrix-vector products alone at batch 1, in the layouts one could store them.

    python benchmarks/layer_matmuls.py [--hidden 576 --inter 1536 --kv 192 --layers 30] [--runs 30]

A Llama layer's seven weight products (q, k, v, o, gate, up, down) for one token, over `--layers`
layers of random float32 weights, with nothing else of the layer (no attention, norms or RoPE), timed
four ways side by side: scanned over stacked (out, in) weights (x @ W.T), the same layers unrolled
in Python over separate arrays (how the engine serves since issue 35: models/layer_split.py),
scanned over weights stored (in, out) (x @ W, the loader's layout), and scanned with q/k/v and
gate/up fused into two products. Also one MLP-sized product
alone in both orientations. Each is compared with its weights read once at `--bandwidth-gbs`.
Medians of `--runs`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from roofline import timed as _timed  # noqa: E402 - a sibling script: the median of blocked runs


def measure(hidden: int, inter: int, kv: int, layers: int, runs: int) -> dict[str, float]:
    """Seconds per pass of each variant, and the weights' bytes."""
    rng = np.random.default_rng(0)

    def w(*shape: int) -> jax.Array:
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * 0.02)

    stack = dict(q=w(layers, hidden, hidden), k=w(layers, kv, hidden), v=w(layers, kv, hidden),
                 o=w(layers, hidden, hidden), g=w(layers, inter, hidden), u=w(layers, inter, hidden),
                 d=w(layers, hidden, inter))
    x = jnp.ones((1, hidden), jnp.float32)

    def body(x: jax.Array, p: dict[str, jax.Array], t: Callable[[jax.Array], jax.Array]) -> jax.Array:
        q, k, v = x @ t(p["q"]), x @ t(p["k"]), x @ t(p["v"])
        x = x + q @ t(p["o"]) + 0 * (k.sum() + v.sum())  # k and v feed attention in the real layer
        return x + (jax.nn.silu(x @ t(p["g"])) * (x @ t(p["u"]))) @ t(p["d"])

    def fused_body(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
        qkv = x @ p["qkv"].T
        q, k, v = qkv[:, :hidden], qkv[:, hidden:hidden + kv], qkv[:, hidden + kv:]
        x = x + q @ p["o"].T + 0 * (k.sum() + v.sum())
        gu = x @ p["gu"].T
        return x + (jax.nn.silu(gu[:, :inter]) * gu[:, inter:]) @ p["d"].T

    def scan(step: Callable[[jax.Array, Any], jax.Array]) -> Callable[..., jax.Array]:
        return jax.jit(lambda x, weights: jax.lax.scan(lambda h, p: (step(h, p), None), x, weights)[0])

    transposed = {k: jnp.swapaxes(v, 1, 2).copy() for k, v in stack.items()}
    fused = dict(qkv=jnp.concatenate([stack["q"], stack["k"], stack["v"]], axis=1), o=stack["o"],
                 gu=jnp.concatenate([stack["g"], stack["u"]], axis=1), d=stack["d"])
    separate = [{k: v[i] for k, v in stack.items()} for i in range(layers)]

    @jax.jit
    def unrolled(x: jax.Array, weights: list[dict[str, jax.Array]]) -> jax.Array:
        for p in weights:
            x = body(x, p, lambda a: a.T)
        return x

    one = stack["g"][0]
    return {
        "scan, (out, in) as stored": _timed(scan(lambda h, p: body(h, p, lambda a: a.T)), x, stack, runs=runs),
        "unrolled, separate arrays": _timed(unrolled, x, separate, runs=runs),
        "scan, stored (in, out)": _timed(scan(lambda h, p: body(h, p, lambda a: a)), x, transposed, runs=runs),
        "scan, qkv and gate/up fused": _timed(scan(fused_body), x, fused, runs=runs),
        "one MLP product, x @ W.T": _timed(jax.jit(lambda x, a: x @ a.T), x, one, runs=runs),
        "one MLP product, x @ W (in, out)": _timed(jax.jit(lambda x, a: x @ a), x, one.T.copy(), runs=runs),
        "weight_bytes": float(sum(v.size * 4 for v in stack.values())),
        "one_bytes": float(one.size * 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--inter", type=int, default=1536)
    parser.add_argument("--kv", type=int, default=192, help="K and V projections' width (KV heads x head size)")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--bandwidth-gbs", type=float, default=57.0)
    args = parser.parse_args()
    result = measure(args.hidden, args.inter, args.kv, args.layers, args.runs)
    bound = result["weight_bytes"] / (args.bandwidth_gbs * 1e9)
    print(f"{args.layers} layers' weights {result['weight_bytes'] / 1e6:.1f} MB: {1e3 * bound:.2f} ms at "
          f"{args.bandwidth_gbs} GB/s")
    for name, seconds in result.items():
        if name.endswith("bytes"):
            continue
        size = result["one_bytes"] if name.startswith("one") else result["weight_bytes"]
        print(f"| {name} | {1e3 * seconds:.3f} ms | {size / seconds / 1e9:.1f} GB/s |")


if __name__ == "__main__":
    main()
