"""Reads the LoRA adapters requests name, for the served model, on the callers' threads.

An adapter is read (models/lora.py's `read_adapter`: PEFT files, checked against the model's shapes)
when a request first names it, by the thread that processes the request (the server's request
handler, the offline caller), never by the step loop: the step only copies an adapter already in host
memory into a device slot. Up to `max_cpu_loras` read adapters stay in host memory (`LoraCache`).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from paxserve.core.lora_slots import LoraCache
from paxserve.lora_request import LoRARequest
from paxserve.models.config import ModelConfig
from paxserve.models.layout import Layout
from paxserve.models.lora import LoraAdapter, read_adapter

logger = logging.getLogger(__name__)


def _hub_id(name: str | None) -> str | None:
    """`name` if it reads as a hub id ("org/model"), not a local path."""
    if not name or name.count("/") != 1 or name.startswith((".", "/", "~")) or os.path.exists(name):
        return None
    return name


class LoraLoader:
    """Adapters for one model: `load(request)` reads one (or returns it from host memory), raising
    ValueError naming why it cannot serve this model. Thread-safe."""

    def __init__(self, cfg: ModelConfig, layout: Layout, max_rank: int, dtype: Any, max_cpu_loras: int,
                 base_models: tuple[str | None, ...] = ()) -> None:
        """`base_models`: names the served model goes by (its --model, its served names); those that
        read as hub ids are what an adapter's `base_model_name_or_path` (a hub id) must name, when
        there are any. Without one only the shapes decide, as the same weights are often served
        from a directory of another name."""
        self.cfg, self.layout, self.max_rank, self.dtype = cfg, layout, max_rank, dtype
        self.base_models = base_models
        self._cache: LoraCache[LoraAdapter] = LoraCache(max_cpu_loras, self._read)
        self._lock = threading.Lock()

    def _read(self, request: LoRARequest) -> LoraAdapter:
        adapter = read_adapter(request.lora_path, self.cfg, self.layout, self.max_rank, self.dtype)
        named = _hub_id(adapter.base_model)
        known = [hub for hub in map(_hub_id, self.base_models) if hub is not None]
        if known and named is not None and named.lower() not in {hub.lower() for hub in known}:
            raise ValueError(f"LoRA adapter {request.lora_name!r} ({request.lora_path}) was trained on {named} "
                             f"(base_model_name_or_path), but this engine serves {' / '.join(known)}")
        logger.info("LoRA adapter %r (id %d) read from %s: rank %d on %s", request.lora_name, request.lora_int_id,
                    request.lora_path, adapter.rank, ", ".join(adapter.targets))
        return adapter

    def load(self, request: LoRARequest) -> LoraAdapter:
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a paxserve.LoRARequest, got {type(request).__name__}")
        with self._lock:
            return self._cache.get(request)

    def forget(self, lora_id: int) -> None:
        """Drop an adapter from host memory (unloaded): its id may name another adapter next."""
        with self._lock:
            self._cache.drop(lora_id)

    def ids(self) -> set[int]:
        with self._lock:
            return self._cache.ids()

    def __contains__(self, lora_id: int) -> bool:
        with self._lock:
            return lora_id in self._cache

    @property
    def num_reads(self) -> int:
        return self._cache.num_reads
