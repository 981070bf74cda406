"""The functions a model step runs on the device, jitted, and their abstract signatures.

A step is two programs that hand each other the logits without leaving the device: the forward
(compiled per (tokens, sequences, block-table width) bucket; a pure-decode step's forward, "decode",
runs the attention backend's decode-only kernel) and the sampler (per sequence bucket; every
sampler feature is runtime data, see `sampling.host_inputs`). Batches that ask for prompt
logprobs run the forward with logits at every position and a sampler that also scores those
positions. `StepShapes` gives each program's arguments as abstract shapes (with their placements
under tensor parallelism), which is all that compiling one ahead of time needs (`programs`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from functools import cache
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from paxserve.core.prompt_logprobs import PROMPT_PACKED_WIDTH
from paxserve.kernels import REFERENCE, AttentionBackend, AttentionMetadata, KVCache
from paxserve.models.layer_split import split_layers
from paxserve.models.quant_weights import with_matmul_kernel
from paxserve.models.sharding import TensorParallel, stored_config
from paxserve.sampling_params import MAX_LOGPROBS
from paxserve.worker.sampling.host_inputs import PACKED_WIDTH, bitmask_width
from paxserve.worker.sampling.sampler import (
    SamplerState,
    SamplingMetadata,
    prompt_logprob_columns,
    sample,
    write_state_rows,
)
from paxserve.worker.sampling.verify import verify
from paxserve.worker.step_inputs import Batch, verify_rows

logger = logging.getLogger(__name__)

STATIC = ("cfg", "attention_backend", "tp", "aux_layers")
# The model programs, keyed (kind, tokens, sequences, block width): a plain step, a pure-decode step
# (the backend's decode-only kernel), a step with logits at every position (prompt logprobs) and a
# verifying step (speculative decoding: a logits row per sequence and per proposal it feeds).
FORWARD_KINDS = ("forward", "decode", "all_logits", "verify")


def run_forward(forward, params, kv_cache, input_ids, positions, metadata, cfg,  # noqa: ANN001, ANN202
                attention_backend: AttentionBackend, tp: TensorParallel | None, aux_layers: tuple[int, ...] = (),
                lora: Any = None, lora_slots: Any = None):
    """The model's forward on one device, or split over the mesh under tensor parallelism. With
    `aux_layers`, it also returns the hidden states an EAGLE-3 head reads; with `lora` (LoRA slots,
    models/lora.py) and `lora_slots` (each token's slot, -1 for none), each token's adapter applies."""
    lora_kw = {} if lora is None else {"lora": lora, "lora_slots": lora_slots}
    if tp is None:
        return forward(params, kv_cache, input_ids, positions, metadata, cfg, attention_backend=attention_backend,
                       **({"aux_layers": aux_layers} if aux_layers else {}), **lora_kw)
    return tp.shard_forward(forward, params, kv_cache, attention_backend=attention_backend, aux_layers=aux_layers,
                            lora=lora)(params, kv_cache, input_ids, positions, metadata,
                                       *(() if lora is None else (lora, lora_slots)))


@cache
def jitted_logits(forward: Callable[..., Any]) -> Callable[..., Any]:
    """The forward: logits [S, V] at each sequence's last token (float32, left on the device). One
    jitted function per architecture, shared by all runners. Under tensor parallelism the forward
    runs split over the mesh and the logits come back whole on every device."""

    def logits(params, kv_cache, input_ids, positions, metadata, last_token, token_source,  # noqa: ANN001, ANN202
               lora=None, lora_slots=None, *, cfg, attention_backend=REFERENCE, tp=None, aux_layers=()):  # noqa: ANN001
        input_ids = _with_last_tokens(input_ids, last_token, token_source)
        return run_forward(forward, params, kv_cache, input_ids, positions, metadata, cfg, attention_backend, tp,
                           aux_layers, lora, lora_slots)

    return jax.jit(logits, static_argnames=STATIC, donate_argnums=(1,))


def _with_last_tokens(input_ids: Int[Array, " T"], last_token: Int[Array, " R"],
                      token_source: Int[Array, " T"]) -> Int[Array, " T"]:
    """Input tokens the host did not have yet (the previous step's samples) read from the device."""
    return jnp.where(token_source >= 0, last_token[jnp.maximum(token_source, 0)], input_ids)


@cache
def jitted_all_logits(forward: Callable[..., Any]) -> Callable[..., Any]:
    """The forward with logits at every token position ([T, V] float32: the memory cost only
    batches that ask for prompt logprobs pay)."""

    def logits(params, kv_cache, input_ids: Int[Array, " T"], positions: Int[Array, " T"],  # noqa: ANN001, ANN202
               metadata: AttentionMetadata, last_token: Int[Array, " R"], token_source: Int[Array, " T"],
               lora=None, lora_slots=None, *, cfg, attention_backend=REFERENCE, tp=None, aux_layers=()):  # noqa: ANN001
        input_ids = _with_last_tokens(input_ids, last_token, token_source)
        every = metadata.replace(logits_indices=jnp.arange(input_ids.shape[0], dtype=jnp.int32))
        return run_forward(forward, params, kv_cache, input_ids, positions, every, cfg, attention_backend, tp,
                           aux_layers, lora, lora_slots)

    return jax.jit(logits, static_argnames=STATIC, donate_argnums=(1,))


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
sample_step = jax.jit(sample, donate_argnums=(2,))
sample_and_score_step = jax.jit(_sample_and_score, donate_argnums=(3,))
verify_step = jax.jit(verify, donate_argnums=(2,))
# Rewrites whole rows of the sampler state in place (compiled once per power of two of rows).
write_state_rows_step = jax.jit(write_state_rows, donate_argnums=(0,))


def write_lora_slot(slots: Any, one: Any, slot: Int[Array, ""]) -> Any:
    """LoRA slots (models/lora.py's LoraWeights, [L, S, ...] per field) with slot `slot` replaced by
    `one`'s only slot ([L, 1, ...]). The model runner jits it with the slots donated, so the write is
    in place."""
    return slots.replace_slot(slot, one)


def attention_metadata(batch: Batch, on_host: bool = False) -> AttentionMetadata:
    """The batch's attention arrays on the device, or (`on_host`) as numpy arrays for a compiled
    program to copy itself."""
    put = np.asarray if on_host else jnp.asarray
    return AttentionMetadata(
        slot_mapping=put(batch.slot_mapping),
        block_tables=put(batch.block_tables),
        context_lens=put(batch.context_lens),
        query_start_loc=put(batch.query_start_loc),
        logits_indices=put(batch.logits_indices),
    )


def _shape(shape: tuple[int, ...], dtype: Any, sharding: Any = None) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)


@dataclass(frozen=True)
class StepShapes:
    """Abstract arguments of the step programs for one engine (its model, cache and batch limits)."""

    cfg: Any  # the whole model's config (the forward splits it under tensor parallelism)
    architecture: Any
    dtype: np.dtype
    block_size: int
    num_blocks: int
    num_state_rows: int
    attention_backend: AttentionBackend = REFERENCE
    tp: TensorParallel | None = None
    quantization: Any = None  # the WeightQuantization the linear weights were loaded with, if any
    kv_dtype: Any = None  # the KV cache's dtype when it is not the model's (fp8)
    matmul_kernel: Any = None  # the MatmulKernel quantized weights run on (None: XLA's matmul)
    num_spec_tokens: int = 0  # speculative decoding's k: a sequence verifies at most k proposals
    aux_layers: tuple[int, ...] = ()  # forwards also return these layers' input streams (an EAGLE-3 head's)
    lora: tuple[int, int] | None = None  # (slots, max rank): forwards take LoRA slots and each token's slot
    # Params with one array per layer (models/layer_split.py), or stacked as loaded (--enforce-eager).
    split_layers: bool = True

    @property
    def verify_width(self) -> int:
        return 1 + self.num_spec_tokens

    def verify_rows(self, t: int, s: int) -> int:
        """A verifying program's logits rows for t tokens of s sequences (`InputBatch` pads to them)."""
        return verify_rows(t, s, self.verify_width)

    @property
    def _replicated(self) -> Any:
        return None if self.tp is None else self.tp.replicated

    def params(self) -> Any:
        make = lambda c: self.architecture.abstract_params(c, self.dtype, self.quantization)  # noqa: E731
        params = make(self.cfg) if self.tp is None else self.tp.abstract_params(make)
        params = split_layers(params) if self.split_layers else params
        return params if self.matmul_kernel is None else with_matmul_kernel(params, self.matmul_kernel)

    def kv_cache(self) -> KVCache:
        heads = self.cfg.num_kv_heads if self.tp is None else self.tp.num_kv_heads_stored
        shape = (self.cfg.num_layers, self.num_blocks, self.block_size, heads, self.cfg.head_dim)
        dtype = self.dtype if self.kv_dtype is None else self.kv_dtype
        cache = jax.eval_shape(lambda: KVCache.zeros(*shape, dtype))
        if self.tp is None:
            return cache
        return jax.tree.map(lambda leaf, sharding: _shape(leaf.shape, leaf.dtype, sharding), cache,
                            self.tp.kv_cache_shardings(cache))

    def sampler_state(self) -> SamplerState:
        r, v, w = self.num_state_rows, self.cfg.vocab_size, bitmask_width(self.cfg.vocab_size)
        return SamplerState(counts=_shape((r, v), jnp.int32, self._replicated),
                            prompt_mask=_shape((r, w), jnp.int32, self._replicated),
                            bias=_shape((r, v), jnp.float32, self._replicated),
                            suppress_mask=_shape((r, w), jnp.int32, self._replicated),
                            last_token=_shape((r,), jnp.int32, self._replicated))

    def sampling(self, s: int) -> SamplingMetadata:
        f32, i32 = jnp.float32, jnp.int32
        return SamplingMetadata(
            temperature=_shape((s,), f32), top_k=_shape((s,), i32), top_p=_shape((s,), f32),
            min_p=_shape((s,), f32), seed=_shape((s, 2), jnp.uint32), step=_shape((s,), i32),
            min_tokens=_shape((s,), i32), presence_penalty=_shape((s,), f32), frequency_penalty=_shape((s,), f32),
            repetition_penalty=_shape((s,), f32), logprobs=_shape((s,), bool), state_row=_shape((s,), i32),
            batch_row=_shape((s,), i32), keep=_shape((s,), bool),
            allowed_token_bitmask=_shape((s, bitmask_width(self.cfg.vocab_size)), i32),
            logprob_ids=_shape((s, MAX_LOGPROBS), i32))

    def lora_weights(self) -> Any:
        """The LoRA slots' abstract arrays (models/lora.py), placed as `TensorParallel.place_lora` does."""
        from paxserve.models.lora import abstract_weights

        num_slots, max_rank = self.lora
        # Under tensor parallelism, the model as the mesh stores it (KV heads repeated up to the devices).
        cfg = self.cfg if self.tp is None else stored_config(self.cfg, self.tp.size)
        host = abstract_weights(cfg, self.architecture.layout(cfg), num_slots, max_rank, self.dtype)
        return host if self.tp is None else self.tp.abstract_lora(host)

    def forward_args(self, t: int, s: int, b: int, logits_rows: int | None = None) -> tuple[Any, ...]:
        i32 = jnp.int32
        metadata = AttentionMetadata(slot_mapping=_shape((t,), i32), block_tables=_shape((s, b), i32),
                                     context_lens=_shape((s,), i32), query_start_loc=_shape((s + 1,), i32),
                                     logits_indices=_shape((logits_rows or s,), i32))
        args = (self.params(), self.kv_cache(), _shape((t,), i32), _shape((t,), i32), metadata,
                _shape((self.num_state_rows,), i32, self._replicated), _shape((t,), i32))
        return args if self.lora is None else (*args, self.lora_weights(), _shape((t,), i32, self._replicated))

    def fingerprint(self, kind: str) -> str:
        """What shapes a program of `kind` here (besides JAX, the devices and the source): the model's
        config, dtype and split, the number of state rows; the forward's cache shape and attention
        backend."""
        tp = None if self.tp is None else (self.tp.size, self.tp.expert_parallel)
        common = f"{self.cfg!r}|{self.dtype}|{self.quantization!r}|{self.matmul_kernel!r}|{self.kv_dtype}|{tp!r}|{kind}"
        if kind.startswith("verify"):
            common += f"|{self.verify_width}"
        if kind in FORWARD_KINDS:
            if self.aux_layers:
                common += f"|aux{self.aux_layers}"
            if self.lora is not None:
                common += f"|lora{self.lora}"
            if not self.split_layers:
                common += "|stacked"
            return f"{common}|{self.attention_backend!r}|{self.num_blocks}x{self.block_size}|{self.num_state_rows}"
        return f"{common}|{self.num_state_rows}"

    def statics(self, kind: str = "forward") -> dict[str, Any]:
        backend = replace(self.attention_backend, pure_decode=True) if kind == "decode" else self.attention_backend
        statics = dict(cfg=self.cfg, attention_backend=backend, tp=self.tp)
        return statics | ({"aux_layers": self.aux_layers} if self.aux_layers and kind in FORWARD_KINDS else {})

    def spec(self, key: tuple[Any, ...]) -> tuple[Callable[[], Any], tuple[Any, ...], Any]:
        """(lower, arguments, example output) of the program `key` names (see `programs`)."""
        kind, *sizes = key
        vocab = self.cfg.vocab_size
        if kind in FORWARD_KINDS:
            t, s, b = sizes
            # The all-positions program takes one logits index per sequence (it makes its own for every
            # position); a verifying one takes its sequences' rows (1 + their proposals each), padded.
            rows = t if kind == "all_logits" else self.verify_rows(t, s) if kind == "verify" else s
            args = self.forward_args(t, s, b, rows if kind == "verify" else None)
            fn = jitted_all_logits if kind == "all_logits" else jitted_logits
            out = (_shape((rows, vocab), jnp.float32, self._replicated), args[1])
            if self.aux_layers:
                out += (_shape((t, len(self.aux_layers) * self.cfg.hidden_size), self.dtype, self._replicated),)
            return (lambda: fn(self.architecture.forward).lower(*args, **self.statics(kind))), args, out
        if kind == "sample":
            (s,) = sizes
            args = (_shape((s, vocab), jnp.float32, self._replicated), self.sampling(s), self.sampler_state())
            out = (_shape((s, PACKED_WIDTH), jnp.float32), args[2])
            return (lambda: sample_step.lower(*args)), args, out
        if kind == "verify_sample":
            (n,) = sizes
            args = (_shape((n, vocab), jnp.float32, self._replicated), self.sampling(n), self.sampler_state(),
                    _shape((n,), jnp.int32), _shape((n, self.num_spec_tokens), jnp.int32))
            out = (_shape((n, PACKED_WIDTH), jnp.float32), args[2])
            return (lambda: verify_step.lower(*args)), args, out
        if kind == "score":
            t, s = sizes
            args = (_shape((t, vocab), jnp.float32, self._replicated), _shape((s,), jnp.int32), self.sampling(s),
                    self.sampler_state(), _shape((t,), jnp.int32))
            out = (_shape((s * PACKED_WIDTH + t * PROMPT_PACKED_WIDTH,), jnp.float32), args[3])
            return (lambda: sample_and_score_step.lower(*args)), args, out
        raise ValueError(f"unknown step program {key!r}")


def measure_activation_bytes(shapes: StepShapes, max_tokens: int, max_seqs: int, max_blocks_per_seq: int) -> int:
    """Temporary memory XLA plans for the largest step bucket, from shapes alone (no weights are
    needed), so memory planning can reserve it before the KV cache takes the rest (per device,
    under tensor parallelism). Of the two step pipelines the heavier counts: a plain step (logits for
    one row per sequence, then the sampler with every stage: penalties, filters, top logprobs) or a
    step with prompt logprobs (logits for every token, then sampling and scoring them), whose
    [tokens, vocab] float32 logits dominate for large vocabularies."""
    from paxserve.worker.step_inputs import next_power_of_2

    t, s = next_power_of_2(max_tokens), next_power_of_2(max_seqs)
    vocab = shapes.cfg.vocab_size
    peaks = {}
    for forward_kind, sampler_key, rows in (("forward", ("sample", s), s), ("all_logits", ("score", t, s), t)):
        forward, _, _ = shapes.spec((forward_kind, t, s, max_blocks_per_seq))
        sampler, _, _ = shapes.spec(sampler_key)
        # The logits are the forward's output and the sampler's input: count them once, beside both.
        peaks[forward_kind] = sum(_temp_bytes(lower()) for lower in (forward, sampler)) + rows * vocab * 4
    logger.info("activation peak: %.1f MiB for a plain step, %.1f MiB for one with prompt logprobs (%d tokens x %d "
                "sequences); reserving the larger", peaks["forward"] / 2**20, peaks["all_logits"] / 2**20, t, s)
    return max(peaks.values())


def _temp_bytes(lowered: Any) -> int:
    analysis = lowered.compile().memory_analysis()
    return int(getattr(analysis, "temp_size_in_bytes", 0) or 0) if analysis is not None else 0
