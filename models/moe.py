"""Mixture-of-experts MLP that computes only the routed experts.

Each token's top-k (token, expert) pairs are sorted by expert, so every expert's rows are one
contiguous run of a [tokens * k, hidden] array. The runs are cut into row tiles of a fixed size,
each tile belonging to one expert, and a `lax.scan` over a static number of tiles runs each tile
through its expert's matrices alone; tiles past the routed rows are skipped by `lax.cond`. Group sizes
are runtime data, so the program never recompiles as routing changes, and no capacity factor drops
tokens.

Why not `jax.lax.ragged_dot`: on CPU (JAX 0.10.2) it lowers to a masked dense product over every
group, and XLA's CUDA lowering is reported to materialise the same dense form unless a cuDNN fusion
applies. That is all-experts compute (and an expert holding NaN poisons every token through
0 * NaN); benchmarks/moe.py measures both side by side, gpu_check part (d) on a GPU.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Float, Int

from paxserve.models.layers import Reduce, activation, dense, mlp
from paxserve.models.quant_weights import QuantizedWeight

# Tile heights: below ~16 rows a tile's product is bound by reading its expert's matrix, so fewer,
# taller tiles cost nothing extra and read each routed expert once; above 256 padding waste dominates.
MIN_TILE_ROWS, MAX_TILE_ROWS = 16, 256


@struct.dataclass
class MoEParams:
    """The MoE layers' weights, each stacked on a leading axis over the model's MoE layers (which
    need not be all layers); matrices are [in, out]."""

    router_w: Float[Array, "L H E"]
    experts_up_w: Float[Array, "L E H I2"]  # each expert's gate and up side by side
    experts_down_w: Float[Array, "L E I H"]
    shared_up_w: Float[Array, "L H S2"] | None = None  # Qwen2-MoE's shared expert
    shared_down_w: Float[Array, "L S H"] | None = None
    shared_gate_w: Float[Array, "L H 1"] | None = None


@struct.dataclass
class MLPParams:
    """Dense MLP weights of the dense layers of an MoE model, stacked over those layers."""

    up_w: Float[Array, "L H I2"]
    down_w: Float[Array, "L I H"]
    up_b: Float[Array, "L I2"] | None = None
    down_b: Float[Array, "L H"] | None = None


@struct.dataclass
class TilePlan:
    """Which rows of the expert-sorted array each tile covers: tile t multiplies rows
    [row_start[t], row_start[t] + num_rows[t]) by expert `expert[t]`; num_rows 0 means skip."""

    expert: Int[Array, " NT"]
    row_start: Int[Array, " NT"]
    num_rows: Int[Array, " NT"]
    tile_rows: int = struct.field(pytree_node=False)


def route(
    x: Float[Array, "T H"], router_w: Float[Array, "H E"], top_k: int, renormalize: bool
) -> tuple[Float[Array, "T K"], Int[Array, "T K"]]:
    """transformers' router: logits in the model dtype, softmax over all experts in float32, top-k,
    optionally rescaled to sum to 1. Returns float32 weights and int32 expert ids."""
    probs = jax.nn.softmax(dense(x, router_w).astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def tile_rows_for(num_rows: int, num_experts: int) -> int:
    """Rows per tile: the mean group size rounded up to a power of two (so a balanced routing fills
    about one tile per expert), within [MIN_TILE_ROWS, MAX_TILE_ROWS]."""
    mean = -(-num_rows // num_experts)
    return min(MAX_TILE_ROWS, max(MIN_TILE_ROWS, 1 << max(0, (mean - 1).bit_length())))


def plan_tiles(group_sizes: Int[Array, " E"], num_rows: int, tile_rows: int) -> TilePlan:
    """Cut each expert's run of sorted rows into tiles of `tile_rows`. The tile count is static:
    sum(ceil(n_e / m)) <= num_rows // m + min(E, num_rows), since each non-empty group adds at most
    one partial tile."""
    num_experts = group_sizes.shape[0]
    num_tiles = num_rows // tile_rows + min(num_experts, num_rows)
    tiles = (group_sizes + tile_rows - 1) // tile_rows
    tile_end = jnp.cumsum(tiles)
    group_start = jnp.cumsum(group_sizes) - group_sizes
    t = jnp.arange(num_tiles, dtype=jnp.int32)
    expert = jnp.searchsorted(tile_end, t, side="right").astype(jnp.int32)  # the group tile t falls in
    used = expert < num_experts
    expert = jnp.minimum(expert, num_experts - 1)
    first = t - (tile_end[expert] - tiles[expert])  # tile t's index within its group
    row_start = group_start[expert] + first * tile_rows
    num_rows_in = jnp.where(used, jnp.clip(group_sizes[expert] - first * tile_rows, 0, tile_rows), 0)
    return TilePlan(expert=expert, row_start=row_start.astype(jnp.int32),
                    num_rows=num_rows_in.astype(jnp.int32), tile_rows=tile_rows)


def take_layer(tree: Any, layer: Int[Array, ""]) -> Any:
    """Every array of `tree` at index `layer` of its leading (stacked-layers) axis."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=False), tree)


