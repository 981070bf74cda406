"""Engine counters and the periodic stats log line."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("paxserve.engine.stats")

ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(slots=True)
class StatsLogger:
    """Accumulates per-step counts; every `interval` seconds logs throughput and cache state."""

    interval: float
    prompt_tokens: int = 0  # totals since start
    generation_tokens: int = 0
    preemptions: int = 0
    # vLLM's iteration_tokens_total histogram: tokens (prompt + generated) per step, cumulative counts
    # for each of ITERATION_TOKEN_BUCKETS (the last is +Inf), their sum and the number of steps.
    iteration_buckets: list[int] = field(default_factory=lambda: [0] * (len(ITERATION_TOKEN_BUCKETS) + 1))
    iteration_tokens_sum: int = 0
    _last_time: float = field(default_factory=time.monotonic)
    _last_prompt: int = 0
    _last_generation: int = 0
    _last_drafts: int = 0
    _last_draft_tokens: int = 0
    _last_accepted: int = 0

    def on_step(self, prompt_tokens: int, generation_tokens: int, preemptions: int) -> None:
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += generation_tokens
        self.preemptions += preemptions
        tokens = prompt_tokens + generation_tokens
        if tokens:  # a step that produced nothing (failed, or only preempted) is not an iteration
            self.iteration_tokens_sum += tokens
            for i, bound in enumerate(ITERATION_TOKEN_BUCKETS):
                if tokens <= bound:
                    self.iteration_buckets[i] += 1
            self.iteration_buckets[-1] += 1

    def maybe_log(self, engine: Any) -> None:
        now = time.monotonic()
        elapsed = now - self._last_time
        if self.interval <= 0 or elapsed < self.interval:
            return
        prefix = engine.kv.prefix_stats
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d reqs, "
            "Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%, Preemptions: %d",
            (self.prompt_tokens - self._last_prompt) / elapsed, (self.generation_tokens - self._last_generation) / elapsed,
            len(engine.scheduler.running), len(engine.scheduler.waiting), 100 * engine.kv.usage,
            100 * prefix.hit_rate, self.preemptions,
        )
        self._last_time, self._last_prompt, self._last_generation = now, self.prompt_tokens, self.generation_tokens
        spec = engine.spec_stats
        if spec.num_drafts > self._last_drafts:
            drafts = spec.num_drafts - self._last_drafts
            proposed = spec.num_draft_tokens - self._last_draft_tokens
            accepted = spec.num_accepted_tokens - self._last_accepted
            logger.info("Speculative decoding: mean acceptance length %.2f (tokens per verified draft, the bonus "
                        "token included), accepted %d of %d proposed tokens (%.1f%%) in %d drafts",
                        1 + accepted / drafts, accepted, proposed, 100 * accepted / proposed, drafts)
            self._last_drafts, self._last_draft_tokens, self._last_accepted = (
                spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens)
