"""Part (d) of gpu_check: the MoE layer on the GPU at Mixtral-8x7B shapes (hidden 4096, 8 experts of
width 14336, top-2, bfloat16, one layer): correctness of paxserve's tiled expert products against
the all-experts product, then times for the tiled layer (skipping empty tiles with `lax.cond`, and
computing them instead), the same layer on `jax.lax.ragged_dot`, and a dense MLP of width 2 x 14336
(the active size), at 1, 64 and 2048 tokens, with the weight bytes the touched experts hold next to
the copy bandwidth. This decides, on a GPU, between the cond and no cond and whether XLA's ragged_dot
could replace the tiled scan (models/moe.py explains why it does not on CPU)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

# Last, for `benchmarks.*`: paxserve comes from gpu_check.sh's PYTHONPATH (benchmarks/checkout.py).
sys.path.append(str(Path(__file__).resolve().parent.parent))

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.moe import ragged_dot_moe
from paxserve.models.layers import mlp
from paxserve.models.moe import MoEParams, experts_forward, experts_forward_reference, moe_mlp, route

Row = Callable[..., None]


def part_d(smoke: bool, row: Row, timed: Callable[..., float], bw: float | None) -> None:
    hidden, width, num_experts, top_k = (64, 96, 8, 2) if smoke else (4096, 14336, 8, 2)
    dtype = jnp.float32 if smoke else jnp.bfloat16
    key = jax.random.key(0)
    k1, k2, k3, k4 = jax.random.split(key, 4)
    scale = lambda n: 1.0 / np.sqrt(n)  # noqa: E731
    p = MoEParams(
        router_w=(jax.random.normal(k1, (1, hidden, num_experts)) * scale(hidden)).astype(dtype),
        experts_up_w=(jax.random.normal(k2, (1, num_experts, hidden, 2 * width)) * scale(hidden)).astype(dtype),
        experts_down_w=(jax.random.normal(k3, (1, num_experts, width, hidden)) * scale(width)).astype(dtype),
    )
    layer = jnp.int32(0)

    # correctness: the tiled products against every expert on every token, then gathered
    x = jax.random.normal(k4, (48, hidden)).astype(dtype)
    weights, ids = route(x, p.router_w[0], top_k, True)
    got = jax.jit(experts_forward, static_argnames=("act",))(x, weights, ids, p.experts_up_w[0],
                                                             p.experts_down_w[0], act="silu")
    ref = experts_forward_reference(x, weights, ids, p.experts_up_w[0], p.experts_down_w[0], act="silu")
    err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))
    tol = 1e-5 if smoke else 3e-2
    row("d", f"MoE tiled experts vs all-experts product ({num_experts}x{top_k}, {jnp.dtype(dtype).name})",
        "PASS" if err < tol else "FAIL", f"max rel err {err:.1e} (tol {tol:.0e})")

    moe, moe_no_skip = (jax.jit(lambda x, p, skip=skip: moe_mlp(
        x, p, layer, top_k=top_k, renormalize=True, weights_in_dtype=False, act="silu", skip_empty_tiles=skip))
        for skip in (True, False))
    ragged = jax.jit(lambda x, p: ragged_dot_moe(x, p, top_k))
    dense_up = p.experts_up_w[0, :top_k].transpose(1, 0, 2).reshape(hidden, -1)  # same bytes as k experts
    dense_down = p.experts_down_w[0, :top_k].reshape(-1, hidden)
    dense = jax.jit(lambda x, u, d: mlp(x, u, None, d, None, act="silu", gated=True))
    expert_bytes = 3 * hidden * width * jnp.dtype(dtype).itemsize
    for tokens in (16,) if smoke else (1, 64, 2048):
        x = jax.random.normal(jax.random.fold_in(k4, tokens), (tokens, hidden)).astype(dtype)
        touched = len(np.unique(np.asarray(route(x, p.router_w[0], top_k, True)[1])))
        times: dict[str, Any] = {}
        for name, fn in (("tiled", lambda: moe(x, p)), ("tiled without cond", lambda: moe_no_skip(x, p)),
                         ("ragged_dot", lambda: ragged(x, p)),
                         ("dense 2xI", lambda: dense(x, dense_up, dense_down))):
            try:
                times[name] = timed(fn, min_time=0.05 if smoke else 0.2, reps=2 if smoke else 5)
            except Exception as e:  # noqa: BLE001 - ragged_dot may not lower everywhere; report it
                times[name] = f"{type(e).__name__}"
        fmt = lambda t: f"{1e3 * t:.3f} ms" if isinstance(t, float) else t  # noqa: E731
        note = ", ".join(f"{k} {fmt(v)}" for k, v in times.items() if k != "tiled")
        if bw and isinstance(times["tiled"], float):
            note += f"; {touched} experts touched = {100 * touched * expert_bytes / times['tiled'] / bw:.0f}% of copy BW"
        row("d", f"MoE layer {tokens} tokens ({touched} experts touched)", fmt(times["tiled"]), note)


def main() -> None:
    """One gpu_check process: part (d) with its rows in the run's rows file."""
    from benchmarks.gpu_check_common import run_part

    run_part("d", __doc__, [part_d])


if __name__ == "__main__":
    main()
