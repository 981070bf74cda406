"""Continuous-batching scheduler: one token budget per step, running requests first.

There are no prefill and decode phases. Every request has `num_computed_tokens`; a step gives each
running request the tokens it still lacks (one for a decoding request, the rest of its prompt, or
as much as the budget allows for a long prompt: chunked prefill), then admits waiting requests
first-come first-served while budget, sequence slots and blocks last. When a running request
cannot get a block, the newest running request is preempted: its blocks are freed (their hashes
kept, so the prefix cache may give them back) and it goes to the front of the waiting queue, to be
recomputed later. Nothing ever runs out of memory.

A paused request (its client reads slower than it is generated) keeps its place but is not
scheduled, and is the first to give up its blocks to a request that can run.

With `policy="priority"` (vLLM's --scheduling-policy priority) the waiting queue is ordered by
(priority, arrival): lower values first, ties in arrival order. A waiting request of a strictly
better priority than the worst running one, that cannot start for want of a batch slot or of blocks,
has that running request preempted at the start of the schedule (repeatedly, as far as needed), so
it starts in this step; blocks are also taken from the worst-priority running request first. Equal
priorities never preempt each other, so they cannot starve one another.

With LoRA adapters, a request starts running only once its adapter holds one of the device's slots
(`LoraSlots`): one held by an adapter no running request uses is taken over, least recently used
first. A waiting request whose adapter can get no slot is passed over, not waited for: requests
behind it (the base model's, or a resident adapter's) still start.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Any

from paxserve.core.kv_cache_manager import KVCacheManager
from paxserve.core.lora_slots import LoraSlots
from paxserve.core.request import Request, RequestStatus
from paxserve.sampling_params import SamplingParams


POLICIES = ("fcfs", "priority")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    # Slots beyond the step's tokens that a draft model writes its proposals' pages into (its k).
    num_lookahead_tokens: int = 0
    policy: str = "fcfs"  # or "priority"

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass(slots=True)
class NewRequestData:
    """A request that starts running this step (its first admission, or again after a preemption):
    everything the model runner needs to give it a row of the persistent batch."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far (recomputed after a preemption); a copy
    sampling_params: SamplingParams
    seed: int
    eos_token_ids: tuple[int, ...]
    block_ids: list[int]  # its whole block table
    lora_slot: int = -1  # the device slot of its LoRA adapter (-1: the base model alone)


