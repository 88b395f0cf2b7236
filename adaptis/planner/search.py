"""The joint search: partition x placement x schedule, guided by the performance model.

Sits at the top of the planner layer: it builds candidate structures (a placement pattern and
a stage count), balances each one's partition, schedules it with the memory-aware list
scheduler (:mod:`adaptis.planner.scheduler`) and keeps the best; then it tunes phase by phase
as the AdaPtis paper does: move a layer boundary off the bottleneck device (partition), try
the other schedule policies (scheduling), keep a move only if the simulated iteration time
improves, roll back otherwise. It is not brute force: each candidate costs one list-schedule,
and the number of candidates is bounded (``max_evaluations``).

It is an anytime search: with a ``deadline`` it stops when the deadline passes (between
candidates, or inside one list schedule) and returns the best candidate scheduled so far,
marked ``cut_short``; the structures most likely to win are tried first.

Placement patterns (device sequences over the stages, in model order):
``looped`` (Megatron: s mod p), ``vshape`` (rounds alternate direction, as ZB-V), and
``isolated`` variants whose last stage (the head) has a device of its own, the fastest, while
the other devices loop over the rest — what a model with a huge vocabulary head needs.
"""

from __future__ import annotations

import logging
import math
import time
from itertools import accumulate
from collections.abc import Callable
from dataclasses import dataclass

from adaptis.planner.costs import Costs
from adaptis.planner.errors import OutOfTime
from adaptis.planner.partition import balanced_partition
from adaptis.planner.scheduler import Policy, Schedule, list_schedule

__all__ = ["SearchResult", "joint_search"]

log = logging.getLogger(__name__)

POLICIES = (Policy(), Policy(fill_with_w=False), Policy(split_backward=False))
# Refinement: non-bottleneck boundary moves tried per round after the bottleneck's own two.
_OTHER_MOVES = 3


@dataclass(frozen=True, slots=True)
class SearchResult:
    stages: list[tuple[int, int]]
    owner: list[int]
    schedule: Schedule
    policy: Policy
    evaluations: int
    pattern: str
    cut_short: bool = False  # the deadline stopped the search before its budget ran out


@dataclass(slots=True)
class _Candidate:
    pattern: str
    owner: list[int]
    stages: list[tuple[int, int]]
    schedule: Schedule
    policy: Policy

    @property
    def time(self) -> float:
        return self.schedule.iteration_time if self.schedule.feasible else math.inf


def _patterns(costs: Costs) -> list[tuple[str, list[int]]]:
    """Device sequences (owner of each stage) to try; each keeps stages <= layers."""
    p = costs.devices
    n = costs.layers
    order = list(range(p))
    fastest = max(order, key=lambda d: (costs.speed[d], d))
    rest = [d for d in order if d != fastest]
    out: list[tuple[str, list[int]]] = []
    for v in range(1, 7):
        if p * v <= n:
            out.append((f"looped-v{v}", [order[s % p] for s in range(p * v)]))
        if v >= 2 and p * v <= n:
            seq = [order[i] if r % 2 == 0 else order[p - 1 - i] for r in range(v) for i in range(p)]
            out.append((f"vshape-v{v}", seq))
        if p >= 2 and (p - 1) * v + 1 <= n:
            seq = [rest[s % (p - 1)] for s in range((p - 1) * v)] + [fastest]
            out.append((f"isolated-head-v{v}", seq))
    return out


def _balanced_cuts(costs: Costs, owner: list[int]) -> list[tuple[int, int]]:
    """Contiguous stages whose per-device load (work / speed) is as even as a greedy cut can
    make it, then polished by single-layer boundary moves that lower the max device load."""
    pre = _prefix_work(costs)
    n = costs.layers
    n_st = len(owner)
    share = [0.0] * costs.devices
    count = [0] * costs.devices
    for d in owner:
        count[d] += 1
    total_speed = sum(costs.speed[d] for d in set(owner))
    for d in set(owner):
        share[d] = pre[-1] * costs.speed[d] / total_speed
    cuts = [0]
    target = 0.0
    for s in range(n_st - 1):
        target += share[owner[s]] / count[owner[s]]
        lo = cuts[-1] + 1
        hi = n - (n_st - 1 - s)
        # The boundary whose prefix work is nearest the cumulative target.
        k = max(lo, min(hi, _nearest(pre, target, lo, hi)))
        cuts.append(k)
        target = pre[k] + (target - pre[k]) * 0.5  # absorb half the rounding error
    cuts.append(n)
    return _polish(costs, owner=owner, cuts=cuts, pre=pre)


def _prefix_work(costs: Costs) -> list[float]:
    """``pre[i]``: F+B+W of layers ``[0, i)``; a range's work is a difference of two."""
    return [0.0, *accumulate(costs.layer_work())]


def _nearest(pre: list[float], target: float, lo: int, hi: int) -> int:
    a, b = lo, hi
    while a < b:
        mid = (a + b) // 2
        if pre[mid] < target:
            a = mid + 1
        else:
            b = mid
    if a > lo and abs(pre[a - 1] - target) <= abs(pre[a] - target):
        return a - 1
    return a