def _slice_expert(w: Array | QuantizedWeight, layer: Array | None, expert: Array) -> Array | QuantizedWeight:
    """One expert's [in, out] matrix out of a [(layers,) experts, in, out] stack: only that matrix
    is sliced, never a layer's whole expert stack (a quantized stack: its values and scales alike)."""
    lead = () if layer is None else (layer,)

    def one(a: Array) -> Array:
        shape = a.shape[-2:]
        return jax.lax.dynamic_slice(a, (*lead, expert, 0, 0), (*(1 for _ in lead), 1, *shape)).reshape(shape)

    return jax.tree.map(one, w)


def grouped_expert_mlp(
    rows: Float[Array, "M H"],
    up_w: Float[Array, "*L E H I2"],
    down_w: Float[Array, "*L E I H"],
    plan: TilePlan,
    *,
    act: str,
    layer: Int[Array, ""] | None = None,
    skip_empty_tiles: bool = True,
) -> Float[Array, "M H"]:
    """Each row of `rows` (sorted by expert, as `plan` describes) through its expert's gated MLP,
    float32 accumulation: one tile at a time, up and down projection together, so the [rows,
    2 x width] intermediate never exists beyond one tile. `skip_empty_tiles` skips the tiles past
    the routed rows with `lax.cond` (free on CPU; on a GPU a conditional may wait on the host, which
    benchmarks/gpu_check.sh part (d) measures against computing them)."""
    m, (num_rows, hidden) = plan.tile_rows, rows.shape
    padded = jnp.concatenate([rows, jnp.zeros((m, hidden), rows.dtype)])  # a tile's slice never runs off the end

    def tile(out: Array, t: tuple[Array, Array, Array]) -> tuple[Array, None]:
        expert, start, count = t
        keep = jax.lax.dynamic_slice_in_dim(out, start, m)  # rows past the group belong to the next one

        def run() -> Array:
            y = mlp(jax.lax.dynamic_slice_in_dim(padded, start, m), _slice_expert(up_w, layer, expert), None,
                    _slice_expert(down_w, layer, expert), None, act=act, gated=True)
            return jnp.where(jnp.arange(m)[:, None] < count, y, keep)

        # Only the tile passes through the cond: the whole output as its operand could be copied.
        y = jax.lax.cond(count > 0, run, lambda: keep) if skip_empty_tiles else run()
        return jax.lax.dynamic_update_slice_in_dim(out, y, start, 0), None

    out = jnp.zeros((num_rows + m, hidden), rows.dtype)
    out, _ = jax.lax.scan(tile, out, (plan.expert, plan.row_start, plan.num_rows))
    return out[:num_rows]


