"""Runs one padded batch through the jitted model step, owning the device-side KV cache and the
sampler's per-request state.

Shapes are bucketed to powers of two (tokens x sequences x block-table width), and those three are
the only compile keys: every sampler feature is runtime data (see `sampling_metadata`), so XLA
compiles a bounded set of programs; each new bucket is logged when it compiles.
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
from paxserve.prompt_logprobs import PROMPT_PACKED_WIDTH, PromptLogprobsInputs
from paxserve.sampler import (
    SamplerState,
    SamplingMetadata,
    prompt_logprob_columns,
    sample,
    state_writes_args,
    write_state_rows,
)
from paxserve.sampling_metadata import PACKED_WIDTH, SampledTokens, SamplingInputs, StateWrites, unpack
from paxserve.sampling_params import MAX_LOGPROBS
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

    def step(params, kv_cache, sampler_state, input_ids, positions, metadata, sampling, cfg,  # noqa: ANN001, ANN202
             attention_backend=REFERENCE, tp=None):  # noqa: ANN001
        logits, kv_cache = _run_forward(forward, params, kv_cache, input_ids, positions, metadata, cfg,
                                        attention_backend, tp)
        packed, sampler_state = sample(logits, sampling, sampler_state)
        return packed, kv_cache, sampler_state

    return jax.jit(step, static_argnames=_STATIC, donate_argnums=(1, 2))


@cache
def _jitted_prompt_logprobs_step(forward: Callable[..., Any]) -> Callable[..., Any]:
    """The step of a batch in which some request asks for prompt logprobs: the forward returns
    logits for every token position ([T, V] float32, the memory cost that only such batches pay),
    the sequences' rows are sampled as in `_jitted_step`, and every position gets its prompt-logprob
    columns (the top MAX_LOGPROBS, whatever the requests asked: the host keeps what each asked for,
    and the width is no compile key). Both results leave the device as one flat float32 array (one
    host copy). It goes through the same `_run_forward`, so tensor parallelism gathers the logits
    as usual."""

    def step(params, kv_cache, sampler_state, input_ids: Int[Array, " T"],  # noqa: ANN001, ANN202
             positions: Int[Array, " T"], metadata: AttentionMetadata, sampling: SamplingMetadata,
             targets: Int[Array, " T"], cfg, attention_backend=REFERENCE, tp=None):  # noqa: ANN001
        every = metadata.replace(logits_indices=jnp.arange(input_ids.shape[0], dtype=jnp.int32))
        logits, kv_cache = _run_forward(forward, params, kv_cache, input_ids, positions, every, cfg,
                                        attention_backend, tp)
        sampled, sampler_state = sample(logits[metadata.logits_indices], sampling, sampler_state)
        prompt = prompt_logprob_columns(logits, targets, MAX_LOGPROBS)
        return jnp.concatenate([sampled.reshape(-1), prompt.reshape(-1)]), kv_cache, sampler_state

    return jax.jit(step, static_argnames=_STATIC, donate_argnums=(1, 2))


# Rewrites whole rows of the sampler state in place (compiled once per power of two of rows).
_write_state_rows = jax.jit(write_state_rows, donate_argnums=(0,))


def _metadata(batch: Batch) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=jnp.asarray(batch.slot_mapping),
        block_tables=jnp.asarray(batch.block_tables),
        context_lens=jnp.asarray(batch.context_lens),
        query_start_loc=jnp.asarray(batch.query_start_loc),
        logits_indices=jnp.asarray(batch.logits_indices),
    )


class ModelRunner:
    """Params + KV cache + sampler state + jitted steps. The cache and the state are donated to every
    step and replaced by its outputs, so XLA updates them in place."""

    def __init__(self, model: LoadedModel, num_blocks: int, block_size: int, max_model_len: int | None = None,
                 attention_backend: AttentionBackend = REFERENCE, max_num_seqs: int = 256) -> None:
        if block_size not in (8, 16, 32):
            raise ValueError(f"block_size must be one of 8, 16, 32, got {block_size}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.attention_backend = attention_backend  # static argument of every jitted step
        self.max_blocks_per_seq = -(-(max_model_len or cfg.max_position_embeddings) // block_size)
        self._num_blocks = num_blocks
        # Row 0 is the all-zero row of requests without state; each running request may hold one more.
        self.num_state_rows = max_num_seqs + 1
        self.kv_cache = self._new_kv_cache()
        self.sampler_state = self._new_sampler_state()
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

    def _new_sampler_state(self) -> SamplerState:
        make = lambda: SamplerState.zeros(self.num_state_rows, self.model.config.vocab_size)  # noqa: E731
        tp = self.model.tp
        # Under tensor parallelism sampling runs alike on every device, on the gathered logits.
        return make() if tp is None else jax.jit(make, out_shardings=tp.replicated)()

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    def kv_cache_intact(self) -> bool:
        """Whether the cache and the sampler state still exist and hold a value: a step they were
        donated to may have deleted them, or left them poisoned by an asynchronous runtime error."""
        try:
            leaves = jax.tree.leaves((self.kv_cache, self.sampler_state))
            if any(leaf.is_deleted() for leaf in leaves):
                return False
            jax.block_until_ready(leaves)
            return True
        except Exception:  # noqa: BLE001 - any failure to produce the value means it is lost
            return False

    def reset_kv_cache(self) -> None:
        """Replace a lost cache and sampler state with zeroed ones of the same shape (their old
        contents are gone: every running request must be recomputed)."""
        for leaf in jax.tree.leaves((self.kv_cache, self.sampler_state)):
            try:
                leaf.delete()  # free device memory first, so old and new never coexist
            except Exception:  # noqa: BLE001 - already deleted or never materialised
                pass
        self.kv_cache = self._new_kv_cache()
        self.sampler_state = self._new_sampler_state()

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

    def write_sampler_state(self, writes: StateWrites) -> None:
        """Set the state rows of requests that start running (before the step that first samples
        them)."""
        self.sampler_state = _write_state_rows(self.sampler_state, *state_writes_args(writes))

    def execute(self, batch: Batch, sampling: SamplingInputs) -> SampledTokens:
        """One engine step: forward, sample on the device, one device-to-host copy."""
        self._note_bucket((batch.input_ids.shape[0], batch.context_lens.shape[0], batch.block_tables.shape[1]))
        packed, self.kv_cache, self.sampler_state = _jitted_step(self.model.architecture.forward)(
            self.model.params, self.kv_cache, self.sampler_state, jnp.asarray(batch.input_ids),
            jnp.asarray(batch.positions), _metadata(batch), SamplingMetadata.from_inputs(sampling),
            cfg=self.model.config, attention_backend=self.attention_backend, tp=self.model.tp,
        )
        return unpack(np.asarray(packed), batch.num_seqs)

    def execute_with_prompt_logprobs(self, batch: Batch, sampling: SamplingInputs,
                                     prompt: PromptLogprobsInputs) -> tuple[SampledTokens, np.ndarray]:
        """`execute` plus prompt logprobs: also returns the packed [T, PROMPT_PACKED_WIDTH] float32
        rows of every flat position. Its programs are keyed by the plain step's bucket alone."""
        t, s = batch.input_ids.shape[0], batch.context_lens.shape[0]
        if prompt.targets.shape[0] != t:
            raise ValueError(f"prompt logprob targets cover {prompt.targets.shape[0]} positions, the batch {t}")
        self._note_bucket(("prompt_logprobs", t, s, batch.block_tables.shape[1]))
        packed, self.kv_cache, self.sampler_state = _jitted_prompt_logprobs_step(self.model.architecture.forward)(
            self.model.params, self.kv_cache, self.sampler_state, jnp.asarray(batch.input_ids),
            jnp.asarray(batch.positions), _metadata(batch), SamplingMetadata.from_inputs(sampling),
            jnp.asarray(prompt.targets), cfg=self.model.config, attention_backend=self.attention_backend,
            tp=self.model.tp,
        )
        flat = np.asarray(packed)
        num_sampled = s * PACKED_WIDTH
        sampled = unpack(flat[:num_sampled].reshape(s, PACKED_WIDTH), batch.num_seqs)
        return sampled, flat[num_sampled:].reshape(t, PROMPT_PACKED_WIDTH)


