"""How a family's Hugging Face tensors become the decoder's params pytree.

A family module describes, per params field, which HF tensors make it (concatenated along their
first axis, optionally re-ordered, then transposed for linear layers). From that one description
come the three things the loader needs: the exact tensor names and shapes a checkpoint must hold,
the conversion, and the abstract params (shapes only) that memory planning and the param cache use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from paxserve.models.config import ModelConfig
from paxserve.models.decoder import DecoderParams, LayerParams
from paxserve.models.gguf_weights import GroupFormat, HostCodes
from paxserve.models.stored_quantization import StoredQuantization
from paxserve.models.quant_weights import GroupQuantizedWeight, QuantizedWeight, WeightQuantization

LAYER_INDEX = "{i}"  # stands for the layer number in per-layer tensor names
# The linear weights `--quantization` quantizes: attention and MLP (experts included). The
# embedding, the LM head, norms, biases, the MoE router and the shared-expert gate keep their width
# (vLLM's choice: they are small, and the head and router decide tokens directly).
# A GGUF file's quantized embedding and LM head stay quantized too (models/gguf_weights.py).
KEPT_TOP = frozenset({"embed", "lm_head"})
QUANTIZABLE = frozenset({
    "layers.qkv_w", "layers.o_w", "layers.up_w", "layers.down_w", "dense_mlp.up_w", "dense_mlp.down_w",
    "moe.experts_up_w", "moe.experts_down_w", "moe.shared_up_w", "moe.shared_down_w",
})


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


def _fields(layout: Layout, num_layers: int) -> list[tuple[str, Leaf, tuple[int, ...]]]:
    """(field path, leaf, the layers it covers) of every per-layer field."""
    out = [(f"layers.{name}", leaf, tuple(range(num_layers))) for name, leaf in layout.layer.items()]
    return out + [(f"{field_name}.{name}", leaf, s.layers) for field_name, s in layout.stacks.items()
                  for name, leaf in s.leaves.items()]


def _names(leaf: Leaf, i: int | None) -> list[str]:
    return [n if i is None else n.replace(LAYER_INDEX, str(i)) for n, _ in leaf.parts]


FormatFor = Callable[[list[str], int], "GroupFormat | WeightQuantization | None"]


class StoredReader(Protocol):
    """A quantized checkpoint's tensors as stored (models/gguf_io.py, compressed_tensors.py, awq_gptq.py)."""

    def read_codes(self, name: str) -> HostCodes: ...

    def read_channel(self, name: str) -> tuple[np.ndarray, np.ndarray]: ...


def stored_formats(layout: Layout, num_layers: int, method: str, types_of: Callable[[str], list[str]],
                   format_for: FormatFor, top: frozenset[str] = frozenset()
                   ) -> tuple[StoredQuantization, dict[str, list[str]]]:
    """How a quantized checkpoint's QUANTIZABLE fields (and the `top` ones) are kept, from how its
    tensors are stored alone (no data read): `format_for(the field's stored types, its input
    width)` decides. Returns (the kept fields' formats, the fields loaded at full width -> their
    stored types)."""
    kept, full = [], {}
    tops = [(path, leaf, (None,)) for path, leaf in layout.top.items() if path in top]
    for path, leaf, layers in tops + _fields(layout, num_layers):
        if path not in QUANTIZABLE and path not in top:
            continue
        types = sorted({t for i in layers for name in _names(leaf, i) for t in types_of(name)})
        width = leaf.shape()[-1 if path == "embed" else -2]  # the embedding's groups run along hidden
        fmt = format_for(types, width) if leaf.transform is None else None
        if fmt is not None and width % getattr(fmt, "group", 1) == 0:
            kept.append((path, fmt))
        else:
            full[path] = types
    return StoredQuantization(method, tuple(kept)), full


def _build_codes(leaf: Leaf, read_codes: Callable[[str], HostCodes], i: int | None, group: int) -> HostCodes:
    """`_build` for a field kept quantized: its parts' codes in `group`s, as [..., in, out]."""
    parts = [read_codes(n).regrouped(group) for n in _names(leaf, i)]
    host = parts[0] if len(parts) == 1 else HostCodes.concatenate(parts, axis=0)
    return host.map(lambda a: np.swapaxes(a, -1, -2))


