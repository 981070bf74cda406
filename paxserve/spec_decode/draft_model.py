"""A draft model: a smaller model of the target's vocabulary proposes the next tokens greedily.

It has its own paged KV cache with as many blocks as the target's, addressed by the same block
ids: a request's draft KV lives in the blocks the scheduler gave the request (it allocates k slots
of lookahead for the draft's proposals), so the draft needs no allocator, and preemption or the end
of a request frees both caches at once.

Before each step, for every request that proposes: one ragged forward over the tokens the draft has
not seen (the whole prompt the first time, then the tokens verification kept), whose last logits
give the first proposal, and one single-token forward per further proposal. What the draft fed as
proposals stays valid in its cache as far as verification kept them, so the next catch-up starts
there. Only speed depends on the draft's cache: verification decides every kept token, so a stale
page (a block a prefix-cache hit brought in, a recomputation) costs acceptance, never correctness.

Greedy proposals are one token each, which is what `sampling.verify`'s acceptance rule is exact for.

Over several hosts the draft is split over all their devices like the target, and each pass is a
plan message (`DRAFT_PASS`: its plain inputs) the workers replay in order between the target's
steps, so its collectives meet; only rank 0 reads the proposals.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from paxserve.core.request import Request
from paxserve.kernels import AttentionBackend
from paxserve.models.loader import LoadedModel
from paxserve.models.layer_split import take_over_layers
from paxserve.models.quant_weights import matmul_kernel
from paxserve.worker.model_runner import host_copy, zeroed_kv_cache
from paxserve.worker.programs import Programs, environment_fingerprint, source_fingerprint
from paxserve.worker.step_functions import StepShapes, attention_metadata
from paxserve.worker.step_inputs import SeqChunk, bucketed_batch, next_power_of_2

logger = logging.getLogger(__name__)

_argmax = jax.jit(lambda logits: jnp.argmax(logits, axis=-1).astype(jnp.int32))
# A draft pass in a multi-host plan: (DRAFT_PASS, starts, chunks, block tables).
DRAFT_PASS = "draft_pass"


@dataclass(slots=True)
class DraftState:
    """What a request's draft cache holds: valid KV for positions [0, computed), then the KV of the
    proposals it fed at positions from `computed` on (valid as far as they turn out right)."""

    preemptions: int  # the request's count when this was made: a preemption loses the pages
    computed: int = 0
    fed: list[int] = field(default_factory=list)


class DraftModel:
    """`program_store`: where its compiled passes are kept (the runner's store: a restart loads them
    instead of compiling). `plan_sink`: on rank 0 of a multi-host engine, where each pass's plain
    inputs go before it runs (the workers `replay` them)."""

    def __init__(self, model: LoadedModel, num_blocks: int, block_size: int, attention_backend: AttentionBackend,
                 max_tokens_per_pass: int, fine_buckets: bool, program_store: Path | None = None,
                 plan_sink: Callable[[tuple], None] | None = None, split_layers: bool = True) -> None:
        if split_layers:  # as the target's runner: one array per layer, small passes unrolled
            take_over_layers(model)
        self.model = model
        self._plan_sink = plan_sink
        self.block_size = block_size
        self.attention_backend = attention_backend
        self.max_tokens_per_pass = max_tokens_per_pass
        self.fine_buckets = fine_buckets
        cfg = model.config
        # Split like the target's over the same devices when the draft is (tensor parallelism).
        self.kv_cache = zeroed_kv_cache(cfg, model.tp, num_blocks, block_size, np.dtype(model.dtype))
        # The target's step programs, for the draft's shapes: one "forward" per (tokens, sequences,
        # block width) bucket ("decode" for one token per sequence where the backend has a kernel
        # for it), compiled when first needed and stored like the target's.
        self.shapes = StepShapes(cfg, model.architecture, np.dtype(model.dtype), block_size, num_blocks, 1,
                                 attention_backend, model.tp, model.quantization, None, matmul_kernel(model.params),
                                 split_layers=split_layers)
        common = "|".join([environment_fingerprint(), source_fingerprint(), "draft"])
        devices = jax.devices()[:1] if model.tp is None else list(model.tp.mesh.devices.flat)
        self.programs = Programs(self.shapes.spec, lambda kind: common + self.shapes.fingerprint(kind), program_store,
                                 background=False, devices=devices)
        if program_store is not None:
            self.programs.scan_store()
        self._decode_kind = "decode" if attention_backend.decode_kernel else "forward"
        self.last_catch_up = 0  # the most tokens a request of the last `propose_batch` caught up on

    def warmup(self, widths: list[int]) -> int:
        """Have the single-sequence decode pass ready at these block widths (the target's warm-up
        widths: a first answer's further proposals then wait for no compile). Returns how many."""
        keys = [(self._decode_kind, 1, 1, next_power_of_2(w)) for w in widths]
        for key in keys:
            self.programs.get(key)
        return len(set(keys))

    def propose_batch(self, requests: list[Request], rooms: list[int],
                      block_ids: Callable[[str], list[int]]) -> list[list[int]]:
        """Up to `rooms[i]` greedy proposals for each request (all of them decode next)."""
        rows = []
        rooms = list(rooms)
        for i, request in enumerate(requests):
            state = request.spec_draft
            if state is None or state.preemptions != request.num_preemptions:
                state = request.spec_draft = DraftState(request.num_preemptions)
            if state.fed:  # the fed proposals' pages hold what verification kept of them
                kept = request.token_ids_slice(state.computed, state.computed + len(state.fed))
                n = 0
                while n < len(kept) and kept[n] == state.fed[n]:
                    n += 1
                # The last token is fed again even when it was a right proposal: its logits are needed.
                state.computed = min(state.computed + n, request.num_tokens - 1)
                state.fed = []
            rows.append(np.asarray(block_ids(request.request_id), np.int32))
            # The draft writes pages up to the position of its last fed proposal, in the request's own
            # blocks (the scheduler's lookahead makes them there); never past them.
            rooms[i] = min(rooms[i], rows[-1].shape[0] * self.block_size - request.num_tokens + 1)
        pending = [r.token_ids_slice(r.spec_draft.computed, r.num_tokens) if room >= 1 else []
                   for r, room in zip(requests, rooms)]
        self.last_catch_up = max(map(len, pending), default=0)
        # Catch up, a pass at a time while a long prompt is pending; the last pass's logits give the
        # first proposals.
        tokens: list[list[int]] = [[] for _ in requests]
        while any(pending):
            budget, chunks = self.max_tokens_per_pass, []
            for i, p in enumerate(pending):
                take = min(len(p), max(1, budget)) if budget > 0 else 0
                chunks.append(p[:take])
                pending[i] = p[take:]
                budget -= take
            live = [i for i, c in enumerate(chunks) if c]
            firsts = self._run([requests[i].spec_draft.computed for i in live], [chunks[i] for i in live],
                               [rows[i] for i in live])
            for i, t in zip(live, firsts):
                requests[i].spec_draft.computed += len(chunks[i])
                if not pending[i]:
                    tokens[i].append(t)
        for step in range(1, max(rooms, default=0)):
            live = [i for i, room in enumerate(rooms) if room > step]
            nxt = self._run([requests[i].num_tokens + step - 1 for i in live], [[tokens[i][-1]] for i in live],
                            [rows[i] for i in live])
            for i, t in zip(live, nxt):
                tokens[i].append(t)
        for request, proposal, room in zip(requests, tokens, rooms):
            request.spec_draft.fed = proposal[:max(0, room - 1)]
        return [proposal[:max(0, room)] for proposal, room in zip(tokens, rooms)]

    def _run(self, starts: list[int], chunks: list[list[int]], tables: list[np.ndarray]) -> list[int]:
        """One forward of the draft over each sequence's chunk (fed at positions from its start);
        the greedy token after each chunk's last."""
        if self._plan_sink is not None:
            self._plan_sink((DRAFT_PASS, starts, chunks, tables))
        return host_copy(self._launch(starts, chunks, tables))[:len(chunks)].tolist()

    def replay(self, message: tuple) -> None:
        """A multi-host worker: run rank 0's pass (`DRAFT_PASS`) on this host's devices."""
        self._launch(*message[1:])

    def _launch(self, starts: list[int], chunks: list[list[int]], tables: list[np.ndarray]) -> jax.Array:
        """Start the pass; the greedy tokens of its padded rows, on the device."""
        n = len(chunks)
        batch = bucketed_batch([SeqChunk(chunk, start, table.tolist()) for chunk, start, table in
                                zip(chunks, starts, tables)], self.block_size, self.fine_buckets)
        t_pad, s_pad, b_pad = batch.input_ids.shape[0], batch.context_lens.shape[0], batch.block_tables.shape[1]
        key = (self._decode_kind if batch.num_tokens == n else "forward", t_pad, s_pad, b_pad)
        if key not in self.programs:
            logger.info("draft model: first pass in bucket %s (tokens, sequences, block width); %d programs so far",
                        key[1:], len(self.programs.keys()))
        logits, self.kv_cache = self.programs.get(key)(
            self.model.params, self.kv_cache, jnp.asarray(batch.input_ids), jnp.asarray(batch.positions),
            attention_metadata(batch), jnp.zeros((1,), jnp.int32), jnp.full(batch.input_ids.shape, -1, jnp.int32))
        return _argmax(logits)
