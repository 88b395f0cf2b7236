"""The first plan when memory binds: a cut balanced with the recomputation each stage needs.

Sits beside :mod:`adaptis.planner.recompute` and :mod:`adaptis.planner.feasibility` under
:mod:`adaptis.planner.strategies`, which calls :func:`memory_first` before the joint search
(issue 32 items 1 and 3). On large memory-bound problems (64 devices x 512 microbatches of a
Nemotron-H-like model on 80 GB) no seed fits, the search's candidates are throttled by memory,
and the search ran out of a 60 s limit before it scheduled one in full: no plan at all, though
recomputing fits easily. Here one contiguous cut, one stage a device in index order, is made
so that memory is part of its price:

- stage ``k`` on device ``k`` holds about ``min(p - k, m)`` microbatches in flight (a 1F1B-like
  fused schedule: the first device holds the whole pipeline's depth, the last one);
- a stage keeps its activations where parameters plus that many microbatches' fit, else it
  recomputes (its forward again in its backward, only its input held per microbatch plus one
  microbatch's working set: :meth:`adaptis.planner.costs.Costs.stage_costs`), else it does
  not fit at all;
- its price is its work over its device's speed, plus its forward again when it recomputes;
- the least max price is found by bisection, each probe a greedy walk that gives every
  stage as many layers as fit within the price (exact when the layers' outputs are the same
  size, as in every transformer-like model: then starting a stage later never costs more).

So only the devices that need it recompute, and the others carry more layers to even the
work out; the large head's device (last, one microbatch in flight) keeps its activations.
The cut is scheduled with fused backwards under both admission rules; the caller keeps a
schedule only where it is faster than what it has.
"""

from __future__ import annotations

import logging
import math
from itertools import accumulate

from adaptis.planner.costs import Costs
from adaptis.planner.recompute import Recomputed, busiest_work
from adaptis.planner.scheduler import Policy, list_schedule
from adaptis.planner.screening import Screen

__all__ = ["memory_first", "recompute_cut"]

log = logging.getLogger(__name__)

Stages = list[tuple[int, int]]

_POLICIES = (Policy(split_backward=False, admit_per_device=True), Policy(split_backward=False))
_SPLIT = Policy(admit_per_device=True)
_REL_TOL = 1e-6  # of the price: finer than the scheduler's own granularity of one layer


class _Prefix:
    """Prefix sums of the layers' costs, for O(1) stage sums."""

    __slots__ = ("act", "fwd", "par", "work")

    def __init__(self, costs: Costs) -> None:
        self.work = [0.0, *accumulate(costs.layer_work())]
        self.fwd = [0.0, *accumulate(costs.forward)]
        self.act = [0.0, *accumulate(costs.activation_bytes)]
        self.par = [0.0, *accumulate(costs.param_bytes)]


def _price(costs: Costs, pre: _Prefix, *, lo: int, hi: int, device: int, inflight: int) -> tuple[float, bool]:
    """Stage ``[lo, hi)`` on ``device``: its price and whether it recomputes (inf: no fit)."""
    par = pre.par[hi] - pre.par[lo]
    act = pre.act[hi] - pre.act[lo]
    cap = costs.memory[device]
    work = (pre.work[hi] - pre.work[lo]) / costs.speed[device]
    if par + act * inflight <= cap:
        return work, False
    held = costs.output_bytes[lo - 1] if lo > 0 else 0.0
    if par + act + held * inflight <= cap:
        return work + (pre.fwd[hi] - pre.fwd[lo]) / costs.speed[device], True
    return math.inf, True


def _walk(costs: Costs, pre: _Prefix, *, limit: float) -> tuple[Stages, list[int], tuple[bool, ...]] | None:
    """Every stage as long as its price stays within ``limit``; None when layers are left."""
    n, p = costs.layers, costs.devices
    stages: Stages = []
    owner: list[int] = []
    flags: list[bool] = []
    lo = 0
    for d in range(p):
        if lo == n:
            break
        inflight = min(p - d, costs.microbatches)
        hi, recompute = lo, False
        # Hundreds of layers: a linear walk is cheaper than a bisection's bookkeeping.
        while hi < n:
            price, again = _price(costs, pre, lo=lo, hi=hi + 1, device=d, inflight=inflight)
            if price > limit or price == math.inf:
                break
            hi, recompute = hi + 1, again
        if hi > lo:
            stages.append((lo, hi))
            owner.append(d)
            flags.append(recompute)
            lo = hi
    return (stages, owner, tuple(flags)) if lo == n else None


def recompute_cut(costs: Costs) -> tuple[Stages, list[int], tuple[bool, ...]] | None:
    """The contiguous cut of least max price (module docstring) with its recompute flags;
    None when no cut fits even recomputing every stage."""
    pre = _Prefix(costs)
    found = _walk(costs, pre, limit=math.inf)
    if found is None:
        return None
    lo, hi = 0.0, max(_price(costs, pre, lo=a, hi=b, device=d, inflight=min(costs.devices - d, costs.microbatches))[0]
                      for (a, b), d in zip(found[0], found[1], strict=True))
    while hi - lo > _REL_TOL * hi:
        mid = (lo + hi) / 2
        trial = _walk(costs, pre, limit=mid)
        if trial is None:
            lo = mid
        else:
            hi, found = mid, trial
    return found


def memory_first(costs: Costs, *, beat: float = math.inf, deadline: float | None = None) -> list[Recomputed]:
    """The feasible schedules of :func:`recompute_cut` (per-device admission first: the global
    rule lets the tightest device throttle every other); empty where the cut's busiest device
    alone cannot beat ``beat``. A cut that recomputes nothing is still a cut by memory (the
    early devices take fewer layers, so they hold the pipeline's depth): it is also tried
    with split backwards."""
    cut = recompute_cut(costs)
    if cut is None:
        return []
    stages, owner, flags = cut
    if busiest_work(costs, stages=stages, owner=owner, recompute=flags) >= beat:
        return []
    out: list[Recomputed] = []
    screen = Screen.of(costs)
    busiest = busiest_work(costs, stages=stages, owner=owner, recompute=flags) / costs.microbatches
    for policy in _POLICIES if any(flags) else (*_POLICIES, _SPLIT):
        best = min((s.iteration_time for _st, _ow, s, _f in out), default=math.inf)
        # Screened: a fused policy whose estimate cannot beat the first schedule is not
        # scheduled in full (64 x 512: the global rule's, 50 % slower, cost a full schedule).
        if screen is not None and out and not policy.split_backward and screen.estimate(
                stages=stages, owner=owner, policy=policy, busiest=busiest, beat=best, deadline=deadline,
                recompute=flags) >= best:
            continue
        sched = list_schedule(costs, stages=stages, owner=owner, policy=policy, deadline=deadline,
                              recompute=flags)
        if sched.feasible:
            out.append((stages, owner, sched, flags))
    log.info("memory first: %d stages, %d recompute, best %.4g", len(stages), sum(flags),
             min((s.iteration_time for _st, _ow, s, _f in out), default=math.inf))
    return out
