"""Plain data crossing the engine's seams: input processor -> engine core -> output processor.

Nothing here holds a reference to the tokenizer, the device or the scheduler, so these objects can
be made on any thread and handed to the step loop, and the step loop's outputs can be handed back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from paxserve.core.prompt_logprobs import PromptLogprobsBuffer
from paxserve.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["EngineCoreRequest", "EngineSnapshot", "RequestOutputKind", "SampleOutput", "SampledLogprobs"]


@dataclass(slots=True)
class EngineCoreRequest:
    """A request ready to schedule: tokenized, validated, with its resolved limits and seeds."""

    request_id: str
    prompt: str | None  # the prompt text, when it came as text (echo, RequestOutput.prompt)
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: the request's own, or the room left in the context
    eos_token_ids: tuple[int, ...]
    seeds: list[int]  # one generator seed per sample
    cache_salt: str | None = None
    priority: int = 0  # the priority policy's order: lower first
    arrival_time: float = field(default_factory=time.monotonic)
    # The compiled structured-output constraint (paxserve.engine.grammar.CompiledGrammar): each sample
    # gets its own matcher from it.
    grammar: Any = None
    # Its LoRA adapter: the paxserve.LoRARequest and the adapter's host weights (models/lora.py).
    lora_request: Any = None
    lora_adapter: Any = None

    def __post_init__(self) -> None:
        if len(self.seeds) != self.sampling_params.n:
            raise ValueError(f"EngineCoreRequest.seeds has {len(self.seeds)} seeds for n={self.sampling_params.n}")

    @property
    def output_kind(self) -> RequestOutputKind:
        return self.sampling_params.output_kind

    def sample_id(self, index: int) -> str:
        """The scheduler's id of sample `index` (the request id itself when n == 1)."""
        return self.request_id if self.sampling_params.n == 1 else f"{self.request_id}#{index}"


@dataclass(slots=True)
class SampledLogprobs:
    """Log-probabilities of one sampled token: its own and the top alternatives (raw numpy rows)."""

    logprob: float
    top_token_ids: np.ndarray
    top_logprobs: np.ndarray


@dataclass(slots=True)
class SampleOutput:
    """What one step did for one sample: its new tokens (one, or several when it verified proposed
    tokens), and why it finished if it did."""

    request_id: str  # the user's request id
    sample_index: int
    new_token_ids: list[int]
    # The new token's logprobs, or a list of them, one per new token.
    logprobs: SampledLogprobs | list[SampledLogprobs] | None = None
    finish_reason: str | None = None  # "stop" (EOS or a stop token id), "length", "error"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # what went wrong, in words safe to show a client
    # "stop" because the structured-output grammar is complete: the last token is text, not an EOS.
    ended_by_grammar: bool = False
    # The request's prompt logprobs, complete, once: with the output of the sample that scored them.
    prompt_logprobs: PromptLogprobsBuffer | None = None
    # On the finishing output: when the sample was first scheduled (time.monotonic) and how often it
    # was preempted (vLLM's per-request queue / prefill / decode times and preemption counts).
    first_scheduled_time: float | None = None
    num_preemptions: int = 0


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """Gauges and counters the step loop publishes after every step, so monitoring never has to
    wait for (or interrupt) the loop."""

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    num_requests_paused: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_failed_steps: int = 0
    num_kv_cache_resets: int = 0
    # Speculative decoding (vLLM's counters): drafts verified, tokens they proposed, tokens accepted,
    # and accepted tokens by position in the draft.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_accepted_per_position: tuple[int, ...] = ()
    # LoRA (vLLM's lora_requests_info): the adapters running and waiting requests use, by name, and
    # how many the device holds at once (0: LoRA is off).
    lora_running: tuple[str, ...] = ()
    lora_waiting: tuple[str, ...] = ()
    max_lora: int = 0
    # vLLM's iteration_tokens_total: cumulative step counts per bucket of engine/stats.py's
    # ITERATION_TOKEN_BUCKETS (+Inf last), and the tokens' sum.
    iteration_tokens_buckets: tuple[int, ...] = ()
    iteration_tokens_sum: int = 0

    def as_dict(self) -> dict[str, float | tuple[int, ...]]:
        return {name: getattr(self, name) for name in self.__slots__}
