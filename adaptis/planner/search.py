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
the other devices loop over the rest (``isolated-head``) or go over it in V-shape rounds
(``isolated-vshape``) — what a model with a huge vocabulary head needs. A family stops
growing its stage count after two counts in a row that did not beat its best (one bad count
is often the pipeline's depth and the stage sizes not dividing; the next can win).

Admission (:class:`adaptis.planner.scheduler.Policy` ``admit_per_device``): a structure whose
devices hold fewer microbatches than it has stages under the global admission rule (the
global rule then starves the pipeline) is also scheduled with per-device admission, and phase
2 tries each of the best structures in the other mode too.
"""

from __future__ import annotations

import logging
import math
import time
from itertools import accumulate
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

from adaptis.planner.costs import Costs
from adaptis.planner.errors import OutOfTime
from adaptis.planner.partition import balanced_partition
from adaptis.planner.scheduler import Policy, Schedule, inflight_caps, list_schedule

__all__ = ["SearchResult", "joint_search"]

log = logging.getLogger(__name__)

# Scheduling policies phase 2 tries on the best structures (each in the admission mode the
# structure was scheduled with; see _admission_modes for the other mode).
POLICIES = (Policy(), Policy(fill_with_w=False), Policy(split_backward=False))
# Phase 2 tries the other policies on this many of the best structures.
_TUNED_STRUCTURES = 4
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
        if p >= 3 and v >= 2 and (p - 1) * v + 1 <= n:
            # The head alone on the fastest device, the rest in V-shape rounds over the others.
            q = p - 1
            seq = [rest[i] if r % 2 == 0 else rest[q - 1 - i] for r in range(v) for i in range(q)]
            out.append((f"isolated-vshape-v{v}", [*seq, fastest]))
    # Drop repeats (isolated-head-v1 is looped-v1 when the fastest device is the last one).
    seen: set[tuple[int, ...]] = set()
    return [(name, o) for name, o in out if not (tuple(o) in seen or seen.add(tuple(o)))]


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


def _evenness(costs: Costs, *, owner: list[int], cuts: list[int], pre: list[float]) -> tuple[float, float]:
    """How even the device loads of ``cuts`` are: (max load, sum of squared loads), lower first."""
    ld = _loads(costs, owner, cuts, pre)
    return (max(ld), sum(x * x for x in ld))


def _evenness_of(costs: Costs, cuts: list[int], *, owner: list[int], pre: list[float]) -> tuple[float, float]:
    """:func:`_evenness` with ``cuts`` positional: a sort key once the rest is bound."""
    return _evenness(costs, owner=owner, cuts=cuts, pre=pre)


def _max_load(costs: Costs, cuts: list[int], *, owner: list[int], pre: list[float]) -> float:
    """The busiest device's load under ``cuts``: a sort key once the rest is bound."""
    return max(_loads(costs, owner, cuts, pre))


def _polish(costs: Costs, *, owner: list[int], cuts: list[int], pre: list[float]) -> list[tuple[int, int]]:
    best = _evenness(costs, owner=owner, cuts=cuts, pre=pre)
    for _ in range(4 * len(cuts)):
        improved = False
        for i in range(1, len(cuts) - 1):
            for step in (-1, 1):
                k = cuts[i] + step
                if cuts[i - 1] < k < cuts[i + 1]:
                    trial = cuts[:i] + [k] + cuts[i + 1 :]
                    sc = _evenness(costs, owner=owner, cuts=trial, pre=pre)
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
        d = min(range(costs.devices), key=partial(_pack_cost, costs, s=s, work=work[s], load=load, owner=owner))
        owner[s] = d
        load[d] += work[s]
    return owner


def _pack_cost(costs: Costs, d: int, *, s: int, work: float, load: list[float], owner: list[int]) -> tuple[float, int]:
    """Device ``d``'s time with stage ``s`` added, then 0 if it holds a neighbour of ``s``."""
    near = (s > 0 and owner[s - 1] == d) or (s + 1 < len(owner) and owner[s + 1] == d)
    return ((load[d] + work) / costs.speed[d], 0 if near else 1)


def _throttled(costs: Costs, *, owner: list[int], stages: list[tuple[int, int]]) -> bool:
    """Whether the global admission rule keeps fewer microbatches in flight than the
    structure has stages (some device's memory holds fewer): then the pipeline never fills."""
    caps = inflight_caps(costs, sc=costs.stage_costs(stages), owner=owner, policy=POLICIES[0])
    return not isinstance(caps, str) and min(caps) < min(len(stages), costs.microbatches)


def _scheduled(costs: Costs, *, ev: _Evaluator, name: str, owner: list[int],
               stages: list[tuple[int, int]], extra: bool = False) -> _Candidate:
    """One structure under the default policy, with per-device admission where the global
    rule throttles it (phase 2 tries the other mode on the best structures). ``extra``: not
    taken from the budget."""
    if extra:
        ev.budget += 1
    per_device = _throttled(costs, owner=owner, stages=stages)
    return ev.run(name, owner, stages, replace(POLICIES[0], admit_per_device=per_device))


class _Evaluator:
    """Schedules the search's candidates and keeps its accounts: evaluations against the
    budget, the deadline, progress reports and the champion (the best candidate scheduled so
    far, whichever phase made it: what a deadline returns). Every phase gets it explicitly."""

    __slots__ = ("costs", "budget", "deadline", "clock", "on_progress", "evals", "champion")

    def __init__(self, costs: Costs, *, budget: int, deadline: float | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 on_progress: Callable[[int, int, float], None] | None = None) -> None:
        self.costs = costs
        self.budget = budget  # phase 1 raises it for its extra candidates (progress shows it)
        self.deadline = deadline
        self.clock = clock
        self.on_progress = on_progress
        self.evals = 0
        self.champion: _Candidate | None = None

    @property
    def spent(self) -> bool:
        return self.evals >= self.budget

    def run(self, pattern: str, owner: list[int], stages: list[tuple[int, int]], policy: Policy) -> _Candidate:
        """List-schedule one candidate; :class:`OutOfTime` once the deadline has passed."""
        if self.deadline is not None and self.clock() >= self.deadline:
            raise OutOfTime("the time limit ran out between candidates")
        self.evals += 1
        sched = list_schedule(self.costs, stages=stages, owner=owner, policy=policy, deadline=self.deadline)
        cand = _Candidate(pattern, owner, stages, sched, policy)
        if self.champion is None or cand.time < self.champion.time:
            self.champion = cand
        if self.on_progress:
            self.on_progress(self.evals, self.budget, self.champion.time)
        return cand


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
    ev = _Evaluator(costs, budget=max_evaluations or (len(patterns) + 27), deadline=deadline,
                    clock=clock, on_progress=on_progress)
    try:
        best = _phases(costs, ev=ev, patterns=patterns)
    except OutOfTime:
        champion = ev.champion
        if champion is None or champion.time == math.inf:
            log.info("search: the time limit ran out before any candidate fit (%d evaluations)", ev.evals)
            return None
        log.info("search: cut short by the time limit after %d evaluations", ev.evals)
        return SearchResult(champion.stages, champion.owner, champion.schedule, champion.policy,
                            ev.evals, champion.pattern, cut_short=True)
    if best is None:
        return None
    log.debug("search: %s, %d stages, %.4g (baseline %.4g), %d evaluations",
              best.pattern, len(best.stages), best.time, incumbent, ev.evals)
    return SearchResult(best.stages, best.owner, best.schedule, best.policy, ev.evals, best.pattern)


def _phases(costs: Costs, *, ev: _Evaluator, patterns: list[tuple[str, list[int]]]) -> _Candidate | None:
    """Structures, policies, then partition moves: the best candidate, None if none fits."""
    best: _Candidate | None = None
    # Phase 1: structure (placement pattern x stage count) with balanced partitions.
    ranked: list[_Candidate] = []
    pre = _prefix_work(costs)
    stalled: set[str] = set()  # pattern families whose last two stage counts did not help
    fam_best: dict[str, float] = {}
    misses: dict[str, int] = {}
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
        cand = _scheduled(costs, ev=ev, name=name, owner=owner, stages=stages)
        if len(set(owner)) == len(owner):
            # The same bottleneck with the slack spread over every stage (no idle tail): a
            # different schedule, so both are simulated; it costs no other candidate its turn.
            even = balanced_partition(
                costs, stages_count=len(owner), speeds=[costs.speed[d] for d in owner], spread=True
            )
            if even != stages:
                other = _scheduled(costs, ev=ev, name=name, owner=owner, stages=even, extra=True)
                if other.time < cand.time:
                    cand = other
        ranked.append(cand)
        if cand.time >= fam_best.get(family, math.inf):
            misses[family] = misses.get(family, 0) + 1
            if misses[family] >= 2:
                stalled.add(family)  # more stages per device only adds hops from here on
        else:
            fam_best[family], misses[family] = cand.time, 0
        if best is None or cand.time < best.time:
            best = cand
    # Packed structures: balanced stages first, then any placement (longest stage first onto
    # the least loaded device, by time): non-contiguous, uneven stage counts per device.
    for k in range(2, 5):
        if k * costs.devices > costs.layers or ev.spent:
            break
        stages = balanced_partition(costs, stages_count=k * costs.devices)
        owner = _pack(costs, stages=stages, pre=pre)
        cand = ev.run(f"packed-v{k}", owner, stages, POLICIES[0])
        ranked.append(cand)
        if best is None or cand.time < best.time:
            best = cand
    ranked.sort(key=lambda c: c.time)
    # Phase 2: scheduling policies on the best structures, in both admission modes.
    for cand in ranked[:_TUNED_STRUCTURES]:
        mode = cand.policy.admit_per_device
        policies = [replace(pol, admit_per_device=mode) for pol in POLICIES[1:]]
        policies.append(replace(cand.policy, admit_per_device=not mode))
        for policy in policies:
            if ev.spent:
                break
            trial = ev.run(cand.pattern, cand.owner, cand.stages, policy)
            if best is None or trial.time < best.time:
                best = trial
    if best is None or best.time == math.inf:
        return None
    # Phase 3: partition moves (the bottleneck first, then any boundary), kept only when the simulation improves.
    return _refine(costs, best=best, ev=ev)


def _refine(costs: Costs, *, best: _Candidate, ev: _Evaluator) -> _Candidate:
    """Partition moves from ``best`` (same placement and policy), each kept only if the
    simulated time improves, until no move helps or ``ev``'s budget is spent."""
    pre = _prefix_work(costs)
    tried: set[tuple[int, ...]] = set()
    while not ev.spent:
        owner = best.owner
        cuts = [lo for lo, _ in best.stages] + [best.stages[-1][1]]
        load = _loads(costs, owner, cuts, pre)
        hot = max(range(len(load)), key=load.__getitem__)
        moves: list[list[int]] = []
        # Shrink each stage of the bottleneck device by one layer, towards the cooler side.
        for s, d in enumerate(owner):
            if d != hot or cuts[s + 1] - cuts[s] < 2:
                continue
            if s > 0:
                moves.append(cuts[:s] + [cuts[s] + 1] + cuts[s + 1 :])
            if s + 1 < len(owner):
                moves.append(cuts[: s + 1] + [cuts[s + 1] - 1] + cuts[s + 2 :])
        moves = [mv for mv in moves if tuple(mv) not in tried]
        moves.sort(key=partial(_max_load, costs, owner=owner, pre=pre))
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
        others.sort(key=partial(_evenness_of, costs, owner=owner, pre=pre))
        moves = moves[:2] + others[:_OTHER_MOVES]
        if not moves:
            break
        improved = False
        for mv in moves:
            if ev.spent:
                break
            tried.add(tuple(mv))
            stages = [(mv[s], mv[s + 1]) for s in range(len(mv) - 1)]
            trial = ev.run(best.pattern, owner, stages, best.policy)
            if trial.time < best.time * (1 - 1e-9):
                best, improved = trial, True
                break
        if not improved:
            break
    return best
