"""Pre-quantized Hugging Face checkpoints in the compressed-tensors format (llm-compressor's, and what
most published "-FP8", "-W8A8" and "-W4A16" checkpoints are), read as they are stored.

`config.json`'s `quantization_config` (quant_method "compressed-tensors") names one weight scheme for
the Linear layers; each quantized module `m` then stores, instead of `m.weight`:

    float-quantized   m.weight float8_e4m3fn [out, in], m.weight_scale [out, 1] (channel) or [1] (tensor)
    int-quantized     m.weight int8 [out, in] and its scale the same way (naive-quantized alike)
    pack-quantized    m.weight_packed int32 [out, in * bits / 32] (code i at bit i * bits, stored
                      as q + 2^(bits-1)), m.weight_scale [out, in / group] (group) or [out, 1]
                      (channel), m.weight_shape, and when asymmetric (4-bit only here)
                      m.weight_zero_point packed the same way along `out`: w = scale * (q - zero_point)

plus `m.input_scale` for static activation scales, and `self_attn.k_scale` / `v_scale` with a
`kv_cache_scheme`. fp8 and int8 per channel (or per tensor, broadcast to channels) become the
`QuantizedWeight` that `--quantization` makes; packed 4- and 8-bit groups become the
`GroupQuantizedWeight` a GGUF file is kept as, with the same exact dequantization. Activations are
quantized dynamically per token where the device has fp8 tensor cores (a checkpoint's static input
scales are read past: per-token scales are at least as fine).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from paxserve.models.gguf_weights import GroupFormat, HostCodes
from paxserve.models.stored_quantization import StoredModules, int32_nibbles

_QUANT_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_shape", ".weight_zero_point", ".input_scale",
                   ".weight_global_scale", ".input_global_scale")
_KV_SCALES = (".self_attn.k_scale", ".self_attn.v_scale")
SUPPORTED = ("fp8 (float-quantized) or int8 (int-quantized) weights per channel or per tensor; 4-bit "
             "pack-quantized weights per group or channel, symmetric or with zero points; symmetric 8-bit ones")


@dataclass(frozen=True)
class WeightScheme:
    """The one weight scheme of a compressed-tensors checkpoint's Linear layers."""

    format: str
    kind: str  # "float" or "int"
    bits: int
    strategy: str  # "tensor", "channel" or "group"
    group_size: int | None
    symmetric: bool
    kv_scales: bool  # the checkpoint has per-layer fp8 K and V scales

    @classmethod
    def parse(cls, qc: dict[str, Any], source: Any) -> "WeightScheme":
        groups = [g for g in (qc.get("config_groups") or {}).values() if g.get("weights")]
        schemes = {repr(sorted(g["weights"].items())) for g in groups}
        if len(schemes) != 1:
            raise ValueError(f"{source}: a compressed-tensors checkpoint with {len(schemes)} weight schemes "
                             "is not supported (one scheme for every Linear layer is)")
        group, weights = groups[0], groups[0]["weights"]
        if qc.get("quantization_status", "compressed") != "compressed":
            raise ValueError(f"{source}: compressed-tensors status {qc.get('quantization_status')!r}; paxserve reads "
                             "compressed checkpoints (as llm-compressor saves them)")
        kv = qc.get("kv_cache_scheme")
        if kv and not (kv.get("type") == "float" and kv.get("num_bits") == 8 and kv.get("strategy") == "tensor"):
            raise ValueError(f"{source}: compressed-tensors kv_cache_scheme {kv} is not supported (fp8 per-tensor "
                             "K and V scales are)")
        scheme = cls(format=group.get("format") or qc.get("format") or "", kind=weights.get("type", "int"),
                     bits=int(weights.get("num_bits", 8)), strategy=weights.get("strategy", "tensor"),
                     group_size=weights.get("group_size"), symmetric=bool(weights.get("symmetric", True)),
                     kv_scales=bool(kv))
        if not scheme._supported():
            raise ValueError(f"{source}: compressed-tensors weights {scheme.describe()} are not supported; supported: "
                             f"{SUPPORTED}")
        return scheme

    def _supported(self) -> bool:
        per_channel = self.strategy in ("tensor", "channel") and self.symmetric and self.bits == 8
        if self.format == "pack-quantized" and self.bits == 8 and not self.symmetric:
            return False  # q - zero_point would not fit a byte
        if self.format == "float-quantized":
            return self.kind == "float" and per_channel
        if self.format in ("int-quantized", "naive-quantized"):
            return self.kind == "int" and per_channel
        if self.format == "pack-quantized":
            return self.kind == "int" and self.bits in (4, 8) and self.strategy in ("group", "channel")
        return False

    def describe(self) -> str:
        group = f" of {self.group_size}" if self.strategy == "group" else ""
        sym = "" if self.symmetric else " with zero points"
        return f"{self.format} {self.kind}{self.bits} per {self.strategy}{group}{sym}"

    @property
    def channel_method(self) -> str | None:
        """The `--quantization` method whose storage this scheme's weights have, if any."""
        if self.format == "pack-quantized":
            return None
        return "fp8" if self.kind == "float" else "int8"


