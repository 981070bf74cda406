"""Model families as pure functions over explicit params pytrees, and their checkpoint loading."""

from models.config import ModelConfig, RopeScaling, model_config_from_hf
from models.loader import LoadedModel, ModelInfo, inspect_model, load_model
from models.registry import ARCHITECTURES, get_architecture

__all__ = [
    "ARCHITECTURES",
    "LoadedModel",
    "ModelInfo",
    "inspect_model",
    "ModelConfig",
    "RopeScaling",
    "get_architecture",
    "load_model",
    "model_config_from_hf",
]
