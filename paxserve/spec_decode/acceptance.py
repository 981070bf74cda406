"""What verification accepted: the engine's counters (vLLM's spec-decode metrics) and the per-request
back-off that keeps speculation from costing much where its proposals keep failing."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodingStats:
    """Totals since start: drafts verified, tokens they proposed, tokens accepted, and accepted
    tokens by position in the draft (position 0 is the first proposed token)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_proposed: int, num_accepted: int) -> None:
        assert 0 <= num_accepted <= num_proposed, (num_accepted, num_proposed)
        if num_proposed == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_proposed:
            self.accepted_per_position.extend([0] * (num_proposed - len(self.accepted_per_position)))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens each verified draft yielded, the bonus token included (vLLM's definition): 1 is
        nothing gained over plain decoding."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


# A request whose proposals are accepted at most this often per position stops proposing for a
# while: a rejected token cost a verified position (a logits row, KV written for nothing).
_LOW_ACCEPTANCE = 0.25
_DECAY = 0.5  # weight of the older drafts in a request's running acceptance rate
_SKIP_DECAY = 0.95  # per step without verification: the rate drifts back to the prior
_ENGINE_DECAY = 0.98  # weight of the older drafts in the engine-wide rate (the requests' prior)
_FIRST_PAUSE = 4  # steps without proposals after the first low stretch; doubles up to _MAX_PAUSE
_MAX_PAUSE = 64
# Async scheduling: steps a request lets overlap (its results not awaited to propose) after one whose
# results were awaited for nothing (no proposal, or none worth verifying); doubles up to _MAX_IDLE
# while that goes on, so a request with nothing to find costs a lost overlap at most 1 step in 16.
_MAX_IDLE = 16


def _accepted_and_tried(num_proposed: int, num_accepted: int) -> tuple[int, int]:
    """Positions after the first rejection were never tried."""
    return num_accepted, num_accepted + (num_accepted < num_proposed)


@dataclass(slots=True)
class AcceptanceRate:
    """The engine's running chance that a proposed token is accepted, given the ones before it were:
    what a request that has not proposed yet is expected to do (an even chance before any draft)."""

    accepted: float = 0.0
    tried: float = 0.0

    @property
    def rate(self) -> float:
        return (self.accepted + 0.5) / (self.tried + 1.0)

    def record(self, num_proposed: int, num_accepted: int) -> None:
        accepted, tried = _accepted_and_tried(num_proposed, num_accepted)
        self.accepted = _ENGINE_DECAY * self.accepted + accepted
        self.tried = _ENGINE_DECAY * self.tried + tried


@dataclass(slots=True)
class DraftBackoff:
    """One request's running chance that a proposed token is accepted, given the ones before it
    were, with the engine's rate as a prior worth one position. After a low stretch it proposes
    nothing for a number of steps that doubles while retries keep failing, and resets when a draft
    is accepted whole."""

    accepted: float = 0.0  # decayed sums over the request's verified drafts
    tried: float = 0.0
    pause: int = 0  # steps left without proposals
    next_pause: int = _FIRST_PAUSE
    idle: int = 0  # async scheduling: steps left that need not wait for its results (`found_nothing`)
    next_idle: int = 1

    def rate(self, prior: float) -> float:
        return (self.accepted + prior) / (self.tried + 1.0)

    def allows(self) -> bool:
        """Whether this step may propose (counts a paused step down)."""
        paused = self.pause > 0
        self.waited()
        return not paused

    def waited(self) -> None:
        """A step it decoded with its last token still in flight (async scheduling): it could not
        propose, which counts its pauses down as any step does."""
        self.idle = max(0, self.idle - 1)
        self.pause = max(0, self.pause - 1)

    def wants_results(self) -> bool:
        """Async scheduling: whether the step in flight is worth waiting for so that it may propose."""
        return self.pause == 0 and self.idle == 0

    def found_nothing(self) -> None:
        """Async scheduling waited for its results and it proposed nothing worth verifying: let its
        next steps overlap (more of them each time this repeats)."""
        self.idle = self.next_idle
        self.next_idle = min(2 * self.next_idle, _MAX_IDLE)

    def gains(self, num_proposed: int, prior: float) -> list[float]:
        """Expected accepted tokens from each of `num_proposed` proposals: the chance that it and
        every one before it are accepted."""
        rate = self.rate(prior)
        return [rate ** (j + 1) for j in range(num_proposed)]

    def skipped(self) -> None:
        """A step that verified none of this request's proposals (they were not worth their cost):
        older evidence weighs less, so the request is tried again in time."""
        self.accepted *= _SKIP_DECAY
        self.tried *= _SKIP_DECAY

    def record(self, num_proposed: int, num_accepted: int, prior: float) -> None:
        if num_proposed == 0:
            return
        accepted, tried = _accepted_and_tried(num_proposed, num_accepted)
        self.accepted = _DECAY * self.accepted + accepted
        self.tried = _DECAY * self.tried + tried
        if num_accepted:
            self.next_idle = 1
        if self.rate(prior) <= _LOW_ACCEPTANCE:
            self.pause = self.next_pause
            self.next_pause = min(2 * self.next_pause, _MAX_PAUSE)
            self.accepted = self.tried = 0.0  # a retry after the pause starts from the prior
        elif num_accepted == num_proposed:
            self.next_pause = _FIRST_PAUSE