@dataclass(slots=True)
class ScheduledRequest:
    """One row of the step, as plain data: which request, where it stands, what it runs."""

    request_id: str
    num_new_tokens: int  # tokens fed this step, starting at num_computed_tokens
    num_computed_tokens: int  # tokens already in its KV cache before this step
    new_block_ids: list[int]  # blocks it was given this step (a new request's are in its NewRequestData)
    # The step completes the request's tokens, so the token it samples is the request's next one (a
    # prompt chunk that leaves more to compute samples nothing that is kept).
    samples: bool = True
    # Speculative decoding: proposed tokens fed after the row's own (the last `len(spec_token_ids)` of
    # its `num_new_tokens`); the step verifies them and keeps the longest prefix its sampler agrees with.
    spec_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    """What one step runs, as plain data (no live Request): rows in order, the requests that join
    the persistent batch, and those that left it."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    # Requests that stopped running since the previous schedule (finished, aborted or preempted,
    # this step's preemptions included): whatever they held per running request can be let go.
    left_running_ids: list[str] = field(default_factory=list)
    # LoRA adapters that take a device slot this step: (slot, the adapter's host weights), written
    # before the step runs.
    lora_loads: list[tuple[int, Any]] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_spec_tokens(self) -> int:
        return sum(len(s.spec_token_ids) for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager, lora_slots: LoraSlots | None = None) -> None:
        self.config = config
        self.kv = kv_manager
        self.lora_slots = lora_slots
        # In the order requests are admitted: arrival (a preempted request back at the front), or
        # (priority, arrival) under the priority policy.
        self.waiting: list[Request] = []
        self.by_priority = config.policy == "priority"
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._left_running: list[str] = []  # reported by the next schedule()

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add_request(self, request: Request) -> None:
        # Trusted input: the input processor made prompt + max_tokens fit max_model_len, the memory
        # plan made max_model_len fit the cache, and the engine core keeps ids unique.
        assert request.request_id not in self.requests, request.request_id
        assert request.num_prompt_tokens + request.max_tokens <= self.config.max_model_len, request.request_id
        self.requests[request.request_id] = request
        self._enqueue(request)

    def _enqueue(self, request: Request, front: bool = False) -> None:
        if self.by_priority:
            bisect.insort(self.waiting, request, key=_rank)
        elif front:
            self.waiting.insert(0, request)
        else:
            self.waiting.append(request)

    def _preempt(self, request: Request) -> None:
        self._left_running.append(request.request_id)
        self.kv.free(request)
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self._enqueue(request, front=True)

    def _with_lookahead(self, request: Request, num_new: int, num_hit: int = 0) -> int:
        """The slots a step of `num_new` tokens allocates: a draft model's lookahead besides (up to
        max_model_len)."""
        lookahead = self.config.num_lookahead_tokens
        if not lookahead:
            return num_new
        total = request.num_computed_tokens + num_hit + num_new
        return num_new + max(0, min(lookahead, self.config.max_model_len - total))

    def _newest_paused(self) -> Request | None:
        return next((r for r in reversed(self.running) if r.paused), None)

    def preempt_all(self) -> list[Request]:
        """Send every running request back to the front of the waiting queue, in order, to be
        recomputed (the KV cache was lost)."""
        victims = list(self.running)
        self.running.clear()
        for request in reversed(victims):
            self._preempt(request)
        return victims

    def _preempt_for_priority(self, out: SchedulerOutput) -> set[str]:
        """Under the priority policy: while the best waiting request has a strictly better priority
        than the worst running one and could not start (no batch slot, or fewer free blocks than
        its tokens need), preempt that running request. Returns the ids preempted."""
        preempted: set[str] = set()
        in_use = self._adapters_in_use()
        best = next((r for r in self.waiting if not r.paused and not r.num_output_placeholders
                     and self._adapter_fits(r, in_use)), None)
        while best is not None and self.running:
            worst = max(self.running, key=_rank)
            if worst.priority <= best.priority:
                break
            full = len(self.running) >= self.config.max_num_seqs
            blocks = -(-(best.num_tokens + self.config.num_lookahead_tokens) // self.kv.block_size)
            if not full and self.kv.num_free_blocks >= blocks:
                break
            self.running.remove(worst)
            self._preempt(worst)
            out.preempted_ids.append(worst.request_id)
            preempted.add(worst.request_id)
        return preempted

    def _victim(self) -> Request:
        """Who gives up its blocks when a running request lacks some: a paused request (it makes no
        progress), else the newest running one, or under the priority policy the worst-ranked."""
        return self._newest_paused() or (max(self.running, key=_rank) if self.by_priority else self.running[-1])

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        preempted_now = self._preempt_for_priority(out) if self.by_priority else set()
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            # Proposed tokens ride along with the one token a decoding request lacks (the engine core
            # proposes only for those), as many as the budget leaves room for.
            spec, request.spec_token_ids = request.spec_token_ids, []
            lacking = request.num_tokens_with_placeholders - request.num_computed_tokens
            if lacking != 1:
                spec = []
            num_new = min(lacking + len(spec), budget)
            if request.paused or num_new <= 0 or (
                    request.num_output_placeholders and
                    request.num_output_tokens + request.num_output_placeholders >= request.max_tokens):
                # Paused, or waiting for the results of its steps in flight (the last it may have).
                i += 1
                continue
            num_blocks_before = self.kv.num_blocks(request.request_id)
            slots = self._with_lookahead(request, num_new)
            while not self.kv.allocate_slots(request, slots):
                if slots != min(lacking, budget):
                    # Memory is short: proposals and a draft's lookahead give way before any request
                    # is preempted for them.
                    spec, num_new = [], min(lacking, budget)
                    slots = num_new
                    continue
                victim = self._victim()
                index = self.running.index(victim)
                del self.running[index]
                if index < i:
                    i -= 1
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is request:
                    break
            else:
                out.scheduled.append(self._scheduled(request, num_new,
                                                     self.kv.block_ids(request.request_id, num_blocks_before),
                                                     spec[:num_new - lacking]))
                budget -= num_new
                i += 1
                continue
            break  # the request itself was preempted: nothing after it is running any more

        # Admitting new work in a step that had to preempt for blocks would only thrash (preempting
        # for a better priority is done to admit it).
        thrashing = len(out.preempted_ids) > len(preempted_now)
        while not thrashing and budget > 0:
            # A preempted request whose last step is still in flight waits for its token first.
            in_use = self._adapters_in_use()
            index = next((j for j, r in enumerate(self.waiting) if not r.paused and not r.num_output_placeholders
                          and r.request_id not in preempted_now and self._adapter_fits(r, in_use)), None)
            if index is None:
                break
            if len(self.running) >= self.config.max_num_seqs:
                # Paused requests must not hold every batch slot: the newest gives its slot up.
                victim = self._newest_paused()
                if victim is None:
                    break
                self.running.remove(victim)
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                continue
            request = self.waiting[index]
            hits, num_hit = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit, budget)
            with_lookahead = self._with_lookahead(request, num_new, num_hit)
            if not self.kv.allocate_slots(request, with_lookahead, hits) and (
                    with_lookahead == num_new or not self.kv.allocate_slots(request, num_new, hits)):
                victim = self._newest_paused()
                if victim is None:
                    break
                self.running.remove(victim)  # its blocks are worth more to a request that can run
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                continue
            del self.waiting[index]
            lora_slot = self._take_slot(request, in_use, out)
            if request.status == RequestStatus.WAITING:  # first admission, not a resume
                request.num_cached_tokens = num_hit
                request.first_scheduled_time = time.monotonic()
                if self.kv.enable_caching:
                    self.kv.prefix_stats.record(request.num_tokens, num_hit)
            request.num_computed_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.new_requests.append(NewRequestData(
                request.request_id, request.prompt_token_ids, list(request.output_token_ids),
                request.sampling_params, request.seed, request.eos_token_ids, self.kv.block_ids(request.request_id),
                lora_slot))
            out.scheduled.append(self._scheduled(request, num_new, []))
            budget -= num_new
        out.left_running_ids, self._left_running = self._left_running, []
        if out.num_spec_tokens and any(self.requests[s.request_id].needs_prompt_logprobs for s in out.scheduled):
            self._drop_spec_tokens(out)
        return out

    def _adapters_in_use(self) -> set[int]:
        return {r.lora_int_id for r in self.running if r.lora_int_id}

    def _adapter_fits(self, request: Request, in_use: set[int]) -> bool:
        """Whether the request's adapter (if any) has a slot or can be given one now."""
        return not request.lora_int_id or self.lora_slots.can_acquire(request.lora_int_id, in_use)

    def _take_slot(self, request: Request, in_use: set[int], out: SchedulerOutput) -> int:
        """The slot of the request's adapter (-1 without one), given it now if it had none."""
        if not request.lora_int_id:
            return -1
        taken = self.lora_slots.acquire(request.lora_int_id, in_use)
        assert taken is not None, "checked by _adapter_fits"
        slot, load = taken
        if load:
            out.lora_loads.append((slot, request.lora_adapter))
        return slot

    def _drop_spec_tokens(self, out: SchedulerOutput) -> None:
        """A step that scores prompt tokens runs the all-positions program, which verifies nothing:
        its rows go without their proposals (the slots they were given stay for the next tokens)."""
        for s in out.scheduled:
            if s.spec_token_ids:
                s.num_new_tokens -= len(s.spec_token_ids)
                self.requests[s.request_id].num_computed_tokens -= len(s.spec_token_ids)
                s.spec_token_ids = []

    def _scheduled(self, request: Request, num_new: int, new_block_ids: list[int],
                   spec: list[int] | None = None) -> ScheduledRequest:
        """The row of a request scheduled for `num_new` tokens (the last `len(spec)` of them proposed).
        Its computed count moves on now (the next schedule may follow this step before its results
        are back), and a step that completes its tokens holds a placeholder for the token it will
        sample."""
        spec = spec or []
        samples = request.num_computed_tokens + num_new - len(spec) == request.num_tokens_with_placeholders
        row = ScheduledRequest(request.request_id, num_new, request.num_computed_tokens, new_block_ids, samples, spec)
        request.num_computed_tokens += num_new
        request.num_output_placeholders += samples
        return row

    def update_from_output(self, out: SchedulerOutput, sampled: list[int] | list[list[int]],
                           scheduled_for: list[Request | None] | None = None) -> list[Request]:
        """Turn each sampling row's placeholder into its tokens (partial prompt chunks keep nothing):
        one, or with proposals the accepted ones and the token after them. The KV of rejected
        proposals is left to be overwritten: the computed count steps back over them. Tokens after
        one that finishes the request (EOS, stop token id, max_tokens) are dropped, as plain
        decoding would never have made them. A request that finished or was aborted while the step
        ran drops its tokens, even if a new request took its id meanwhile (`scheduled_for`: each
        row's request if it is still unfinished, else None, when the step ran behind later
        schedules). `sampled`: each row's token, or its list of tokens. Returns the requests finished
        by length or stop tokens."""
        finished = []
        if scheduled_for is None:
            scheduled_for = [self.requests.get(s.request_id) for s in out.scheduled]
        for s, tokens, request in zip(out.scheduled, sampled, scheduled_for, strict=True):
            if not s.samples or request is None:
                continue
            tokens = tokens if isinstance(tokens, list) else [tokens]
            assert 1 <= len(tokens) <= 1 + len(s.spec_token_ids), (tokens, s.spec_token_ids)
            request.num_output_placeholders -= 1
            if request.status == RequestStatus.RUNNING:
                request.num_computed_tokens -= len(s.spec_token_ids) + 1 - len(tokens)
            for token in tokens:
                status = request.append_output(token)
                if status is not None:
                    self.finish(request, status)
                    finished.append(request)
                    break
        return finished

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request (length, stop, abort): its blocks go back to the pool at once."""
        if request.status.finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            self._left_running.append(request.request_id)
        else:
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request)
        self.kv.forget(request)
        del self.requests[request.request_id]

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request


def _rank(request: Request) -> tuple[int, float, str]:
    """The priority policy's order: lower priority values first, then earlier arrivals."""
    return request.priority, request.arrival_time, request.request_id
