"""Runs one padded batch through the jitted model step, owning the device-side KV cache."""

from __future__ import annotations

import logging
from functools import cache
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from models.loader import LoadedModel
from paxserve.batch import Batch
from pallas_kernels import AttentionMetadata, KVCache

logger = logging.getLogger(__name__)


@cache
def _jitted(forward: Callable[..., Any]) -> Callable[..., Any]:
    """One jitted step per architecture, shared by all runners: XLA's cache is keyed by the static
    config and the shapes, so a second runner for the same model reuses the compiled programs."""
    return jax.jit(forward, static_argnames=("cfg",), donate_argnums=(1,))


class ModelRunner:
    """Params + KV cache + one jitted step. The cache is donated to every step and replaced by the
    step's output, so XLA updates it in place."""

    def __init__(self, model: LoadedModel, num_blocks: int, block_size: int) -> None:
        if block_size not in (8, 16, 32):
            raise ValueError(f"block_size must be one of 8, 16, 32, got {block_size}")
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.kv_cache = KVCache.zeros(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                                      jnp.dtype(model.dtype))
        self._step = _jitted(model.architecture.forward)
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, block_size,
                    2 * self.kv_cache.k.nbytes / 2**20)

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    def execute(self, batch: Batch) -> np.ndarray:
        """Float32 logits [num_seqs, vocab] for the real sequences of `batch`."""
        metadata = AttentionMetadata(
            slot_mapping=jnp.asarray(batch.slot_mapping),
            block_tables=jnp.asarray(batch.block_tables),
            context_lens=jnp.asarray(batch.context_lens),
            query_start_loc=jnp.asarray(batch.query_start_loc),
            logits_indices=jnp.asarray(batch.logits_indices),
        )
        logits, self.kv_cache = self._step(
            self.model.params, self.kv_cache, jnp.asarray(batch.input_ids), jnp.asarray(batch.positions), metadata,
            cfg=self.model.config,
        )
        return np.asarray(logits[: batch.num_seqs])
