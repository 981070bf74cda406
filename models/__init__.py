"""Model families as pure functions over explicit params pytrees, and their checkpoint loading."""

from paxserve.models.config import ModelConfig, RopeScaling, model_config_from_hf
from paxserve.models.loader import LoadedModel, ModelInfo, inspect_model, load_model
from paxserve.models.registry import ARCHITECTURES, get_architecture

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
