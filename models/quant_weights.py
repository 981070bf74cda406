"""Weights kept quantized on the device, and the matmul that reads them.

A `QuantizedWeight` stands wherever the decoder has a linear weight `[..., in, out]`: `q` holds
the quantized values in the same layout (so layer stacking, `lax.scan`, expert slicing and the
tensor-parallel split treat it as they treat the full-width array) and `scale` one float32 per
output channel, `[..., 1, out]` (the size-1 axis stands where `in` is, so one sharding rule
covers both leaves). The matmul dequantizes inside the product: the per-channel scale commutes
with the contraction over `in`, so it is applied to the float32 result, never to a full-width
copy of the weight.

Methods (vLLM's names): "int8", weight-only on every backend; "fp8" (float8_e4m3fn), on GPUs with
fp8 tensor cores (compute capability 8.9+) an fp8 x fp8 product with a dynamic per-token scale of
the activations, elsewhere weight-only like int8.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import struct
from jaxtyping import Array, Float

from paxserve.kernels import cpu_matmul
from paxserve.kernels.matmul_dispatch import kernel_serves, run_kernel

QUANTIZATION_METHODS = ("fp8", "int8")
_STORAGE = {"int8": np.dtype(np.int8), "fp8": np.dtype(ml_dtypes.float8_e4m3fn)}
_QMAX = {"int8": 127.0, "fp8": float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)}  # 448
FP8_MAX = _QMAX["fp8"]
# The smallest compute capability with fp8 tensor cores (Ada, Hopper and later).
FP8_COMPUTE_CAPABILITY = 8.9


@struct.dataclass
class QuantizedWeight:
    """A linear weight as `q * scale` (per output channel); see the module docstring."""

    q: Any  # [..., in, out] int8 or float8_e4m3fn
    scale: Any  # [..., 1, out] float32
    fp8_activations: bool = struct.field(pytree_node=False, default=False)
    # The Pallas kernel the matmul runs (a `paxserve.kernels.MatmulKernel`), or None for XLA's.
    kernel: Any = struct.field(pytree_node=False, default=None)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    @property
    def ndim(self) -> int:
        return len(self.q.shape)

    def dequantize(self, dtype: Any = jnp.float32) -> Array:
        """The full-width weight (tests and references; the serving path never builds it)."""
        return (self.q.astype(jnp.float32) * self.scale).astype(dtype)


def quantized_matmul(x: Float[Array, "T I"], w: QuantizedWeight) -> Float[Array, "T O"]:
    """x @ (q * scale) accumulated in float32, returned in float32 (the caller rounds once)."""
    scale = w.scale.reshape(w.scale.shape[-1])
    if w.kernel is not None and not w.fp8_activations and kernel_serves(w.kernel, x, w.q, None, 8):
        return run_kernel(w.kernel, x, w.q, None, None, 8, 0) * scale
    if w.fp8_activations:
        # Dynamic per-token scale: each row of x is scaled so its largest magnitude is fp8's max.
        x32 = x.astype(jnp.float32)
        row_scale = jnp.maximum(jnp.max(jnp.abs(x32), axis=-1, keepdims=True), 1e-12) / FP8_MAX
        xq = (x32 / row_scale).astype(jnp.float8_e4m3fn)
        y = jnp.dot(xq, w.q, preferred_element_type=jnp.float32)
        return y * row_scale * scale
    y = jnp.dot(x, w.q.astype(x.dtype), precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return y * scale


@dataclass(frozen=True)
class WeightQuantization:
    """How linear weights are quantized at load: `method` and whether the matmul quantizes the
    activations too (fp8 on a GPU that has fp8 tensor cores)."""

    method: str
    fp8_activations: bool = False

    def __post_init__(self) -> None:
        if self.method not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization {self.method!r} is not supported; supported: "
                             f"{', '.join(QUANTIZATION_METHODS)}")
        if self.fp8_activations and self.method != "fp8":
            raise ValueError("fp8 activations go with fp8 weights only")

    @classmethod
    def for_device(cls, method: str, platform: str, compute_capability: str | float | None) -> "WeightQuantization":
        """fp8 x fp8 products where the device has fp8 tensor cores, weight-only elsewhere."""
        fp8_cores = platform == "gpu" and compute_capability is not None and \
            float(compute_capability) >= FP8_COMPUTE_CAPABILITY
        return cls(method, fp8_activations=method == "fp8" and fp8_cores)

    @property
    def storage(self) -> np.dtype:
        return _STORAGE[self.method]

    def describe(self) -> str:
        how = "fp8 x fp8 matmuls with per-token activation scales" if self.fp8_activations else \
            "weight-only (dequantized inside each matmul)"
        return f"{self.method} weights, one float32 scale per output channel, {how}"

    def quantize(self, w: Any, xp: Any = np) -> QuantizedWeight:
        """Quantization of `[..., in, out]`: scale = max |w| over `in` / the format's max, so every
        channel uses the whole range; an all-zero channel gets scale 1. `xp` is numpy (the loader,
        on the host) or jax.numpy (on a device, e.g. gpu_check's random weights)."""
        w32 = xp.asarray(w, np.float32)
        amax = xp.max(xp.abs(w32), axis=-2, keepdims=True)
        scale = xp.where(amax > 0, amax / _QMAX[self.method], 1.0).astype(np.float32)
        scaled = w32 / scale
        if self.method == "int8":
            q = xp.clip(xp.rint(scaled), -127, 127).astype(np.int8)
        else:
            q = xp.clip(scaled, -FP8_MAX, FP8_MAX).astype(self.storage)
        return QuantizedWeight(q=q, scale=scale, fp8_activations=self.fp8_activations)

    def abstract(self, shape: tuple[int, ...]) -> QuantizedWeight:
        """ShapeDtypeStructs of a quantized `[..., in, out]` weight."""
        return QuantizedWeight(q=jax.ShapeDtypeStruct(shape, self.storage),
                               scale=jax.ShapeDtypeStruct((*shape[:-2], 1, shape[-1]), np.float32),
                               fp8_activations=self.fp8_activations)


@struct.dataclass
class GroupQuantizedWeight:
    """A linear weight `[..., in, out]` as integer codes with a scale (and an offset) per group of
    `in // scale.shape[-2]` consecutive inputs: w = scale_g * c + offset_g, computed in float32 (a
    GGUF file kept as it is; models/gguf_weights.py). `codes` is int8 [..., in, out], or with
    `bits` 4, unsigned nibbles two to a byte along `in` ([..., in // 2, out]; byte i holds inputs
    2i, low nibble, and 2i + 1). Every leaf keeps `out` last and a multiple of `in` second to last,
    so stacking, the layer scan, expert slicing and the tensor-parallel split treat it as they
    treat the full-width array.

    `table`: an embedding, [vocab, hidden] like the float table, every leaf transposed (groups and
    nibble pairs along the last axis), so a lookup reads whole rows and the tied head multiplies
    by the table's transpose exactly as it does the float table's."""

    codes: Any
    scale: Any  # [..., in // group, out] float16 or float32 ([vocab, hidden // group] for a table)
    offset: Any = None  # like scale, or None
    bits: int = struct.field(pytree_node=False, default=8)
    table: bool = struct.field(pytree_node=False, default=False)
    # Subtracted from every 4-bit code before the scale: signed codes stored as unsigned nibbles
    # (compressed-tensors' q + 8), so w = scale * (nibble - bias) rounds once, as its dequantization does.
    bias: int = struct.field(pytree_node=False, default=0)
    kernel: Any = struct.field(pytree_node=False, default=None)  # as QuantizedWeight's
    # codes, scale and offset in the CPU kernel's tile order (cpu_matmul.tile_columns; same shapes):
    # set with the kernel by `with_matmul_kernel`, undone by `untiled` and by `dequantize`.
    tiled: bool = struct.field(pytree_node=False, default=False)

    @property
    def shape(self) -> tuple[int, ...]:
        if self.table:
            rows, cols = self.codes.shape
            return (rows, cols * (8 // self.bits))
        *lead, rows, out = self.codes.shape
        return (*lead, rows * (8 // self.bits), out)

    @property
    def ndim(self) -> int:
        return len(self.codes.shape)

    @property
    def group(self) -> int:
        """Inputs per scale."""
        return self.shape[-1 if self.table else -2] // self.scale.shape[-1 if self.table else -2]

    def rows(self, index: Array) -> "GroupQuantizedWeight":
        """A table's rows `index` (an embedding lookup, before dequantizing only those rows)."""
        return jax.tree.map(lambda a: jnp.take(a, index, axis=0), self)

    def dequantize(self, dtype: Any = jnp.float32) -> Array:
        """The weight at `dtype`, rounded once from the float32 value: what a dequantizing loader
        would have stored, bit for bit. The decoder calls it inside each product, so the full-width
        weight exists only for the layer being computed."""
        if self.tiled:
            return self.untiled().dequantize(dtype)
        # Groups (and nibble pairs) run along `in`: the second-to-last axis, or a table's last.
        axis = -1 if self.table else -2
        codes = self.codes
        if self.bits == 4:
            pairs = jnp.stack([codes & 0xF, codes >> 4], axis=axis)  # byte i -> inputs 2i, 2i + 1
            codes = pairs.reshape(self.shape)
        i = codes.ndim + axis
        groups = self.scale.shape[axis]
        c = codes.reshape(*codes.shape[:i], groups, codes.shape[i] // groups, *codes.shape[i + 1:])
        c = c.astype(jnp.float32) - self.bias
        w = jnp.expand_dims(self.scale.astype(jnp.float32), axis) * c
        if self.offset is not None:
            w = w + jnp.expand_dims(self.offset.astype(jnp.float32), axis)
        return w.reshape(codes.shape).astype(dtype)

    def can_tile(self) -> bool:
        """Whether the CPU kernel's tile order applies: a linear weight of whole tiles of outputs."""
        return not self.table and self.codes.shape[-1] % cpu_matmul.TILE == 0

    def retiled(self, tiled: bool) -> "GroupQuantizedWeight":
        """This weight with codes, scale and offset in the CPU kernel's tile order (`tiled`) or in the
        plain one; ShapeDtypeStructs (abstract params) keep their shapes and change only the flag."""
        if tiled == self.tiled:
            return self
        if tiled and not self.can_tile():
            raise ValueError(f"a weight of {self.codes.shape[-1]} outputs cannot be tiled by {cpu_matmul.TILE}")
        order = cpu_matmul.tile_columns if tiled else cpu_matmul.untile_columns

        def reorder(a: Any) -> Any:
            return a if a is None or isinstance(a, jax.ShapeDtypeStruct) else order(a)

        return self.replace(codes=reorder(self.codes), scale=reorder(self.scale), offset=reorder(self.offset),
                            tiled=tiled)

    def untiled(self) -> "GroupQuantizedWeight":
        return self.retiled(False)

    def as_table(self) -> "GroupQuantizedWeight":
        """An `[hidden, vocab]` weight (numpy leaves or ShapeDtypeStructs) stored as an embedding table."""
        def flip(a: Any) -> Any:
            return jax.ShapeDtypeStruct(a.shape[::-1], a.dtype) if isinstance(a, jax.ShapeDtypeStruct) else a.T

        return jax.tree.map(flip, self).replace(table=True)


def group_matmul(x: Float[Array, "T I"], w: GroupQuantizedWeight) -> Float[Array, "T O"]:
    """x @ w.dequantize(x.dtype) accumulated in float32: on the weight's kernel when it serves the
    shapes (the codes widened tile by tile in registers), else dequantized whole by XLA first."""
    if w.kernel is not None and not w.table and kernel_serves(w.kernel, x, w.codes, w.scale.shape[-2], w.bits,
                                                              tiled=w.tiled):
        return run_kernel(w.kernel, x, w.codes, w.scale, w.offset, w.bits, w.bias, tiled=w.tiled)
    return jnp.dot(x, w.dequantize(x.dtype), precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def table_matmul(x: Float[Array, "T H"], table: GroupQuantizedWeight) -> Float[Array, "T V"]:
    """x @ table.dequantize(x.dtype).T accumulated in float32: an embedding kept quantized used as
    the output head (tied weights), on the weight's kernel when it takes tables (the CPU kernel
    reads the rows where they lie), else dequantized whole by XLA first."""
    if table.kernel is not None and kernel_serves(table.kernel, x, table.codes, table.scale.shape[-1], table.bits,
                                                  table=True):
        return run_kernel(table.kernel, x, table.codes, table.scale, table.offset, table.bits, table.bias, table=True)
    return jnp.dot(x, table.dequantize(x.dtype).T, precision=jax.lax.Precision.HIGHEST,
                   preferred_element_type=jnp.float32)


def with_matmul_kernel(params: Any, kernel: Any) -> Any:
    """`params` with every quantized linear weight set to run on `kernel` (a `MatmulKernel`, or None
    for XLA's path). The arrays are the same ones, except where the kernel reads its weights in its
    own order (`MatmulKernel.tiles`: group-quantized weights of whole tiles are reordered, and put
    back in the plain order for any other kernel)."""
    tiles = kernel is not None and kernel.tiles

    def set_kernel(w: Any) -> Any:
        if isinstance(w, GroupQuantizedWeight) and not w.table:
            w = w.retiled(tiles and w.can_tile())
        return w.replace(kernel=kernel)

    return jax.tree.map(lambda w: set_kernel(w) if _is_quantized(w) else w, params, is_leaf=_is_quantized)


def matmul_kernel(params: Any) -> Any:
    """The kernel `params`' quantized weights run on (set by `with_matmul_kernel`), or None."""
    kernels = {w.kernel for w in jax.tree.leaves(params, is_leaf=_is_quantized) if _is_quantized(w)}
    return next(iter(kernels)) if len(kernels) == 1 else None


def _is_quantized(w: Any) -> bool:
    return isinstance(w, (QuantizedWeight, GroupQuantizedWeight))


def dequantize_kept(params: Any, dtype: Any) -> Any:
    """`params` with every GroupQuantizedWeight replaced by its full-width weight at `dtype`: the
    same model as a loader that dequantizes the GGUF file would give (references, tests)."""
    return jax.tree.map(lambda w: w.dequantize(dtype) if isinstance(w, GroupQuantizedWeight) else w, params,
                        is_leaf=lambda w: isinstance(w, GroupQuantizedWeight))

