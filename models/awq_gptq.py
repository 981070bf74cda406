"""Pre-quantized 4-bit AutoAWQ and AutoGPTQ checkpoints (`quant_method` "awq" / "gptq" in
config.json's `quantization_config`), read as they are stored.

Each quantized module `m` stores, instead of `m.weight` [out, in]:

    AWQ (GEMM)  m.qweight int32 [in, out / 8]: eight 4-bit codes per word along `out`, in the order
                0, 2, 4, 6, 1, 3, 5, 7 (nibble k of a word holds column 8w + ORDER[k]);
                m.qzeros int32 [in / group, out / 8] packed alike; m.scales float16 [in / group, out].
    GPTQ        m.qweight int32 [in / 8, out]: eight codes per word along `in`, nibble k = row 8w + k;
                m.qzeros int32 [groups, out / 8] along `out`, holding zero - 1 (AutoGPTQ's v1
                format; "gptq_v2" holds the zero); m.scales float16 [groups, out]; m.g_idx int32
                [in], each input row's group (i // group unless the checkpoint was quantized in
                activation order, `desc_act`).

Both dequantize as w = scale * (q - zero). With float16 scales, scale * q and scale * zero are exact
in float32 and so is their difference: kept as unsigned 4-bit codes with a scale and an offset
(-scale * zero) per group, each weight is the exact value, rounded once to the activation dtype.
Symmetric GPTQ (every zero 8) needs no offset: its codes carry a static bias of 8. An act-order
GPTQ layer (groups not contiguous) is dequantized at load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from paxserve.models.gguf_weights import GroupFormat, HostCodes
from paxserve.models.stored_quantization import StoredModules, int32_nibbles

_AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])  # column of nibble k within its word's eight columns
_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx")


@dataclass(frozen=True)
class GroupScheme:
    method: str  # "awq" or "gptq"
    group_size: int
    symmetric: bool  # GPTQ `sym`; AWQ checkpoints carry zero points (`zero_point`)
    zeros_minus_one: bool  # GPTQ v1 stores zero - 1

    @classmethod
    def parse(cls, qc: dict[str, Any], source: Any) -> "GroupScheme":
        method = qc["quant_method"]
        bits = int(qc.get("bits", qc.get("w_bit", 4)))
        group = int(qc.get("group_size", qc.get("q_group_size", 128)))
        if bits != 4:
            raise ValueError(f"{source}: {method} with {bits}-bit weights is not supported (4-bit is)")
        if method == "awq":
            version = str(qc.get("version", "gemm")).lower()
            if version != "gemm" or not qc.get("zero_point", True):
                raise ValueError(f"{source}: AWQ version {version!r} (zero_point={qc.get('zero_point', True)}) is "
                                 "not supported (AutoAWQ's GEMM layout with zero points is)")
            return cls("awq", group, False, False)
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2") or group <= 0:
            raise ValueError(f"{source}: GPTQ checkpoint_format {fmt!r} with group_size {group} is not supported "
                             "(gptq or gptq_v2 with groups is)")
        return cls("gptq", group, bool(qc.get("sym", True)), fmt == "gptq")

    def describe(self) -> str:
        return f"{self.method} int4 per group of {self.group_size}"


class GroupCheckpoint(StoredModules):
    """A safetensors checkpoint whose AWQ / GPTQ modules are seen under their plain `.weight` names."""

    def __init__(self, ckpt: Any, scheme: GroupScheme) -> None:
        self.scheme = scheme
        names = ckpt.names()
        quantized = {n.removesuffix(".qweight") for n in names if n.endswith(".qweight")}
        for module in sorted(quantized):
            missing = [s for s in (".qzeros", ".scales") if module + s not in names]
            if missing:
                raise ValueError(f"{scheme.method} checkpoint: {module} has qweight but no {missing[0].lstrip('.')}")
        super().__init__(ckpt, quantized, _SUFFIXES)

    def shape(self, name: str) -> tuple[int, ...]:
        module = self._module(name)
        if module is None:
            return tuple(self._ckpt.shape(name))
        rows, cols = self._ckpt.shape(module + ".qweight")
        return (cols * 8, rows) if self.scheme.method == "awq" else (cols, rows * 8)

    def _act_order(self, module: str) -> bool:
        if self.scheme.method != "gptq" or module + ".g_idx" not in self._ckpt.names():
            return False
        g_idx = np.asarray(self._ckpt.read(module + ".g_idx"))
        return not np.array_equal(g_idx, np.arange(g_idx.size) // self.scheme.group_size)

    def types(self, name: str) -> list[str]:
        module = self._module(name)
        if module is None:
            return [str(self._ckpt.dtype(name))]
        return [self.scheme.describe() + (" in activation order" if self._act_order(module) else "")]

    def _unpacked(self, module: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(codes [in, out], zeros [groups, out], scales float32 [groups, out]) as stored."""
        qweight, qzeros = self._ckpt.read(module + ".qweight"), self._ckpt.read(module + ".qzeros")
        scales = np.asarray(self._ckpt.read(module + ".scales"), np.float32)
        if self.scheme.method == "awq":
            def along_out(words: np.ndarray) -> np.ndarray:
                n = int32_nibbles(words)  # [rows, words, 8], nibble k = column ORDER[k]
                out = np.empty_like(n)
                out[..., _AWQ_ORDER] = n
                return out.reshape(words.shape[0], -1)
            return along_out(qweight), along_out(qzeros), scales
        codes = int32_nibbles(qweight.T).reshape(qweight.shape[1], -1).T  # [in, out]: row 8w + k from nibble k
        zeros = int32_nibbles(qzeros).reshape(qzeros.shape[0], -1)
        return codes, zeros + 1 if self.scheme.zeros_minus_one else zeros, scales

    def read_codes(self, name: str) -> HostCodes:
        """Unsigned codes [out, in] with per-group scales and offsets -scale * zero (or, for a
        symmetric GPTQ module, signed codes q - 8 and no offset)."""
        module = self._module(name)
        codes, zeros, scales = self._unpacked(module)
        group = self.scheme.group_size
        if self.scheme.method == "gptq" and self.scheme.symmetric:
            if np.any(zeros != 8):
                raise ValueError(f"gptq checkpoint: {module} is symmetric (sym=true) but has zero points other than 8")
            return HostCodes((codes - 8).T, scales.T, None, group)
        return HostCodes(codes.T, scales.T, (-(scales * zeros.astype(np.float32))).T, group)

    def read(self, name: str) -> np.ndarray:
        """The tensor at full width: a quantized module dequantized (act order included)."""
        module = self._module(name)
        if module is None:
            return self._ckpt.read(name)
        codes, zeros, scales = self._unpacked(module)
        if self.scheme.method == "gptq" and module + ".g_idx" in self._ckpt.names():
            rows = np.asarray(self._ckpt.read(module + ".g_idx")).astype(np.int64)
        else:
            rows = np.arange(codes.shape[0]) // self.scheme.group_size
        return (scales[rows] * (codes - zeros[rows]).astype(np.float32)).T

    def format_for(self, types: list[str], width: int) -> GroupFormat | None:
        if types != [self.scheme.describe()]:
            return None  # a float part, or a layer in activation order
        sym = self.scheme.method == "gptq" and self.scheme.symmetric
        return GroupFormat(bits=4, group=self.scheme.group_size, scale_dtype="float16" if sym else "float32",
                           offset=not sym, types=(self.scheme.describe(),), bias=8 if sym else 0)

    def kv_scales(self, num_layers: int) -> None:
        return None
