"""EAGLE-3 proposals: a one-layer head (`models.eagle3`) that reads the target's own hidden states.

The target's step programs also return the residual streams entering three of its layers at every
position they compute (`aux_layers`). Before each schedule, one ragged pass of the head catches up
on the positions the last step computed and kept (a verifying step's rejected positions are left
out), for every request in that step, so its one-layer cache never misses a position the target
computed. For a request that decodes next, that pass's last output gives its first proposal: the
head's vocabulary-wide product runs only when some request will propose (the `Speculator` weighs
it, with the further passes, as a draft's cost). Each further proposal is one single-token pass
that reads the head's own previous output in place of a target hidden state. Proposals are greedy
(one token each), which is what `sampling.verify`'s acceptance rule is exact for.

The head's cache pages are the target's block ids (the scheduler allocates k slots of lookahead for
the pages of further proposals), so preemption and the end of a request free both at once. Only
speed depends on that cache: verification decides every kept token.

Over several hosts the head runs whole on every device of all of them, and each pass is a plan
message (`EAGLE_PASS`) the workers replay in order: its plain inputs, and where its hidden states
come from (the target steps it catches up on, named by their dispatch index, or the head's own
previous pass), which every rank holds on its devices alike. Only rank 0 reads the proposals.
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from paxserve.core.scheduler import ScheduledRequest
from paxserve.core.request import Request
from paxserve.kernels import AttentionBackend, AttentionMetadata, KVCache
from paxserve.models.eagle3 import Eagle3Config, Eagle3Params, eagle3_forward
from paxserve.worker.model_runner import host_copy
from paxserve.worker.programs import Programs, environment_fingerprint, source_fingerprint
from paxserve.worker.step_functions import attention_metadata
from paxserve.worker.step_inputs import SeqChunk, bucketed_batch, next_power_of_2

logger = logging.getLogger(__name__)

_take = jax.jit(lambda rows, index: rows[index])
# A head pass in a multi-host plan: (EAGLE_PASS, chunks, source steps or None, rows, with head).
EAGLE_PASS = "eagle_pass"
# Target steps whose hidden states a multi-host worker keeps at most (a catch-up reads the steps
# completed since the last one, at most two with async scheduling, and one more may be in flight):
# rank 0 drops a step's once a catch-up took it in, a worker when a pass read it or a later one.
_KEPT_STEPS = 4


class Eagle3Proposer:
    """`target_embed`: the target's embedding table (a head without its own reads it). `replicated`:
    under tensor parallelism, the mesh's whole-on-every-device sharding: the head (one layer) is not
    split; its weights and cache are kept whole on every device, where the target's hidden states are."""

    def __init__(self, cfg: Eagle3Config, params: Eagle3Params, target_embed: jax.Array, num_blocks: int,
                 block_size: int, attention_backend: AttentionBackend, fine_buckets: bool,
                 replicated: NamedSharding | None = None, program_store: Path | None = None,
                 plan_sink: Callable[[tuple], None] | None = None) -> None:
        """`program_store`: where its compiled passes are kept (the runner's store: a restart loads
        them instead of compiling). `plan_sink`: on rank 0 of a multi-host engine, where each pass's
        plain inputs go before it runs (the workers `replay` them)."""
        self.cfg = cfg
        self._plan_sink = plan_sink
        self.params = params if replicated is None else jax.device_put(params, replicated)
        self.target_embed = target_embed
        self.block_size = block_size
        self.fine_buckets = fine_buckets
        c = cfg.layer
        make = partial(KVCache.zeros, 1, num_blocks, block_size, c.num_kv_heads, c.head_dim, params.final_norm.dtype)
        self.kv_cache = make() if replicated is None else jax.jit(make, out_shardings=replicated)()
        self._replicated = replicated
        self._forward = jax.jit(partial(eagle3_forward, cfg=cfg, attention_backend=attention_backend),
                                donate_argnums=(2,), static_argnames=("with_head",))
        # Its passes are stored programs keyed ("eagle3", tokens, sequences, block width, hidden
        # width, with head), lowered from these abstract weights and cache.
        keep = (lambda x: x.sharding) if replicated is not None else (lambda x: None)
        self._abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=keep(x)),
                                      (self.params, target_embed, self.kv_cache))
        common = "|".join([environment_fingerprint(), source_fingerprint(), "eagle3", repr(cfg),
                           repr(attention_backend), f"{num_blocks}x{block_size}", repr(self._abstract)])
        devices = jax.devices()[:1] if replicated is None else list(replicated.mesh.devices.flat)
        self.programs = Programs(self._spec, lambda kind: common, program_store, background=False, devices=devices)
        if program_store is not None:
            self.programs.scan_store()
        # Target steps taken in since the last catch-up: each one's dispatch index and, per request,
        # (first position, first row, rows). One with synchronous scheduling; with async scheduling
        # a step in flight may be taken in early, after its predecessor's was recorded.
        self._pending: list[tuple[int, dict[str, tuple[int, int, int]]]] = []
        # The aux hidden states of the last `_KEPT_STEPS` target steps, by dispatch index.
        self._aux: dict[int, jax.Array] = {}
        # After a catch-up: per request that decodes next, (its first proposal, its row in `_last`).
        self._first: dict[str, tuple[int, int]] = {}
        self._last: jax.Array | None = None  # the head's output of its last pass [S_pad, H]
        self.last_catch_up = 0  # the most positions of one request the last catch-up fed

    def warmup(self, widths: list[int], aux_width: int) -> int:
        """Have a single decoding sequence's passes ready at these block widths (the target's warm-up
        widths): its catch-up on the target's hidden states (`aux_width` wide) with and without the
        head's product, and a further pass on its own output. Returns how many programs."""
        keys = {("eagle3", 1, 1, next_power_of_2(w), width, with_head) for w in widths
                for width, with_head in ((aux_width, 0), (aux_width, 1), (self.cfg.layer.hidden_size, 1))}
        for key in sorted(keys):
            self.programs.get(key)
        return len(keys)

    def keep_aux(self, index: int, aux: jax.Array) -> None:
        """The aux hidden states [T, 3 x hidden] of the target step dispatched `index`-th (every rank
        keeps the last few: a pass names the ones it reads)."""
        self._aux[index] = aux
        self._drop_through(index - _KEPT_STEPS)

    def _drop_through(self, index: int) -> None:
        for old in [i for i in self._aux if i <= index]:
            del self._aux[old]

    def record_step(self, scheduled: list[ScheduledRequest], aux: jax.Array, index: int) -> None:
        """A target step's aux hidden states [T, 3 x hidden] (its rows in `scheduled`'s order) and
        its dispatch index."""
        rows, offset = {}, 0
        for s in scheduled:
            rows[s.request_id] = (s.num_computed_tokens, offset, s.num_new_tokens)
            offset += s.num_new_tokens
        self.keep_aux(index, aux)
        self._pending.append((index, rows))

    def catch_up(self, running: list[Request], block_ids: Callable[[str], list[int]], wanted: set[str]) -> None:
        """Feed the head the positions the steps since the last catch-up computed and kept (each at
        most once); the requests in `wanted` that decode next get their first proposal from it."""
        self._first, self.last_catch_up = {}, 0
        pending, self._pending = self._pending, []
        by_id = {r.request_id: r for r in running}
        at: dict[str, dict[int, int]] = {}  # per request: position -> row in the steps' hidden states
        base = 0
        for index, rows in pending:
            for request_id, (first, offset, count) in rows.items():
                r = by_id.get(request_id)
                if r is None:
                    continue
                # Positions whose next token is known: verification may have kept fewer than were
                # fed, and a preemption since forgets the rest (a later step computes them again).
                kept = min(count, r.num_computed_tokens - first, r.num_tokens - 1 - first)
                rows_at = at.setdefault(request_id, {})
                for j in range(max(kept, 0)):
                    rows_at[first + j] = base + offset + j
            base += int(self._aux[index].shape[0])
        live = []
        for r in running:
            rows_at = at.get(r.request_id)
            if not rows_at:
                continue
            first, kept = min(rows_at), 0
            while first + kept in rows_at:
                kept += 1
            live.append((r, first, [rows_at[first + j] for j in range(kept)]))
        if not live:
            self._drop_through(pending[-1][0] if pending else -1)
            return
        self.last_catch_up = max(len(index) for *_, index in live)
        # A request's output predicts the token after its last when the catch-up reached it.
        proposing = [i for i, (r, first, index) in enumerate(live)
                     if r.request_id in wanted and first + len(index) == r.num_tokens - 1]
        out = self._run([(r, first, r.token_ids_slice(first + 1, first + len(index) + 1)) for r, first, index in live],
                        tuple(i for i, _ in pending), np.asarray([i for *_, index in live for i in index], np.int32),
                        block_ids, with_head=bool(proposing))
        for i in proposing:
            self._first[live[i][0].request_id] = (out[i], i)

    def propose_batch(self, requests: list[Request], rooms: list[int],
                      block_ids: Callable[[str], list[int]]) -> list[list[int]]:
        """Up to `rooms[i]` greedy proposals for each request (the first from the catch-up; a room of
        1 costs no pass)."""
        tokens, at, rooms = [], [], list(rooms)
        for i, r in enumerate(requests):
            token, row = self._first.get(r.request_id, (None, 0))
            tokens.append([] if token is None else [token])
            at.append(row)
            # Further proposals write pages up to the last fed proposal's position, in the request's
            # own blocks (the scheduler's lookahead makes them there); never past them.
            limit = len(block_ids(r.request_id)) * self.block_size - r.num_tokens + 2
            rooms[i] = 0 if token is None else min(rooms[i], limit)
        for step in range(1, max(rooms, default=0)):
            live = [i for i, room in enumerate(rooms) if room > step]
            out = self._run([(requests[i], requests[i].num_tokens - 2 + step, [tokens[i][-1]]) for i in live],
                            None, np.asarray([at[i] for i in live], np.int32), block_ids)
            for j, i in enumerate(live):
                tokens[i].append(out[j])
                at[i] = j
        return [t[:room] for t, room in zip(tokens, rooms)]

    def _spec(self, key: tuple) -> tuple:
        """(lower, abstract arguments, example output) of a pass, as `Programs` builds them."""
        _, t, s, b, width, with_head = key
        i32, dtype = jnp.int32, self.params.final_norm.dtype
        shape = jax.ShapeDtypeStruct
        metadata = AttentionMetadata(slot_mapping=shape((t,), i32), block_tables=shape((s, b), i32),
                                     context_lens=shape((s,), i32), query_start_loc=shape((s + 1,), i32),
                                     logits_indices=shape((s,), i32))
        hidden = shape((t, width), dtype, sharding=self._replicated)
        args = (*self._abstract, shape((t,), i32), hidden, shape((t,), i32), metadata)
        out = (shape((s,), i32) if with_head else None, shape((s, self.cfg.layer.hidden_size), dtype),
               self._abstract[2])
        return (lambda: self._forward.lower(*args, with_head=bool(with_head))), args, out

    def _run(self, feeds: list[tuple[Request, int, list[int]]], steps: tuple[int, ...] | None, rows: np.ndarray,
             block_ids: Callable[[str], list[int]], with_head: bool = True) -> list[int]:
        """One pass of the head: each request feeds its tokens at positions from its start, reading
        the hidden states at `rows` of the target steps dispatched `steps`-th (concatenated), or of
        the head's last pass (None). The greedy token after each request's last (none without
        `with_head`); the head's output there stays on the device (`_last`)."""
        chunks = [SeqChunk(tokens, start, block_ids(r.request_id)) for r, start, tokens in feeds]
        if self._plan_sink is not None:
            self._plan_sink((EAGLE_PASS, chunks, steps, rows, with_head))
        out = self._launch(chunks, steps, rows, with_head)
        return [] if out is None else host_copy(out)[:len(feeds)].tolist()

    def replay(self, message: tuple) -> None:
        """A multi-host worker: run rank 0's pass (`EAGLE_PASS`) on this host's devices."""
        self._launch(*message[1:])

    def _launch(self, chunks: list[SeqChunk], steps: tuple[int, ...] | None, rows: np.ndarray,
                with_head: bool) -> jax.Array | None:
        """Start the pass; its greedy tokens (padded rows) on the device, None without the head."""
        batch = bucketed_batch(chunks, self.block_size, self.fine_buckets)
        if steps is None:
            source = self._last
        else:
            missing = [i for i in steps if i not in self._aux]
            if missing:
                raise RuntimeError(f"EAGLE-3 head: the hidden states of target step(s) {missing} are gone (kept: "
                                   f"{sorted(self._aux)})")
            source = self._aux[steps[0]] if len(steps) == 1 else jnp.concatenate([self._aux[i] for i in steps])
            self._drop_through(max(steps))  # the pass holds `source` while it needs it
        t_pad = batch.input_ids.shape[0]
        hidden = _take(source, jnp.asarray(np.pad(rows, (0, t_pad - len(rows)))))
        if hidden.dtype != self.params.final_norm.dtype:
            hidden = hidden.astype(self.params.final_norm.dtype)
        if self._replicated is not None:
            hidden = jax.device_put(hidden, self._replicated)
        key = ("eagle3", t_pad, batch.context_lens.shape[0], batch.block_tables.shape[1], int(hidden.shape[-1]),
               int(with_head))
        if key not in self.programs:
            logger.info("EAGLE-3 head: first pass of shape %s (tokens, sequences, block width, hidden width, "
                        "proposing); %d programs so far", key[1:], len(self.programs.keys()))
        out, self._last, self.kv_cache = self.programs.get(key)(
            self.params, self.target_embed, self.kv_cache, jnp.asarray(batch.input_ids), hidden,
            jnp.asarray(batch.positions), attention_metadata(batch))
        return out