def experts_forward(
    x: Float[Array, "T H"],
    weights: Float[Array, "T K"],
    experts: Int[Array, "T K"],
    up_w: Float[Array, "*L E H I2"],
    down_w: Float[Array, "*L E I H"],
    *,
    act: str,
    layer: Int[Array, ""] | None = None,
    skip_empty_tiles: bool = True,
    out_dtype: Any = None,
    first_expert: Int[Array, ""] | int = 0,
) -> Float[Array, "T H"]:
    """Sum over each token's k experts of weight * expert(x), running only those experts; combined
    in float32 and returned in `out_dtype` (default: x's). Under expert parallelism `up_w` and
    `down_w` hold experts `first_expert ..` only: pairs routed elsewhere sort past every local
    group, are in no tile, and add nothing here (their device adds them)."""
    num_tokens, top_k = experts.shape
    num_experts = up_w.shape[-3]
    flat = experts.reshape(-1)
    if not (isinstance(first_expert, int) and first_expert == 0):
        flat = flat - first_expert
        flat = jnp.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # bincount below drops these
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    plan = plan_tiles(sizes, flat.shape[0], tile_rows_for(flat.shape[0], num_experts))
    y = grouped_expert_mlp(x[order // top_k], up_w, down_w, plan, act=act, layer=layer,
                           skip_empty_tiles=skip_empty_tiles)
    unsorted = jnp.zeros_like(y).at[order].set(y).reshape(num_tokens, top_k, -1)
    out = jnp.einsum("tk,tkh->th", weights.astype(jnp.float32), unsorted.astype(jnp.float32))
    return out.astype(x.dtype if out_dtype is None else out_dtype)


def experts_forward_reference(
    x: Float[Array, "T H"], weights: Float[Array, "T K"], experts: Int[Array, "T K"],
    up_w: Float[Array, "E H I2"], down_w: Float[Array, "E I H"], *, act: str,
) -> Float[Array, "T H"]:
    """Every expert on every token in float32, then each token's k picked: what `experts_forward`
    must equal (and the dense all-experts compute it exists to avoid)."""
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    gate, up = jnp.split(jnp.einsum("th,ehi->tei", f32(x), f32(up_w), precision="highest"), 2, axis=-1)
    y = jnp.einsum("tei,eih->teh", activation(act, gate) * up, f32(down_w), precision="highest")
    return jnp.einsum("tk,tkh->th", f32(weights), jnp.take_along_axis(y, experts[:, :, None], axis=1))


def moe_mlp(
    x: Float[Array, "T H"],
    p: MoEParams,
    layer: Int[Array, ""],
    *,
    top_k: int,
    renormalize: bool,
    weights_in_dtype: bool,
    act: str,
    skip_empty_tiles: bool = True,
    reduce: Reduce | None = None,
    expert_axis: str | None = None,
) -> Float[Array, "T H"]:
    """One MoE layer (`layer` indexes the stacked `p`): routed experts, plus Qwen2-MoE's shared
    expert scaled by sigmoid(x @ shared_gate) when the model has one. Under tensor parallelism
    every device routes alike (the router is replicated) and runs its slice of each expert's
    width (or, with `expert_axis`, its own whole experts); `reduce` sums the float32 partial outputs
    once, after the combine."""
    weights, experts = route(x, take_layer(p.router_w, layer), top_k, renormalize)
    if weights_in_dtype:  # Qwen rounds the weights to the model dtype; Mixtral keeps float32
        weights = weights.astype(x.dtype)
    first = 0 if expert_axis is None else jax.lax.axis_index(expert_axis) * p.experts_up_w.shape[-3]
    out = experts_forward(x, weights, experts, p.experts_up_w, p.experts_down_w, act=act, layer=layer,
                          skip_empty_tiles=skip_empty_tiles, out_dtype=None if reduce is None else jnp.float32,
                          first_expert=first)
    if p.shared_up_w is not None:
        up, down, gate = take_layer((p.shared_up_w, p.shared_down_w, p.shared_gate_w), layer)
        out = out + jax.nn.sigmoid(dense(x, gate)) * mlp(x, up, None, down, None, act=act, gated=True)
    return out if reduce is None else reduce(out).astype(x.dtype)
