"""Runs the engine's steps on the device: owns the KV cache, the sampler's per-request state, the
persistent batch and the compiled step programs.

Shapes are bucketed (tokens x sequences x block-table width: powers of two, on a CPU also three
quarters of one for tokens and sequences), and those three are the only compile keys of the forward
(with its kind: a pure-decode step, one token per sequence, is a "decode" program on the attention
backend's decode-only kernel when it has one; the sampler's key is the sequence bucket alone): every
sampler feature is runtime data (see
`sampling.host_inputs`). Programs are compiled ahead of time and stored
(`programs`); a step whose bucket is not compiled yet runs in a compiled bucket that covers it, if
one costs at most `_COVER_COST` times as much, while its own compiles in the background; growing
contexts and batches have the next bucket compiled before they reach it (batches only while the steps
are quiet, on a CPU). A stored program counts as compiled: it loads the first time a step runs it.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int
from tqdm.auto import tqdm

from paxserve.core.prompt_logprobs import PROMPT_PACKED_WIDTH, PromptLogprobsInputs
from paxserve.core.scheduler import SchedulerOutput
from paxserve.kernels import REFERENCE, AttentionBackend, KVCache
from paxserve.models.config import ModelConfig
from paxserve.models.loader import LoadedModel
from paxserve.models.layer_split import take_over_layers
from paxserve.models.quant_weights import matmul_kernel
from paxserve.models.sharding import TensorParallel
from paxserve.sampling_params import MAX_LOGPROBS
from paxserve.worker.input_batch import InputBatch, PreparedStep
from paxserve.worker.programs import Programs, environment_fingerprint, source_fingerprint
from paxserve.worker.sampling.host_inputs import (
    PACKED_WIDTH,
    ConstrainedRows,
    SampledTokens,
    SamplingInputs,
    StateWrites,
    bitmask_width,
    build_state_writes,
    unpack,
)
from paxserve.worker.sampling.sampler import SamplerState, SamplingMetadata, state_writes_args
from paxserve.worker.step_functions import (
    FORWARD_KINDS,
    StepShapes,
    attention_metadata,
    write_lora_slot,
    write_state_rows_step,
)
from paxserve.worker.step_inputs import Batch, bucket_size, bucket_sizes, next_power_of_2

logger = logging.getLogger(__name__)

# A step may run in a compiled bucket that costs up to this many times its own (tokens x sequences
# x block width) while its own compiles in the background; a larger one is not worth it.
_COVER_COST = 4
# Warm-up's single-sequence decode steps (block widths): within `_COVER_COST` they serve every context
# of 1-8 blocks (a chat prompt and a short first answer: 128 tokens at block size 16).
_WARM_DECODE_WIDTHS = (_COVER_COST, 2 * _COVER_COST)
# On a CPU the steps and the compiles share the cores (a background compile made the 40-token answers
# of the bundled model 2-2.5x slower): a guess at a program compiles only once no step has run for
# this long. Steps follow each other within milliseconds while requests run.
_QUIET_S = 0.5
# The device calls a multi-host rank 0 publishes (`plan_sink`), and the end of its engine. A
# drafter's passes are published as their own kinds (`paxserve.spec_decode`).
WRITE_STATE, WRITE_LORA, DISPATCH, STOP = "write_state", "write_lora", "dispatch", "stop"


@dataclass(slots=True)
class ModelStep:
    """An engine step in flight: its host-side rows and its device work."""

    prepared: PreparedStep
    device: "DeviceStep"


@dataclass(slots=True)
class DeviceStep:
    """A step dispatched to the device whose results have not been copied back yet."""

    packed: jax.Array  # the sampler's packed output (flat, with the prompt-logprob rows after it)
    num_seqs: int  # real rows
    num_rows: int  # padded rows
    num_prompt_positions: int | None  # padded token positions scored, for a prompt-logprobs step
    # The step's hidden states at `aux_layers`' inputs (an EAGLE-3 head reads them), on the device:
    # with async scheduling a step completes after its successor dispatched, so they travel with it.
    aux: jax.Array | None = None
    # The runner's count of steps dispatched before this one: the same on every rank of a
    # multi-host engine (workers replay every dispatch), so a drafter's pass can name the steps
    # whose hidden states it reads.
    index: int = -1
    # Rows that asked for more top logprobs than the packed columns hold: their whole log-softmax
    # rows (padded to a power of two with copies of the last) and which sampler rows they are.
    wide: jax.Array | None = None
    wide_rows: list[int] | None = None


def zeroed_kv_cache(cfg: ModelConfig, tp: TensorParallel | None, num_blocks: int, block_size: int,
                    dtype: np.dtype) -> KVCache:
    """A zeroed KV cache for a model of `cfg`, split over `tp`'s mesh by KV heads when given."""
    if tp is None:
        return KVCache.zeros(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype)
    # Made in place on the mesh (each device zeroes only its KV heads), never whole on one device.
    heads = tp.num_kv_heads_stored
    make = lambda: KVCache.zeros(cfg.num_layers, num_blocks, block_size, heads, cfg.head_dim, dtype)  # noqa: E731
    return jax.jit(make, out_shardings=tp.kv_cache_shardings(jax.eval_shape(make)))()


