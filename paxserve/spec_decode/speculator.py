"""The engine core's speculative decoding: proposals for the decoding requests before each
schedule, how many of them are worth verifying (`planner`), and what verification accepted."""

from __future__ import annotations

import math
import time
from typing import Callable, Hashable, Iterable

import numpy as np

from paxserve.core.request import Request
from paxserve.spec_decode.acceptance import AcceptanceRate, DraftBackoff, SpecDecodingStats
from paxserve.spec_decode.config import SpeculativeConfig
from paxserve.spec_decode.draft_model import DraftModel
from paxserve.spec_decode.eagle3 import Eagle3Proposer
from paxserve.spec_decode.ngram import NgramProposer
from paxserve.spec_decode.planner import StepTimes, drafting_pays, plan_drafts

# Steps in a row a draft model may sit out for not paying before it runs again to be re-measured
# (doubling, up to the maximum, while it keeps not paying).
_DRAFT_PROBE = 32
_MAX_DRAFT_PROBE = 1024
# (tokens, sequences, whether it verifies) -> the program such a step runs, as `record_step` names it
# (None: a verifying program that is not ready yet).
StepProgram = Callable[[int, int, bool], Hashable | None]


class Speculator:
    """`draft`: the draft model that proposes (method "draft_model"), `eagle` the EAGLE-3 head
    (method "eagle3"), else n-gram lookup does; `block_ids`: a request's block ids, where a draft's
    cache pages are. `overlap`: the engine schedules asynchronously, so a request whose last token
    is in flight cannot propose unless the engine waits for it (`wants_results`)."""

    def __init__(self, config: SpeculativeConfig, step_program: StepProgram, draft: DraftModel | None = None,
                 block_ids: Callable[[str], list[int]] | None = None, eagle: Eagle3Proposer | None = None,
                 overlap: bool = False) -> None:
        for method, given in (("draft_model", draft), ("eagle3", eagle)):
            if (given is None) != (config.method != method):
                raise ValueError(f"speculative method {config.method!r} {'needs' if given is None else 'takes no'} "
                                 f"{method.replace('_', ' ')}")
        self.config = config
        self.draft = draft
        self.eagle = eagle
        self._block_ids = block_ids
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.stats = SpecDecodingStats()
        self.engine_rate = AcceptanceRate()
        self.times = StepTimes()
        self._step_program = step_program
        self._steps_without_draft = 0
        self._probe_every = _DRAFT_PROBE
        self.overlap = overlap
        self._last_dispatch: tuple[Hashable, float] | None = None

    @property
    def drafter(self) -> Eagle3Proposer | DraftModel | None:
        """The model whose passes propose (the EAGLE-3 head or the draft model), None for n-gram."""
        return self.eagle or self.draft

    def wants_results(self, in_flight_verifies: bool, running: Iterable[Request]) -> bool:
        """Async scheduling: whether to wait for the step in flight before proposing. Always when it
        verifies proposals (its requests cannot be scheduled before their accepted count is known);
        else when a request decoding in it would likely propose once its token is known (one that
        has not tried yet, or whose acceptance back-off and `found_nothing` pauses are over).
        Otherwise the next step is built while it runs, without proposals from its requests."""
        if in_flight_verifies:
            return True
        running = list(running)
        limit = self.config.disable_by_batch_size
        if limit is not None and len(running) >= limit:
            return False
        return any(r.num_output_placeholders and _room(r, 1) and (r.spec_backoff is None or
                                                                  r.spec_backoff.wants_results())
                   for r in running)

    def propose(self, running: Iterable[Request]) -> None:
        """Set each running request's `spec_token_ids` for the next schedule: proposals for those
        that decode next (one token lacking, nothing in flight), cut to what a structured output's
        grammar accepts, as many of each as the plan finds worth their cost."""
        k = self.config.num_speculative_tokens
        running = list(running)
        for r in running:
            r.spec_token_ids = []
        decoding, candidates = self._candidates(running, k)
        prior = self.engine_rate.rate
        drafter = self.drafter
        if drafter is not None:
            # A drafter's passes cost time whatever is accepted: they run only when drafting pays.
            # The EAGLE-3 head catches up whatever is proposed (its cache must not miss a position),
            # its vocabulary-wide product only for the requests that will propose.
            pays = bool(candidates) and self._drafting_pays(candidates, decoding, prior)
            started = time.perf_counter()
            if self.eagle is not None:
                self.eagle.catch_up(running, self._block_ids,
                                    {r.request_id for r, _ in candidates} if pays else set())
            if not pays:
                self._none_for([r for r, _ in candidates])
                return
            proposals = drafter.propose_batch([r for r, _ in candidates], [room for _, room in candidates],
                                              self._block_ids)
            # Its time as it is step after step: a request's first catch-up (its whole prompt), or
            # one after steps without drafting, would count a one-off as every step's cost.
            if drafter.last_catch_up <= k + 1:
                self.times.record(("draft", len(candidates)), time.perf_counter() - started)
            self._steps_without_draft = 0
        elif not candidates:
            return
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
        if self.overlap:
            found = {id(r) for r, _ in proposing}
            for r, _ in candidates:
                if id(r) not in found:
                    r.spec_backoff.found_nothing()
        if not proposing:
            return
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
        self._none_for([r for (r, _), count in zip(proposing, counts) if count == 0])

    def _none_for(self, requests: list[Request]) -> None:
        """Candidates this step verifies nothing of (their proposals did not pay)."""
        for r in requests:
            r.spec_backoff.skipped()
            if self.overlap:
                r.spec_backoff.found_nothing()

    def _candidates(self, running: list[Request], k: int) -> tuple[int, list[tuple[Request, int]]]:
        """How many requests decode next (one token lacking, nothing in flight), and those of them
        that may propose now, each with its room (at most k; never past max_tokens)."""
        limit = self.config.disable_by_batch_size
        decoding = 0
        candidates: list[tuple[Request, int]] = []
        if limit is not None and len(running) >= limit:
            return decoding, candidates
        for r in running:
            if r.num_output_placeholders and not r.paused and r.spec_backoff is not None:
                r.spec_backoff.waited()
            if r.paused or r.num_output_placeholders or r.num_computed_tokens != r.num_tokens - 1:
                continue
            decoding += 1
            room = _room(r, k)
            if not room:
                continue
            if r.spec_backoff is None:
                r.spec_backoff = DraftBackoff()
                r.spec_prompt = np.asarray(r.prompt_token_ids, np.int32)
            if r.spec_backoff.allows():
                candidates.append((r, room))
        return decoding, candidates

    def _drafting_pays(self, candidates: list[tuple[Request, int]], decoding: int, prior: float) -> bool:
        """A draft model's passes cost time whatever is accepted: run them when the proposals they
        would bring are expected to pay for those passes and the verifying step, from the draft's
        measured time at this batch size. After `_DRAFT_PROBE` steps (doubling while it keeps not
        paying) they run anyway, so a workload or a machine that changes is noticed."""
        self._steps_without_draft += 1
        gains = [r.spec_backoff.gains(room, prior) for r, room in candidates]
        total = sum(room for _, room in candidates)
        plain, verify = (self._step_program(decoding + d, decoding, d > 0) for d in (0, total))
        if verify is None:  # its program is compiling: nothing could be verified this step
            return False
        if drafting_pays(gains, decoding, self.times.get(plain), self.times.get(verify),
                         self.times.get(("draft", len(candidates)))):
            self._probe_every = _DRAFT_PROBE
            return True
        if self._steps_without_draft >= self._probe_every:
            # A probe costs a catch-up over every token since the last draft: each one that finds
            # drafting still not paying waits twice as long for the next.
            self._probe_every = min(2 * self._probe_every, _MAX_DRAFT_PROBE)
            return True
        return False

    def record_verified(self, request: Request | None, num_proposed: int, num_accepted: int) -> None:
        self.stats.record(num_proposed, num_accepted)
        if request is not None and request.spec_backoff is not None:
            request.spec_backoff.record(num_proposed, num_accepted, self.engine_rate.rate)
        self.engine_rate.record(num_proposed, num_accepted)

    def record_step(self, program: Hashable, seconds: float) -> None:
        """A step's wall time (dispatch to results) by the program it ran."""
        self.times.record(program, seconds)

    def record_dispatch(self, dispatched: tuple[Hashable, float] | None) -> None:
        """Async scheduling: a step dispatched now (its program, when), or None when none was. A
        step's cost is then the time from its dispatch to the next one's: one overlapped by its
        successor costs the longer of its device time and the host's work, one that was waited for
        (it verified proposals, or a request proposed after it) costs both, one after the other,
        which the plan must see. A step after which nothing ran is not timed."""
        last, self._last_dispatch = self._last_dispatch, dispatched
        if last is not None and dispatched is not None:
            self.times.record(last[0], dispatched[1] - last[1])


def _room(r: Request, k: int) -> int:
    """How many tokens a request may propose once its tokens in flight are known (at most k): none
    while paused or when its grammar has ended, and never past max_tokens (the token after the
    proposals is always kept too)."""
    if r.paused or (r.matcher is not None and r.matcher.is_stopped()):
        return 0
    return max(0, min(k, r.max_tokens - r.num_output_tokens - r.num_output_placeholders - 1))
