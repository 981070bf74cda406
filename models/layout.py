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

from models.config import ModelConfig
from models.decoder import DecoderParams, LayerParams

LAYER_INDEX = "{i}"  # stands for the layer number in per-layer tensor names


@dataclass(frozen=True)
class Leaf:
    """One params field: HF tensors `(name, shape)` concatenated on axis 0, then `transform`
    (a shape-preserving re-ordering, e.g. Falcon's fused QKV rows), then transposed if `linear`
    (HF stores linear weights [out, in]; the decoder multiplies by [in, out])."""

    parts: tuple[tuple[str, tuple[int, ...]], ...]
    linear: bool = False
    transform: Callable[[np.ndarray], np.ndarray] | None = field(default=None, compare=False)

    def shape(self) -> tuple[int, ...]:
        rows = sum(shape[0] for _, shape in self.parts)
        shape = (rows, *self.parts[0][1][1:])
        return tuple(reversed(shape)) if self.linear else shape


def linear(*parts: tuple[str, tuple[int, ...]], transform: Callable[[np.ndarray], np.ndarray] | None = None) -> Leaf:
    return Leaf(tuple(parts), linear=True, transform=transform)


def vector(*parts: tuple[str, tuple[int, ...]], transform: Callable[[np.ndarray], np.ndarray] | None = None) -> Leaf:
    return Leaf(tuple(parts), transform=transform)


@dataclass(frozen=True)
class Layout:
    """`top`: DecoderParams fields other than `layers` (embed, final_norm, final_norm_b, lm_head);
    `layer`: LayerParams fields, their names containing `{i}`. Fields left out are None."""

    top: dict[str, Leaf]
    layer: dict[str, Leaf]


LayoutFn = Callable[[ModelConfig], Layout]


def tensor_shapes(layout: Layout, num_layers: int) -> dict[str, tuple[int, ...]]:
    shapes = {name: shape for leaf in layout.top.values() for name, shape in leaf.parts}
    for i in range(num_layers):
        for leaf in layout.layer.values():
            shapes |= {name.replace(LAYER_INDEX, str(i)): shape for name, shape in leaf.parts}
    return shapes


def _build(leaf: Leaf, read: Callable[[str], np.ndarray], i: int | None) -> np.ndarray:
    names = [n if i is None else n.replace(LAYER_INDEX, str(i)) for n, _ in leaf.parts]
    arrays = [read(n) for n in names]
    t = arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=0)
    if leaf.transform is not None:
        t = leaf.transform(t)
    return t.T if leaf.linear else t


def params_from_layout(
    layout: Layout, read: Callable[[str], np.ndarray], num_layers: int, dtype: np.dtype
) -> DecoderParams:
    """Read and convert every tensor; per-layer fields are stacked on a leading layer axis (filled
    in place, so peak host memory is one stacked copy)."""

    def stacked(leaf: Leaf) -> jax.Array:
        out = np.empty((num_layers, *leaf.shape()), dtype)
        for i in range(num_layers):
            out[i] = _build(leaf, read, i)
        return jnp.asarray(out)

    layers = LayerParams(**{name: stacked(leaf) for name, leaf in layout.layer.items()})
    top = {name: jnp.asarray(np.asarray(_build(leaf, read, None), dtype)) for name, leaf in layout.top.items()}
    return DecoderParams(layers=layers, **top)


def abstract_from_layout(layout: Layout, num_layers: int, dtype: np.dtype) -> DecoderParams:
    s = lambda shape: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
    layers = LayerParams(**{name: s((num_layers, *leaf.shape())) for name, leaf in layout.layer.items()})
    return DecoderParams(layers=layers, **{name: s(leaf.shape()) for name, leaf in layout.top.items()})
