"""Runs one padded batch through the jitted model step, owning the device-side KV cache.

Shapes are bucketed to powers of two (tokens x sequences x block-table width) so XLA compiles a
bounded set of programs; each new bucket is logged when it compiles.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from models.loader import LoadedModel
from models.sharding import TensorParallel
from paxserve.batch import Batch, SeqChunk, build_batch, next_power_of_2
from paxserve.prompt_logprobs import PromptLogprobsInputs, prompt_packed_width
from paxserve.sampler import SamplingMetadata, prompt_logprob_columns, sample
from paxserve.sampling_metadata import SampledTokens, SamplingInputs, unpack
from pallas_kernels import REFERENCE, AttentionBackend, AttentionMetadata, KVCache

logger = logging.getLogger(__name__)


_STATIC = ("cfg", "attention_backend", "tp")


def _run_forward(forward, params, kv_cache, input_ids, positions, metadata, cfg,  # noqa: ANN001, ANN202
                 attention_backend: AttentionBackend, tp: TensorParallel | None):
    if tp is None:
        return forward(params, kv_cache, input_ids, positions, metadata, cfg, attention_backend=attention_backend)
    return tp.shard_forward(forward, params, kv_cache, attention_backend=attention_backend)(
        params, kv_cache, input_ids, positions, metadata)


@cache
def _jitted_logits(forward: Callable[..., Any]) -> Callable[..., Any]:
    """Forward only (logits back to the host): one jitted function per architecture, shared by all
    runners, so XLA's cache (keyed by the static config and shapes) is reused across runners."""

    def logits(params, kv_cache, input_ids, positions, metadata, cfg,  # noqa: ANN001, ANN202
               attention_backend=REFERENCE, tp=None):  # noqa: ANN001
        return _run_forward(forward, params, kv_cache, input_ids, positions, metadata, cfg, attention_backend, tp)

    return jax.jit(logits, static_argnames=_STATIC, donate_argnums=(1,))


@cache
def _jitted_step(forward: Callable[..., Any]) -> Callable[..., Any]:
    """Forward + on-device sampling: only the packed sampled ids (and logprobs) leave the device.
    Under tensor parallelism the forward runs split over the mesh and sampling runs on the
    gathered full-vocabulary logits, alike on every device."""

    def step(params, kv_cache, input_ids, positions, metadata, sampling, cfg,  # noqa: ANN001, ANN202
             attention_backend=REFERENCE, tp=None):  # noqa: ANN001
        logits, kv_cache = _run_forward(forward, params, kv_cache, input_ids, positions, metadata, cfg,
                                        attention_backend, tp)
        return sample(logits, sampling), kv_cache

    return jax.jit(step, static_argnames=_STATIC, donate_argnums=(1,))


@cache
def _jitted_prompt_logprobs_step(forward: Callable[..., Any]) -> Callable[..., Any]:
    """The step of a batch in which some request asks for prompt logprobs: the forward returns
    logits for every token position ([T, V] float32, the memory cost that only such batches pay),
    the sequences' rows are sampled as in `_jitted_step`, and every position gets its prompt-logprob
    columns. Both results leave the device as one flat float32 array (one host copy). It goes
    through the same `_run_forward`, so tensor parallelism gathers the logits as usual."""

    def step(params, kv_cache, input_ids: Int[Array, " T"], positions: Int[Array, " T"],  # noqa: ANN001, ANN202
             metadata: AttentionMetadata, sampling: SamplingMetadata, targets: Int[Array, " T"], cfg,  # noqa: ANN001
             num_top: int, attention_backend=REFERENCE, tp=None):  # noqa: ANN001
        every = metadata.replace(logits_indices=jnp.arange(input_ids.shape[0], dtype=jnp.int32))
        logits, kv_cache = _run_forward(forward, params, kv_cache, input_ids, positions, every, cfg,
                                        attention_backend, tp)
        sampled = sample(logits[metadata.logits_indices], sampling)
        prompt = prompt_logprob_columns(logits, targets, num_top)
        return jnp.concatenate([sampled.reshape(-1), prompt.reshape(-1)]), kv_cache

    return jax.jit(step, static_argnames=(*_STATIC, "num_top"), donate_argnums=(1,))


def _metadata(batch: Batch) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=jnp.asarray(batch.slot_mapping),
        block_tables=jnp.asarray(batch.block_tables),
        context_lens=jnp.asarray(batch.context_lens),
        query_start_loc=jnp.asarray(batch.query_start_loc),
        logits_indices=jnp.asarray(batch.logits_indices),
    )