class CompressedCheckpoint(StoredModules):
    """A safetensors checkpoint whose quantized modules are seen under their plain `.weight` names
    (with their logical shapes), readable as stored (`read_channel`, `read_codes`) or dequantized
    (`read`)."""

    def __init__(self, ckpt: Any, scheme: WeightScheme) -> None:
        self.scheme = scheme
        names = ckpt.names()
        quantized = {n.removesuffix(".weight_scale") for n in names if n.endswith(".weight_scale")}
        stored_quantized = {n.removesuffix(".weight_packed") for n in names if n.endswith(".weight_packed")} | {
            n.removesuffix(".weight") for n in names
            if n.endswith(".weight") and ckpt.dtype(n).itemsize == 1 and ckpt.dtype(n).kind != "b"}
        if missing := sorted(stored_quantized - quantized):
            raise ValueError(f"compressed-tensors checkpoint: {missing[0]} is stored quantized but has no "
                             f"weight_scale ({len(missing)} module(s) without one)")
        super().__init__(ckpt, quantized, _QUANT_SUFFIXES + _KV_SCALES)

    def shape(self, name: str) -> tuple[int, ...]:
        module = self._module(name)
        if module is not None and self.scheme.format == "pack-quantized":
            return tuple(int(d) for d in self._ckpt.read(module + ".weight_shape"))
        return tuple(self._ckpt.shape(name))

    def types(self, name: str) -> list[str]:
        """What the tensor is stored as: the scheme, or its float dtype."""
        return [self.scheme.describe()] if self._module(name) is not None else [str(self._ckpt.dtype(name))]

    def read_channel(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(values [out, in] as stored, float8_e4m3fn or int8; one float32 scale per output row)."""
        module = self._module(name)
        q = self._ckpt.read(name)
        scale = np.asarray(self._ckpt.read(module + ".weight_scale"), np.float32).reshape(-1)
        return q, np.broadcast_to(scale, (q.shape[0],)) if scale.size == 1 else scale

    def read_codes(self, name: str) -> HostCodes:
        """A pack-quantized weight as signed codes with group scales; with zero points, the codes
        are q - zero_point (so w = scale * code rounds once, as compressed-tensors computes it)."""
        module, bits = self._module(name), self.scheme.bits
        out, n_in = self.shape(name)
        codes = _unpack(self._ckpt.read(module + ".weight_packed"), bits, n_in)
        scale = np.asarray(self._ckpt.read(module + ".weight_scale"), np.float32)
        group = n_in // scale.shape[-1]
        if not self.scheme.symmetric:
            zero = _unpack(np.ascontiguousarray(self._ckpt.read(module + ".weight_zero_point").T), bits, out).T
            codes = codes - np.repeat(zero, group, axis=-1)
        return HostCodes(codes.astype(np.int16), scale, None, group)

    def read(self, name: str) -> np.ndarray:
        """The tensor at full width: a quantized module dequantized (as compressed-tensors does, in float32)."""
        if self._module(name) is None:
            return self._ckpt.read(name)
        if self.scheme.format == "pack-quantized":
            return self.read_codes(name).dequantize()
        q, scale = self.read_channel(name)
        return q.astype(np.float32) * scale[:, None]

    def kv_scales(self, num_layers: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Per-layer fp8 K and V scales, when the checkpoint has them."""
        if not self.scheme.kv_scales:
            return None
        found = self._ckpt.names()
        out = []
        for suffix in _KV_SCALES:
            names = [next((n for n in found if n.endswith(f"layers.{i}{suffix}")), None) for i in range(num_layers)]
            if any(n is None for n in names):
                raise ValueError(f"the checkpoint's kv_cache_scheme promises {suffix.lstrip('.')} for every layer, "
                                 f"but layer {names.index(None)} has none")
            out.append(np.array([float(np.asarray(self._ckpt.read(n)).reshape(-1)[0]) for n in names], np.float32))
        return out[0], out[1]

    def format_for(self, types: list[str], width: int) -> GroupFormat | str | None:
        """How a params field whose parts are stored as `types`, `width` inputs wide, is kept: a
        GroupFormat, a channel method ("fp8", "int8"), or None (at full width: a float part)."""
        if types != [self.scheme.describe()]:
            return None
        if self.scheme.channel_method is not None:
            return self.scheme.channel_method
        s = self.scheme
        # Codes with zero points (q - zero_point, up to 2^bits - 1 apart) need a byte each.
        four = s.bits == 4 and s.symmetric
        return GroupFormat(bits=4 if four else 8, group=s.group_size or width, scale_dtype="float32", offset=False,
                           types=(s.describe(),), bias=8 if four else 0)


def _unpack(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """compressed-tensors' dense int32 packing along the last axis: code i at bit i * bits, stored as
    q + 2^(bits - 1); 4 and 8 bits never straddle a byte. Returns the signed codes [..., count]."""
    if bits == 4:
        raw = int32_nibbles(packed).reshape(*packed.shape[:-1], -1)
    else:
        raw = np.ascontiguousarray(packed).astype("<i4").view(np.uint8)
    return raw[..., :count].astype(np.int16) - (1 << (bits - 1))
