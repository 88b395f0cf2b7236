"""The joint search: partition x placement x schedule, guided by the performance model.

Sits at the top of the planner layer: it builds candidate structures (a placement pattern and
a stage count), balances each one's partition, schedules it with the memory-aware list
scheduler (:mod:`adaptis.planner.scheduler`) and keeps the best; then it tunes phase by phase
as the AdaPtis paper does: move a layer boundary off the bottleneck device (partition), try
the other schedule policies (scheduling), keep a move only if the simulated iteration time
improves, roll back otherwise (the climbs and the first device's W tail are in
:mod:`adaptis.planner.climb`). It is not brute force: each candidate costs one list-schedule,
and the number of candidates is bounded (``max_evaluations``).

It is an anytime search: with a ``deadline`` it stops when the deadline passes (between
candidates, or inside one list schedule) and returns the best candidate scheduled so far,
marked ``cut_short``; the structures most likely to win are tried first.

Placement patterns and their balanced cuts are in :mod:`adaptis.planner.structures`. A family
of patterns stops growing its stage count after two counts in a row that did not beat its
best (one bad count is often the pipeline's depth and the stage sizes not dividing; the next
can win).

Large problems (over 16 devices x 128 microbatches) are *screened*
(:mod:`adaptis.planner.screening`): the structures and policies are ranked by an estimate
from schedules of ``p`` and ``2p`` microbatches, the best few estimates are scheduled in full
(only those can be returned), and the refinement, in full, is held to a few candidates.

Objective: every phase compares :attr:`Candidate.time`, the iteration or, where the problem
scores the step (``Costs.by_step``, the default with data-parallel replicas), the step: the
pipeline, then the part of each stage's all-reduce it does not hide, then the optimizer
(:mod:`adaptis.planner.post_pipeline`, as the scheduler's replay gives it). The bounds that
prune (the busiest device's work) bound the iteration, so they bound the step too.

Admission (:class:`adaptis.planner.scheduler.Policy` ``admit_per_device``): a structure whose
devices hold fewer microbatches than it has stages under the global admission rule (the
global rule then starves the pipeline) is scheduled with per-device admission instead, and phase
2 tries each of the best structures in the other mode too.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from adaptis.planner.climb import refine, w_tail
from adaptis.planner.costs import Costs
from adaptis.planner.errors import OutOfTime, PlannerError
from adaptis.planner.evaluator import Candidate, Evaluator
from adaptis.planner.partition import balanced_partition
from adaptis.planner.scheduler import Policy, Schedule, inflight_caps
from adaptis.planner.structures import (
    balanced_cuts,
    loads,
    pack,
    patterns,
)

__all__ = ["SearchResult", "joint_search"]

log = logging.getLogger(__name__)

# Scheduling policies phase 2 tries on the best structures (each in the admission mode the
# structure was scheduled with; see _admission_modes for the other mode).
POLICIES = (Policy(), Policy(fill_with_w=False), Policy(split_backward=False))
# Screened problems: phase 2 and the climbs start only from a candidate within this fraction
# of the caller's plan (``prune_at``); another policy or a move of one layer gains a few per
# cent at most.
_REFINE_REACH = 0.05
# Phase 2 tries the other policies on this many of the best structures.
_TUNED_STRUCTURES = 4
# Budget left after the refinement: climb from other patterns' candidates this close to the best.
_CLIMB_OTHERS = 0.02
# ... on problems up to this many devices x microbatches: at 16 x 128 the climbs cost ~1 s CPU
# (2.4 -> 3.4 s) for nothing; every gain on the 36 search-quality workloads is at 8 x 64 or less.
_CLIMB_OTHERS_UP_TO = 1024


@dataclass(frozen=True, slots=True)
class SearchResult:
    stages: list[tuple[int, int]]
    owner: list[int]
    schedule: Schedule
    policy: Policy
    evaluations: int
    pattern: str
    cut_short: bool = False  # the deadline stopped the search before its budget ran out

    @classmethod
    def of(cls, cand: Candidate, *, evaluations: int, cut_short: bool = False) -> SearchResult:
        """``cand``'s result; only a scheduled candidate (the champion, a phase's best) is one."""
        if cand.schedule is None:
            raise PlannerError("the search returned a candidate it never scheduled (internal error)")
        return cls(cand.stages, cand.owner, cand.schedule, cand.policy, evaluations, cand.pattern,
                   cut_short=cut_short)


def _throttled(costs: Costs, *, owner: list[int], stages: list[tuple[int, int]]) -> bool:
    """Whether the global admission rule keeps fewer microbatches in flight than the
    structure has stages (some device's memory holds fewer): then the pipeline never fills."""
    caps = inflight_caps(costs, sc=costs.stage_costs(stages), owner=owner, policy=POLICIES[0])
    return not isinstance(caps, str) and min(caps) < min(len(stages), costs.microbatches)


def _busiest(costs: Costs, *, owner: list[int], stages: list[tuple[int, int]],
             pre: list[float]) -> float:
    """The busiest device's work over the iteration: no schedule of these cuts is faster."""
    cuts = [lo for lo, _ in stages] + [stages[-1][1]]
    return max(loads(costs, owner, cuts=cuts, pre=pre)) * costs.microbatches


def _scheduled(costs: Costs, *, ev: Evaluator, name: str, owner: list[int],
               stages: list[tuple[int, int]], extra: bool = False, beat: float = math.inf) -> Candidate:
    """One structure under the default policy, with per-device admission where the global
    rule throttles it (phase 2 tries the other mode on the best structures). ``extra``: not
    taken from the budget; ``beat``: the time to beat (a screened estimate may stop early)."""
    if extra:
        ev.budget += 1
    per_device = _throttled(costs, owner=owner, stages=stages)
    return ev.score(name, owner, stages=stages, policy=replace(POLICIES[0], admit_per_device=per_device),
                    beat=beat)


def joint_search(
    costs: Costs,
    *,
    incumbent: float = math.inf,
    prune_at: float = math.inf,
    max_evaluations: int | None = None,
    on_progress: Callable[[int, int, float], None] | None = None,
    deadline: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> SearchResult | None:
    """Best partition, placement and schedule found; None if no candidate fits in memory
    (or none was scheduled before ``deadline``, a :func:`time.monotonic` value).

    ``incumbent`` is the best baseline's iteration time: only logged against, the caller keeps
    whichever is better. ``prune_at``: the time of a plan the caller already has; structures
    whose busiest device alone cannot beat it are not scheduled (default: none are pruned so).
    ``clock`` reads the time the deadline is checked against between candidates (inside a list
    schedule it is :func:`time.monotonic`).
    """
    tried = patterns(costs)
    ev = Evaluator(costs, budget=max_evaluations or (len(tried) + 27), deadline=deadline,
                    clock=clock, on_progress=on_progress)
    ev.prune_at = prune_at
    try:
        best = _phases(costs, ev=ev, structures=tried)
    except OutOfTime:
        champion = ev.champion
        if champion is None or champion.time == math.inf:
            log.info("search: the time limit ran out before any candidate fit (%d evaluations)", ev.evals)
            return None
        log.info("search: cut short by the time limit after %d evaluations", ev.evals)
        return SearchResult.of(champion, evaluations=ev.evals, cut_short=True)
    if best is None:
        return None
    log.debug("search: %s, %d stages, %.4g (baseline %.4g), %d evaluations",
              best.pattern, len(best.stages), best.time, incumbent, ev.evals)
    return SearchResult.of(best, evaluations=ev.evals)


def _phases(costs: Costs, *, ev: Evaluator,
            structures: list[tuple[str, list[int]]]) -> Candidate | None:
    """Structures, policies, then partition moves: the best candidate, None if none fits."""
    # Stable: the first of equally fast candidates leads, as it led while they were tried.
    ranked = sorted(_structures(costs, ev=ev, structures=structures), key=_time)
    tuned, best = _policies(ev=ev, ranked=ranked, best=ranked[0] if ranked else None)
    if ev.screen is not None:  # estimates so far: schedule the best few in full
        best = ev.confirm(ranked + tuned)
    if best is None or best.time == math.inf:
        return None
    if ev.screen is not None and best.time >= ev.prune_at * (1 + _REFINE_REACH):
        # The caller's plan is further ahead than partition moves of one layer gain: on the
        # 64 x 512 memory-bound problem the confirmed best was 40 % behind, and refining it
        # cost six full schedules (9 s) for nothing.
        log.debug("search: the best confirmed (%.4g) is past the plan in hand (%.4g)", best.time, ev.prune_at)
        return best
    # Phase 3: partition moves (the bottleneck first, then any boundary), kept only when the simulation improves.
    best = refine(costs, best=best, ev=ev)
    if costs.devices * costs.microbatches <= _CLIMB_OTHERS_UP_TO:
        best = _climb_others(costs, ev=ev, best=best, candidates=ranked + tuned)
    # Phase 4: the first device's W tail.
    return w_tail(costs, best=best, ev=ev)


def _time(c: Candidate) -> float:
    return c.time


def _structures(costs: Costs, *, ev: Evaluator, structures: list[tuple[str, list[int]]]
                ) -> list[Candidate]:
    """Phase 1: every structure (placement pattern x stage count) with balanced partitions,
    then the packed structures; the candidates in the order tried."""
    best: Candidate | None = None
    ranked: list[Candidate] = []
    pre = ev.pre
    stalled: set[str] = set()  # pattern families whose last two stage counts did not help
    fam_best: dict[str, float] = {}
    misses: dict[str, int] = {}
    for name, owner in structures:
        family = name.rsplit("-v", 1)[0]
        if family in stalled:
            continue
        if len(set(owner)) == len(owner):  # one stage per device: the exact min-max cut
            speeds = [costs.speed[d] for d in owner]
            cut_sets = [balanced_partition(costs, stages_count=len(owner), speeds=speeds)]
            # The same bottleneck with the slack spread over every stage (no idle tail).
            even = balanced_partition(costs, stages_count=len(owner), speeds=speeds, spread=True)
            if even != cut_sets[0]:
                cut_sets.append(even)
        else:
            cut_sets = balanced_cuts(costs, owner)
        # Busiest device's own work is a bound on the iteration: skip hopeless structures.
        first = _busiest(costs, owner=owner, stages=cut_sets[0], pre=pre)
        if first >= min(ev.prune_at, math.inf if best is None else best.time):
            stalled.add(family)
            continue
        # Each set of cuts is a different schedule, so each is simulated unless its busiest
        # device alone cannot beat the first; the ones after the first cost no other
        # candidate its turn.
        beat = min(ev.prune_at, math.inf if best is None else best.time)
        cand = _scheduled(costs, ev=ev, name=name, owner=owner, stages=cut_sets[0], beat=beat)
        for stages in cut_sets[1:]:
            if _busiest(costs, owner=owner, stages=stages, pre=pre) >= cand.time:
                continue
            other = _scheduled(costs, ev=ev, name=name, owner=owner, stages=stages, extra=True,
                               beat=min(beat, cand.time))
            if other.time < cand.time:
                cand = other
        ranked.append(cand)
        if ev.screen is not None and cand.time >= ev.prune_at:
            # Screened, and its estimate cannot beat the caller's plan: more stages a device
            # only add hops to a fill that already loses (on the 64 x 512 memory-bound problem
            # every family's later counts estimated past it too, at 0.3-1.7 s each).
            stalled.add(family)
        elif cand.time >= fam_best.get(family, math.inf):
            misses[family] = misses.get(family, 0) + 1
            # More stages per device only adds hops from here on. Screened problems stop at the
            # first miss: each count costs two schedules there, and on the scale workload no
            # count after a miss won (32 x 256: every family's time grows from its second count).
            if misses[family] >= (1 if ev.screen is not None else 2):
                stalled.add(family)
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
        owner = pack(costs, stages=stages, pre=pre)
        cand = ev.score(f"packed-v{k}", owner, stages=stages, policy=POLICIES[0],
                        beat=min(ev.prune_at, math.inf if best is None else best.time))
        ranked.append(cand)
        if best is None or cand.time < best.time:
            best = cand
        if ev.screen is not None and cand.time >= ev.prune_at:
            break  # as a family above: packed-v3 and v4 cost 2 s each there and lost by 2x
    return ranked


def _policies(*, ev: Evaluator, ranked: list[Candidate], best: Candidate | None
              ) -> tuple[list[Candidate], Candidate | None]:
    """Phase 2: the other scheduling policies, and the other admission mode, on the best
    structures (``ranked``: fastest first); the trials in the order tried, and the best
    candidate so far (``best`` or a faster trial)."""
    tuned: list[Candidate] = []
    for cand in ranked[:_TUNED_STRUCTURES]:
        if ev.screen is not None and cand.time >= ev.prune_at * (1 + _REFINE_REACH):
            break  # ranked fastest first: no policy gains this much on a screened estimate
        mode = cand.policy.admit_per_device
        policies = [replace(pol, admit_per_device=mode) for pol in POLICIES[1:]]
        policies.append(replace(cand.policy, admit_per_device=not mode))
        if ev.costs.by_step and len(set(cand.owner)) < len(cand.owner):
            # Scored by the step, a device with several stages drains one stage's W's first so
            # its all-reduce starts under the others' (extra to the budget: R = 1 unchanged).
            ev.budget += 1
            policies.append(replace(cand.policy, drain_w=True))
        for policy in policies:
            if ev.spent:
                break
            trial = ev.score(cand.pattern, cand.owner, stages=cand.stages, policy=policy,
                             beat=min(ev.prune_at, math.inf if best is None else best.time))
            tuned.append(trial)
            if best is None or trial.time < best.time:
                best = trial
    return tuned, best


def _climb_others(costs: Costs, *, ev: Evaluator, best: Candidate,
                  candidates: list[Candidate]) -> Candidate:
    """Budget left (the hill-climb stopped early): climb from the best candidate of the next
    pattern too; a local optimum of one structure is not the search's. Only those within
    _CLIMB_OTHERS of the best: a climb rarely gains more (deepseek-M-8dev-2k-mixed: vshape-v2
    from 1.5 % behind to 0.4 % ahead), and each costs schedules. Scheduled candidates only: a
    screened one's time is an estimate, and a climb that finds no move would hand it back
    unscheduled."""
    others = sorted((c for c in candidates if c.pattern != best.pattern
                     and c.schedule is not None
                     and c.time < best.time * (1 + _CLIMB_OTHERS)), key=_time)
    seen = {best.pattern}
    for other in others:
        if ev.spent:
            break
        if other.pattern in seen:
            continue
        seen.add(other.pattern)
        alt = refine(costs, best=other, ev=ev)
        if alt.time < best.time * (1 - 1e-9):
            best = alt
    return best
