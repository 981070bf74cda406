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
from jaxtyping import Array, Float, Int

from models.loader import LoadedModel
from models.sharding import TensorParallel
from paxserve.batch import Batch, SeqChunk, build_batch, next_power_of_2
from paxserve.input_batch import InputBatch
from paxserve.prompt_logprobs import PROMPT_PACKED_WIDTH, PromptLogprobsInputs
from paxserve.sampler import (
    SamplerState,
    SamplingMetadata,
    prompt_logprob_columns,
    sample,
    state_writes_args,
    write_state_rows,
)
from paxserve.sampling_metadata import (
    PACKED_WIDTH,
    ConstrainedRows,
    SampledTokens,
    SamplingInputs,
    StateWrites,
    bitmask_width,
    build_state_writes,
    unpack,
)
from paxserve.sampling_params import MAX_LOGPROBS
from paxserve.scheduler import SchedulerOutput
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
    """The forward: logits [S, V] at each sequence's last token (float32, left on the device). One
    jitted function per architecture, shared by all runners, so XLA's cache (keyed by the static
    config and shapes) is reused across runners. Under tensor parallelism the forward runs split
    over the mesh and the logits come back whole on every device."""

    def logits(params, kv_cache, input_ids, positions, metadata, cfg,  # noqa: ANN001, ANN202
               attention_backend=REFERENCE, tp=None):  # noqa: ANN001
        return _run_forward(forward, params, kv_cache, input_ids, positions, metadata, cfg, attention_backend, tp)

    return jax.jit(logits, static_argnames=_STATIC, donate_argnums=(1,))


@cache
def _jitted_all_logits(forward: Callable[..., Any]) -> Callable[..., Any]:
    """The forward with logits at every token position ([T, V] float32: the memory cost only
    batches that ask for prompt logprobs pay)."""

    def logits(params, kv_cache, input_ids: Int[Array, " T"], positions: Int[Array, " T"],  # noqa: ANN001, ANN202
               metadata: AttentionMetadata, cfg, attention_backend=REFERENCE, tp=None):  # noqa: ANN001
        every = metadata.replace(logits_indices=jnp.arange(input_ids.shape[0], dtype=jnp.int32))
        return _run_forward(forward, params, kv_cache, input_ids, positions, every, cfg, attention_backend, tp)

    return jax.jit(logits, static_argnames=_STATIC, donate_argnums=(1,))


def _sample_and_score(logits: Float[Array, "T V"], logits_indices: Int[Array, " S"], sampling: SamplingMetadata,
                      sampler_state: SamplerState, targets: Int[Array, " T"]) -> tuple[jax.Array, SamplerState]:
    """Sample each sequence's row of the all-positions logits and give every position its
    prompt-logprob columns (the top MAX_LOGPROBS, whatever the requests asked: the host keeps what
    each asked for), as one flat float32 array (one host copy)."""
    sampled, sampler_state = sample(logits[logits_indices], sampling, sampler_state)
    prompt = prompt_logprob_columns(logits, targets, MAX_LOGPROBS)
    return jnp.concatenate([sampled.reshape(-1), prompt.reshape(-1)]), sampler_state


