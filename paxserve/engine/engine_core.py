"""The engine core: scheduler + KV cache manager + model runner, one `step()` at a time.

It takes requests that are already tokenized and validated (`EngineCoreRequest`) and gives back
plain per-sample outputs (`SampleOutput`): new token ids, logprob rows, and the finish reasons the
core itself decides (length, EOS, stop token ids, error). Text, stop strings and the user-facing
`RequestOutput` belong to the output processor, so nothing request-specific but scheduling and the
model step runs here; that keeps the step loop's thread free for the device.

A step that raises fails only the requests it carried (finish reason "error"): the prefix-cache
registrations it made are rolled back, and if the KV cache it was given (donated) is gone, a fresh
one is made and every other running request is recomputed from its tokens.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from paxserve.core.interface import EngineCoreRequest, EngineSnapshot, SampledLogprobs, SampleOutput
from paxserve.core.kv_cache_manager import KVCacheManager
from paxserve.core.prompt_logprobs import (
    PromptLogprobsBuffer,
    PromptLogprobsInputs,
    build_prompt_logprobs_inputs,
    fill_prompt_logprobs,
)
from paxserve.core.request import Request, RequestStatus
from paxserve.core.scheduler import Scheduler, SchedulerOutput
from paxserve.engine.stats import StatsLogger
from paxserve.spec_decode.acceptance import SpecDecodingStats
from paxserve.spec_decode.config import SpeculativeConfig
from paxserve.spec_decode.draft_model import DraftModel
from paxserve.spec_decode.eagle3 import Eagle3Proposer
from paxserve.spec_decode.speculator import Speculator
from paxserve.worker.model_runner import ModelRunner, ModelStep
from paxserve.worker.sampling.host_inputs import SampledTokens, constrained_rows

logger = logging.getLogger(__name__)

@dataclass(slots=True)
class _Flight:
    """A step dispatched to the device whose results have not been taken in yet."""

    out: SchedulerOutput
    requests: list[Request | None]  # each row's request when it was scheduled (its id may be reused later)
    step: ModelStep
    registered: list  # the prefix-cache blocks its schedule registered
    buffers: list[PromptLogprobsBuffer | None]
    prompt: PromptLogprobsInputs | None
    num_prompt_tokens: int
    num_preempted: int = 0
    abandoned: bool = False  # undone because the step before it failed
    started: float = 0.0  # when its dispatch began


STEP_FAILED_MESSAGE = ("The engine step that was serving this request failed; the server is still running and "
                       "the request can be retried.")


class EngineCore:
    """Not thread-safe: one thread (the step loop, or the offline `Engine`) calls everything."""

    def __init__(self, runner: ModelRunner, kv: KVCacheManager, scheduler: Scheduler, vocab_size: int,
                 stats: StatsLogger, async_scheduling: bool = False, isolate_failed_steps: bool = True,
                 speculative: SpeculativeConfig | None = None, draft: DraftModel | None = None,
                 eagle: Eagle3Proposer | None = None) -> None:
        """`isolate_failed_steps=False` (a multi-host engine): a failed step raises instead of failing
        only its requests, since the other ranks' caches and programs can no longer be kept in step.
        `speculative`: propose tokens for decoding requests and verify them in their next step (the
        runner must have been made for its number of tokens), with `draft` proposing when its method
        is "draft_model", `eagle` when it is "eagle3" (the runner must then keep the head's aux hidden
        states). With async scheduling too, a request can propose only once its last token is known:
        the step in flight is waited for when it verifies proposals or a request in it would likely
        propose (`Speculator.wants_results`); otherwise the next step overlaps it as usual."""
        self.runner = runner
        self.kv = kv
        self.scheduler = scheduler
        self.vocab_size = vocab_size
        self.stats = stats
        if runner.input_batch.num_rows != scheduler.config.max_num_seqs + 1:
            raise ValueError(f"the model runner has rows for {runner.input_batch.num_rows - 1} sequences, the "
                             f"scheduler runs {scheduler.config.max_num_seqs}: build both from the same max_num_seqs")
        self._samples: dict[str, list[str]] = {}  # user request id -> ids of its unfinished samples
        self.num_failed_steps = 0
        self.num_kv_cache_resets = 0
        self.last_num_scheduled = 0  # sequences the last step ran (0: nothing could run)
        self.async_scheduling = async_scheduling
        self.isolate_failed_steps = isolate_failed_steps
        self._in_flight: _Flight | None = None
        self.speculative = speculative
        self.spec_stats = SpecDecodingStats()
        self._speculator = None
        # Async scheduling with speculation: steps whose results were waited for before proposing,
        # and steps built while their predecessor ran.
        self.num_spec_waits = 0
        self.num_overlapped_steps = 0
        if speculative is not None:
            if runner.input_batch.verify_width != 1 + speculative.num_speculative_tokens:
                raise ValueError(f"the model runner verifies {runner.input_batch.verify_width - 1} proposed tokens, "
                                 f"the speculative config proposes {speculative.num_speculative_tokens}: build "
                                 "both from the same config")
            if eagle is not None and runner.shapes.aux_layers != eagle.cfg.aux_layers:
                raise ValueError(f"the model runner keeps the hidden states of layers {runner.shapes.aux_layers}, the "
                                 f"EAGLE-3 head reads {eagle.cfg.aux_layers}: build both from the same head")
            self._speculator = Speculator(speculative, self._step_program, draft, kv.block_ids, eagle,
                                          overlap=async_scheduling)
            self.spec_stats = self._speculator.stats
        self._verify_programs: dict = {}
        # LoRA: the directory each adapter id named last (only the path: the weights stay in the
        # loader's bounded host cache and on the requests that use them).
        self._lora_paths: dict[int, Any] = {}

    # ---- requests ------------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue all n samples of a request, or none of them (ValueError)."""
        if request.request_id in self._samples:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        prompt_k = request.sampling_params.prompt_logprobs
        if request.lora_request is not None:
            self._check_adapter(request.lora_request, request.lora_adapter)
        samples = [
            Request(request_id=request.sample_id(i), prompt_token_ids=request.prompt_token_ids,
                    sampling_params=request.sampling_params, max_tokens=request.max_tokens,
                    eos_token_ids=request.eos_token_ids, seed=request.seeds[i], arrival_time=request.arrival_time,
                    parent_id=request.request_id, sample_index=i, cache_salt=request.cache_salt,
                    priority=request.priority,
                    matcher=None if request.grammar is None else request.grammar.new_matcher(),
                    # One sample scores the prompt for all n; the others may use the prefix cache.
                    prompt_logprobs=PromptLogprobsBuffer.empty(len(request.prompt_token_ids), prompt_k)
                    if i == 0 and prompt_k is not None else None,
                    lora_request=request.lora_request, lora_adapter=request.lora_adapter)
            for i in range(request.sampling_params.n)
        ]
        added: list[Request] = []
        try:
            for sample in samples:
                self.scheduler.add_request(sample)
                added.append(sample)
        except ValueError:
            for sample in added:
                self.scheduler.abort(sample.request_id)
            raise
        self._samples[request.request_id] = [s.request_id for s in samples]

    def _check_adapter(self, lora_request: Any, adapter: Any) -> None:
        """An adapter id names one adapter (its directory). An id that comes back naming another
        directory (unloaded, then loaded anew) has its slot rewritten, unless requests still use the
        old one: the new request is then refused."""
        slots = self.scheduler.lora_slots
        if slots is None:
            raise ValueError("this engine serves no LoRA adapters: start it with enable_lora=True (--enable-lora)")
        lora_id = lora_request.lora_int_id
        held = self._lora_paths.get(lora_id)
        if held is not None and held != adapter.path:
            if any(r.lora_int_id == lora_id for r in self.scheduler.requests.values()):
                raise ValueError(f"LoRA id {lora_id} was read again ({lora_request.lora_name!r}) while requests still "
                                 "run with its earlier weights: give a changed adapter a new id")
            slots.release(lora_id)
        self._lora_paths[lora_id] = adapter.path

    def abort_request(self, request_id: str) -> None:
        """End every sample of the request now and free its blocks. Unknown ids are ignored."""
        for sample_id in self._samples.pop(request_id, []):
            self.scheduler.abort(sample_id)

    def finish_samples(self, sample_ids: list[str]) -> None:
        """Samples the output processor ended (a stop string): free their blocks now."""
        for sample_id in sample_ids:
            request = self.scheduler.requests.get(sample_id)
            if request is not None:
                self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
                self._forget(request)

    def set_paused(self, request_id: str, paused: bool) -> None:
        """Hold a request out of the batch while its reader catches up (or let it run again)."""
        for sample_id in self._samples.get(request_id, []):
            request = self.scheduler.requests.get(sample_id)
            if request is not None:
                request.paused = paused

    def has_unfinished_requests(self) -> bool:
        """Requests not finished yet. (A step in flight whose requests all ended meanwhile counts for
        nothing: its results would be dropped, and the next step takes it in.)"""
        return bool(self._samples)

    def _forget(self, request: Request) -> None:
        siblings = self._samples.get(request.parent_id or request.request_id)
        if siblings is None:
            return
        if request.request_id in siblings:
            siblings.remove(request.request_id)
        if not siblings:
            del self._samples[request.parent_id or request.request_id]

    # ---- the step ------------------------------------------------------------------------------

    @property
    def has_step_in_flight(self) -> bool:
        return self._in_flight is not None

    def step(self) -> list[SampleOutput]:
        """Schedule, run the model once, and report each sample that got a token or finished.

        With async scheduling the step is dispatched to the device and the previous one's results
        are taken in while it runs, so the host's scheduling and bookkeeping hide under device work;
        the outputs returned are then the previous step's. A row whose request finished (or was
        aborted) meanwhile drops its token, so nothing is ever emitted past a stop."""
        outputs: list[SampleOutput] = []
        if self._speculator is not None:
            self._verify_programs = {}  # this step's answers of `_step_program`, by bucket
            flight = self._in_flight
            if flight is not None:
                if self._speculator.wants_results(flight.out.num_spec_tokens > 0, self.scheduler.running):
                    self.num_spec_waits += 1
                    outputs += self._complete(self._take_in_flight())
                else:
                    self.num_overlapped_steps += 1
            self._speculator.propose(self.scheduler.running)
        out = self.scheduler.schedule()
        self.last_num_scheduled = len(out.scheduled)
        flight = None
        try:
            self.runner.update_rows(out)
            if out.scheduled and self._in_flight is not None and self._needs_previous_results(out):
                outputs += self._complete(self._take_in_flight())
            if out.scheduled:
                flight = self._dispatch(out)
        except Exception as e:  # noqa: BLE001 - isolated: only this step's requests fail
            outputs += self._fail_step(out, self.kv.take_registered(), e)
        if flight is not None:
            flight.num_preempted = len(out.preempted_ids)
        elif not out.scheduled:
            self.stats.on_step(0, 0, len(out.preempted_ids))
        if self._speculator is not None and self.async_scheduling:
            self._speculator.record_dispatch(None if flight is None else (self._timed_program(flight.out),
                                                                          flight.started))
        if not self.async_scheduling:
            return outputs + (self._complete(flight) if flight is not None else [])
        if self._in_flight is not None:
            outputs += self._complete(self._take_in_flight(), successor=flight)
        self._in_flight = None if flight is None or flight.abandoned else flight
        return outputs

    def _timed_program(self, out: SchedulerOutput) -> tuple[str, int, int]:
        """A step's size as its time is kept: (kind, token bucket, sequence bucket), whichever
        program served it (its own, or a larger one while its own compiled)."""
        t, s, _ = self.runner.exact_buckets(out.num_scheduled_tokens, len(out.scheduled), 1)
        if out.num_spec_tokens:
            return ("verify", t, s)
        return (self.runner.decode_kind if out.num_scheduled_tokens == len(out.scheduled) else "forward", t, s)

    def _step_program(self, num_tokens: int, num_seqs: int, verifying: bool) -> tuple[str, int, int] | None:
        """The size (as `_timed_program` names it) of a step of decoding rows; None for a verifying
        one that no compiled program can serve yet (its own compiles meanwhile)."""
        t, s, _ = self.runner.exact_buckets(num_tokens, num_seqs, 1)
        if not verifying:
            return (self.runner.decode_kind, t, s)
        # The plan asks once per proposal count; the answer changes only with the token bucket.
        memo = self._verify_programs
        if (t, s) not in memo:
            if "widest" not in memo:
                memo["widest"] = max((self.kv.num_blocks(r.request_id) for r in self.scheduler.running), default=1)
            key = self.runner.ready_verify_program(num_tokens, num_seqs, max(1, memo["widest"]))
            memo[(t, s)] = None if key is None else ("verify", t, s)
        return memo[(t, s)]

    def _take_in_flight(self) -> _Flight:
        flight, self._in_flight = self._in_flight, None
        assert flight is not None
        return flight

    def _needs_previous_results(self, out: SchedulerOutput) -> bool:
        """A structured-output row's bitmask needs its matcher to have seen the token in flight."""
        for s in out.scheduled:
            request = self.scheduler.requests.get(s.request_id)
            if request is not None and request.matcher is not None and request.num_output_placeholders > s.samples:
                return True
        return False

    def _dispatch(self, out: SchedulerOutput) -> _Flight:
        started = time.perf_counter()
        requests = [self.scheduler.requests.get(s.request_id) for s in out.scheduled]
        # A matcher constrains its row only where the step samples a token that is kept.
        constrained = constrained_rows([(i, r.matcher, s.spec_token_ids)
                                        for i, (s, r) in enumerate(zip(out.scheduled, requests))
                                        if s.samples and r is not None and r.matcher is not None
                                        and not r.matcher.is_stopped()], self.vocab_size)
        buffers = [None if r is None else r.prompt_logprobs for r in requests]
        prompt = None
        if any(b is not None for b in buffers):
            prompt = build_prompt_logprobs_inputs(
                [(b, r.prompt_token_ids, s.num_computed_tokens, s.num_new_tokens) if r is not None else (None, [], 0,
                                                                                                          s.num_new_tokens)
                 for b, r, s in zip(buffers, requests, out.scheduled)], out.num_scheduled_tokens)
        num_prompt_tokens = sum(s.num_new_tokens for s, r in zip(out.scheduled, requests)
                                if s.num_new_tokens - len(s.spec_token_ids) > 1
                                or (r is not None and r.num_output_tokens == 0))
        step = self.runner.dispatch_model(out, constrained, prompt)  # nobody scores prompts: the plain program
        return _Flight(out, requests, step, self.kv.take_registered(), buffers, prompt, num_prompt_tokens,
                       started=started)

    def _complete(self, flight: _Flight, successor: _Flight | None = None) -> list[SampleOutput]:
        """Take in a dispatched step's results. If they cannot be had, its requests fail, and a
        successor already dispatched on top of it is abandoned (rolled back, to be scheduled again)."""
        out = flight.out
        try:
            sampled, prompt_rows = self.runner.complete_model(flight.step)
        except Exception as e:  # noqa: BLE001 - isolated: only this step's requests fail
            if successor is not None:
                self._abandon(successor)
            return self._fail_step(out, flight.registered, e, self._live(flight))
        if self._speculator is not None:
            if not self.async_scheduling:  # steps run one at a time: this was the step's whole time
                self._speculator.record_step(self._timed_program(out), time.perf_counter() - flight.started)
            if self._speculator.eagle is not None and flight.step.device.aux is not None:
                self._speculator.eagle.record_step(out.scheduled, flight.step.device.aux, flight.step.device.index)
        if flight.prompt is not None and prompt_rows is not None:
            fill_prompt_logprobs(flight.buffers, flight.prompt, prompt_rows)
        requests = self._live(flight)
        row_tokens = sampled.row_tokens
        before = [0 if r is None else r.num_output_tokens for r in requests]
        finished_now = {r.request_id for r in self.scheduler.update_from_output(out, row_tokens, requests)}
        outputs = []
        num_generated = 0
        for row, (s, request) in enumerate(zip(out.scheduled, requests)):
            if s.spec_token_ids:
                self._speculator.record_verified(request, len(s.spec_token_ids), len(row_tokens[row]) - 1)
            if s.samples and request is not None:
                num_new = request.num_output_tokens - before[row]
                num_generated += num_new
                outputs.append(self._sample_output(request, row, sampled, request.request_id in finished_now,
                                                   num_new))
        self.stats.on_step(flight.num_prompt_tokens, num_generated, flight.num_preempted)
        self.stats.maybe_log(self)
        return outputs

    def _abandon(self, flight: _Flight) -> None:
        """Undo a dispatched step whose inputs can no longer be trusted: wait for it, drop its
        results, give its requests back the computed counts and placeholders it took, forget its
        prefix-cache registrations and its placeholders in the persistent batch."""
        flight.abandoned = True
        try:
            self.runner.collect(flight.step.device)
        except Exception:  # noqa: BLE001 - its results are dropped either way
            pass
        self.runner.input_batch.unrecord(flight.step.prepared)
        self.kv.rollback(flight.registered)
        for s, request in zip(flight.out.scheduled, self._live(flight)):
            if request is None:
                continue
            request.num_output_placeholders -= s.samples
            if request.status == RequestStatus.RUNNING:
                request.num_computed_tokens = s.num_computed_tokens

    def _live(self, flight: _Flight) -> list[Request | None]:
        """The step's requests that are still unfinished (None where one ended, even if a new
        request has taken its id since)."""
        return [r if r is not None and self.scheduler.requests.get(r.request_id) is r else None
                for r in flight.requests]

    def _sample_output(self, request: Request, row: int, sampled: SampledTokens, finished: bool,
                       num_new: int = 1) -> SampleOutput:
        """`num_new`: the tokens the step added to the request (several when it verified proposals)."""
        logprobs = None
        if request.sampling_params.wants_logprobs and sampled.sampled_logprobs is not None:
            first = sampled.first_row(row)
            logprobs = [_wide_logprobs(float(sampled.sampled_logprobs[i]), sampled.wide[i],
                                       request.sampling_params.logprobs)
                        if sampled.wide is not None and i in sampled.wide else
                        SampledLogprobs(float(sampled.sampled_logprobs[i]), sampled.top_token_ids[i],
                                        sampled.top_logprobs[i]) for i in range(first, first + num_new)]
            logprobs = logprobs[0] if num_new == 1 else logprobs
        prompt_logprobs = request.prompt_logprobs
        if prompt_logprobs is not None and prompt_logprobs.complete and not prompt_logprobs.sent:
            prompt_logprobs.sent = True
        else:
            prompt_logprobs = None
        if finished:
            self._forget(request)
        return SampleOutput(
            request.parent_id or request.request_id, request.sample_index, request.output_token_ids[-num_new:],
            logprobs,
            finish_reason=request.status.value if finished else None,
            stop_reason=request.stop_reason if finished else None, num_cached_tokens=request.num_cached_tokens,
            error=request.error if finished else None, ended_by_grammar=finished and request.ended_by_grammar,
            prompt_logprobs=prompt_logprobs, first_scheduled_time=request.first_scheduled_time,
            num_preemptions=request.num_preemptions,
        )

    def _fail_step(self, out: SchedulerOutput, registered: list, error: Exception,
                   requests: list[Request | None] | None = None) -> list[SampleOutput]:
        """`requests`: the step's requests still unfinished, when it ran behind later schedules."""
        self.num_failed_steps += 1
        if not self.isolate_failed_steps:
            raise RuntimeError(f"a model step failed on a multi-host engine, which cannot recover from it (the ranks "
                               f"are no longer in step): {type(error).__name__}: {error}") from error
        if requests is None:
            requests = [self.scheduler.requests.get(s.request_id) for s in out.scheduled]
        failed = [r for r in requests if r is not None]
        logger.error("a model step failed: its %d sequences end with an error, every other request goes on "
                     "(%s: %s)", len(failed), type(error).__name__, str(error).splitlines()[0][:300] if str(error)
                     else "", exc_info=error)
        self.kv.rollback(registered)
        outputs = []
        for request in failed:
            self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
            self._forget(request)
            outputs.append(SampleOutput(request.parent_id or request.request_id, request.sample_index, [],
                                        finish_reason=RequestStatus.FINISHED_ERROR.value,
                                        num_cached_tokens=request.num_cached_tokens, error=STEP_FAILED_MESSAGE))
        num_preempted = 0
        if not self.runner.kv_cache_intact():
            # The step had been given the cache (donated) and took it down with it: every cached
            # token is gone, so the survivors start over from their token ids.
            self.runner.reset_kv_cache()
            self.kv.reset_prefix_cache()
            self.num_kv_cache_resets += 1
            num_preempted = len(self.scheduler.preempt_all())
            logger.warning("the failed step lost the KV cache: made a new one; %d running requests will be "
                           "recomputed from their tokens", num_preempted)
        self.stats.on_step(0, 0, len(out.preempted_ids) + num_preempted)
        return outputs

    # ---- monitoring ----------------------------------------------------------------------------

    def snapshot(self) -> EngineSnapshot:
        sched = self.scheduler
        return EngineSnapshot(
            num_requests_running=len(sched.running),
            num_requests_waiting=len(sched.waiting),
            num_requests_paused=sum(r.paused for r in sched.requests.values()),
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=self.kv.prefix_stats.queries,
            prefix_cache_hits=self.kv.prefix_stats.hits,
            num_preemptions=self.stats.preemptions,
            prompt_tokens=self.stats.prompt_tokens,
            generation_tokens=self.stats.generation_tokens,
            num_failed_steps=self.num_failed_steps,
            num_kv_cache_resets=self.num_kv_cache_resets,
            spec_decode_num_drafts=self.spec_stats.num_drafts,
            spec_decode_num_draft_tokens=self.spec_stats.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.spec_stats.num_accepted_tokens,
            spec_decode_accepted_per_position=tuple(self.spec_stats.accepted_per_position),
            lora_running=_adapter_names(sched.running),
            lora_waiting=_adapter_names(sched.waiting),
            max_lora=0 if sched.lora_slots is None else sched.lora_slots.max_loras,
            iteration_tokens_buckets=tuple(self.stats.iteration_buckets),
            iteration_tokens_sum=self.stats.iteration_tokens_sum,
        )


def _wide_logprobs(own: float, row: np.ndarray, k: int) -> SampledLogprobs:
    """A token's logprobs (`own`) with the top `k` of its whole log-softmax row (-1: every token),
    most likely first (ties by token id)."""
    ids = np.argsort(-row, kind="stable")
    ids = ids if k < 0 else ids[:k]
    return SampledLogprobs(own, ids.astype(np.int32), row[ids])


def _adapter_names(requests: Any) -> tuple[str, ...]:
    """The adapters `requests` use, by name, once each, in order."""
    return tuple(dict.fromkeys(r.lora_request.lora_name for r in requests if r.lora_request is not None))

