"""The output processor: engine-core sample outputs -> user-facing RequestOutputs.

The one place a request finishes. It detokenizes, finds stop strings (and tells the core to free
the samples they ended), builds logprob entries, and emits each request's outputs in its
`RequestOutputKind`: deltas for streaming (only what the step added, so a long answer is never
copied again and again), everything so far, or one final output. It never touches the device, so
it can run on any one thread (the async engine gives it its own).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from paxserve.core.interface import EngineCoreRequest, RequestOutputKind, SampledLogprobs, SampleOutput
from paxserve.core.prompt_logprobs import PromptLogprobsBuffer
from paxserve.core.request import RequestStatus
from paxserve.engine.detokenizer import IncrementalDetokenizer
from paxserve.outputs import CompletionOutput, Logprob, RequestOutput

logger = logging.getLogger(__name__)

OUTPUT_FAILED_MESSAGE = "Turning the generated tokens into text failed for this request; the server is still running."


@dataclass(slots=True)
class _Sample:
    index: int
    detokenizer: IncrementalDetokenizer
    want_logprobs: bool
    # Every token so far, or with delta outputs only those not handed out yet (nothing is kept twice).
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_text: str = ""
    changed: bool = False

    def output(self, text: str) -> CompletionOutput:
        return CompletionOutput(
            index=self.index, text=text, token_ids=self.token_ids,
            cumulative_logprob=self.cumulative_logprob if self.want_logprobs else None,
            logprobs=self.logprobs if self.want_logprobs else None,
            finish_reason=self.finish_reason, stop_reason=self.stop_reason)


@dataclass(slots=True)
class _RequestState:
    request: EngineCoreRequest
    samples: list[_Sample]
    num_cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_sent: bool = False  # delta outputs carry them once
    first_scheduled_time: float | None = None  # the earliest of its samples'
    preemptions: dict[int, int] = field(default_factory=dict)  # sample index -> its preemptions so far

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


@dataclass(slots=True)
class ProcessedOutputs:
    request_outputs: list[RequestOutput] = field(default_factory=list)
    samples_to_finish: list[str] = field(default_factory=list)  # ended by a stop string: free them in the core
    requests_to_abort: list[str] = field(default_factory=list)  # failed: end all their samples in the core


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}

    def __len__(self) -> int:
        return len(self._states)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Start tracking a request (before the core can produce anything for it)."""
        assert request.request_id not in self._states, request.request_id  # the engine core keeps ids unique
        params = request.sampling_params
        samples = [_Sample(i, IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params),
                           params.wants_logprobs) for i in range(params.n)]
        self._states[request.request_id] = _RequestState(request, samples)

    def abort_request(self, request_id: str) -> None:
        """Forget a request that was aborted (outputs still in flight for it are dropped)."""
        self._states.pop(request_id, None)

    def process(self, outputs: list[SampleOutput]) -> ProcessedOutputs:
        result = ProcessedOutputs()
        touched: dict[str, _RequestState] = {}
        for out in outputs:
            state = self._states.get(out.request_id)
            if state is None:
                continue  # aborted meanwhile
            touched[out.request_id] = state
            try:
                self._apply(state, out, result)
            except Exception:  # noqa: BLE001 - isolated: only this request fails
                logger.exception("processing the output of request %s failed; ending it with an error",
                                 out.request_id)
                self._fail(state, OUTPUT_FAILED_MESSAGE, result)
        for request_id, state in touched.items():
            output = self._make_output(state)
            if output is not None:
                result.request_outputs.append(output)
            if state.finished:
                del self._states[request_id]
        return result

    def _apply(self, state: _RequestState, out: SampleOutput, result: ProcessedOutputs) -> None:
        sample = state.samples[out.sample_index]
        if sample.finish_reason is not None:
            return  # a step already under way when a stop string ended it
        state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
        if out.first_scheduled_time is not None:
            state.first_scheduled_time = min(state.first_scheduled_time or out.first_scheduled_time,
                                             out.first_scheduled_time)
        state.preemptions[out.sample_index] = out.num_preemptions
        if out.finish_reason == RequestStatus.FINISHED_ERROR.value:
            self._fail(state, out.error or "The request failed.", result)
            return
        params = state.request.sampling_params
        if out.prompt_logprobs is not None and state.prompt_logprobs is None:
            state.prompt_logprobs = self._prompt_logprobs(state.request.prompt_token_ids, out.prompt_logprobs)
        # A token that ended the sample as EOS or a stop token id is text only when asked (vLLM).
        ended_by_token = out.finish_reason == RequestStatus.FINISHED_STOPPED.value and not out.ended_by_grammar
        logprobs = [out.logprobs] if isinstance(out.logprobs, SampledLogprobs) else out.logprobs
        detok = sample.detokenizer
        stop = None
        last = len(out.new_token_ids) - 1
        # Token by token: a stop string completed by one of several new tokens (verified proposals)
        # ends the sample there, as plain decoding would have, and the tokens after it are not kept.
        for i, token in enumerate(out.new_token_ids):
            sample.token_ids.append(token)
            if sample.want_logprobs and logprobs is not None:
                sample.logprobs.append(self._logprobs_entry(token, logprobs[i], params.num_logprob_columns,
                                                            ranked=params.logprob_token_ids is None))
                sample.cumulative_logprob += logprobs[i].logprob
            if (i < last or not ended_by_token or params.include_stop_str_in_output) and not detok.finished:
                stop = detok.update([token])
                if stop is not None:
                    break
        sample.changed = True
        if stop is not None:
            sample.finish_reason, sample.stop_reason = RequestStatus.FINISHED_STOPPED.value, stop
            if out.finish_reason is None:
                result.samples_to_finish.append(state.request.sample_id(sample.index))
        elif out.finish_reason is not None:
            sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
        if sample.finish_reason is not None:
            detok.finish()
        sample.new_text += detok.get_delta()

    def _fail(self, state: _RequestState, message: str, result: ProcessedOutputs) -> None:
        """A request fails as a whole: every sample still going ends with "error"."""
        state.error = state.error or message
        for sample in state.samples:
            if sample.finish_reason is None:
                sample.finish_reason = RequestStatus.FINISHED_ERROR.value
                sample.changed = True
        result.requests_to_abort.append(state.request.request_id)

    def _make_output(self, state: _RequestState) -> RequestOutput | None:
        kind = state.request.output_kind
        finished = state.finished
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if kind == RequestOutputKind.DELTA:
            completions = []
            for s in state.samples:
                if s.changed:
                    completions.append(s.output(s.new_text))
                    s.token_ids, s.logprobs = [], []  # handed over: the output owns them now
            if not completions:
                return None
        else:
            # Cumulative outputs are snapshots: later steps must not change what was handed out.
            final = kind == RequestOutputKind.FINAL_ONLY
            completions = []
            for s in state.samples:
                c = s.output(s.detokenizer.emitted_text)
                if not final:
                    c.token_ids = list(c.token_ids)
                    c.logprobs = list(c.logprobs) if c.logprobs is not None else None
                completions.append(c)
        for s in state.samples:
            s.changed, s.new_text = False, ""
        request = state.request
        prompt_logprobs = state.prompt_logprobs
        if kind == RequestOutputKind.DELTA:
            if state.prompt_logprobs_sent:
                prompt_logprobs = None
            elif prompt_logprobs is not None:
                state.prompt_logprobs_sent = True
        return RequestOutput(request_id=request.request_id, prompt=request.prompt,
                             prompt_token_ids=request.prompt_token_ids, outputs=completions, finished=finished,
                             num_cached_tokens=state.num_cached_tokens, error=state.error,
                             prompt_logprobs=prompt_logprobs,
                             first_scheduled_time=state.first_scheduled_time if finished else None,
                             num_preemptions=sum(state.preemptions.values()) if finished else 0)

    def _prompt_logprobs(self, prompt_ids: list[int],
                         buffer: PromptLogprobsBuffer) -> list[dict[int, Logprob] | None]:
        """The engine's raw prompt-logprob rows as vLLM's list: None for token 0, then one entry per
        token in the same shape as the sampled tokens' (with its exact rank from the device)."""
        entries: list[dict[int, Logprob] | None] = [None]
        k = buffer.num_top
        for i, token in enumerate(prompt_ids[1:]):
            lp = SampledLogprobs(float(buffer.logprobs[i]), buffer.top_token_ids[i], buffer.top_logprobs[i])
            entries.append(self._logprobs_entry(token, lp, k, rank=int(buffer.ranks[i])))
        return entries

    def _logprobs_entry(self, token: int, lp: SampledLogprobs, k: int, rank: int | None = None,
                        ranked: bool = True) -> dict[int, Logprob]:
        """`rank`: the token's exact rank when known; else its place in the top ids, if there.
        `ranked` false: the columns are chosen tokens (logprob_token_ids), whose ranks are unknown."""
        top_ids = lp.top_token_ids.tolist()
        top_lps = lp.top_logprobs.tolist()
        k = len(top_ids) if k < 0 else k  # -1: the whole vocabulary (the row holds every token)
        tok = self.tokenizer

        def decode(t: int) -> str | None:
            return tok.decode([t]) if tok is not None else None

        if rank is None and ranked and token in top_ids:
            rank = top_ids.index(token) + 1
        entry = {token: Logprob(lp.logprob, rank=rank, decoded_token=decode(token))}
        for place, (tid, value) in enumerate(zip(top_ids[:k], top_lps[:k]), start=1):
            entry.setdefault(int(tid), Logprob(float(value), rank=place if ranked else None,
                                               decoded_token=decode(int(tid))))
        return entry
