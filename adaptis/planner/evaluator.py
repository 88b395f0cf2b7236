"""The joint search's candidates and their accounts: one schedule per candidate, within budget.

Sits under the search (:mod:`adaptis.planner.search`, whose phases make candidates) and the
climbs (:mod:`adaptis.planner.climb`, which improve the best one), which both pass the one
:class:`Evaluator` of a search around: it list-schedules each candidate (or, on a screened
problem, estimates it), scores it by the iteration or, where the problem says so
(``Costs.by_step``: data parallel by default), by the step, counts evaluations against the
budget, stops at the deadline, reports progress and keeps the champion (the best candidate
scheduled so far: what a deadline returns).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from adaptis.planner.costs import Costs
from adaptis.planner.errors import OutOfTime
from adaptis.planner.scheduler import Policy, Schedule, list_schedule
from adaptis.planner.screening import Screen
from adaptis.planner.structures import loads, prefix_work

__all__ = ["Candidate", "Evaluator"]


# Screened problems: the best estimates scheduled in full (the refinement's: adaptis.planner.climb).
_CONFIRMED = 3


@dataclass(slots=True)
class Candidate:
    pattern: str
    owner: list[int]
    stages: list[tuple[int, int]]
    schedule: Schedule | None  # None: screened only (``estimate``), never returned as it is
    policy: Policy
    estimate: float = math.inf
    by_step: bool = False  # scored by the step, not the iteration (Costs.by_step)

    @property
    def time(self) -> float:
        """What the search minimises: the iteration, or the step (``by_step``); inf where it
        does not fit, the estimate where it was screened only."""
        if self.schedule is None:
            return self.estimate
        return self.schedule.score(by_step=self.by_step)


class Evaluator:
    """Schedules the search's candidates and keeps its accounts: evaluations against the
    budget, the deadline, progress reports and the champion (the best candidate scheduled so
    far, whichever phase made it: what a deadline returns). Every phase gets it explicitly."""

    __slots__ = ("costs", "budget", "deadline", "clock", "on_progress", "evals", "champion", "screen",
                 "pre", "prune_at")

    def __init__(self, costs: Costs, *, budget: int, deadline: float | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 on_progress: Callable[[int, int, float], None] | None = None) -> None:
        self.costs = costs
        self.budget = budget  # phase 1 raises it for its extra candidates (progress shows it)
        self.deadline = deadline
        self.clock = clock
        self.on_progress = on_progress
        self.evals = 0
        self.champion: Candidate | None = None
        self.screen = Screen.of(costs)  # None: every candidate is scheduled in full
        self.pre = prefix_work(costs)
        self.prune_at = math.inf  # a plan the caller has: what cannot beat it is not scheduled

    @property
    def spent(self) -> bool:
        return self.evals >= self.budget

    def run(self, pattern: str, owner: list[int], *, stages: list[tuple[int, int]], policy: Policy) -> Candidate:
        """List-schedule one candidate; :class:`OutOfTime` once the deadline has passed."""
        if self.deadline is not None and self.clock() >= self.deadline:
            raise OutOfTime("the time limit ran out between candidates")
        self.evals += 1
        sched = list_schedule(self.costs, stages=stages, owner=owner, policy=policy, deadline=self.deadline)
        cand = Candidate(pattern, owner, stages, sched, policy, by_step=self.costs.by_step)
        if self.champion is None or cand.time < self.champion.time:
            self.champion = cand
        if self.on_progress:
            self.on_progress(self.evals, self.budget, self.champion.time)
        return cand

    def score(self, pattern: str, owner: list[int], *, stages: list[tuple[int, int]], policy: Policy,
              beat: float = math.inf) -> Candidate:
        """:meth:`run`, or on a screened problem an estimate (a candidate without a schedule:
        :meth:`confirm` schedules it in full before it can be returned)."""
        if self.screen is None:
            return self.run(pattern, owner, stages=stages, policy=policy)
        if self.deadline is not None and self.clock() >= self.deadline:
            raise OutOfTime("the time limit ran out between candidates")
        self.evals += 1
        cuts = [lo for lo, _ in stages] + [stages[-1][1]]
        est = self.screen.estimate(stages=stages, owner=owner, policy=policy, deadline=self.deadline,
                                   busiest=max(loads(self.costs, owner, cuts=cuts, pre=self.pre)), beat=beat)
        if self.on_progress:
            self.on_progress(self.evals, self.budget, math.inf if self.champion is None else self.champion.time)
        return Candidate(pattern, owner, stages, None, policy, est, by_step=self.costs.by_step)

    def confirm(self, cands: list[Candidate]) -> Candidate | None:
        """The best of the :data:`_CONFIRMED` best estimates, each scheduled in full (extra to
        the budget); candidates with a schedule already are taken as they are. None of those at
        or past :attr:`prune_at`: an estimate that reaches it is the screen's floor (the fill
        plus the busiest device's work, :meth:`Screen.estimate`), not a time to confirm; on the
        64 x 512 memory-bound problem each such schedule cost 1.5 s and came out 40 % slower."""
        seen: set[tuple[tuple[int, ...], tuple[tuple[int, int], ...], Policy]] = set()
        best: Candidate | None = None
        for cand in sorted(cands, key=lambda c: c.time):
            key = (tuple(cand.owner), tuple(cand.stages), cand.policy)
            if len(seen) >= _CONFIRMED or cand.time == math.inf or cand.time >= self.prune_at:
                break
            if key in seen:
                continue
            seen.add(key)
            full = cand
            if cand.schedule is None:
                self.budget += 1
                full = self.run(cand.pattern, cand.owner, stages=cand.stages, policy=cand.policy)
            if best is None or full.time < best.time:
                best = full
        return best
