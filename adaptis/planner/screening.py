"""Screening: a large problem's candidates ranked from schedules of fewer microbatches.

Sits between :mod:`adaptis.planner.search` (which decides what to schedule) and
:mod:`adaptis.planner.scheduler` (which it calls). One list schedule costs time in
proportion to stages x microbatches, so on 64 devices x 512 microbatches the search cannot
schedule its two dozen structures and their policies in full within seconds. A pipeline's
iteration time is, past its fill, about linear in the microbatches: T(m) ~ fill + m x period.
So a candidate is scheduled with ``p`` and ``2p`` microbatches (``p`` devices: enough for every
device to reach its steady state) and its time extrapolated to ``m``:

    T(m) ~ T(2p) + (m - 2p) x max(slope, busiest),   slope = (T(2p) - T(p)) / p,

``busiest`` being the busiest device's work per microbatch (no steady state is faster). On
issue 13's scale workload (Nemotron-H, 6 layers a device, 32 x 256) every structure within
10 % of the lower bound is estimated within 3.2 % of its full schedule, losing ones within
8.7 %, and the best two are those of the full schedules (docs/planner-search.md).

It is an estimate, not a bound: the search schedules in full every candidate it may return
(the best few estimates, then the refinement), so a returned plan still replays at exactly
the time it reports.

A candidate whose ``p``-microbatch schedule plus ``(m - p)`` x ``busiest`` already reaches the
time to beat skips its second schedule: its fill alone loses.

Problems up to 16 devices x 128 microbatches (the paper's largest) are never screened: a full
schedule costs at most a tenth of a second there, and their plans stay exactly as before.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from adaptis.planner.costs import Costs
from adaptis.planner.scheduler import Policy, list_schedule

__all__ = ["SCREEN_ABOVE", "Screen"]

#: devices x microbatches above which the search screens (16 x 128, the paper's largest, is not).
SCREEN_ABOVE = 2048


@dataclass(frozen=True, slots=True)
class Screen:
    """The problem at ``p`` and ``2p`` microbatches, and the size the estimates are for."""

    small: Costs
    large: Costs
    microbatches: int

    @classmethod
    def of(cls, costs: Costs) -> Screen | None:
        """The screen for ``costs``, or None where full schedules are cheap enough (small
        problems) or the extrapolation would reach too little (fewer than ``4p`` microbatches)."""
        p, m = costs.devices, costs.microbatches
        if p * m <= SCREEN_ABOVE or m < 4 * p:
            return None
        return cls(dataclasses.replace(costs, microbatches=p),
                   dataclasses.replace(costs, microbatches=2 * p), m)

    def estimate(self, *, stages: list[tuple[int, int]], owner: list[int], policy: Policy,
                 busiest: float, beat: float, deadline: float | None,
                 recompute: tuple[bool, ...] | None = None) -> float:
        """The extrapolated iteration time at the full size, plus the step's tail where the
        problem scores the step (inf: does not fit in memory).

        ``busiest``: the busiest device's work per microbatch; ``beat``: the time to beat
        (the second schedule is skipped when the first already shows it cannot);
        ``recompute``: the stages that recompute (as :func:`list_schedule` takes them)."""
        m1, m2 = self.small.microbatches, self.large.microbatches
        first = list_schedule(self.small, stages=stages, owner=owner, policy=policy, deadline=deadline,
                              recompute=recompute)
        if not first.feasible:
            return float("inf")
        floor = first.iteration_time + (self.microbatches - m1) * busiest
        if floor >= beat:
            return floor
        second = list_schedule(self.large, stages=stages, owner=owner, policy=policy, deadline=deadline,
                               recompute=recompute)
        if not second.feasible:  # memory is checked per microbatch count: 2p can exceed p
            return float("inf")
        slope = (second.iteration_time - first.iteration_time) / (m2 - m1)
        # Scored by the step: the tail after the pipeline (the exposed all-reduce, the
        # optimizer) does not grow with the microbatches, so the 2p schedule's is taken as it is.
        tail = second.step_time - second.iteration_time if self.large.by_step else 0.0
        return second.iteration_time + (self.microbatches - m2) * max(slope, busiest) + tail
