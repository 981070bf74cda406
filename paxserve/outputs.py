"""What the engine returns: vLLM's RequestOutput / CompletionOutput shapes."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely; None when the sampled token is outside the top-k
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One of the n samples of a request. With `RequestOutputKind.DELTA` the text, token ids and
    logprobs are what this output added; otherwise they are everything so far."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    # Per generated token: {token_id: Logprob} for the sampled token and the top-k alternatives.
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def extend(self, later: CompletionOutput) -> None:
        """Append a later delta of the same sample (a reader that fell behind gets one merged delta)."""
        self.text += later.text
        self.token_ids.extend(later.token_ids)
        if later.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(later.logprobs)
        self.cumulative_logprob = later.cumulative_logprob
        self.finish_reason = later.finish_reason
        self.stop_reason = later.stop_reason


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # set when it finished with "error": what went wrong, safe to show a client
    # SamplingParams.prompt_logprobs: per prompt token, None for the first (nothing precedes it), else
    # {token_id: Logprob} for the prompt's own token (exact rank) and the top alternatives. With
    # delta outputs it comes once, on the first output (after they are ready); otherwise on every
    # output from then on (cumulative) or on the final one.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # Set on the finished output: when the request first got a batch place (time.monotonic; the
    # earliest of its samples) and the preemptions of all its samples (vLLM's per-request metrics).
    first_scheduled_time: float | None = None
    num_preemptions: int = 0

    @property
    def num_output_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)

    def merge_delta(self, later: RequestOutput) -> None:
        """Fold a later delta output of the same request into this one."""
        mine = {o.index: o for o in self.outputs}
        for o in later.outputs:
            if o.index in mine:
                mine[o.index].extend(o)
            else:
                self.outputs.append(o)
        self.finished = later.finished
        self.num_cached_tokens = later.num_cached_tokens
        self.first_scheduled_time = later.first_scheduled_time or self.first_scheduled_time
        self.num_preemptions = later.num_preemptions or self.num_preemptions
        self.error = later.error or self.error
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs
