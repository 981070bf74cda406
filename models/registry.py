"""Architectures by their Hugging Face `architectures` name.

Every family runs the same decoder (`models.decoder.forward`); an entry here only says how to read
the family's config (`config_from_hf`) and where its tensors live (`layout`, seen through `rename`
and `view`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from paxserve.models import decoder, layout
from paxserve.models.config import ModelConfig
from paxserve.models.families import falcon, gemma3, llama, moe, qwen
from paxserve.models.families.common import llama_layout
from paxserve.models.quant_weights import WeightQuantization
from paxserve.models.stored_quantization import StoredQuantization

# At load (fp8, int8), or as a quantized checkpoint stores it (GGUF, compressed-tensors, AWQ, GPTQ).
Quantization = WeightQuantization | StoredQuantization | None
# Tensors some checkpoints carry that hold nothing the model needs (old rotary caches).
_ROTARY_CACHES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True, slots=True)
class Architecture:
    """What the loader and the runner need to know about one model family."""

    name: str
    config_from_hf: Callable[[Mapping[str, Any]], ModelConfig]
    layout: layout.LayoutFn
    forward: Callable[..., Any] = decoder.forward
    hf_ignored_suffixes: tuple[str, ...] = _ROTARY_CACHES
    hf_ignored_prefixes: tuple[str, ...] = ()  # parts of a checkpoint a text model does not read
    rename: Callable[[str], str] | None = None  # legacy tensor names -> the names `layout` uses
    view: Callable[[Any], Any] | None = None  # the checkpoint as `layout` names it (e.g. experts fused)

    def hf_tensor_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every tensor the checkpoint must hold, with its HF ([out, in]) shape."""
        return layout.tensor_shapes(self.layout(cfg), cfg.num_layers)

    def params_from_hf(self, read: Callable[[str], np.ndarray], cfg: ModelConfig, dtype: np.dtype,
                       place: layout.Place | None = None, quantization: Quantization = None,
                       keep_unquantized: bool = False, stored: layout.StoredReader | None = None
                       ) -> tuple[Any, Any]:
        """Assemble params from HF-named tensors (already checked for presence and shape); `place`
        puts each field on the device(s) (default: the default device); `quantization` quantizes
        the linear weights as they load. Returns (params, the unquantized params when
        `keep_unquantized` and quantizing, else None). A quantized checkpoint's fields (`quantization`
        is then its StoredQuantization) are read as stored through `stored` and stay quantized."""
        kwargs = {} if place is None else {"place": place}
        return layout.params_from_layout(self.layout(cfg), read, cfg.num_layers, dtype, quantization=quantization,
                                         keep_unquantized=keep_unquantized, stored=stored, **kwargs)

    def abstract_params(self, cfg: ModelConfig, dtype: np.dtype, quantization: Quantization = None
                        ) -> Any:
        """Shapes and dtypes of the params without materialising them: lets memory planning size the
        weights before loading, and tells the on-disk param cache what to restore."""
        return layout.abstract_from_layout(self.layout(cfg), cfg.num_layers, dtype, quantization)


_ENTRIES = (
    Architecture("LlamaForCausalLM", llama.llama_config, llama_layout),
    Architecture("MistralForCausalLM", llama.mistral_config, llama_layout),
    Architecture("Qwen2ForCausalLM", qwen.qwen2_config, llama_layout),
    Architecture("Qwen3ForCausalLM", qwen.qwen3_config, llama_layout),
    Architecture("Gemma3ForCausalLM", gemma3.gemma3_config, gemma3.gemma3_layout),
    Architecture("Gemma3ForConditionalGeneration", gemma3.gemma3_config, gemma3.gemma3_multimodal_layout,
                 hf_ignored_prefixes=gemma3.MULTIMODAL_IGNORED_PREFIXES, rename=gemma3.rename_legacy),
    Architecture("FalconForCausalLM", falcon.falcon_config, falcon.falcon_layout),
    Architecture("MixtralForCausalLM", moe.mixtral_config, moe.moe_layout, view=moe.FusedExperts),
    Architecture("Qwen2MoeForCausalLM", moe.qwen2_moe_config, moe.moe_layout, view=moe.FusedExperts),
    Architecture("Qwen3MoeForCausalLM", moe.qwen3_moe_config, moe.moe_layout, view=moe.FusedExperts),
)
ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in _ENTRIES}


def get_architecture(name: str) -> Architecture:
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise ValueError(
            f"Architecture {name!r} is not supported; supported architectures: {', '.join(sorted(ARCHITECTURES))}"
        ) from None
