"""Each layer's weights as arrays of their own, for the programs that serve.

The loader stacks every layer's weight on a leading axis (one array per field: what the param cache,
tensor parallelism and memory planning handle). A program that scans over such a stack slices one
layer's weights out on every pass, and XLA materializes each slice before the product reads it: on a
CPU, a batch-1 decode step of SmolLM2 spent more time copying its weights (about 19 of 33 ms) than
multiplying by them (benchmarks/RESULTS.md, issue 35). Split into one array per layer and field,
the decoder unrolls its layers in passes of at most UNROLL_MAX_TOKENS tokens and every product
reads its weight where it lies; the price is a longer compile (each layer is its own code), so
larger passes, bound by their products, still scan (models/decoder.py).

Only `DecoderParams.layers` is split. The MoE expert stacks already slice one expert matrix at a
time (models/moe.py), and the stacked KV cache is read by gathers that index it in place.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from paxserve.models.decoder import UNROLL_MAX_TOKENS, DecoderParams

logger = logging.getLogger(__name__)


def _one_layer_sharding(sharding: Any) -> Any:
    """A stacked leaf's placement without its layer axis (None when it has none to keep)."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, P(*tuple(sharding.spec)[1:]))
    return None


def _layer(leaf: Any, i: int) -> Any:
    sharding = _one_layer_sharding(getattr(leaf, "sharding", None))
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype, sharding=sharding)
    one = leaf[i]
    return one if sharding is None or one.sharding == sharding else jax.device_put(one, sharding)


def is_split(params: DecoderParams) -> bool:
    return isinstance(params.layers, tuple)


def split_layers(params: DecoderParams) -> DecoderParams:
    """`params` with `layers` as a tuple of per-layer `LayerParams` (arrays or abstract shapes);
    already split params are returned as they are. The stacked arrays stay alive as long as the
    caller holds `params`: `take_over_layers` frees them one field at a time."""
    if is_split(params):
        return params
    leaves, treedef = jax.tree.flatten(params.layers)
    return params.replace(layers=_split_leaves(leaves, treedef))


def _split_leaves(leaves: list[Any], treedef: Any) -> tuple[Any, ...]:
    num_layers = leaves[0].shape[0]
    per_layer: list[list[Any]] = [[] for _ in range(num_layers)]
    for j in range(len(leaves)):
        stacked, leaves[j] = leaves[j], None  # this list's reference goes before the next field is split
        for i in range(num_layers):
            per_layer[i].append(_layer(stacked, i))
        del stacked
    return tuple(jax.tree.unflatten(treedef, layer) for layer in per_layer)


def take_over_layers(model: Any) -> None:
    """Split `model.params` (a `LoadedModel`'s) in place. The model object is the params' only
    holder at this point of start-up, so each stacked field is freed once its layers are copied out:
    the device holds at most one field twice, never the whole model."""
    params = model.params
    if is_split(params):
        return
    leaves, treedef = jax.tree.flatten(params.layers)
    model.params = params = params.replace(layers=None)
    model.params = params.replace(layers=_split_leaves(leaves, treedef))
    logger.info("weights split into one array per layer: passes of at most %d tokens run the %d layers unrolled, "
                "copying no layer's weights out of a stack (those programs compile longer)", UNROLL_MAX_TOKENS,
                len(model.params.layers))
