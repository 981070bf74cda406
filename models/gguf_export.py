"""A GGUF model written out as a Hugging Face checkpoint directory (config.json, safetensors, tokenizer).

The tensors are what `GGUFCheckpoint.read` gives (dequantized, under transformers' names), so the
directory loads like any float checkpoint: with `--quantization`, for one, which applies to float
checkpoints only. benchmarks/quantization.py and the real-model quantization tests use it on the
bundled GGUF files.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import safetensors.numpy

from paxserve.models.gguf_io import GGUFCheckpoint
from paxserve.models.tokenizer import tokenizer_from_gguf

_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16),
           "float32": np.dtype(np.float32)}


def export_gguf_as_hf(gguf_path: str | Path, directory: str | Path, dtype: str = "bfloat16") -> Path:
    """Write `gguf_path` as a checkpoint directory with its weights in `dtype`; returns the directory."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {', '.join(_DTYPES)}")
    directory = Path(directory)
    ckpt = GGUFCheckpoint(Path(gguf_path))
    config = ckpt.hf_config() | {"dtype": dtype}
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: np.ascontiguousarray(ckpt.read(name).astype(_DTYPES[dtype])) for name in sorted(ckpt.names())}
    if dtype == "bfloat16":  # safetensors' numpy side has no bfloat16: the file is written by hand
        _save_bf16(tensors, directory / "model.safetensors")
    else:
        safetensors.numpy.save_file(tensors, str(directory / "model.safetensors"))
    tokenizer_from_gguf(ckpt).save_pretrained(str(directory))
    (directory / "config.json").write_text(json.dumps(config))  # last: a directory with it is complete
    return directory


def _save_bf16(tensors: dict[str, np.ndarray], path: Path) -> None:
    """The safetensors format (an 8-byte header length, a JSON header, the raw tensors) for bfloat16."""
    header, offset = {}, 0
    for name, array in tensors.items():
        header[name] = {"dtype": "BF16", "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for array in tensors.values():
            f.write(array.tobytes())
