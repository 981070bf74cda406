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


# A request whose recent drafts accept at most this fraction of their tokens stops proposing for
# a while: a rejected token cost a verified position (a logits row, KV written for nothing).
_LOW_ACCEPTANCE = 0.25
_DECAY = 0.5  # weight of the older drafts in the running acceptance rate
_FIRST_PAUSE = 4  # steps without proposals after the first low stretch; doubles up to _MAX_PAUSE
_MAX_PAUSE = 64


@dataclass(slots=True)
class DraftBackoff:
    """One request's running acceptance rate; after low acceptance it proposes nothing for a number
    of steps that doubles while retries keep failing, and resets when a draft does well."""

    rate: float = 1.0
    pause: int = 0  # steps left without proposals
    next_pause: int = _FIRST_PAUSE

    def allows(self) -> bool:
        """Whether this step may propose (counts a paused step down)."""
        if self.pause > 0:
            self.pause -= 1
            return False
        return True

    def record(self, num_proposed: int, num_accepted: int) -> None:
        if num_proposed == 0:
            return
        self.rate = _DECAY * self.rate + (1 - _DECAY) * num_accepted / num_proposed
        if self.rate <= _LOW_ACCEPTANCE:
            self.pause = self.next_pause
            self.next_pause = min(2 * self.next_pause, _MAX_PAUSE)
            self.rate = 2 * _LOW_ACCEPTANCE  # a retry after the pause gets one more chance
        elif num_accepted == num_proposed:
            self.next_pause = _FIRST_PAUSE
