"""The engine core's speculative decoding: proposals for the decoding requests before each
schedule, how many of them are worth verifying (`planner`), and what verification accepted."""

from __future__ import annotations

import math
from typing import Callable, Hashable, Iterable

import numpy as np

from paxserve.core.request import Request
from paxserve.spec_decode.acceptance import AcceptanceRate, DraftBackoff, SpecDecodingStats
from paxserve.spec_decode.config import SpeculativeConfig
from paxserve.spec_decode.draft_model import DraftModel
from paxserve.spec_decode.ngram import NgramProposer
from paxserve.spec_decode.planner import StepTimes, plan_drafts

# (tokens, sequences, whether it verifies) -> the program such a step runs, as `record_step` names it
# (None: a verifying program that is not ready yet).
StepProgram = Callable[[int, int, bool], Hashable | None]


class Speculator:
    """`draft`: the draft model that proposes (method "draft_model"), else n-gram lookup does;
    `block_ids`: a request's block ids, where the draft model's cache pages are."""

    def __init__(self, config: SpeculativeConfig, step_program: StepProgram, draft: DraftModel | None = None,
                 block_ids: Callable[[str], list[int]] | None = None) -> None:
        if (draft is None) != (config.method != "draft_model"):
            raise ValueError(f"speculative method {config.method!r} {'needs' if draft is None else 'takes no'} "
                             "draft model")
        self.config = config
        self.draft = draft
        self._block_ids = block_ids
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.stats = SpecDecodingStats()
        self.engine_rate = AcceptanceRate()
        self.times = StepTimes()
        self._step_program = step_program

    def propose(self, running: Iterable[Request]) -> None:
        """Set each running request's `spec_token_ids` for the next schedule: proposals for those
        that decode next (one token lacking, nothing in flight), cut to what a structured output's
        grammar accepts, as many of each as the plan finds worth their cost."""
        k = self.config.num_speculative_tokens
        running = list(running)
        for r in running:
            r.spec_token_ids = []
        limit = self.config.disable_by_batch_size
        if limit is not None and len(running) >= limit:
            return
        decoding = 0
        candidates: list[tuple[Request, int]] = []
        for r in running:
            if r.paused or r.num_output_placeholders or r.num_computed_tokens != r.num_tokens - 1:
                continue
            decoding += 1
            if r.matcher is not None and r.matcher.is_stopped():
                continue
            # Never past max_tokens: the token after the proposals is always kept too.
            room = min(k, r.max_tokens - r.num_output_tokens - 1)
            if room < 1:
                continue
            if r.spec_backoff is None:
                r.spec_backoff = DraftBackoff()
                r.spec_prompt = np.asarray(r.prompt_token_ids, np.int32)
            if r.spec_backoff.allows():
                candidates.append((r, room))
        if not candidates:
            return
        if self.draft is not None:
            proposals = self.draft.propose_batch([r for r, _ in candidates], [room for _, room in candidates],
                                                 self._block_ids)
        else:
            proposals = [self.proposer.propose(np.concatenate([r.spec_prompt, np.asarray(r.output_token_ids,
                                                                                        np.int32)]), room)
                         for r, room in candidates]
        proposing: list[tuple[Request, list[int]]] = []
        for (r, _), proposal in zip(candidates, proposals):
            if r.matcher is not None:  # what the grammar would refuse is never sampled
                proposal = proposal[:r.matcher.validate_tokens(proposal)]
            if proposal:
                proposing.append((r, proposal))
        if not proposing:
            return
        prior = self.engine_rate.rate
        seconds: dict[Hashable, float | None] = {}

        def step_time(d: int) -> float | None:
            program = self._step_program(decoding + d, decoding, d > 0)
            if program is None:
                return math.inf
            if program not in seconds:  # asked once per proposal count; many share a program
                seconds[program] = self.times.get(program)
            return seconds[program]

        counts = plan_drafts([r.spec_backoff.gains(len(p), prior) for r, p in proposing], decoding, step_time)
        for (r, proposal), count in zip(proposing, counts):
            r.spec_token_ids = proposal[:count]
            if count == 0:
                r.spec_backoff.skipped()

    def record_verified(self, request: Request | None, num_proposed: int, num_accepted: int) -> None:
        self.stats.record(num_proposed, num_accepted)
        if request is not None and request.spec_backoff is not None:
            request.spec_backoff.record(num_proposed, num_accepted, self.engine_rate.rate)
        self.engine_rate.record(num_proposed, num_accepted)

    def record_step(self, program: Hashable, seconds: float) -> None:
        """A step's wall time (dispatch to results) by the program it ran."""
        self.times.record(program, seconds)
