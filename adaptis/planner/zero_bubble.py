"""The Zero Bubble greedy order: F/B/W lists built by replaying time under a memory cap.

Sits in the planner layer beside :mod:`adaptis.planner.baselines`, whose ``zb-h1`` and
``zb-v`` take it as one of their candidate orders (as the Zero Bubble authors' automatic
scheduler does). It reads a :class:`~adaptis.planner.costs.Costs` and the stages, placement
and per-device memory caps it is given, and returns per-device action lists; scoring them
is the simulator's job.
"""

from __future__ import annotations

import math
import time
from typing import Literal

from adaptis.api.plan import Action
from adaptis.planner.costs import Costs
from adaptis.planner.errors import OutOfTime, PlannerError

__all__ = ["Actions", "zero_bubble_actions"]

Actions = list[list[Action]]

_EPS = 1e-9  # sizes are ratios of byte counts: sums of them may miss a whole number by a hair


def _budgets(
    costs: Costs, *, stages: list[tuple[int, int]], owned: list[list[int]], caps: list[int]
) -> tuple[list[float], list[float], list[float]]:
    """Per stage the size of one chunk activation, per device the reserve and the budget.

    Sizes are in units of the device's largest chunk activation, the unit ``caps`` counts
    in. Where a device's chunks are equal (one stage per device, uniform stages) every size
    is 1 and the budget is ``caps[d]``: a count of chunks, as the ZB schedules define it.
    Where they differ (ZB-V's first device holds the embedding stage beside the head) a
    count would charge a small chunk as a large one and starve the pipeline, so sizes are
    the true byte ratios and the budget is the bytes of ``caps[d]`` large chunks, cut to
    the device's free memory (``caps`` may have been raised to a strategy's minimum). The
    budget never drops below one entering chunk plus the reserve (progress).
    """
    sc = costs.stage_costs(stages)
    size = [1.0] * len(stages)
    reserve: list[float] = []
    budget: list[float] = []
    for d, mine in enumerate(owned):
        unit = max(sc.activation_bytes[s] for s in mine)
        if unit > 0 and any(sc.activation_bytes[s] < unit for s in mine):
            for s in mine:
                size[s] = sc.activation_bytes[s] / unit
        later = max((size[s] for s in mine if s != min(mine)), default=0.0)
        room = costs.memory[d] - sum(sc.param_bytes[s] for s in mine)
        cap = float(caps[d])
        if any(size[s] < 1.0 for s in mine) and not math.isinf(room):
            cap = min(cap, room / unit)
        reserve.append(later)
        budget.append(max(cap, size[min(mine)] + later))
    return size, reserve, budget


def zero_bubble_actions(
    costs: Costs,
    *,
    stages: list[tuple[int, int]],
    owned: list[list[int]],
    caps: list[int],
    lazy_w: bool = False,
    deadline: float | None = None,
) -> Actions:
    """The F/B/W order of a Zero Bubble schedule, built by replaying time as the simulator does.

    Whenever a device is free it runs, among its ready work: the oldest microbatch's B (the
    critical path back to stage 0), else the oldest F it may admit, else the oldest W (the
    deferrable weight gradient fills the gap). ``lazy_w`` runs a W only if it ends before
    the next input it knows of arrives. Each stage runs its microbatches in order.

    Memory is counted in chunk activations (one ``(stage, microbatch)`` between its F and its
    W): device ``d`` holds at most ``caps[d]`` of them. A microbatch entering the device (F on
    its first stage there) must leave room for one chunk of its later stages, so a
    microbatch coming back through them always finds room: chunks drain towards the last
    stage's device, which never waits on anyone, so the order cannot deadlock. Where a
    device's chunks differ in size (see :func:`_budgets`) the count is in bytes instead.
    """
    order = _Order(costs, stages=stages, owned=owned, caps=caps, lazy_w=lazy_w)
    steps = 0
    while any(order.left):
        steps += 1
        # ``deadline`` (time.monotonic): a 32 x 512 order alone takes seconds; read the clock
        # every 1024 steps only.
        if deadline is not None and not steps & 1023 and time.monotonic() >= deadline:
            raise OutOfTime("the time limit ran out during a zero bubble order")
        order.step()
    return order.out


_Next = tuple[float, tuple[int, int, int], Literal["F", "B", "W", "wait"], int]  # (start, priority, kind, stage)