def zero_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: np.dtype) -> Future[KVCache]:
    """A single-device KV cache zeroed on threads, K and V each on its own. Zeroing touches every page
    of a cache of GiBs (1.3-2.5 s for 4 GiB on the 2-core CPU, mostly page faults), which this way runs
    beside the weights' loading; JAX releases the GIL while it fills a buffer."""
    shape = KVCache.array_shape(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    pool = ThreadPoolExecutor(2, thread_name_prefix="paxserve-kv-zero")
    k, v = (pool.submit(jnp.zeros, shape, KVCache.storage_dtype(dtype)) for _ in range(2))
    future = pool.submit(lambda: KVCache.of_pages(k.result(), v.result(), dtype))
    pool.shutdown(wait=False)
    return future


class ModelRunner:
    """Params + KV cache + sampler state + persistent batch + compiled programs. The cache and the
    state are donated to every step and replaced by its outputs, so XLA updates them in place.

    `program_store`: a directory for compiled programs (None: compile in this process only);
    `background_compile`: compile a missing bucket off the step thread while a covering one serves;
    `kv_cache`: a zeroed cache made beforehand (`zero_kv_cache`, while the weights loaded), else one
    is made here; `plan_sink`: on rank 0 of a multi-host engine, where each device call's plain
    inputs go before the call is made, for the workers to make it too (`paxserve.distributed.worker_loop`);
    `lora`: (slots, max rank) of the LoRA adapters the device holds at once (models/lora.py): every
    forward takes the slots and each token's slot, so any mix of adapters runs in the same programs."""

    def __init__(self, model: LoadedModel, num_blocks: int, block_size: int, max_model_len: int | None = None,
                 attention_backend: AttentionBackend = REFERENCE, max_num_seqs: int = 256,
                 program_store: Path | None = None, background_compile: bool = False,
                 kv_cache: KVCache | None = None, plan_sink: Callable[[tuple], None] | None = None,
                 kv_cache_dtype: np.dtype | None = None, kv_scales: tuple[np.ndarray, np.ndarray] | None = None,
                 num_spec_tokens: int = 0, aux_layers: tuple[int, ...] = (),
                 lora: tuple[int, int] | None = None, split_layers: bool = True) -> None:
        if block_size not in (8, 16, 32):
            raise ValueError(f"block_size must be one of 8, 16, 32, got {block_size}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        cfg = model.config
        if split_layers:  # one array per layer: small passes run the layers unrolled, no weight copies
            take_over_layers(model)
        self.model = model
        self.block_size = block_size
        self.attention_backend = attention_backend  # static argument of every program
        # Pure-decode steps get their own programs, on the backend's decode-only kernel.
        self.decode_kind = "decode" if attention_backend.decode_kernel else "forward"
        # Buckets between powers of two (`bucket_size`) where a padded row costs its full share of the
        # step: on a CPU the step is compute-bound (measured in benchmarks/RESULTS.md). On a GPU a decode
        # step is bound by reading weights and KV, so padded rows cost little, and the Triton kernel
        # takes the step's tokens as one block, which Triton needs to be a power of two.
        self.fine_buckets = attention_backend.name == "reference" and jax.devices()[0].platform == "cpu"
        self.max_blocks_per_seq = -(-(max_model_len or cfg.max_position_embeddings) // block_size)
        self._num_blocks = num_blocks
        # Row 0 is the all-zero row of requests without state; each running request may hold one more.
        self.num_state_rows = max_num_seqs + 1
        self.input_batch = InputBatch(max_num_seqs, self.max_blocks_per_seq, block_size, cfg.vocab_size,
                                      num_spec_tokens, lora=lora is not None)
        # The cache's dtype (the model's, or fp8) and, for fp8, its per-layer (K, V) scales.
        self.kv_dtype = np.dtype(model.dtype if kv_cache_dtype is None else kv_cache_dtype)
        self._kv_scales = kv_scales
        self.kv_cache = self._new_kv_cache() if kv_cache is None else self._scaled(self._checked_kv_cache(kv_cache))
        self.sampler_state = self._new_sampler_state()
        self.shapes = StepShapes(cfg, model.architecture, np.dtype(model.dtype), block_size, num_blocks,
                                 self.num_state_rows, attention_backend, model.tp, model.quantization,
                                 None if self.kv_dtype == np.dtype(model.dtype) else self.kv_dtype,
                                 matmul_kernel(model.params), num_spec_tokens, tuple(aux_layers), lora,
                                 split_layers)
        self.lora_weights, self._write_lora = self._new_lora_slots() if lora is not None else (None, None)
        self.num_lora_writes = 0  # adapters written into slots (each a slot changing hands)
        self._aux: jax.Array | None = None  # the last forward's aux hidden states, for its DeviceStep
        common = "|".join([environment_fingerprint(), source_fingerprint()])
        devices = jax.devices()[:1] if model.tp is None else list(model.tp.mesh.devices.flat)
        self.programs = Programs(lambda key: self.shapes.spec(key), lambda kind: common + self.shapes.fingerprint(kind),
                                 program_store, background_compile, devices,
                                 quiet_s=_QUIET_S if jax.devices()[0].platform == "cpu" else 0.0)
        self.compiled: set[tuple] = set()  # buckets the steps ran in, for the log and for tests
        # Token slots the forward steps ran, and how many held real tokens: the padding the buckets cost.
        self.tokens_run = 0
        self.tokens_real = 0
        self._all_allowed: dict[int, jax.Array] = {}  # the bitmask of steps without constrained rows, by S
        self._no_logprob_ids: dict[int, jax.Array] = {}  # logprob_ids of steps without logprob_token_ids, by S
        self.plan_sink = plan_sink
        self.num_dispatched = 0

    def _scaled(self, cache: KVCache) -> KVCache:
        """An fp8 cache with its calibrated per-layer scales (a new cache's are 1.0)."""
        if self._kv_scales is None:
            return cache
        place = {} if self.model.tp is None else {"device": self.model.tp.replicated}
        k_scale, v_scale = (jax.device_put(np.asarray(s, np.float32), **place) for s in self._kv_scales)
        return cache.replace(k_scale=k_scale, v_scale=v_scale)

    def _new_kv_cache(self) -> KVCache:
        return self._scaled(self._zeroed_kv_cache())

    def _zeroed_kv_cache(self) -> KVCache:
        return zeroed_kv_cache(self.model.config, self.model.tp, self._num_blocks, self.block_size, self.kv_dtype)

    def _checked_kv_cache(self, kv_cache: KVCache) -> KVCache:
        cfg = self.model.config
        if self.model.tp is not None:
            raise ValueError("a KV cache made beforehand is only taken without tensor parallelism")
        shape = KVCache.array_shape(cfg.num_layers, self._num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        dtype = KVCache.storage_dtype(self.kv_dtype)
        for name, leaf in (("k", kv_cache.k), ("v", kv_cache.v)):
            if leaf.shape != shape or leaf.dtype != dtype:
                raise ValueError(f"kv_cache.{name} must be {dtype.name}{list(shape)} for this model and plan, "
                                 f"got {leaf.dtype.name}{list(leaf.shape)}")
        return kv_cache

    def _lora_host(self, num_slots: int, adapter: Any = None) -> Any:
        """Host slots (models/lora.py) for the whole model, `adapter` in slot 0 if given."""
        from paxserve.models.lora import empty_weights, write_slot

        cfg = self.model.config
        host = empty_weights(cfg, self.model.architecture.layout(cfg), num_slots, self.shapes.lora[1], self.model.dtype)
        return host if adapter is None else write_slot(host, 0, adapter)

    def _place_lora(self, host: Any) -> Any:
        return jax.tree.map(jnp.asarray, host) if self.model.tp is None else self.model.tp.place_lora(host)

    def _new_lora_slots(self) -> tuple[Any, Callable[..., Any]]:
        """Zeroed LoRA slots on the device (split as their base weights are under tensor
        parallelism), and the program that writes one slot in place (the slot is runtime data, so it
        compiles once)."""
        slots = self._place_lora(self._lora_host(self.shapes.lora[0]))
        shardings = None if self.model.tp is None else jax.tree.map(lambda leaf: leaf.sharding, slots)
        return slots, jax.jit(write_lora_slot, donate_argnums=(0,), out_shardings=shardings)

    def write_lora(self, slot: int, adapter: Any) -> None:
        """Put `adapter` (models/lora.py's LoraAdapter, host arrays) into device slot `slot`. A step
        already dispatched that reads the slot's old adapter runs first: the device runs calls in order."""
        if self.lora_weights is None:
            raise ValueError("this model runner was made without LoRA slots (lora=None)")
        if not 0 <= slot < self.shapes.lora[0]:
            raise ValueError(f"LoRA slot {slot} is out of range: the runner holds {self.shapes.lora[0]} slots")
        if adapter.rank > self.shapes.lora[1]:
            raise ValueError(f"a LoRA adapter of rank {adapter.rank} does not fit slots of rank {self.shapes.lora[1]}")
        if self.plan_sink is not None:
            self.plan_sink((WRITE_LORA, slot, adapter))
        one = self._place_lora(self._lora_host(1, adapter))
        self.lora_weights = self._write_lora(self.lora_weights, one, jnp.int32(slot))
        self.num_lora_writes += 1

    def _new_sampler_state(self) -> SamplerState:
        make = lambda: SamplerState.zeros(self.num_state_rows, self.model.config.vocab_size)  # noqa: E731
        tp = self.model.tp
        # Under tensor parallelism sampling runs alike on every device, on the gathered logits.
        return make() if tp is None else jax.jit(make, out_shardings=tp.replicated)()

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

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

    # ---- buckets and programs ----------------------------------------------------------------------

    def exact_buckets(self, num_tokens: int, num_seqs: int, widest: int) -> tuple[int, int, int]:
        """A step's own padded sizes: `bucket_size` in tokens and sequences, a power of two in
        block-table width (capped at what one sequence may hold)."""
        return (bucket_size(num_tokens, self.fine_buckets), bucket_size(num_seqs, self.fine_buckets),
                min(next_power_of_2(widest), max(widest, self.max_blocks_per_seq)))

    def program(self, num_tokens: int, num_seqs: int, widest: int, kind: str = "forward") -> tuple[str, int, int, int]:
        """The program a step runs: a pure-decode step (one token per sequence) asks for a "decode"
        program when the backend has a decode-only kernel; its own bucket when that program is ready
        (or cannot be had any other way: it is then compiled before the step runs), else the
        cheapest compiled one that covers it within `_COVER_COST` (for a decode step, a plain
        forward covers too) while its own compiles in the background. Either way the buckets a
        growing batch reaches next are then queued for the background."""
        if kind == "forward" and num_tokens == num_seqs:
            kind = self.decode_kind
        exact = self.exact_buckets(num_tokens, num_seqs, widest)
        if (kind, *exact) in self.programs or not self.programs.background:
            self._prefetch(kind, exact, widest)
            return (kind, *exact)
        t, s, b = exact
        covers = self._covers(kind, exact)
        if not covers:
            # Only its own program can serve this step: build it now, before the buckets that come
            # next are queued, so that no background compile slows this one down.
            self.programs.get((kind, *exact))
            self._prefetch(kind, exact, widest)
            return (kind, *exact)
        self._prefetch(kind, exact, widest)
        # The cheapest cover; of two the same size, the step's own kind.
        cover = min(covers, key=lambda k: (k[1] * k[2] * k[3], k[0] != kind))
        # A decode bucket serves step after step: its own program is needed soon, unless the cover
        # is of its kind and differs only in block width, which the growing contexts reach anyway
        # (warm-up's wide single-sequence step serves a first answer's early widths this way). A
        # prompt's step runs once, so its own bucket is a guess at the next prompt of that length.
        self.programs.compile_later((kind, *exact), guess=t != s or cover[:3] == (kind, t, s))
        return cover

    def _covers(self, kind: str, exact: tuple[int, int, int]) -> list[tuple[str, int, int, int]]:
        t, s, b = exact
        kinds = (kind, "forward") if kind == "decode" else (kind,)
        return [key for key in self.programs.keys() if key[0] in kinds and key[1] >= t and key[2] >= s
                and key[3] >= b and key[1] * key[2] * key[3] <= _COVER_COST * t * s * b]

    def ready_verify_program(self, num_tokens: int, num_seqs: int, widest: int) -> tuple[str, int, int, int] | None:
        """The verifying program a step of this size would run without waiting for a compile (its
        own, or the cheapest that covers it), or None: its own is then queued for the background,
        so speculation can use it once it is ready rather than stall a step compiling it. Without
        background compiles every program counts as ready (it compiles when first run)."""
        exact = self.exact_buckets(num_tokens, num_seqs, widest)
        if ("verify", *exact) in self.programs or not self.programs.background:
            key = ("verify", *exact)
        else:
            covers = self._covers("verify", exact)
            key = min(covers, key=lambda k: k[1] * k[2] * k[3]) if covers else None
            if key is None or key[1:] != exact:
                self.programs.compile_later(("verify", *exact))
        if key is not None and self.programs.background:
            rows = self.shapes.verify_rows(key[1], key[2])
            if ("verify_sample", rows) not in self.programs:
                self.programs.compile_later(("verify_sample", rows))
                return None
        return key

    def _prefetch(self, kind: str, exact: tuple[int, int, int], widest: int) -> None:
        """Decode steps grow one token per step and batches grow one request at a time: have the next
        block width, and the next batch of decode steps, compiled before they are needed. Only the
        next width of a decode step whose widest table is in the last quarter of its bucket is
        needed soon (its context grows every step); the rest are guesses, which wait for the steps
        to be quiet rather than slow them down."""
        if kind not in ("forward", "decode") or not self.programs.background:
            return
        t, s, b = exact
        decode = t == s
        if b < self.max_blocks_per_seq:
            self.programs.compile_later((kind, t, s, min(2 * b, self.max_blocks_per_seq)),
                                        guess=not (decode and 4 * widest >= 3 * b))
        if decode and s < self.num_state_rows - 1:  # more sequences may come
            grown = bucket_size(s + 1, self.fine_buckets)
            self.programs.compile_later((kind, grown, grown, b), guess=True)
            self.programs.compile_later(("sample", grown), guess=True)

    @property
    def warm_decode_widths(self) -> list[int]:
        """The block widths warm-up readies single-sequence decode steps at (a drafter's too)."""
        return sorted({min(w, self.max_blocks_per_seq) for w in _WARM_DECODE_WIDTHS})

    def warmup(self, max_num_seqs: int, max_num_batched_tokens: int) -> tuple[int, int, int]:
        """Note the stored programs (a directory listing: none is loaded yet), then have the decode
        step of every batch-size bucket (block width 1) and its sampler ready: with background
        compiles the single-sequence ones now (loaded or compiled; its step at the block widths of
        `_WARM_DECODE_WIDTHS`) and the missing rest in the background (ascending, as guesses: while
        the steps are quiet), so the engine serves at once; else all of them now. Any other stored
        program is loaded by the first step that needs it.
        Returns (programs loaded now, programs compiled now, stored programs left for first use)."""
        self.programs.scan_store()
        loaded_before, compiled_before = self.programs.num_loaded, self.programs.num_compiled
        sizes = bucket_sizes(min(max_num_seqs, max_num_batched_tokens), self.fine_buckets)
        keys = [key for s in sizes for key in ((self.decode_kind, s, s, 1), ("sample", s))]
        if self.programs.background:
            # Only the single-sequence step is worth having before ready (the first request needs
            # it); a larger bucket that is stored loads on first use, and one that is not is covered
            # meanwhile. It is built at the block widths of `_WARM_DECODE_WIDTHS`, not 1: no chat
            # prompt fits in one block (the template alone passes 16 tokens), and a first answer's
            # decode steps then run without waiting for a compile until its context passes 8 blocks.
            now = [*((self.decode_kind, 1, 1, w) for w in self.warm_decode_widths), ("sample", 1)]
        else:
            now = keys
        stored = [key for key in now if key in self.programs]  # loading first: it takes ms, not seconds
        missing = [key for key in now if key not in self.programs]
        for key in stored:
            self.programs.get(key)
        for key in tqdm(missing, desc="Compiling decode steps", unit="program", disable=None if missing else True):
            self.programs.get(key)
        later = [key for key in keys if key not in now and key not in self.programs]
        for key in later:
            self.programs.compile_later(key, guess=True)
        if later:
            logger.info("compiling %d more decode-step programs in the background", len(later))
        return (self.programs.num_loaded - loaded_before, self.programs.num_compiled - compiled_before,
                self.programs.num_unloaded)

    # ---- the engine's steps: the persistent batch -------------------------------------------------

    def update_rows(self, out: SchedulerOutput) -> None:
        """Apply what the schedule changed to the persistent batch: rows of requests that stopped
        running go back, requests that start running take rows (their sampler state is written
        now), running ones get this step's new blocks."""
        for request_id in out.left_running_ids:
            self.input_batch.remove(request_id)
        for slot, adapter in out.lora_loads:
            self.write_lora(slot, adapter)
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

    def dispatch_model(self, out: SchedulerOutput, constrained: ConstrainedRows | None = None,
                       prompt: PromptLogprobsInputs | None = None) -> ModelStep:
        """Start the scheduled rows on the device (after `update_rows`) and return at once: the batch
        is gathered from the persistent batch (inputs the previous step has not returned yet are
        read on the device), constrained rows' bitmask words (plain data from the engine core) go
        into an all-ones bitmask. `complete_model` waits for the results."""
        kind = "forward" if prompt is None else "all_logits"
        chosen: list[tuple[str, int, int, int]] = []

        def sizes(num_tokens: int, num_seqs: int, widest: int) -> tuple[int, int, int]:
            chosen.append(self.program(num_tokens, num_seqs, widest, kind))
            return chosen[-1][1:]

        if out.num_spec_tokens:
            assert prompt is None, "the schedule drops proposals from a step that scores prompt tokens"
            kind = "verify"
        step = self.input_batch.prepare(out.scheduled, sizes)
        if prompt is None:
            step.batch.program = chosen[-1][0]
        if constrained is not None:
            step.sampling.allowed_token_bitmask = constrained.bitmask(step.sampling.temperature.shape[0],
                                                                      step.first_rows)
        if prompt is not None:
            prompt = prompt.padded(step.batch.input_ids.shape[0])
        return ModelStep(step, self.dispatch(step.batch, step.sampling, prompt))

    def complete_model(self, step: ModelStep) -> tuple[SampledTokens, np.ndarray | None]:
        """Wait for a dispatched step, record its kept tokens in the persistent batch and return
        them (with the prompt-logprob rows of a prompt-logprobs step)."""
        sampled, prompt_rows = self.collect(step.device)
        sampled.row_tokens = step.prepared.row_tokens(sampled.token_ids)
        sampled.first_rows = step.prepared.first_rows
        self.input_batch.record(step.prepared, sampled.row_tokens)
        return sampled, prompt_rows

    # ---- one step on the device ----------------------------------------------------------------------

    def _sampling_metadata(self, sampling: SamplingInputs) -> SamplingMetadata:
        s = sampling.temperature.shape[0]
        if sampling.allowed_token_bitmask is None and s not in self._all_allowed:
            self._all_allowed[s] = jnp.full((s, bitmask_width(self.model.config.vocab_size)), -1, jnp.int32)
        if sampling.logprob_ids is None and s not in self._no_logprob_ids:
            self._no_logprob_ids[s] = jnp.full((s, MAX_LOGPROBS), -1, jnp.int32)
        return SamplingMetadata.from_inputs(sampling, self._all_allowed.get(s), self._no_logprob_ids.get(s),
                                            on_host=True)

    def _run(self, key: tuple, *args: Any) -> Any:
        if key[0] in FORWARD_KINDS and key[1:] not in self.compiled:
            self.compiled.add(key[1:])
            logger.info("first step in bucket %s (tokens, sequences, block width); %d buckets used so far",
                        key[1:], len(self.compiled))
        return self.programs.get(key)(*args)

    def forward_args(self, batch: Batch) -> tuple[Any, ...]:
        """The arguments of a forward program (`step_functions.jitted_logits`) for `batch`, with this
        runner's params, cache and last sampled tokens. The batch's arrays stay on the host: the
        compiled program copies them to the device itself, cheaper than one jnp.asarray each."""
        source = batch.token_source if batch.token_source is not None else np.full(batch.input_ids.shape, -1, np.int32)
        args = (self.model.params, self.kv_cache, np.asarray(batch.input_ids), np.asarray(batch.positions),
                attention_metadata(batch, on_host=True), self.sampler_state.last_token, np.asarray(source))
        if self.lora_weights is None:
            return args
        slots = batch.lora_slots if batch.lora_slots is not None else np.full(batch.input_ids.shape, -1, np.int32)
        place = {} if self.model.tp is None else {"device": self.model.tp.replicated}
        return (*args, self.lora_weights, jax.device_put(slots, **place))

    def write_sampler_state(self, writes: StateWrites) -> None:
        """Set the state rows of requests that start running (before the step that first samples
        them)."""
        if self.plan_sink is not None:
            self.plan_sink((WRITE_STATE, writes))
        self.sampler_state = write_state_rows_step(self.sampler_state, *state_writes_args(writes))

    def dispatch(self, batch: Batch, sampling: SamplingInputs,
                 prompt: PromptLogprobsInputs | None = None) -> DeviceStep:
        """Start one step on the device (the forward, then sampling there) and return without
        waiting for it: JAX runs it while the host goes on. With `prompt`, the forward keeps logits
        at every position and the sampler scores them too."""
        if self.plan_sink is not None:
            self.plan_sink((DISPATCH, batch, sampling, prompt))
        index, self.num_dispatched = self.num_dispatched, self.num_dispatched + 1
        t, s, b = batch.input_ids.shape[0], batch.context_lens.shape[0], batch.block_tables.shape[1]
        self.tokens_run += t
        self.tokens_real += batch.num_tokens
        if sampling.draft_tokens is not None:
            n = sampling.draft_tokens.shape[0]
            logits = self._forward(("verify", t, s, b), self.forward_args(batch))
            packed, self.sampler_state = self._run(("verify_sample", n), logits, self._sampling_metadata(sampling),
                                                   self.sampler_state, jnp.asarray(sampling.draft_tokens),
                                                   jnp.asarray(sampling.earlier_drafts))
            return self._with_wide(DeviceStep(packed, sampling.num_rows, n, None, self._aux, index), logits, sampling)
        if prompt is None:
            logits = self._forward((batch.program, t, s, b), self.forward_args(batch))
            packed, self.sampler_state = self._run(("sample", s), logits, self._sampling_metadata(sampling),
                                                   self.sampler_state)
            return self._with_wide(DeviceStep(packed, batch.num_seqs, s, None, self._aux, index), logits, sampling)
        if prompt.targets.shape[0] != t:
            raise ValueError(f"prompt logprob targets cover {prompt.targets.shape[0]} positions, the batch {t}")
        args = self.forward_args(batch)
        logits = self._forward(("all_logits", t, s, b), args)
        packed, self.sampler_state = self._run(("score", t, s), logits, args[4].logits_indices,
                                               self._sampling_metadata(sampling), self.sampler_state,
                                               jnp.asarray(prompt.targets))
        return DeviceStep(packed, batch.num_seqs, s, t, self._aux, index)

    @staticmethod
    def _with_wide(step: DeviceStep, logits: jax.Array, sampling: SamplingInputs) -> DeviceStep:
        """Rows asking for more top logprobs than the packed columns hold get their whole log-softmax
        row as well (rare: a distinct small program, compiled per power of two of such rows). Every
        rank of a multi-host engine runs it too: it replays this dispatch."""
        if sampling.wide_logprobs is None:
            return step
        rows = np.flatnonzero(sampling.wide_logprobs[:sampling.num_rows]).tolist()
        if not rows:
            return step
        padded = rows + [rows[-1]] * ((1 << (len(rows) - 1).bit_length()) - len(rows))
        step.wide, step.wide_rows = _log_softmax_rows(logits, jnp.asarray(padded, jnp.int32)), rows
        return step

    def _forward(self, key: tuple, args: tuple[Any, ...]) -> jax.Array:
        """Run a forward program: its logits (the cache, and any aux hidden states, are kept)."""
        logits, self.kv_cache, *aux = self._run(key, *args)
        self._aux = aux[0] if aux else None
        return logits

    def collect(self, step: DeviceStep) -> tuple[SampledTokens, np.ndarray | None]:
        """Wait for a dispatched step and copy its results to the host (the step's one copy)."""
        flat = host_copy(step.packed)
        if step.num_prompt_positions is None:
            sampled = unpack(flat, step.num_seqs)
            if step.wide is not None:
                wide = host_copy(step.wide)
                sampled.wide = {row: wide[i] for i, row in enumerate(step.wide_rows)}
            return sampled, None
        num_sampled = step.num_rows * PACKED_WIDTH
        sampled = unpack(flat[:num_sampled].reshape(step.num_rows, PACKED_WIDTH), step.num_seqs)
        return sampled, flat[num_sampled:].reshape(step.num_prompt_positions, PROMPT_PACKED_WIDTH)


@jax.jit
def _log_softmax_rows(logits: Float[Array, "S V"], rows: Int[Array, " N"]) -> Float[Array, "N V"]:
    """The whole log-softmax of the chosen rows' raw logits, as the top logprobs are."""
    return jax.nn.log_softmax(logits[rows].astype(jnp.float32), axis=-1)


def host_copy(array: jax.Array) -> np.ndarray:
    """A replicated result on the host. Across hosts its copies are not all this process's to read;
    the local one is the same (every device computed it alike)."""
    if not isinstance(array, jax.Array) or array.is_fully_addressable:
        return np.asarray(array)
    if not array.sharding.is_fully_replicated:
        raise ValueError(f"a step result is split over hosts ({array.sharding}); only replicated results are read")
    return np.asarray(array.addressable_data(0))
