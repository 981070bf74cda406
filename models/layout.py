"""How a family's Hugging Face tensors become the decoder's params pytree.

A family module describes, per params field, which HF tensors make it (concatenated along their
first axis, optionally re-ordered, then transposed for linear layers). From that one description
come the three things the loader needs: the exact tensor names and shapes a checkpoint must hold,
the conversion, and the abstract params (shapes only) that memory planning and the param cache use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from paxserve.models.config import ModelConfig
from paxserve.models.decoder import DecoderParams, LayerParams

LAYER_INDEX = "{i}"  # stands for the layer number in per-layer tensor names


@dataclass(frozen=True)
class Leaf:
    """One params field: HF tensors `(name, shape)` concatenated on axis 0, then `transform`
    (a shape-preserving re-ordering, e.g. Falcon's fused QKV rows), then the last two axes swapped
    if `linear` (HF stores linear weights [out, in], experts [experts, out, in]; the decoder
    multiplies by [in, out])."""

    parts: tuple[tuple[str, tuple[int, ...]], ...]
    linear: bool = False
    transform: Callable[[np.ndarray], np.ndarray] | None = field(default=None, compare=False)

    def shape(self) -> tuple[int, ...]:
        rows = sum(shape[0] for _, shape in self.parts)
        shape = (rows, *self.parts[0][1][1:])
        return (*shape[:-2], shape[-1], shape[-2]) if self.linear else shape


def linear(*parts: tuple[str, tuple[int, ...]], transform: Callable[[np.ndarray], np.ndarray] | None = None) -> Leaf:
    return Leaf(tuple(parts), linear=True, transform=transform)


def vector(*parts: tuple[str, tuple[int, ...]], transform: Callable[[np.ndarray], np.ndarray] | None = None) -> Leaf:
    return Leaf(tuple(parts), transform=transform)


@dataclass(frozen=True)
class Stack:
    """Per-layer fields that only some layers have (an MoE model's expert and dense-MLP layers):
    `params_cls(**leaves)` stacked over `layers`, `{i}` in the names being the model's layer index."""

    params_cls: type
    layers: tuple[int, ...]
    leaves: dict[str, Leaf]


@dataclass(frozen=True)
class Layout:
    """`top`: DecoderParams array fields (embed, final_norm, final_norm_b, lm_head); `layer`:
    LayerParams fields, their names containing `{i}`; `stacks`: DecoderParams fields holding a
    `Stack`. Fields left out are None."""

    top: dict[str, Leaf]
    layer: dict[str, Leaf]
    stacks: dict[str, Stack] = field(default_factory=dict)


LayoutFn = Callable[[ModelConfig], Layout]


def _per_layer(layout: Layout, num_layers: int) -> list[tuple[tuple[int, ...], dict[str, Leaf]]]:
    return [(tuple(range(num_layers)), layout.layer)] + [(s.layers, s.leaves) for s in layout.stacks.values()]


def tensor_shapes(layout: Layout, num_layers: int) -> dict[str, tuple[int, ...]]:
    shapes = {name: shape for leaf in layout.top.values() for name, shape in leaf.parts}
    for layers, leaves in _per_layer(layout, num_layers):
        for i in layers:
            for leaf in leaves.values():
                shapes |= {name.replace(LAYER_INDEX, str(i)): shape for name, shape in leaf.parts}
    return shapes


def _build(leaf: Leaf, read: Callable[[str], np.ndarray], i: int | None) -> np.ndarray:
    names = [n if i is None else n.replace(LAYER_INDEX, str(i)) for n, _ in leaf.parts]
    arrays = [read(n) for n in names]
    t = arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=0)
    if leaf.transform is not None:
        t = leaf.transform(t)
    return np.swapaxes(t, -1, -2) if leaf.linear else t


def _assemble(layout: Layout, num_layers: int, per_layer: Callable[[str, Leaf, tuple[int, ...]], object],
              top: Callable[[str, Leaf], object]) -> DecoderParams:
    """DecoderParams with each per-layer field made by `per_layer(path, leaf, the layers it covers)`
    and each top field by `top(path, leaf)` (path: "layers.qkv_w", "moe.experts_up_w", "embed"): the
    one shape of the pytree, for real and for abstract params."""
    layers = LayerParams(**{name: per_layer(f"layers.{name}", leaf, tuple(range(num_layers)))
                            for name, leaf in layout.layer.items()})
    stacks = {field_name: s.params_cls(**{name: per_layer(f"{field_name}.{name}", leaf, s.layers)
                                          for name, leaf in s.leaves.items()})
              for field_name, s in layout.stacks.items()}
    return DecoderParams(layers=layers, **{name: top(name, leaf) for name, leaf in layout.top.items()}, **stacks)


Place = Callable[[str, np.ndarray], jax.Array]  # a host field (by its path) onto the device(s)


def _to_default_device(path: str, array: np.ndarray) -> jax.Array:
    return jnp.asarray(array)


def params_from_layout(
    layout: Layout, read: Callable[[str], np.ndarray], num_layers: int, dtype: np.dtype,
    place: Place = _to_default_device,
) -> DecoderParams:
    """Read and convert every tensor; per-layer fields are stacked on a leading layer axis (filled
    in place, so peak host memory is one stacked copy) and handed to `place` one field at a time
    (tensor parallelism sends each device only its slice)."""

    def stacked(path: str, leaf: Leaf, layers: tuple[int, ...]) -> jax.Array:
        out = np.empty((len(layers), *leaf.shape()), dtype)
        for row, i in enumerate(layers):
            out[row] = _build(leaf, read, i)
        return place(path, out)

    return _assemble(layout, num_layers, stacked,
                     lambda path, leaf: place(path, np.asarray(_build(leaf, read, None), dtype)))


def abstract_from_layout(layout: Layout, num_layers: int, dtype: np.dtype) -> DecoderParams:
    s = lambda shape: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
    return _assemble(layout, num_layers, lambda path, leaf, layers: s((len(layers), *leaf.shape())),
                     lambda path, leaf: s(leaf.shape()))