class _Order:
    """The replay :func:`zero_bubble_actions` runs: each device's clock, the chunks it
    holds, the microbatches each stage has run, and each device's next action."""

    def __init__(self, costs: Costs, *, stages: list[tuple[int, int]], owned: list[list[int]],
                 caps: list[int], lazy_w: bool) -> None:
        sc = costs.stage_costs(stages)
        self.m = m = costs.microbatches
        self.n_st = n_st = len(stages)
        self.owned, self.lazy_w = owned, lazy_w
        self.owner = owner = [0] * n_st
        for d, mine in enumerate(owned):
            for s in mine:
                owner[s] = d
        speed = costs.speed
        self.dur = {
            "F": [sc.forward[s] / speed[owner[s]] for s in range(n_st)],
            "B": [sc.backward[s] / speed[owner[s]] for s in range(n_st)],
            "W": [sc.weight[s] / speed[owner[s]] for s in range(n_st)],
        }
        self.hop = [0.0] + [costs.transfer_time(owner[s - 1], owner[s], nbytes=sc.output_bytes[s - 1])
                            for s in range(1, n_st)]
        self.first = [min(mine) for mine in owned]
        self.size, self.reserve, self.budget = _budgets(costs, stages=stages, owned=owned, caps=caps)
        self.f_end = [[-1.0] * m for _ in range(n_st)]
        self.b_end = [[-1.0] * m for _ in range(n_st)]
        self.next_f = [0] * n_st
        self.next_b = [0] * n_st
        self.next_w = [0] * n_st
        self.held = [0.0] * len(owned)
        self.free = [0.0] * len(owned)
        self.left = [3 * m * len(mine) for mine in owned]
        self.out: Actions = [[] for _ in owned]
        self.plan: list[_Next | None] = [self.decide(d) for d in range(len(owned))]

    def decide(self, d: int) -> _Next | None:
        """Device d's next action; None if nothing is known."""
        m, n_st, f_end, b_end, hop = self.m, self.n_st, self.f_end, self.b_end, self.hop
        cands: list[_Next] = []
        for s in self.owned[d]:
            mb = self.next_b[s]
            if mb < m and f_end[s][mb] >= 0 and (s + 1 == n_st or b_end[s + 1][mb] >= 0):
                r = f_end[s][mb] if s + 1 == n_st else max(f_end[s][mb], b_end[s + 1][mb] + hop[s + 1])
                cands.append((r, (0, mb, -s), "B", s))
            mb = self.next_f[s]
            room = (self.held[d] + self.size[s] + (self.reserve[d] if s == self.first[d] else 0.0)
                    <= self.budget[d] + _EPS)
            if mb < m and room and (s == 0 or f_end[s - 1][mb] >= 0):
                r = 0.0 if s == 0 else f_end[s - 1][mb] + hop[s]
                cands.append((r, (1, mb, -s), "F", s))
            mb = self.next_w[s]
            if mb < self.next_b[s]:
                cands.append((b_end[s][mb], (2, mb, -s), "W", s))
        if not cands:
            return None
        start = max(self.free[d], min(c[0] for c in cands))
        soonest = min((c[0] for c in cands if c[0] > start), default=math.inf)
        r, prio, kind, s = min((c for c in cands if c[0] <= start), key=lambda c: c[1])
        if kind == "W" and self.lazy_w and start + self.dur["W"][s] > soonest:
            return (soonest, (1, 0, 0), "wait", s)  # idle until that input is here
        return (start, prio, kind, s)

    def step(self) -> None:
        """Run the earliest next action of any device, then decide again for the devices it
        can change: its own, and the one its output or gradient goes to."""
        ready = [(c[0], d) for d, c in enumerate(self.plan) if c is not None and self.left[d]]
        if not ready:
            raise PlannerError("zero bubble schedule made no progress (internal error)")
        _, d = min(ready)
        start, _, kind, s = self.plan[d]  # type: ignore[misc]
        touched = {d}
        if kind == "wait":
            self.free[d] = start
        else:
            end = start + self.dur[kind][s]
            self.free[d] = end
            if kind == "F":
                mb = self.next_f[s]
                self.f_end[s][mb] = end
                self.next_f[s] += 1
                self.held[d] += self.size[s]
                if s + 1 < self.n_st:
                    touched.add(self.owner[s + 1])
            elif kind == "B":
                mb = self.next_b[s]
                self.b_end[s][mb] = end
                self.next_b[s] += 1
                if s > 0:
                    touched.add(self.owner[s - 1])
            else:
                mb = self.next_w[s]
                self.next_w[s] += 1
                self.held[d] -= self.size[s]
            self.out[d].append((kind, s, mb))
            self.left[d] -= 1
        for e in touched:
            self.plan[e] = self.decide(e)