def _loads(costs: Costs, owner: list[int], cuts: list[int], pre: list[float]) -> list[float]:
    load = [0.0] * costs.devices
    for s, d in enumerate(owner):
        load[d] += (pre[cuts[s + 1]] - pre[cuts[s]]) / costs.speed[d]
    return load


def _polish(costs: Costs, *, owner: list[int], cuts: list[int], pre: list[float]) -> list[tuple[int, int]]:
    def score(c: list[int]) -> tuple[float, float]:
        ld = _loads(costs, owner, c, pre)
        return (max(ld), sum(x * x for x in ld))

    best = score(cuts)
    for _ in range(4 * len(cuts)):
        improved = False
        for i in range(1, len(cuts) - 1):
            for step in (-1, 1):
                k = cuts[i] + step
                if cuts[i - 1] < k < cuts[i + 1]:
                    trial = cuts[:i] + [k] + cuts[i + 1 :]
                    sc = score(trial)
                    if sc < best:
                        best, cuts, improved = sc, trial, True
        if not improved:
            break
    return [(cuts[s], cuts[s + 1]) for s in range(len(cuts) - 1)]


def _pack(costs: Costs, *, stages: list[tuple[int, int]], pre: list[float]) -> list[int]:
    """LPT bin packing of stages onto devices by time; ties go to the device holding the
    previous stage (no transfer), so neighbours stay together when it costs nothing."""
    load = [0.0] * costs.devices
    owner = [-1] * len(stages)
    work = [pre[hi] - pre[lo] for lo, hi in stages]
    for s in sorted(range(len(stages)), key=lambda i: -work[i]):
        def cost(d: int) -> tuple[float, int]:
            near = (s > 0 and owner[s - 1] == d) or (s + 1 < len(stages) and owner[s + 1] == d)
            return ((load[d] + work[s]) / costs.speed[d], 0 if near else 1)

        d = min(range(costs.devices), key=cost)
        owner[s] = d
        load[d] += work[s]
    return owner


