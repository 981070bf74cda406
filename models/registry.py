"""Architectures by their Hugging Face `architectures` name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from models import llama
from models.config import ModelConfig


@dataclass(frozen=True, slots=True)
class Architecture:
    """What the loader and the runner need to know about one model family."""

    name: str
    forward: Callable[..., Any]
    hf_tensor_shapes: Callable[[ModelConfig], dict[str, tuple[int, ...]]]
    params_from_hf: Callable[[Callable[[str], np.ndarray], ModelConfig, np.dtype], Any]
    abstract_params: Callable[[ModelConfig, np.dtype], Any]
    hf_ignored_suffixes: tuple[str, ...] = ()


_LLAMA = Architecture(
    name="LlamaForCausalLM",
    forward=llama.forward,
    hf_tensor_shapes=llama.hf_tensor_shapes,
    params_from_hf=llama.params_from_hf,
    abstract_params=llama.abstract_params,
    hf_ignored_suffixes=llama.HF_IGNORED_SUFFIXES,
)

ARCHITECTURES: dict[str, Architecture] = {_LLAMA.name: _LLAMA}


def get_architecture(name: str) -> Architecture:
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise ValueError(
            f"Architecture {name!r} is not supported; supported architectures: {', '.join(sorted(ARCHITECTURES))}"
        ) from None
