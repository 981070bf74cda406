"""GGUF tensors kept quantized: llama.cpp's block formats read as integer codes with group scales.

Every format paxserve keeps dequantizes, per group of consecutive input features, as
`w = scale_g * c + offset_g` in float32, where `c` is a small integer:

    Q8_0  c in [-128, 127], scale d                   (groups of 32)
    Q4_0  c in [-8, 7],     scale d                   Q4_1  c in [0, 15], scale d, offset m
    Q5_0  c in [-16, 15],   scale d                   Q5_1  c in [0, 31], scale d, offset m
    Q4_K  c in [0, 15],     scale d*sc_j, offset -dmin*m_j     (super-blocks of 256, groups of 32)
    Q5_K  c in [0, 31],     the same
    Q6_K  c in [-32, 31],   scale d*sc_j              (groups of 16)

Each product `scale_g * c` is exact in float32 (an f16 times a 6-bit scale times a small integer
needs at most 23 bits), so the one rounding is the offset's addition, the same one `gguf`'s numpy
dequantization makes: the weights come out bit for bit as `gguf.quants.dequantize` gives them.

The codes are not unpacked by hand. `gguf` itself decodes them: a copy of each block with its
scales set to 1 and its offsets to 0 dequantizes to exactly its integer codes, and the scales come
from the block headers (`Q4_K.get_scale_min` for the packed 6-bit sub-block scales).

A params field (one linear weight stacked over layers; a fused QKV of several tensors) gets one
storage `GroupFormat` for all its parts, whose formats may differ by layer (Q4_K_M files mix Q4_K
and Q6_K in `ffn_down`, Q5_0 and Q8_0 in `attn_v`): the smallest group of its parts (a part with
larger groups repeats its scales), 4-bit codes two to a byte when every part's codes fit in 4 bits
(then as unsigned nibbles: a signed Q4_0 code c is stored as c + 8 with offset -8d, exactly the
same weight), else int8; float16 scales and offsets when every part's are float16 values (the
legacy formats' d and m are), else float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import jax
import numpy as np

from paxserve.models.quant_weights import GroupQuantizedWeight

_F16_ONE = np.array([1.0], np.float16).view(np.uint8)


@dataclass(frozen=True)
class _Kind:
    """How one GGUF format is read as codes: `group` inputs per scale, the codes' range, whether
    there is an offset, and whether its scales and offsets are float16 values."""

    group: int
    low: int
    high: int
    offset: bool
    f16_scales: bool


KINDS: dict[str, _Kind] = {
    "Q8_0": _Kind(32, -128, 127, False, True),
    "Q4_0": _Kind(32, -8, 7, False, True),
    "Q4_1": _Kind(32, 0, 15, True, True),
    "Q5_0": _Kind(32, -16, 15, False, True),
    "Q5_1": _Kind(32, 0, 31, True, True),
    "Q4_K": _Kind(32, 0, 15, True, False),
    "Q5_K": _Kind(32, 0, 31, True, False),
    "Q6_K": _Kind(16, -32, 31, False, False),
}
KEPT_TYPES = tuple(KINDS)


@dataclass
class HostCodes:
    """One tensor (or a stack of them) as codes with group scales, on the host, in the checkpoint's
    orientation: `codes` [..., rows, in] int16 (int8 for Q8_0), `scale` and `offset` [..., rows,
    in // group] float32."""

    codes: np.ndarray
    scale: np.ndarray
    offset: np.ndarray | None
    group: int

    def regrouped(self, group: int) -> "HostCodes":
        """The same weights with scales per `group` inputs (a divisor of this group)."""
        if group == self.group:
            return self
        k = self.group // group
        rep = lambda a: None if a is None else np.repeat(a, k, axis=-1)  # noqa: E731
        return HostCodes(self.codes, rep(self.scale), rep(self.offset), group)

    def with_offset(self) -> "HostCodes":
        if self.offset is not None:
            return self
        return HostCodes(self.codes, self.scale, np.zeros_like(self.scale), self.group)

    def map(self, fn: Any) -> "HostCodes":
        """`fn` applied to every array along the leading (row) axes, e.g. a row permutation."""
        return HostCodes(fn(self.codes), fn(self.scale), None if self.offset is None else fn(self.offset), self.group)

    def dequantize(self) -> np.ndarray:
        g = self.codes.reshape(*self.codes.shape[:-1], -1, self.group).astype(np.float32)
        w = self.scale[..., None] * g
        if self.offset is not None:
            w = w + self.offset[..., None]
        return w.reshape(self.codes.shape)

    @staticmethod
    def concatenate(parts: list["HostCodes"], axis: int) -> "HostCodes":
        group = min(p.group for p in parts)
        parts = [p.regrouped(group) for p in parts]
        if any(p.offset is not None for p in parts):
            parts = [p.with_offset() for p in parts]
        cat = lambda arrays: np.concatenate(arrays, axis=axis)  # noqa: E731
        offset = None if parts[0].offset is None else cat([p.offset for p in parts])
        return HostCodes(cat([p.codes for p in parts]), cat([p.scale for p in parts]), offset, group)


def decode(data: np.ndarray, type_name: str, shape: tuple[int, ...]) -> HostCodes:
    """A GGUF tensor's raw blocks (`data`, uint8 [..., bytes per row]) as codes and group scales,
    `shape` being its logical shape ([..., rows, in])."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import Q4_K, dequantize

    kind = KINDS[type_name]
    qtype = GGMLQuantizationType[type_name]
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(-1, GGML_QUANT_SIZES[qtype][1])
    if type_name == "Q8_0":  # the codes are the block's int8 bytes: no need for gguf's float pass
        scale = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        return HostCodes(blocks[:, 2:].view(np.int8).reshape(shape), scale.reshape(*shape[:-1], -1), None, kind.group)
    unit = blocks.copy()
    f16 = lambda b: b.view(np.float16).astype(np.float32)  # noqa: E731 - [n, 2] bytes -> [n, 1] float32
    if type_name in ("Q4_K", "Q5_K"):
        d, dmin = f16(blocks[:, 0:2]), f16(blocks[:, 2:4])
        sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
        scale = d * sc.astype(np.float32)  # gguf's own order: d * sc, then dmin * m
        offset = -(dmin * m.astype(np.float32))
        unit[:, 0:2], unit[:, 2:4] = _F16_ONE, 0
        # Every sub-block scale 1 and min 0 in the 6-bit packing `get_scale_min` reads.
        unit[:, 4:16] = np.array([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1], np.uint8)
    elif type_name == "Q6_K":
        d = f16(blocks[:, 208:210])
        scale, offset = d * blocks[:, 192:208].view(np.int8).astype(np.float32), None
        unit[:, 192:208], unit[:, 208:210] = 1, _F16_ONE
    else:
        scale = f16(blocks[:, 0:2])
        offset = f16(blocks[:, 2:4]) if kind.offset else None
        unit[:, 0:2] = _F16_ONE
        if kind.offset:
            unit[:, 2:4] = 0
    codes = dequantize(unit.reshape(-1), qtype).reshape(shape)
    per_row = lambda a: a.reshape(*shape[:-1], shape[-1] // kind.group)  # noqa: E731 - blocks run along rows
    return HostCodes(codes.astype(np.int16), per_row(scale).astype(np.float32),
                     None if offset is None else per_row(offset).astype(np.float32), kind.group)


@dataclass(frozen=True)
class GroupFormat:
    """How one params field stores its GGUF weights on the device (see the module docstring)."""

    bits: int  # 4: unsigned nibbles, two per byte along the input axis; 8: int8
    group: int
    scale_dtype: str  # "float16" or "float32"
    offset: bool
    types: tuple[str, ...]  # the GGUF formats it holds, for the log
    bias: int = 0  # 4-bit codes stored as code + bias (signed codes of one scheme, no offset needed)

    @classmethod
    def for_types(cls, types: Iterable[str]) -> "GroupFormat | None":
        """The storage of a field whose parts have these GGUF formats; None when one of them is
        not kept quantized (a float tensor, or a format this module does not read), in which
        case the field is dequantized at load."""
        types = tuple(sorted(set(types)))
        if not types or any(t not in KINDS for t in types):
            return None
        kinds = [KINDS[t] for t in types]
        unsigned4 = all(k.high - min(k.low, 0) <= 15 for k in kinds)  # every code fits a nibble once shifted
        return cls(bits=4 if unsigned4 else 8, group=min(k.group for k in kinds),
                   scale_dtype="float16" if all(k.f16_scales for k in kinds) else "float32",
                   offset=unsigned4 or any(k.offset for k in kinds), types=types)

    def to_json(self) -> dict[str, Any]:
        return {"bits": self.bits, "group": self.group, "scale_dtype": self.scale_dtype, "offset": self.offset,
                "types": list(self.types), "bias": self.bias}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "GroupFormat":
        return cls(int(d["bits"]), int(d["group"]), str(d["scale_dtype"]), bool(d["offset"]), tuple(d["types"]),
                   int(d.get("bias", 0)))

    def describe(self) -> str:
        return (f"{'/'.join(self.types)} as {self.bits}-bit codes, groups of {self.group}, "
                f"{self.scale_dtype} scales{' and offsets' if self.offset else ''}")

    def bits_per_weight(self) -> float:
        return self.bits + (2 if self.offset else 1) * np.dtype(self.scale_dtype).itemsize * 8 / self.group

    def abstract(self, shape: tuple[int, ...]) -> GroupQuantizedWeight:
        """ShapeDtypeStructs of a `[..., in, out]` weight in this format."""
        *lead, n_in, n_out = shape
        if n_in % self.group:
            raise ValueError(f"an input width of {n_in} is not a whole number of {self.group}-wide groups")
        codes = jax.ShapeDtypeStruct((*lead, n_in // (8 // self.bits), n_out), np.uint8 if self.bits == 4 else np.int8)
        groups = jax.ShapeDtypeStruct((*lead, n_in // self.group, n_out), np.dtype(self.scale_dtype))
        return GroupQuantizedWeight(codes=codes, scale=groups, offset=groups if self.offset else None, bits=self.bits,
                                    bias=self.bias)

    def encode(self, host: HostCodes) -> GroupQuantizedWeight:
        """A field's host codes, already regrouped to this format's group and turned to the decoder's
        `[..., in, out]` orientation (codes [..., in, out], scales [..., in // group, out]), as this
        format stores them (numpy leaves)."""
        if host.group != self.group:
            raise ValueError(f"codes in groups of {host.group}, the format's are {self.group}")
        scale = host.scale
        offset = host.offset if host.offset is not None else np.zeros_like(scale)
        codes = host.codes
        if self.bits == 4:
            if self.bias:  # one scheme's signed codes, stored shifted (the decoder subtracts the bias)
                codes = codes + self.bias
            else:
                # Signed parts (Q4_0) become unsigned nibbles c + 8, their offset -8 * scale: the
                # same weights exactly (both terms and their sum are representable).
                low = codes.reshape(*codes.shape[:-2], -1, self.group, codes.shape[-1]).min(axis=-2)
                shift = np.where(low < 0, 8, 0).astype(np.int16)
                offset = np.where(shift > 0, -8 * scale, offset)
                codes = codes + np.repeat(shift, self.group, axis=-2)
            if codes.min(initial=0) < 0 or codes.max(initial=0) > 15:
                raise ValueError("codes do not fit in 4 bits")
            u = codes.astype(np.uint8)
            codes = u[..., 0::2, :] | (u[..., 1::2, :] << np.uint8(4))
        else:
            codes = codes.astype(np.int8)
        out_scale = _narrow(scale, self.scale_dtype, "scale")
        out_offset = _narrow(offset, self.scale_dtype, "offset") if self.offset else None
        return GroupQuantizedWeight(codes=codes, scale=out_scale, offset=out_offset, bits=self.bits, bias=self.bias)


def _narrow(a: np.ndarray, dtype: str, what: str) -> np.ndarray:
    out = a.astype(dtype)
    if dtype != "float32" and not np.array_equal(out.astype(np.float32), a):
        raise ValueError(f"a GGUF group {what} is not a {dtype} value (out of its range)")
    return out

