"""How many proposed tokens a step verifies. A proposal is worth the tokens it is expected to add
against what it adds to the step's time, and both are measured: each request's acceptance rate, and
recent steps' wall times by program. On a GPU a small decode step is bound by reading the weights, so
verification rows are nearly free and every proposal goes in; on a compute-bound CPU a step's time
grows with its tokens, and only proposals likely to be accepted pay for themselves."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Hashable

# Steps whose times are kept per program: the median of a few ignores a pause (a collection, a
# neighbour) and follows a machine whose speed changes.
_WINDOW = 8
# Proposals are verified only when they are expected to bring this much more than plain decoding:
# acceptance rates and step times are estimates, and a gain within their noise is no gain.
_MARGIN = 1.05


@dataclass(slots=True)
class StepTimes:
    """Wall times of recent steps by program. A program's first step is not counted: it may have
    compiled or loaded the program."""

    _times: dict[Hashable, deque] = field(default_factory=dict)

    def record(self, program: Hashable, seconds: float) -> None:
        times = self._times.get(program)
        if times is None:
            self._times[program] = deque(maxlen=_WINDOW)
        else:
            times.append(seconds)

    def get(self, program: Hashable) -> float | None:
        """The median of the recent times, None before any."""
        times = self._times.get(program)
        return statistics.median(times) if times else None


def plan_drafts(gains: list[list[float]], num_decoding: int, step_time: Callable[[int], float | None]) -> list[int]:
    """How many of its proposals each request feeds this step.

    `gains[i][j]`: request i's expected extra tokens from its proposal j (the chance that it and the
    ones before it are accepted), falling in j. `num_decoding`: the requests that decode this step,
    proposing or not (each yields one token). `step_time(d)`: the step's time with d proposal tokens
    in all, None when not measured yet: taken as the time without any, so that proposing is tried
    and measured (infinite: such a step cannot run yet). Until a plain step's time is known nothing
    is verified: a workload whose every step verified would never measure it. The number of
    proposal tokens chosen is the one with the most expected tokens per second (when it beats plain
    decoding's by `_MARGIN`); they are the ones with the largest gains."""
    if not gains:
        return []
    base = step_time(0)
    if base is None:
        return [0] * len(gains)
    ranked = sorted(((gain, i) for i, row in enumerate(gains) for gain in row), key=lambda x: -x[0])
    plain = num_decoding / base
    best, best_rate, expected = 0, plain, float(num_decoding)
    for d, (gain, _) in enumerate(ranked, 1):
        expected += gain
        seconds = step_time(d)
        rate = expected / (base if seconds is None else seconds)
        if rate > best_rate:
            best, best_rate = d, rate
    if best_rate < _MARGIN * plain:
        best = 0
    counts = [0] * len(gains)
    for _, i in ranked[:best]:  # a request's gains fall, so its chosen ones are its first
        counts[i] += 1
    return counts


def drafting_pays(gains: list[list[float]], num_decoding: int, plain_seconds: float | None,
                  verify_seconds: float | None, draft_seconds: float | None) -> bool:
    """Whether running a draft model this step is expected to pay: the tokens all its proposals
    would bring (`gains` as in `plan_drafts`, every request at its full room) against the draft's
    own time and the verifying step's, beside plain decoding's rate (by `_MARGIN`). The draft's time
    counts as paying until measured, so that it gets measured; a plain step's is measured first (no
    draft runs until it is), and stands in for a verifying step's not measured yet (it costs no less):
    proposals the plan never verifies never measure one, so counting it as paying would run the
    draft for nothing, step after step."""
    if plain_seconds is None:
        return False
    if draft_seconds is None:
        return True
    expected = num_decoding + sum(map(sum, gains))
    verify = plain_seconds if verify_seconds is None else verify_seconds
    return expected / (draft_seconds + verify) >= _MARGIN * num_decoding / plain_seconds