# Sampling is its own program, run on the forward's logits without leaving the device: it compiles
# once per sequence bucket, not once per (tokens, sequences, block-table width) bucket of the model.
_sample = jax.jit(sample, donate_argnums=(2,))
_sample_and_score_jit = jax.jit(_sample_and_score, donate_argnums=(3,))
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
        self.input_batch = InputBatch(max_num_seqs, self.max_blocks_per_seq, block_size, cfg.vocab_size)
        self.kv_cache = self._new_kv_cache()
        self.sampler_state = self._new_sampler_state()
        self.compiled: set[tuple] = set()  # compiled step shapes, for the log and for tests
        self._all_allowed: dict[int, jax.Array] = {}  # the bitmask of steps without constrained rows, by S

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

    def buckets(self, num_tokens: int, num_seqs: int, widest: int) -> tuple[int, int, int]:
        """A step's padded sizes, its compile key: powers of two in tokens, sequences and block-table
        width (the width capped at what one sequence may hold)."""
        return (next_power_of_2(num_tokens), next_power_of_2(num_seqs),
                min(next_power_of_2(widest), max(widest, self.max_blocks_per_seq)))

    def build(self, chunks: list[SeqChunk]) -> Batch:
        """Pad a list of chunks to its bucket (tests, warm-up, tools; the engine's steps come from the
        persistent batch)."""
        t, s, b = self.buckets(sum(len(c.token_ids) for c in chunks), len(chunks),
                               max(len(c.block_table) for c in chunks))
        return build_batch(chunks, self.block_size, pad_tokens_to=t, pad_seqs_to=s, pad_blocks_to=b)

    # ---- the engine's steps: the persistent batch -------------------------------------------------

    def update_rows(self, out: SchedulerOutput) -> None:
        """Apply what the schedule changed to the persistent batch: rows of requests that stopped
        running go back, requests that start running take rows (their sampler state is written
        now), running ones get this step's new blocks."""
        for request_id in out.left_running_ids:
            self.input_batch.remove(request_id)
        writes = []
        for new in out.new_requests:
            row = self.input_batch.add(new)
            if row is not None:
                writes.append((row.state_row, row))
        for s in out.scheduled:
            if s.new_block_ids:
                self.input_batch.append_blocks(s.request_id, s.new_block_ids)
        if writes:
            self.write_sampler_state(build_state_writes(writes, self.num_state_rows, self.model.config.vocab_size))

    def execute_model(self, out: SchedulerOutput, constrained: ConstrainedRows | None = None,
                      prompt: PromptLogprobsInputs | None = None) -> tuple[SampledTokens, np.ndarray | None]:
        """Run the scheduled rows (after `update_rows`): the batch is gathered from the persistent
        batch, constrained rows' bitmask words (plain data from the engine core) are placed in an
        all-ones bitmask, and the rows' kept tokens are recorded. With `prompt`, also returns the
        prompt-logprob rows (see `execute_with_prompt_logprobs`)."""
        step = self.input_batch.prepare(out.scheduled, self.buckets)
        if constrained is not None:
            bitmask = np.full((step.batch.context_lens.shape[0], constrained.words.shape[1]), -1, np.int32)
            bitmask[constrained.rows] = constrained.words
            step.sampling.allowed_token_bitmask = bitmask
        prompt_rows = None
        if prompt is None:
            sampled = self.execute(step.batch, step.sampling)
        else:
            prompt = prompt.padded(step.batch.input_ids.shape[0])
            sampled, prompt_rows = self.execute_with_prompt_logprobs(step.batch, step.sampling, prompt)
        self.input_batch.record(step, sampled.token_ids)
        return sampled, prompt_rows

    def _note_bucket(self, key: tuple) -> None:
        if key not in self.compiled:
            self.compiled.add(key)
            logger.info("compiling model step for bucket %s (%d compiled so far)", key, len(self.compiled))

    def _sampling_metadata(self, sampling: SamplingInputs) -> SamplingMetadata:
        s = sampling.temperature.shape[0]
        if sampling.allowed_token_bitmask is None and s not in self._all_allowed:
            self._all_allowed[s] = jnp.full((s, bitmask_width(self.model.config.vocab_size)), -1, jnp.int32)
        return SamplingMetadata.from_inputs(sampling, self._all_allowed.get(s))

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
        """One engine step: the forward, sampling on the device, one device-to-host copy."""
        self._note_bucket((batch.input_ids.shape[0], batch.context_lens.shape[0], batch.block_tables.shape[1]))
        logits, self.kv_cache = _jitted_logits(self.model.architecture.forward)(
            self.model.params, self.kv_cache, jnp.asarray(batch.input_ids), jnp.asarray(batch.positions),
            _metadata(batch), cfg=self.model.config, attention_backend=self.attention_backend, tp=self.model.tp,
        )
        packed, self.sampler_state = _sample(logits, self._sampling_metadata(sampling), self.sampler_state)
        return unpack(np.asarray(packed), batch.num_seqs)

    def execute_with_prompt_logprobs(self, batch: Batch, sampling: SamplingInputs,
                                     prompt: PromptLogprobsInputs) -> tuple[SampledTokens, np.ndarray]:
        """`execute` plus prompt logprobs: also returns the packed [T, PROMPT_PACKED_WIDTH] float32
        rows of every flat position. Its programs are keyed by the plain step's bucket alone."""
        t, s = batch.input_ids.shape[0], batch.context_lens.shape[0]
        if prompt.targets.shape[0] != t:
            raise ValueError(f"prompt logprob targets cover {prompt.targets.shape[0]} positions, the batch {t}")
        self._note_bucket(("prompt_logprobs", t, s, batch.block_tables.shape[1]))
        metadata = _metadata(batch)
        logits, self.kv_cache = _jitted_all_logits(self.model.architecture.forward)(
            self.model.params, self.kv_cache, jnp.asarray(batch.input_ids), jnp.asarray(batch.positions), metadata,
            cfg=self.model.config, attention_backend=self.attention_backend, tp=self.model.tp,
        )
        packed, self.sampler_state = _sample_and_score_jit(
            logits, metadata.logits_indices, self._sampling_metadata(sampling), self.sampler_state,
            jnp.asarray(prompt.targets))
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
    forward = _jitted_logits(architecture.forward).lower(
        params, kv, jnp.asarray(batch.input_ids), jnp.asarray(batch.positions), _metadata(batch), cfg=cfg,
        attention_backend=attention_backend, tp=tp)
    logits = jax.ShapeDtypeStruct((num_seqs, cfg.vocab_size), jnp.float32)
    sampler = _sample.lower(logits, SamplingMetadata.from_inputs(sampling), state)
    # The logits are the forward's output and the sampler's input: count them once, beside both.
    return sum(_temp_bytes(lowered) for lowered in (forward, sampler)) + num_seqs * cfg.vocab_size * 4


def _temp_bytes(lowered: Any) -> int:
    analysis = lowered.compile().memory_analysis()
    return int(getattr(analysis, "temp_size_in_bytes", 0) or 0) if analysis is not None else 0
