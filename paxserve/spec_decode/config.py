"""vLLM's `--speculative-config`: which proposer, how many tokens it may propose per step."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# Beyond this a verification step feeds more tokens than a proposal is ever right about, and every
# sequence's logits rows (1 + k of them) are paid for whether it proposed or not.
MAX_SPECULATIVE_TOKENS = 16
METHODS = ("ngram", "draft_model", "eagle3")
MODEL_METHODS = ("draft_model", "eagle3")  # the methods that take a `model`
# Named by vLLM but not built here yet: asking for them is an error that says so.
PLANNED_METHODS = ("eagle", "mtp", "suffix", "medusa")
_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model", "disable_by_batch_size"}


def _bad(name: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"speculative_config.{name}={value!r} is invalid: {allowed}")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """`method` "ngram": propose the tokens that followed the last earlier occurrence of the
    sequence's final n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`), in the
    prompt or the output so far. "draft_model": a smaller `model` (a checkpoint directory or .gguf
    file) of the same vocabulary proposes greedily. "eagle3": an EAGLE-3 head (`model`: its
    directory, config.json and safetensors) proposes greedily from the target's hidden states."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 5
    # No proposals while this many requests or more are running (vLLM's name). Without it, how many
    # proposals a step verifies is weighed against the step times measured (`planner`).
    disable_by_batch_size: int | None = None
    model: str | None = None  # the draft model

    def __post_init__(self) -> None:
        if self.method in PLANNED_METHODS:
            raise _bad("method", self.method, f"is not available in paxserve yet; available: {', '.join(METHODS)}")
        if self.method not in METHODS:
            raise _bad("method", self.method, f"must be one of {', '.join(METHODS)}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise _bad("num_speculative_tokens", k, f"must be an integer in [1, {MAX_SPECULATIVE_TOKENS}]")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise _bad(name, value, "must be an integer >= 1")
        if self.method == "draft_model" and not self.model:
            raise _bad("model", self.model, "is required for method 'draft_model': a checkpoint directory or .gguf file")
        if self.method == "eagle3" and not self.model:
            raise _bad("model", self.model, "is required for method 'eagle3': the head's directory")
        if self.method not in MODEL_METHODS and self.model is not None:
            raise _bad("model", self.model, f"is for methods {' and '.join(MODEL_METHODS)}; method {self.method!r} uses no model")
        b = self.disable_by_batch_size
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise _bad("disable_by_batch_size", b, "must be an integer >= 1 (or absent)")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise _bad("prompt_lookup_min", self.prompt_lookup_min,
                       f"must be <= prompt_lookup_max={self.prompt_lookup_max}")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict[str, Any] | str | None") -> "SpeculativeConfig | None":
        """From `Engine(speculative_config=...)` or the CLI's JSON text. A missing prompt_lookup_min
        is 1; a missing prompt_lookup_max is 5, or prompt_lookup_min when that is larger."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config must be a JSON object: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object (a dict), got {type(value).__name__}")
        unknown = sorted(set(value) - _KEYS)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known: {sorted(_KEYS)}")
        method = value.get("method")
        if method is None:
            method = "draft_model" if "model" in value else None
            if method is None:
                raise _bad("method", None, f"is required (one of {', '.join(METHODS)}), or a draft 'model'")
        if "num_speculative_tokens" not in value:
            raise _bad("num_speculative_tokens", None, f"is required: an integer in [1, {MAX_SPECULATIVE_TOKENS}]")
        lo = 1 if value.get("prompt_lookup_min") is None else value["prompt_lookup_min"]
        hi = value.get("prompt_lookup_max")
        if hi is None:
            hi = max(lo, 5) if isinstance(lo, int) else lo
        model = value.get("model")
        return cls(method, value["num_speculative_tokens"], lo, hi, value.get("disable_by_batch_size"),
                   None if model is None else str(model))
