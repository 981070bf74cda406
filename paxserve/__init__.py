"""paxserve: a vLLM-class LLM serving engine on JAX.

    from paxserve import Engine, SamplingParams
    engine = Engine()  # the bundled SmolLM2-135M-Instruct
    outs = engine.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=32))
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["AsyncEngine", "Engine", "EngineConfig", "LoRARequest", "RequestOutput", "CompletionOutput",
           "RequestOutputKind", "SamplingParams"]

_LAZY = {
    "Engine": "paxserve.engine.llm_engine",
    "AsyncEngine": "paxserve.engine.async_engine",
    "EngineConfig": "paxserve.config",
    "LoRARequest": "paxserve.lora_request",
    "RequestOutput": "paxserve.outputs",
    "CompletionOutput": "paxserve.outputs",
    "SamplingParams": "paxserve.sampling_params",
    "RequestOutputKind": "paxserve.sampling_params",
}


def __getattr__(name: str) -> Any:
    # Lazy so that `paxserve --help` and the host-side modules don't pay for importing JAX.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'paxserve' has no attribute {name!r}")
