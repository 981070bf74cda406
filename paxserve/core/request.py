"""A request's life on the host: its tokens, how many are in the KV cache, and why it ended."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from paxserve.core.prompt_logprobs import PromptLogprobsBuffer
from paxserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue; its KV blocks were freed and get recomputed
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # a step that carried it failed; the engine went on with the others

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                       RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR})


@dataclass(slots=True, eq=False)
class Request:
    """One sequence being generated. With `n > 1` each sample is its own Request sharing the
    prompt (and, through prefix caching, the prompt's KV blocks)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved against the room left in max_model_len
    eos_token_ids: tuple[int, ...] = ()
    seed: int = 0  # generator seed for this sample: draws depend only on (seed, output position)
    arrival_time: float = field(default_factory=time.monotonic)
    parent_id: str | None = None  # the user's request id when this is one of n samples
    sample_index: int = 0
    cache_salt: str | None = None  # mixed into its prefix-cache keys: only equal salts share blocks
    priority: int = 0  # the priority policy's order: lower first (vLLM's)
    # Its reader is behind (a slow client): not scheduled, and the first to give up its blocks.
    paused: bool = False
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens sampled by steps that are scheduled (or running on the device) but whose results have
    # not come back: they count for scheduling (the next decode follows them) but have no id yet.
    num_output_placeholders: int = 0
    num_computed_tokens: int = 0  # tokens in the KV cache once the scheduled steps have run
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first scheduling
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    first_token_time: float | None = None
    first_scheduled_time: float | None = None  # when it first got a place in the batch (time.monotonic)
    # Structured outputs: this sample's llguidance matcher, advanced by every output token. It
    # depends only on the output tokens, so preemption (recompute from the tokens) leaves it valid.
    matcher: Any = None
    ended_by_grammar: bool = False  # finished because the grammar is complete (its last token is text)
    error: str | None = None
    # Prompt logprobs collected so far; set on the one sample of a request that scores its prompt.
    prompt_logprobs: PromptLogprobsBuffer | None = None
    # Speculative decoding: tokens proposed to follow its last one, verified by its next step (set
    # by the engine core before scheduling; the schedule takes them, as many as its budget allows).
    spec_token_ids: list[int] = field(default_factory=list)
    spec_backoff: Any = None  # its paxserve.spec_decode.acceptance.DraftBackoff, once it proposed
    spec_prompt: Any = None  # its prompt as a numpy array, made once for the proposer's lookups
    spec_draft: Any = None  # its paxserve.spec_decode.draft_model.DraftState: what the draft's cache holds
    # Its LoRA adapter (paxserve.lora_request.LoRARequest) and the adapter's weights as read on the
    # host (models/lora.py's LoraAdapter), written into a device slot when it is scheduled.
    lora_request: Any = None
    lora_adapter: Any = None

    def __post_init__(self) -> None:
        assert self.prompt_token_ids and self.max_tokens >= 1, "the input processor checked both"

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether some prompt token still lacks its logprob: such a request must compute its prompt
        rather than take it from the prefix cache (cached tokens have no logits)."""
        return self.prompt_logprobs is not None and not self.prompt_logprobs.complete

    @property
    def lora_int_id(self) -> int:
        """Its adapter's id, 0 for the base model."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        """Tokens the request will have once its in-flight steps come back: what scheduling sees."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_output_placeholders

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output without building the whole list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def append_output(self, token_id: int) -> RequestStatus | None:
        """Record a sampled token; return the finishing status it causes, if any (stop strings are
        checked later by the detokenizer)."""
        self.output_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        params = self.sampling_params
        matcher = self.matcher
        if matcher is not None and not matcher.is_stopped() and not matcher.consume_token(token_id):
            # The step's bitmask allowed only what the grammar accepts, so this is a bug, not the user's.
            self.error = f"structured output: the grammar rejected a sampled token ({matcher.get_error()[:200]})"
            return RequestStatus.FINISHED_ERROR
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if params.stop_token_ids and token_id in params.stop_token_ids:
                self.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if matcher is not None and matcher.is_stopped():
            # The grammar takes nothing more (the JSON closed, the choice is made): done now, without
            # spending a step on the EOS it would force.
            self.ended_by_grammar = True
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
