"""Read single or sharded safetensors checkpoints into numpy without torch.

The format is small enough to parse directly (8-byte header length, JSON header, raw data), which
lets us memory-map tensors, read bfloat16 through `ml_dtypes`, and say exactly what is wrong with a
damaged file instead of failing deep inside a library.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True, slots=True)
class _Entry:
    file: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file


class SafetensorsCheckpoint:
    """All tensors of a checkpoint directory, by name; data is read lazily through memory maps."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        files = self._shard_files()
        self._entries: dict[str, _Entry] = {}
        for file in files:
            for name, entry in _read_header(file).items():
                if name in self._entries:
                    raise ValueError(f"tensor {name!r} appears in both {self._entries[name].file.name} and {file.name}")
                self._entries[name] = entry
        self._maps: dict[Path, np.memmap] = {}

    def _shard_files(self) -> list[Path]:
        index = self.directory / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{index} is not a valid safetensors index (needs a 'weight_map'): {e}") from None
            files = sorted({self.directory / f for f in weight_map.values()})
            missing = [f.name for f in files if not f.exists()]
            if missing:
                raise ValueError(f"{index.name} lists shard files that do not exist: {missing}")
            return files
        single = self.directory / SINGLE_FILE
        if single.exists():
            return [single]
        others = sorted(self.directory.glob("*.safetensors"))
        if others:
            return others
        raise ValueError(f"no safetensors weights in {self.directory} (expected {SINGLE_FILE} or {INDEX_FILE})")

    def names(self) -> set[str]:
        return set(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name].shape

    def dtype(self, name: str) -> np.dtype:
        return self._entries[name].dtype

    def read(self, name: str) -> np.ndarray:
        entry = self._entries[name]
        mm = self._maps.get(entry.file)
        if mm is None:
            mm = self._maps[entry.file] = np.memmap(entry.file, dtype=np.uint8, mode="r")
        count = int(np.prod(entry.shape, dtype=np.int64))
        raw = mm[entry.start : entry.start + count * entry.dtype.itemsize]
        return raw.view(entry.dtype).reshape(entry.shape)


def _read_header(file: Path) -> dict[str, _Entry]:
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{file} is not a safetensors file: only {size} bytes")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8:
            raise ValueError(f"{file} is truncated: its header claims {header_len} bytes but the file has {size}")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{file} has a corrupt safetensors header: {e}") from None
    data_start = 8 + header_len
    entries: dict[str, _Entry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise ValueError(f"{file}: tensor {name!r} has unsupported dtype {info.get('dtype')!r}")
        shape = tuple(int(d) for d in info["shape"])
        begin, end = (int(x) for x in info["data_offsets"])
        if end - begin != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            raise ValueError(f"{file}: tensor {name!r} byte range does not match its shape {shape} and dtype")
        if data_start + end > size:
            raise ValueError(
                f"{file} is truncated: tensor {name!r} needs bytes up to {data_start + end} but the file has {size}"
            )
        entries[name] = _Entry(file=file, dtype=dtype, shape=shape, start=data_start + begin)
    return entries