def _build(leaf: Leaf, read: Callable[[str], np.ndarray], i: int | None) -> np.ndarray:
    arrays = [read(n) for n in _names(leaf, i)]
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
    place: Place = _to_default_device, quantization: WeightQuantization | StoredQuantization | None = None,
    keep_unquantized: bool = False, stored: StoredReader | None = None,
) -> tuple[DecoderParams, DecoderParams | None]:
    """Read and convert every tensor; per-layer fields are stacked on a leading layer axis (filled
    in place, so peak host memory is one stacked copy) and handed to `place` one field at a time
    (tensor parallelism sends each device only its slice). With `quantization`, the QUANTIZABLE
    fields are quantized layer by layer as they are read (from the weights rounded to `dtype`, as
    vLLM quantizes the loaded checkpoint), their values and scales placed as "path.q", "path.scale".

    Returns (params, the same model unquantized or None): with `keep_unquantized`, the quantized
    fields are also placed at full width (the other fields are shared), from the same one read of
    the checkpoint, for the start-up numerics check to compare against and then drop.

    With a `StoredQuantization` (a checkpoint quantized already), its fields are read as stored
    through `stored` and kept so: group formats as "path.codes", "path.scale", "path.offset",
    per-channel values as `--quantization` places them."""
    read_codes = None if stored is None else stored.read_codes
    placed: dict[str, object] = {}
    full: dict[str, jax.Array] = {}

    def kept(path: str, leaf: Leaf, layers: tuple[int, ...] | None, fmt: GroupFormat) -> GroupQuantizedWeight:
        if layers is None:  # the embedding (encoded as the tied head's [H, V], stored as a table) or the LM head
            host = fmt.encode(_build_codes(leaf, read_codes, None, fmt.group))
            host = host.as_table() if path == "embed" else host
        else:  # stacked over the layers, filled in place
            host = jax.tree.map(lambda a: np.empty(a.shape, a.dtype), fmt.abstract((len(layers), *leaf.shape())))
            for row, i in enumerate(layers):
                one = fmt.encode(_build_codes(leaf, read_codes, i, fmt.group))
                for buf, value in zip(jax.tree.leaves(host), jax.tree.leaves(one)):
                    buf[row] = value
        return host.replace(**{name: place(f"{path}.{name}", getattr(host, name))
                               for name in ("codes", "scale", "offset") if getattr(host, name) is not None})

    def channel(path: str, leaf: Leaf, layers: tuple[int, ...], fmt: WeightQuantization) -> QuantizedWeight:
        """Values stored per channel (an fp8 or int8 checkpoint): its parts' rows and scales side by side."""
        spec = fmt.abstract((len(layers), *leaf.shape()))
        q, scale = np.empty(spec.q.shape, spec.q.dtype), np.empty(spec.scale.shape, spec.scale.dtype)
        for row, i in enumerate(layers):
            parts = [stored.read_channel(n) for n in _names(leaf, i)]
            q[row] = np.swapaxes(np.concatenate([p[0] for p in parts], axis=0), -1, -2)
            scale[row] = np.concatenate([p[1] for p in parts])[None, :]
        return QuantizedWeight(q=place(f"{path}.q", q), scale=place(f"{path}.scale", scale),
                               fp8_activations=fmt.fp8_activations)

    def stacked(path: str, leaf: Leaf, layers: tuple[int, ...]) -> jax.Array | QuantizedWeight | GroupQuantizedWeight:
        shape = (len(layers), *leaf.shape())
        if isinstance(quantization, StoredQuantization):
            fmt = quantization.format_of(path)
            if fmt is not None:
                placed[path] = kept(path, leaf, layers, fmt) if isinstance(fmt, GroupFormat) else \
                    channel(path, leaf, layers, fmt)
                return placed[path]
            quantize = False
        else:
            quantize = quantization is not None and path in QUANTIZABLE
        out = np.empty(shape, dtype) if not quantize or keep_unquantized else None
        if quantize:
            spec = quantization.abstract(shape)
            q, scale = np.empty(spec.q.shape, spec.q.dtype), np.empty(spec.scale.shape, spec.scale.dtype)
        for row, i in enumerate(layers):
            w = np.asarray(_build(leaf, read, i), dtype)
            if out is not None:
                out[row] = w
            if quantize:
                one = quantization.quantize(w)
                q[row], scale[row] = one.q, one.scale
        if not quantize:
            placed[path] = place(path, out)
            return placed[path]
        if out is not None:
            full[path] = place(path, out)
        placed[path] = QuantizedWeight(q=place(f"{path}.q", q), scale=place(f"{path}.scale", scale),
                                       fp8_activations=quantization.fp8_activations)
        return placed[path]

    def top(path: str, leaf: Leaf) -> jax.Array | GroupQuantizedWeight:
        fmt = quantization.format_of(path) if isinstance(quantization, StoredQuantization) else None
        placed[path] = place(path, np.asarray(_build(leaf, read, None), dtype)) if fmt is None else \
            kept(path, leaf, None, fmt)
        return placed[path]

    params = _assemble(layout, num_layers, stacked, top)
    if not keep_unquantized or not isinstance(quantization, WeightQuantization):
        return params, None
    reference = _assemble(layout, num_layers, lambda path, leaf, layers: full.get(path, placed[path]),
                          lambda path, leaf: placed[path])
    return params, reference


def abstract_from_layout(layout: Layout, num_layers: int, dtype: np.dtype,
                         quantization: WeightQuantization | StoredQuantization | None = None) -> DecoderParams:
    s = lambda shape: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731

    def per_layer(path: str, leaf: Leaf, layers: tuple[int, ...]) -> Any:
        shape = (len(layers), *leaf.shape())
        if isinstance(quantization, StoredQuantization):
            fmt = quantization.format_of(path)
            return s(shape) if fmt is None else fmt.abstract(shape)
        return quantization.abstract(shape) if quantization is not None and path in QUANTIZABLE else s(shape)

    def top(path: str, leaf: Leaf) -> Any:
        fmt = quantization.format_of(path) if isinstance(quantization, StoredQuantization) else None
        if fmt is None:
            return s(leaf.shape())
        return fmt.abstract(leaf.shape()[::-1]).as_table() if path == "embed" else fmt.abstract(leaf.shape())

    return _assemble(layout, num_layers, per_layer, top)