def joint_search(
    costs: Costs,
    *,
    incumbent: float = math.inf,
    max_evaluations: int | None = None,
    on_progress: Callable[[int, int, float], None] | None = None,
    deadline: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> SearchResult | None:
    """Best partition, placement and schedule found; None if no candidate fits in memory
    (or none was scheduled before ``deadline``, a :func:`time.monotonic` value).

    ``incumbent`` is the best baseline's iteration time: only logged against, the caller keeps
    whichever is better. ``clock`` reads the time the deadline is checked against between
    candidates (inside a list schedule it is :func:`time.monotonic`).
    """
    patterns = _patterns(costs)
    # One list so that phase 1's extra candidates raise the budget the progress shows too.
    budget = [max_evaluations or (len(patterns) + 27)]
    evals = 0

    # The best candidate scheduled so far, whichever phase made it: what a deadline returns.
    champion: _Candidate | None = None

    def run(pattern: str, owner: list[int], stages: list[tuple[int, int]], policy: Policy) -> _Candidate:
        nonlocal evals, champion
        if deadline is not None and clock() >= deadline:
            raise OutOfTime("the time limit ran out between candidates")
        evals += 1
        sched = list_schedule(costs, stages=stages, owner=owner, policy=policy, deadline=deadline)
        cand = _Candidate(pattern, owner, stages, sched, policy)
        if champion is None or cand.time < champion.time:
            champion = cand
        if on_progress:
            on_progress(evals, budget[0], champion.time)
        return cand

    try:
        best = _phases(costs, run=run, patterns=patterns, evals=lambda: evals, budget=budget)
    except OutOfTime:
        if champion is None or champion.time == math.inf:
            log.info("search: the time limit ran out before any candidate fit (%d evaluations)", evals)
            return None
        log.info("search: cut short by the time limit after %d evaluations", evals)
        return SearchResult(champion.stages, champion.owner, champion.schedule, champion.policy,
                            evals, champion.pattern, cut_short=True)
    if best is None:
        return None
    log.debug("search: %s, %d stages, %.4g (baseline %.4g), %d evaluations",
              best.pattern, len(best.stages), best.time, incumbent, evals)
    return SearchResult(best.stages, best.owner, best.schedule, best.policy, evals, best.pattern)


def _phases(
    costs: Costs,
    *,
    run: Callable[[str, list[int], list[tuple[int, int]], Policy], _Candidate],
    patterns: list[tuple[str, list[int]]],
    evals: Callable[[], int],
    budget: list[int],
) -> _Candidate | None:
    """Structures, policies, then partition moves: the best candidate, None if none fits."""
    best: _Candidate | None = None
    # Phase 1: structure (placement pattern x stage count) with balanced partitions.
    ranked: list[_Candidate] = []
    pre = _prefix_work(costs)
    stalled: set[str] = set()  # pattern families whose last stage count did not help
    last: dict[str, float] = {}
    for name, owner in patterns:
        family = name.rsplit("-v", 1)[0]
        if family in stalled:
            continue
        if len(set(owner)) == len(owner):  # one stage per device: the exact min-max cut
            stages = balanced_partition(
                costs, stages_count=len(owner), speeds=[costs.speed[d] for d in owner]
            )
        else:
            stages = _balanced_cuts(costs, owner)
        cuts = [lo for lo, _ in stages] + [stages[-1][1]]
        # Busiest device's own work is a bound on the iteration: skip hopeless structures.
        bound = max(_loads(costs, owner, cuts, pre)) * costs.microbatches
        if best is not None and bound >= best.time:
            stalled.add(family)
            continue
        cand = run(name, owner, stages, POLICIES[0])
        if len(set(owner)) == len(owner):
            # The same bottleneck with the slack spread over every stage (no idle tail): a
            # different schedule, so both are simulated; it costs no other candidate its turn.
            even = balanced_partition(
                costs, stages_count=len(owner), speeds=[costs.speed[d] for d in owner], spread=True
            )
            if even != stages:
                budget[0] += 1
                other = run(name, owner, even, POLICIES[0])
                if other.time < cand.time:
                    cand = other
        ranked.append(cand)
        if cand.time >= last.get(family, math.inf):
            stalled.add(family)  # more stages per device only adds hops from here on
        last[family] = cand.time
        if best is None or cand.time < best.time:
            best = cand
    # Packed structures: balanced stages first, then any placement (longest stage first onto
    # the least loaded device, by time): non-contiguous, uneven stage counts per device.
    for k in range(2, 5):
        if k * costs.devices > costs.layers or evals() >= budget[0]:
            break
        stages = balanced_partition(costs, stages_count=k * costs.devices)
        owner = _pack(costs, stages=stages, pre=pre)
        cand = run(f"packed-v{k}", owner, stages, POLICIES[0])
        ranked.append(cand)
        if best is None or cand.time < best.time:
            best = cand
    ranked.sort(key=lambda c: c.time)
    # Phase 2: scheduling policies on the three best structures.
    for cand in ranked[:3]:
        for policy in POLICIES[1:]:
            if evals() >= budget[0]:
                break
            trial = run(cand.pattern, cand.owner, cand.stages, policy)
            if best is None or trial.time < best.time:
                best = trial
    if best is None or best.time == math.inf:
        return None
    # Phase 3: partition moves (the bottleneck first, then any boundary), kept only when the simulation improves.
    return _refine(costs, best=best, run=run, budget=budget[0], evals=evals)


def _refine(
    costs: Costs,
    *,
    best: _Candidate,
    run: Callable[[str, list[int], list[tuple[int, int]], Policy], _Candidate],
    budget: int,
    evals: Callable[[], int],
) -> _Candidate:
    pre = _prefix_work(costs)
    tried: set[tuple[int, ...]] = set()
    while evals() < budget:
        cuts = [lo for lo, _ in best.stages] + [best.stages[-1][1]]
        load = _loads(costs, best.owner, cuts, pre)
        hot = max(range(len(load)), key=load.__getitem__)
        moves: list[list[int]] = []
        # Shrink each stage of the bottleneck device by one layer, towards the cooler side.
        for s, d in enumerate(best.owner):
            if d != hot or cuts[s + 1] - cuts[s] < 2:
                continue
            if s > 0:
                moves.append(cuts[:s] + [cuts[s] + 1] + cuts[s + 1 :])
            if s + 1 < len(best.owner):
                moves.append(cuts[: s + 1] + [cuts[s + 1] - 1] + cuts[s + 2 :])
        moves = [mv for mv in moves if tuple(mv) not in tried]
        moves.sort(key=lambda mv: max(_loads(costs, best.owner, mv, pre)))
        # Then any other boundary one layer either way: the bottleneck of the *schedule* is
        # not always the busiest device (a stage that starts late, a W tail), so the loads'
        # max cannot rank these; the least squared load (most even) goes first.
        others = []
        for i in range(1, len(cuts) - 1):
            for step in (-1, 1):
                k = cuts[i] + step
                if cuts[i - 1] < k < cuts[i + 1]:
                    mv = cuts[:i] + [k] + cuts[i + 1 :]
                    if tuple(mv) not in tried and mv not in moves:
                        others.append(mv)

        def evenness(mv: list[int]) -> tuple[float, float]:
            ld = _loads(costs, best.owner, mv, pre)
            return (max(ld), sum(x * x for x in ld))

        others.sort(key=evenness)
        moves = moves[:2] + others[:_OTHER_MOVES]
        if not moves:
            break
        improved = False
        for mv in moves:
            if evals() >= budget:
                break
            tried.add(tuple(mv))
            stages = [(mv[s], mv[s + 1]) for s in range(len(mv) - 1)]
            trial = run(best.pattern, best.owner, stages, best.policy)
            if trial.time < best.time * (1 - 1e-9):
                best, improved = trial, True
                break
        if not improved:
            break
    return best
