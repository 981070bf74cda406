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
from paxserve.worker.programs import Programs, environment_fingerprint, source_fingerprint
from paxserve.worker.step_functions import attention_metadata
from paxserve.worker.step_inputs import SeqChunk, bucketed_batch, next_power_of_2

logger = logging.getLogger(__name__)

_take = jax.jit(lambda rows, index: rows[index])


class Eagle3Proposer:
    """`target_embed`: the target's embedding table (a head without its own reads it). `replicated`:
    under tensor parallelism, the mesh's whole-on-every-device sharding: the head (one layer) is not
    split; its weights and cache are kept whole on every device, where the target's hidden states are."""

    def __init__(self, cfg: Eagle3Config, params: Eagle3Params, target_embed: jax.Array, num_blocks: int,
                 block_size: int, attention_backend: AttentionBackend, fine_buckets: bool,
                 replicated: NamedSharding | None = None, program_store: Path | None = None) -> None:
        """`program_store`: where its compiled passes are kept (the runner's store: a restart loads
        them instead of compiling)."""
        self.cfg = cfg
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
        # Target steps taken in since the last catch-up: each one's aux hidden states and, per request,
        # (first position, first row, rows). One with synchronous scheduling; with async scheduling
        # a step in flight may be taken in early, after its predecessor's was recorded.
        self._pending: list[tuple[jax.Array, dict[str, tuple[int, int, int]]]] = []
        # After a catch-up: per request that decodes next, (its first proposal, its row in `_hidden`).
        self._first: dict[str, tuple[int, int]] = {}
        self._hidden: jax.Array | None = None
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

    def record_step(self, scheduled: list[ScheduledRequest], aux: jax.Array) -> None:
        """A target step's aux hidden states [T, 3 x hidden], its rows in `scheduled`'s order."""
        rows, offset = {}, 0
        for s in scheduled:
            rows[s.request_id] = (s.num_computed_tokens, offset, s.num_new_tokens)
            offset += s.num_new_tokens
        self._pending.append((aux, rows))

    def catch_up(self, running: list[Request], block_ids: Callable[[str], list[int]], wanted: set[str]) -> None:
        """Feed the head the positions the steps since the last catch-up computed and kept (each at
        most once); the requests in `wanted` that decode next get their first proposal from it."""
        self._first, self._hidden, self.last_catch_up = {}, None, 0
        pending, self._pending = self._pending, []
        by_id = {r.request_id: r for r in running}
        at: dict[str, dict[int, int]] = {}  # per request: position -> row in the steps' hidden states
        base = 0
        for aux, rows in pending:
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
            base += int(aux.shape[0])
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
            return
        self.last_catch_up = max(len(index) for *_, index in live)
        aux = pending[0][0] if len(pending) == 1 else jnp.concatenate([a for a, _ in pending])
        # A request's output predicts the token after its last when the catch-up reached it.
        proposing = [i for i, (r, first, index) in enumerate(live)
                     if r.request_id in wanted and first + len(index) == r.num_tokens - 1]
        out, self._hidden = self._run([(r, first, r.token_ids_slice(first + 1, first + len(index) + 1))
                                       for r, first, index in live], aux,
                                      np.asarray([i for *_, index in live for i in index], np.int32), block_ids,
                                      with_head=bool(proposing))
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
        hidden = self._hidden
        for step in range(1, max(rooms, default=0)):
            live = [i for i, room in enumerate(rooms) if room > step]
            out, hidden = self._run([(requests[i], requests[i].num_tokens - 2 + step, [tokens[i][-1]]) for i in live],
                                    hidden, np.asarray([at[i] for i in live], np.int32), block_ids)
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

    def _run(self, feeds: list[tuple[Request, int, list[int]]], source: jax.Array, rows: np.ndarray,
             block_ids: Callable[[str], list[int]], with_head: bool = True) -> tuple[list[int], jax.Array]:
        """One pass of the head: each request feeds its tokens at positions from its start, reading
        the hidden states `source[rows]` in order. The greedy token after each request's last (none
        without `with_head`), and the head's output there ([S_pad, H], on the device)."""
        batch = bucketed_batch([SeqChunk(tokens, start, block_ids(r.request_id)) for r, start, tokens in feeds],
                               self.block_size, self.fine_buckets)
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
        out, x, self.kv_cache = self.programs.get(key)(
            self.params, self.target_embed, self.kv_cache, jnp.asarray(batch.input_ids), hidden,
            jnp.asarray(batch.positions), attention_metadata(batch))
        return ([] if out is None else np.asarray(out)[:len(feeds)].tolist()), x