class ModelRunner:
    """Params + KV cache + jitted steps. The cache is donated to every step and replaced by the
    step's output, so XLA updates it in place."""

    def __init__(self, model: LoadedModel, num_blocks: int, block_size: int, max_model_len: int | None = None,
                 attention_backend: AttentionBackend = REFERENCE) -> None:
        if block_size not in (8, 16, 32):
            raise ValueError(f"block_size must be one of 8, 16, 32, got {block_size}")
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.attention_backend = attention_backend  # static argument of every jitted step
        self.max_blocks_per_seq = -(-(max_model_len or cfg.max_position_embeddings) // block_size)
        self._num_blocks = num_blocks
        self.kv_cache = self._new_kv_cache()
        self.buckets: set[tuple] = set()  # compiled step shapes, for the log and for tests

    def _new_kv_cache(self) -> KVCache:
        cfg, tp = self.model.config, self.model.tp
        if tp is None:
            return KVCache.zeros(cfg.num_layers, self._num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim,
                                 jnp.dtype(self.model.dtype))
        # Made in place on the mesh (each device zeroes only its KV heads), never whole on one device.
        heads = tp.num_kv_heads_stored
        make = lambda: KVCache.zeros(cfg.num_layers, self._num_blocks, self.block_size, heads,  # noqa: E731
                                     cfg.head_dim, jnp.dtype(self.model.dtype))
        return jax.jit(make, out_shardings=KVCache(k=tp.kv_sharding, v=tp.kv_sharding))()

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    def kv_cache_intact(self) -> bool:
        """Whether the cache still exists and holds a value: a step it was donated to may have
        deleted it, or left it poisoned by an asynchronous runtime error."""
        try:
            leaves = jax.tree.leaves(self.kv_cache)
            if any(leaf.is_deleted() for leaf in leaves):
                return False
            jax.block_until_ready(leaves)
            return True
        except Exception:  # noqa: BLE001 - any failure to produce the value means it is lost
            return False

    def reset_kv_cache(self) -> None:
        """Replace a lost cache with a zeroed one of the same shape (its old contents are gone)."""
        for leaf in jax.tree.leaves(self.kv_cache):
            try:
                leaf.delete()  # free device memory first, so old and new never coexist
            except Exception:  # noqa: BLE001 - already deleted or never materialised
                pass
        self.kv_cache = self._new_kv_cache()

    def build(self, chunks: list[SeqChunk]) -> Batch:
        """Pad a batch to its bucket: powers of two in tokens, sequences and block-table width."""
        num_tokens = sum(len(c.token_ids) for c in chunks)
        widest = max(len(c.block_table) for c in chunks)
        return build_batch(
            chunks, self.block_size,
            pad_tokens_to=next_power_of_2(num_tokens),
            pad_seqs_to=next_power_of_2(len(chunks)),
            pad_blocks_to=min(next_power_of_2(widest), max(widest, self.max_blocks_per_seq)),
        )

    def _note_bucket(self, key: tuple) -> None:
        if key not in self.buckets:
            self.buckets.add(key)
            logger.info("compiling model step for bucket %s (%d compiled so far)", key, len(self.buckets))

    def compute_logits(self, batch: Batch) -> np.ndarray:
        """Float32 logits [num_seqs, vocab] for the real sequences of `batch` (tests, greedy tools)."""
        self._note_bucket(("logits", batch.input_ids.shape[0], batch.context_lens.shape[0],
                           batch.block_tables.shape[1]))
        logits, self.kv_cache = _jitted_logits(self.model.architecture.forward)(
            self.model.params, self.kv_cache, jnp.asarray(batch.input_ids), jnp.asarray(batch.positions),
            _metadata(batch), cfg=self.model.config, attention_backend=self.attention_backend, tp=self.model.tp,
        )
        return np.asarray(logits[: batch.num_seqs])

    def execute(self, batch: Batch, sampling: SamplingInputs) -> SampledTokens:
        """One engine step: forward, sample on the device, one device-to-host copy."""
        self._note_bucket((batch.input_ids.shape[0], batch.context_lens.shape[0], batch.block_tables.shape[1],
                           sampling.all_greedy, sampling.use_top_k_top_p, sampling.use_penalties,
                           sampling.num_logprobs, sampling.output_token_ids.shape[1],
                           sampling.prompt_token_ids.shape[1], sampling.logit_bias_ids.shape[1],
                           sampling.suppress_ids.shape[1]))
        packed, self.kv_cache = _jitted_step(self.model.architecture.forward)(
            self.model.params, self.kv_cache, jnp.asarray(batch.input_ids), jnp.asarray(batch.positions),
            _metadata(batch), SamplingMetadata.from_inputs(sampling), cfg=self.model.config,
            attention_backend=self.attention_backend, tp=self.model.tp,
        )
        return unpack(np.asarray(packed), batch.num_seqs, sampling.num_logprobs)

    def execute_with_prompt_logprobs(self, batch: Batch, sampling: SamplingInputs,
                                     prompt: PromptLogprobsInputs) -> tuple[SampledTokens, np.ndarray]:
        """`execute` plus prompt logprobs: also returns the packed [T, 2 + 2 * num_top] float32 rows
        of every flat position (see `prompt_logprobs.prompt_packed_width`). Its programs are keyed
        by the plain step's bucket plus num_top (5 or 20)."""
        t, s = batch.input_ids.shape[0], batch.context_lens.shape[0]
        if prompt.targets.shape[0] != t:
            raise ValueError(f"prompt logprob targets cover {prompt.targets.shape[0]} positions, the batch {t}")
        self._note_bucket(("prompt_logprobs", prompt.num_top, t, s, batch.block_tables.shape[1], sampling.all_greedy,
                           sampling.use_top_k_top_p, sampling.use_penalties, sampling.num_logprobs,
                           sampling.output_token_ids.shape[1], sampling.prompt_token_ids.shape[1],
                           sampling.logit_bias_ids.shape[1], sampling.suppress_ids.shape[1]))
        packed, self.kv_cache = _jitted_prompt_logprobs_step(self.model.architecture.forward)(
            self.model.params, self.kv_cache, jnp.asarray(batch.input_ids), jnp.asarray(batch.positions),
            _metadata(batch), SamplingMetadata.from_inputs(sampling), jnp.asarray(prompt.targets),
            cfg=self.model.config, num_top=prompt.num_top, attention_backend=self.attention_backend,
            tp=self.model.tp,
        )
        flat = np.asarray(packed)
        num_sampled = s * sampling.packed_width
        sampled = unpack(flat[:num_sampled].reshape(s, sampling.packed_width), batch.num_seqs,
                         sampling.num_logprobs)
        return sampled, flat[num_sampled:].reshape(t, prompt_packed_width(prompt.num_top))


def measure_activation_bytes(
    model_cfg: Any, architecture: Any, dtype: np.dtype, block_size: int, max_tokens: int, max_seqs: int,
    max_blocks_per_seq: int, attention_backend: AttentionBackend = REFERENCE, tp: TensorParallel | None = None,
) -> int:
    """Temporary memory XLA plans for the largest step bucket, from shapes alone (no weights are
    needed), so memory planning can reserve it before the KV cache takes the rest (per device,
    under tensor parallelism)."""
    from paxserve.sampling_metadata import SamplingRow, build_sampling_inputs
    from paxserve.sampling_params import SamplingParams

    cfg = model_cfg
    num_tokens, num_seqs = next_power_of_2(max_tokens), next_power_of_2(max_seqs)
    kv_heads = cfg.num_kv_heads if tp is None else tp.num_kv_heads_stored
    kv_shape = (cfg.num_layers, 2, block_size, kv_heads, cfg.head_dim)
    kv_sharding = None if tp is None else tp.kv_sharding
    kv = KVCache(k=jax.ShapeDtypeStruct(kv_shape, dtype, sharding=kv_sharding),
                 v=jax.ShapeDtypeStruct(kv_shape, dtype, sharding=kv_sharding))
    params = architecture.abstract_params(cfg, dtype) if tp is None else \
        tp.abstract_params(lambda c: architecture.abstract_params(c, dtype))
    chunk = SeqChunk([0], 0, [1])
    batch = build_batch([chunk], block_size, pad_tokens_to=num_tokens, pad_seqs_to=num_seqs,
                        pad_blocks_to=max_blocks_per_seq)
    sampling = build_sampling_inputs([SamplingRow(SamplingParams(temperature=1.0, top_p=0.9), [0], [], 0, ())],
                                     num_seqs, cfg.vocab_size)
    lowered = _jitted_step(architecture.forward).lower(
        params, kv, jnp.asarray(batch.input_ids), jnp.asarray(batch.positions),
        _metadata(batch), SamplingMetadata.from_inputs(sampling), cfg=cfg, attention_backend=attention_backend, tp=tp,
    )
    analysis = lowered.compile().memory_analysis()
    return int(getattr(analysis, "temp_size_in_bytes", 0) or 0) if analysis is not None else 0
