"""The memory-driven fallback: a plan that fits when every baseline and the search do not.

Sits beside :mod:`adaptis.planner.search` under :mod:`adaptis.planner.strategies`, which calls
:func:`memory_fallback` only when nothing else fits in memory. The baselines and the search
cut the layers by *time* and put a stage on every device; under tight memory that is exactly
what fails (a device with little memory still gets its share of parameters). Here the cut is
driven by memory first:

- contiguous stages, one per device, in a device order (index order, most memory first,
  fastest first); a device may get no stage at all when that is the only way to fit;
- each device's stage must hold its parameters plus one microbatch's activations (the list
  scheduler then admits as many microbatches as memory allows, at least one);
- among the cuts that fit, the one with the smallest slowest stage (work / speed) is found
  by bisection: for a fixed device order, taking on each device as many layers as fit both
  limits is optimal (any cut that fits can be shifted forward to it), so each probe is exact;
- scheduled with :func:`adaptis.planner.scheduler.list_schedule` under the default policy,
  fused backward, and fused with one microbatch in flight; the fastest that fits wins.
"""

from __future__ import annotations

import logging
import math
from itertools import accumulate

from adaptis.planner.costs import Costs
from adaptis.planner.scheduler import Policy, Schedule, list_schedule

__all__ = ["memory_cuts", "memory_fallback", "memory_partition"]

log = logging.getLogger(__name__)

Stages = list[tuple[int, int]]

_POLICIES = (Policy(), Policy(split_backward=False), Policy(split_backward=False, max_inflight=1))
_REL_TOL = 1e-9


def memory_partition(costs: Costs, *, order: list[int], limit: float = math.inf) -> tuple[Stages, list[int]] | None:
    """Contiguous stages over ``order`` (devices, skipped when they get nothing) such that
    each device holds its stage's parameters and one microbatch's activations and its work
    / speed is at most ``limit``; None when the layers do not all fit."""
    n = costs.layers
    mem = [0.0, *accumulate(p + a for p, a in zip(costs.param_bytes, costs.activation_bytes, strict=True))]
    work = [0.0, *accumulate(costs.layer_work())]
    stages: Stages = []
    owner: list[int] = []
    lo = 0
    for d in order:
        if lo == n:
            break
        hi = lo
        # Layers are few (hundreds): a linear walk is cheaper than two bisections' bookkeeping.
        while (hi < n and mem[hi + 1] - mem[lo] <= costs.memory[d]
               and (work[hi + 1] - work[lo]) / costs.speed[d] <= limit):
            hi += 1
        if hi > lo:
            stages.append((lo, hi))
            owner.append(d)
            lo = hi
    return (stages, owner) if lo == n else None


def _orders(costs: Costs) -> list[list[int]]:
    idx = list(range(costs.devices))
    out = [idx, sorted(idx, key=lambda d: -costs.memory[d]), sorted(idx, key=lambda d: -costs.speed[d])]
    return [o for i, o in enumerate(out) if o not in out[:i]]


def _tightest(costs: Costs, *, order: list[int]) -> tuple[Stages, list[int]] | None:
    """The cut of :func:`memory_partition` with the least slowest stage, by bisection."""
    found = memory_partition(costs, order=order)
    if found is None:
        return None
    work = [0.0, *accumulate(costs.layer_work())]
    hi = max((work[b] - work[a]) / costs.speed[d] for (a, b), d in zip(*found, strict=True))
    lo = 0.0
    while hi - lo > _REL_TOL * hi:
        mid = (lo + hi) / 2
        trial = memory_partition(costs, order=order, limit=mid)
        if trial is None:
            lo = mid
        else:
            hi, found = mid, trial
    return found


def memory_cuts(costs: Costs) -> list[tuple[Stages, list[int]]]:
    """The memory-driven cuts (one per device order, duplicates dropped), not scheduled."""
    out: list[tuple[Stages, list[int]]] = []
    for order in _orders(costs):
        cut = _tightest(costs, order=order)
        if cut is not None and cut not in out:
            out.append(cut)
    return out


def memory_fallback(costs: Costs) -> tuple[Stages, list[int], Schedule] | None:
    """The fastest memory-driven plan that the list scheduler fits; None if there is none."""
    best: tuple[Stages, list[int], Schedule] | None = None
    for stages, owner in memory_cuts(costs):  # a repeated cut could only tie: strict < keeps the first
        for policy in _POLICIES:
            sched = list_schedule(costs, stages=stages, owner=owner, policy=policy)
            if sched.feasible and (best is None or sched.iteration_time < best[2].iteration_time):
                best = (stages, owner, sched)
    if best is not None:
        log.info("memory fallback: %d stages on devices %s, %.4g", len(best[0]), best[1], best[2].iteration_time)
    return best
