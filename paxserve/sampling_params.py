"""Per-request sampling settings, with vLLM's names, defaults and ranges."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from paxserve.structured_outputs import StructuredOutputsParams

# Penalties outside these ranges are rejected, as vLLM and OpenAI do.
PENALTY_RANGE = (-2.0, 2.0)
MAX_LOGPROBS = 20


class RequestOutputKind(enum.IntEnum):
    """What each RequestOutput of a request holds (vLLM's names and values)."""

    CUMULATIVE = 0  # everything so far, every step
    DELTA = 1  # only what this step added: streaming without copying the whole answer every step
    FINAL_ONLY = 2  # one output, when the request has finished


class RequestError(ValueError):
    """An invalid request: `param` names the field at fault (temperature, prompt, messages, ...), so
    the server's 400 names it without reading the message."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _fail(name: str, value: object, allowed: str) -> None:
    raise RequestError(f"SamplingParams.{name}={value!r} is invalid: {allowed}", param=name)


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How to pick tokens for one request and when to stop.

    `temperature=0` is greedy. `top_k` of 0 or -1 disables top-k. `seed` makes sampling
    reproducible and independent of whatever else is in the batch. `logprobs=k` returns the sampled
    token's log-probability and the k most likely tokens, computed from the raw model logits;
    `prompt_logprobs=k` does the same for every prompt token after the first.

    Frozen: a request's settings are checked once, here, and nothing downstream can change them
    (`dataclasses.replace` makes a checked copy).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    # Log-probabilities of the prompt's own tokens (each given the ones before it) and their top-k
    # alternatives; the request then skips the prefix cache, since cached tokens have no logits.
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # The output must match this (a JSON schema, a regex, a choice, a grammar): guided decoding.
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's: only these tokens may be sampled (the others' logits are masked before anything else).
    allowed_token_ids: list[int] | None = None
    # vLLM's: each sampled token's logprob and these tokens' (at most MAX_LOGPROBS), instead of the top
    # `logprobs` alternatives.
    logprob_token_ids: list[int] | None = None
    stop_strings: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            _fail("n", self.n, "must be an integer >= 1")
        if self.temperature < 0:
            _fail("temperature", self.temperature, "must be >= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            _fail("top_p", self.top_p, "must be in (0, 1]")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k not in (0, -1)):
            _fail("top_k", self.top_k, "must be -1 or 0 (disabled) or an integer >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            _fail("min_p", self.min_p, "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not PENALTY_RANGE[0] <= value <= PENALTY_RANGE[1]:
                _fail(name, value, f"must be in [{PENALTY_RANGE[0]}, {PENALTY_RANGE[1]}]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            _fail("repetition_penalty", self.repetition_penalty, "must be in (0, 2]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            _fail("max_tokens", self.max_tokens, "must be an integer >= 1 (or None for the room left in the context)")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            _fail("min_tokens", self.min_tokens, "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", self.min_tokens, f"must be <= max_tokens={self.max_tokens}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or self.logprobs < -1):
            _fail("logprobs", self.logprobs, "must be an integer >= 0, or -1 for the whole vocabulary")
        ids = self.logprob_token_ids
        if ids is not None and (not isinstance(ids, (list, tuple)) or not 1 <= len(ids) <= MAX_LOGPROBS or any(
                isinstance(t, bool) or not isinstance(t, int) for t in ids) or len(set(ids)) != len(ids)):
            _fail("logprob_token_ids", ids, f"must be a list of 1 to {MAX_LOGPROBS} distinct token ids")
        if self.prompt_logprobs is not None and (isinstance(self.prompt_logprobs, bool) or not isinstance(
                self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            _fail("prompt_logprobs", self.prompt_logprobs, f"must be an integer in [0, {MAX_LOGPROBS}] (or None): "
                  "prompt tokens' top alternatives stop at that many (the whole vocabulary, -1, is not supported "
                  "for them)")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -2**63 <= self.seed < 2**63):
            # vLLM's range (a signed 64-bit integer); a negative seed is its own stream (mod 2**64).
            _fail("seed", self.seed, "must be an integer in [-2**63, 2**63)")
        # Token ids' range is the vocabulary's, checked by check_vocab once the model is known.
        if self.logit_bias:
            for token, bias in self.logit_bias.items():
                if not isinstance(token, int):
                    _fail("logit_bias", self.logit_bias, "keys must be integer token ids")
                if not -100.0 <= float(bias) <= 100.0:
                    _fail("logit_bias", self.logit_bias, "values must be in [-100, 100]")
        if self.stop_token_ids and any(not isinstance(t, int) for t in self.stop_token_ids):
            _fail("stop_token_ids", self.stop_token_ids, "must be integer token ids")
        if self.allowed_token_ids is not None and (not self.allowed_token_ids or any(
                isinstance(t, bool) or not isinstance(t, int) for t in self.allowed_token_ids)):
            _fail("allowed_token_ids", self.allowed_token_ids, "must be a non-empty list of integer token ids")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            _fail("stop", self.stop, "must be a non-empty string or a list of non-empty strings")
        object.__setattr__(self, "stop_strings", tuple(stops))
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            _fail("structured_outputs", self.structured_outputs, "must be a StructuredOutputsParams (or None)")
        try:
            object.__setattr__(self, "output_kind", RequestOutputKind(self.output_kind))
        except ValueError:
            _fail("output_kind", self.output_kind, "must be a RequestOutputKind (0 cumulative, 1 delta, 2 final only)")

    @property
    def wants_logprobs(self) -> bool:
        """Whether each sampled token comes with logprobs (top alternatives or chosen tokens')."""
        return self.logprobs is not None or self.logprob_token_ids is not None

    @property
    def num_logprob_columns(self) -> int:
        """How many alternatives each sampled token's logprobs list (-1: the whole vocabulary)."""
        return len(self.logprob_token_ids) if self.logprob_token_ids else (self.logprobs or 0)

    @property
    def wide_logprobs(self) -> bool:
        """More top alternatives than the device's top-k columns hold (MAX_LOGPROBS), or all of them
        (-1): the step copies the row's whole distribution to the host for these."""
        return not self.logprob_token_ids and self.logprobs is not None and (
            self.logprobs < 0 or self.logprobs > MAX_LOGPROBS)

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1.0

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids must exist in the model's vocabulary (checked when the model is known), and no
        more alternatives can be asked for than it has."""
        if self.logprobs is not None and self.logprobs > vocab_size:
            _fail("logprobs", self.logprobs, f"must be at most the vocabulary size {vocab_size} (or -1 for all)")
        for name, ids in (("logit_bias", list(self.logit_bias or {})), ("stop_token_ids", self.stop_token_ids or []),
                          ("allowed_token_ids", self.allowed_token_ids or []),
                          ("logprob_token_ids", self.logprob_token_ids or [])):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:  # vLLM's wording, which clients match
                raise RequestError(f"token_id(s) {bad[:5]} in {name} contain out-of-vocab token ids. Vocabulary "
                                   f"size: {vocab_size} (token ids must be in [0, {vocab_size}))", param=name)
