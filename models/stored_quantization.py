"""How a checkpoint that is quantized already keeps its linear weights on the device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from paxserve.models.gguf_weights import GroupFormat
from paxserve.models.quant_weights import WeightQuantization


@dataclass(frozen=True)
class StoredQuantization:
    """A checkpoint's weights kept as it stores them: the storage of each params field that is
    ("layers.qkv_w" -> a GroupFormat, or the per-channel WeightQuantization its values already
    have); fields not named load at full width. `method` is vLLM's name for the checkpoint's
    quantization ("gguf", "compressed-tensors", "awq", "gptq")."""

    method: str
    formats: tuple[tuple[str, GroupFormat | WeightQuantization], ...]
    fp8_activations: bool = False

    def format_of(self, path: str) -> GroupFormat | WeightQuantization | None:
        return dict(self.formats).get(path)

    def describe(self) -> str:
        kinds = sorted({t for _, f in self.formats for t in (f.types if isinstance(f, GroupFormat) else (f.method,))})
        if not kinds:
            return f"{self.method} checkpoint with no linear weight kept quantized"
        return f"{self.method} weights kept as stored ({', '.join(kinds)}), dequantized inside each matmul"

    def to_json(self) -> dict[str, Any]:
        return {"method": self.method, "formats": {
            path: f.to_json() if isinstance(f, GroupFormat) else {"method": f.method, "fp8_activations": f.fp8_activations}
            for path, f in self.formats}}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "StoredQuantization":
        def one(f: dict[str, Any]) -> GroupFormat | WeightQuantization:
            return WeightQuantization(f["method"], f["fp8_activations"]) if "method" in f else GroupFormat.from_json(f)

        return cls(d.get("method", "gguf"), tuple((path, one(f)) for path, f in sorted(d.get("formats", {}).items())))


class StoredModules:
    """A checkpoint whose quantized modules (each stored as several tensors: values, scales, zero
    points...) are seen as one `module.weight` each, the name the layout reads."""

    def __init__(self, ckpt: Any, quantized: set[str], stored_suffixes: tuple[str, ...]) -> None:
        self._ckpt, self._quantized = ckpt, quantized
        self._names = {n for n in ckpt.names() if not n.endswith(stored_suffixes)} | {m + ".weight" for m in quantized}

    def names(self) -> set[str]:
        return set(self._names)

    def _module(self, name: str) -> str | None:
        """The quantized module `name` stands for, or None for a tensor stored as it is."""
        module = name.removesuffix(".weight")
        return module if name.endswith(".weight") and module in self._quantized else None


def int32_nibbles(words: np.ndarray) -> np.ndarray:
    """[..., n] int32 words of eight 4-bit codes -> [..., n, 8] int16: code k is bits 4k..4k+3
    (the packing of AutoAWQ, AutoGPTQ and compressed-tensors alike; they differ in the axis and
    the order of the columns)."""
    return ((np.asarray(words).astype(np.uint32)[..., None] >> np.arange(0, 32, 4, dtype=np.uint32)) & 0xF
            ).astype(np.int16)