def measure_activation_bytes(
    model_cfg: Any, architecture: Any, dtype: np.dtype, block_size: int, max_tokens: int, max_seqs: int,
    max_blocks_per_seq: int, attention_backend: AttentionBackend = REFERENCE, tp: TensorParallel | None = None,
) -> int:
    """Temporary memory XLA plans for the largest step bucket, from shapes alone (no weights are
    needed), so memory planning can reserve it before the KV cache takes the rest (per device,
    under tensor parallelism). The one program holds every sampler stage (penalties, filters,
    logprobs), so its peak is that of the heaviest mix of requests."""
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
    state = jax.eval_shape(lambda: SamplerState.zeros(max_seqs + 1, cfg.vocab_size))
    if tp is not None:
        state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=tp.replicated), state)
    chunk = SeqChunk([0], 0, [1])
    batch = build_batch([chunk], block_size, pad_tokens_to=num_tokens, pad_seqs_to=num_seqs,
                        pad_blocks_to=max_blocks_per_seq)
    sampling = build_sampling_inputs([SamplingRow(SamplingParams(temperature=1.0, top_p=0.9), [0], [], 0, ())],
                                     num_seqs, cfg.vocab_size)
    lowered = _jitted_step(architecture.forward).lower(
        params, kv, state, jnp.asarray(batch.input_ids), jnp.asarray(batch.positions),
        _metadata(batch), SamplingMetadata.from_inputs(sampling), cfg=cfg, attention_backend=attention_backend, tp=tp,
    )
    analysis = lowered.compile().memory_analysis()
    return int(getattr(analysis, "temp_size_in_bytes", 0) or 0) if analysis is not None else 0
