"""Strategies by name: the planner's entry point for the CLI, the operator and the benchmarks.

``plan_strategy(problem, name)`` returns the plan and its simulated figures for one of the
contract's strategy names; ``compare(problem)`` runs them all. ``adaptis`` starts from the best
baseline and never returns a plan slower than it or one that exceeds a device's memory; when
neither the baselines nor the search fit, it tries :func:`adaptis.planner.feasibility.memory_fallback`.
``plan_strategy(problem, "adaptis")`` runs only the one-order baselines as seeds (:data:`SEEDS`:
1F1B and balanced); the others (several orders or chunk counts each, a fifth of the time of
a 32 x 256 plan before screening) are there for the comparison, and the joint search never lost to one of
them on the paper's 36 workloads (bench/search_quality.py: the search alone is the result).

``time_limit_s`` bounds a call (baselines and search together; None: no limit): the
baselines run cheapest first within the first half of it (the first always runs; later ones
are skipped once the half has passed), the joint search returns the best candidate it
scheduled by the end, and the adaptis result says so in ``cut_short``; past the limit,
``compare``'s lower bound is the pipeline and memory terms (1-4 and 6) only. The search keeps at least half
the time because where no baseline fits in memory it alone can find a plan. The limit is
checked between steps and every few thousand scheduler steps, so a call overruns it by at
most one baseline's simulation.

The lower bound (``lower_bound``) is the largest of six limits no plan can beat:
1. all work spread perfectly: sum of F+B+W over layers x microbatches / sum of device speeds;
2. the heaviest layer on the fastest device: its F+B+W x microbatches / max speed (a layer
   cannot be split, so its device does at least that);
3. one microbatch's critical path: sum of F and B over all layers on the fastest device, plus
   the smallest W (the last W of the iteration runs after the last B);
4. for every layer L, on the fastest device: its first F cannot start before one microbatch's
   forward through the layers before L; its device then runs m of its F and B; after the
   last of those B, that microbatch's backward still has to cross every layer before L:
   sum F(<L) + m (F_L + B_L) + sum B(<L). (Likewise sum F(<L) + m (F_L + B_L + W_L).)
5. granularity: layers are indivisible, so some device runs at least the least possible
   max per-device work over every layer -> device assignment (bounded from below in
   :func:`adaptis.planner.bounds.assignment_bound`; placements need not be contiguous).
6. memory: the work plus the recomputation the cluster's memory forces on it
   (:func:`adaptis.planner.memory_bound.memory_bound`; issue 32).
The first four are :func:`adaptis.planner.bounds.pipeline_bound`, the bound before 5.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from adaptis.api.plan import STRATEGY_NAMES, Comparison, Plan, Predicted, StrategyName, StrategyResult, is_strategy_name
from adaptis.api.problem import Problem
from adaptis.planner.baselines import BASELINES
from adaptis.planner.bounds import assignment_bound, pipeline_bound
from adaptis.planner.costs import Costs
from adaptis.planner.errors import DeadlockError, OutOfTime, PlannerError
from adaptis.planner.feasibility import memory_cuts, memory_fallback
from adaptis.planner.memory_bound import memory_bound
from adaptis.planner.memory_first import memory_first
from adaptis.planner.reasons import memory_lever, over_memory
from adaptis.planner.recompute import Recomputed, recompute_variants, tight_devices
from adaptis.planner.scheduler import Schedule
from adaptis.planner.search import joint_search
from adaptis.planner.simulator import Simulation, simulate

__all__ = ["Outcome", "compare", "lower_bound", "plan_strategy"]

log = logging.getLogger(__name__)

Progress = Callable[[int, int, float], None]


@dataclass(frozen=True, slots=True)
class Outcome:
    name: str
    plan: Plan | None
    simulation: Simulation | None
    result: StrategyResult


def lower_bound(costs: Costs, *, deadline: float | None = None) -> float:
    """The largest of the pipeline terms, the granularity term (:mod:`adaptis.planner.bounds`)
    and the memory term (:mod:`adaptis.planner.memory_bound`); past ``deadline`` the
    granularity term is the loosest it has found so far."""
    return max(pipeline_bound(costs), memory_bound(costs), assignment_bound(costs, deadline=deadline))


def _outcome(name: str, costs: Costs, *, plan: Plan, seconds: float) -> Outcome:
    try:
        sim = simulate(costs, plan)
    except DeadlockError as err:  # a baseline must never deadlock: report, don't crash
        log.error("%s: %s", name, err)
        return Outcome(name, None, None, StrategyResult(feasible=False, reason=str(err)))
    result = StrategyResult(
        feasible=sim.feasible,
        reason=sim.reason,
        iteration_time=sim.iteration_time,
        bubble_ratio=sim.bubble_ratio,
        peak_memory_bytes=list(sim.peak_memory),
        post_pipeline_time=sim.post_pipeline_time,
        step_time=sim.step_time,
        stages=len(plan.stages),
        placement=[list(p) for p in plan.placement],
        search_seconds=seconds,
    )
    predicted = Predicted(
        iteration_time=sim.iteration_time,
        bubble_ratio=min(1.0, sim.bubble_ratio),
        time_unit=costs.time_unit,
        peak_memory_bytes=list(sim.peak_memory),
        post_pipeline_time=sim.post_pipeline_time,
        step_time=sim.step_time,
    )
    plan = plan.model_copy(update={"strategy": name, "microbatches": costs.microbatches,
                                   "predicted": predicted})
    return Outcome(name, plan, sim, result)


@dataclass(frozen=True, slots=True)
class _Limit:
    """A call's time limit: the seconds asked for and the :func:`time.monotonic` deadline."""

    seconds: float | None
    deadline: float | None
    baselines_until: float | None  # the end of the baselines' share

    @classmethod
    def start(cls, seconds: float | None) -> _Limit:
        if seconds is None:
            return cls(None, None, None)
        if not math.isfinite(seconds) or seconds <= 0:
            raise PlannerError(f"time limit: {seconds} s; give a positive number of seconds")
        now = time.monotonic()
        return cls(seconds, now + seconds, now + seconds / 2)

    def passed(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def baselines_passed(self) -> bool:
        return self.baselines_until is not None and time.monotonic() >= self.baselines_until


#: The baselines ``plan_strategy(..., "adaptis")`` starts from: one order and one simulation each.
SEEDS: tuple[StrategyName, ...] = ("1f1b", "balanced")

# The order baselines run in under a time limit: one-order ones first (1F1B and balanced are
# also the strongest of those), then those that try several orders or chunk counts.
_CHEAPEST_FIRST: tuple[StrategyName, ...] = ("1f1b", "balanced", "gpipe", "zb-h1", "zb-v", "i1f1b")


def _baselines(costs: Costs, limit: _Limit = _Limit(None, None, None), *,
               names: tuple[StrategyName, ...] | None = None, first_always: bool = True) -> dict[str, Outcome]:
    """The baselines (``names``: only those; default all), cheapest first, in the contract's
    order; past the limit's baselines' share only the first runs (none: ``first_always=False``)."""
    out: dict[str, Outcome] = {}
    wanted = [n for n in BASELINES if names is None or n in names]
    order = [n for n in _CHEAPEST_FIRST if n in wanted] + [n for n in wanted if n not in _CHEAPEST_FIRST]
    for name in order:
        make = BASELINES[name]
        if (out or not first_always) and limit.baselines_passed():
            why = (f"the baselines' half of the time limit ({limit.seconds:g} s) ran out" if first_always
                   else f"the time limit ({limit.seconds:g} s) ran out while adaptis planned")
            out[name] = Outcome(name, None, None, StrategyResult(feasible=False, reason=f"not tried: {why}"))
            continue
        t0 = time.perf_counter()
        try:
            plan = make(costs, deadline=limit.baselines_until)
        except PlannerError as err:  # e.g. i1f1b on a 1-layer model: infeasible, not a crash
            log.info("%s: %s", name, err)
            out[name] = Outcome(name, None, None, StrategyResult(feasible=False, reason=str(err)))
            continue
        out[name] = _outcome(name, costs, plan=plan, seconds=time.perf_counter() - t0)
    return {name: out[name] for name in wanted}  # the contract's order, whatever ran first


def _adaptis(costs: Costs, baselines: dict[str, Outcome], *, on_progress: Progress | None,
             limit: _Limit) -> Outcome:
    t0 = time.perf_counter()
    feasible = [o for o in baselines.values() if o.result.feasible and o.plan is not None]
    by = costs.by_step  # the search's objective: the step with replicas, else the iteration

    def score(o: Outcome) -> float:
        return (o.result.step_time if by else o.result.iteration_time) or 0.0

    incumbent = min(feasible, key=score, default=None)
    seed_time = math.inf if incumbent is None else score(incumbent) or math.inf
    # Memory binds on the seeds: a cut priced with the recomputation each stage needs, before
    # the search, so a plan is in hand within seconds whatever the search then finds in time.
    early = _memory_first(costs, baselines, limit=limit, beat=seed_time)
    early_time = min((sched.score(by_step=by) for _st, _ow, sched, _f in early), default=math.inf)
    found = None if limit.passed() else joint_search(
        costs,
        incumbent=min(seed_time, early_time),
        # Only where no seed fits: then the search's structures that cannot beat the early
        # plan are not scheduled (where a seed fits the search runs as it always has).
        prune_at=early_time if incumbent is None else math.inf,
        on_progress=on_progress,
        deadline=limit.deadline,
    )
    # Cut: the search said so, or never ran / found nothing because the limit had passed.
    cut = found.cut_short if found is not None else limit.passed()
    best = incumbent
    tried: list[_Tried] = [*early, *([] if found is None else [(found.stages, found.owner, found.schedule, None)])]
    if found is None and incumbent is None and not early and not cut:
        # Nothing fits: cut by memory (devices may stay empty), fewer microbatches in flight.
        fallback = memory_fallback(costs)
        tried = [] if fallback is None else [(*fallback, None)]
    if not cut:
        times = [sched.score(by_step=by) for _st, _ow, sched, _f in tried if sched.feasible]
        tried += _recomputed(costs, tried=tried[len(early):], limit=limit, beat=min([seed_time, *times]),
                             binds=bool(early))
    # Fastest claim first: a schedule replays at the time it claims, so the first that the
    # simulator confirms wins; one full simulation, not one per candidate (seconds each at scale).
    for stages, owner, schedule, recompute in sorted(
            (t for t in tried if t[2].feasible), key=lambda t: t[2].score(by_step=by)):
        if best is not None and schedule.score(by_step=by) >= score(best):
            break
        placement = [[s for s, d in enumerate(owner) if d == dev] for dev in range(costs.devices)]
        plan = Plan.model_construct(  # generated: the simulator checks it below
            stages=stages, placement=placement,
            actions=[list(a) for a in schedule.actions],  # one list per device, empty ones too
            recompute=None if recompute is None or not any(recompute) else list(recompute),
        )
        cand = _outcome("adaptis", costs, plan=plan, seconds=0.0)
        if cand.result.feasible and (
            best is None or score(cand) < score(best)
        ):
            best = cand
            break
        log.error(  # the property tests say this never happens; the next claim is tried
            "adaptis: a schedule claimed %.6g but replays at %s", schedule.iteration_time,
                  cand.result.iteration_time if cand.result.feasible else cand.result.reason)
    seconds = time.perf_counter() - t0
    if best is None:
        reason = _least_memory_reason(costs, baselines)
        if cut:
            reason = f"the time limit ({limit.seconds:g} s) ran out before any plan fit; {reason}"
        return Outcome("adaptis", None, None, StrategyResult(
            feasible=False, reason=reason, search_seconds=seconds,
            cut_short="no plan: the time limit ran out first" if cut else None))
    assert best.plan is not None and best.simulation is not None  # invariant, not user input
    note = None
    skipped = [n for n, o in baselines.items() if (o.result.reason or "").startswith("not tried")]
    if cut or skipped:
        evals = 0 if found is None else found.evaluations
        unseen = f"; baselines not tried: {', '.join(skipped)}" if skipped else ""
        searched = (f"the search ran to its end ({evals} candidates)" if not cut
                    else f"{evals} search candidates")
        note = (f"the best plan found within the time limit ({limit.seconds:g} s): the joint "
                f"search's ({searched}){unseen}" if best.name == "adaptis" else
                f"the best baseline ({best.name}) found within the time limit "
                f"({limit.seconds:g} s), {searched}{unseen}")
    plan = best.plan.model_copy(update={"strategy": "adaptis"})
    result = best.result.model_copy(update={"search_seconds": seconds, "cut_short": note})
    return Outcome("adaptis", plan, best.simulation, result)


def _memory_first(costs: Costs, baselines: dict[str, Outcome], *, limit: _Limit, beat: float) -> list[Recomputed]:
    """:func:`adaptis.planner.memory_first.memory_first` where memory binds on the seeds'
    structures (a device of theirs holds fewer microbatches than the pipeline's depth); empty
    elsewhere or once the time limit passes."""
    seeds = [_structure(o.plan) for o in baselines.values() if o.plan is not None]
    if limit.passed() or not any(tight_devices(costs, stages=st, owner=ow) for st, ow in seeds):
        return []
    try:
        return memory_first(costs, beat=beat, deadline=limit.deadline)
    except OutOfTime:
        log.info("memory first: the time limit ran out")
        return []


def _structure(plan: Plan) -> tuple[list[tuple[int, int]], list[int]]:
    """A plan's (stages, owner): owner[s] is stage s's device."""
    owner = [0] * len(plan.stages)
    for d, stages in enumerate(plan.placement):
        for s in stages:
            owner[s] = d
    return [(lo, hi) for lo, hi in plan.stages], owner


def _never_slower(adaptis: Outcome, others: dict[str, Outcome], *, limit: _Limit,
                  by_step: bool = False) -> Outcome:
    """``adaptis``, or the fastest of ``others`` (the baselines that are not seeds) where that
    fits and is faster: under ``compare`` adaptis is never slower than a baseline it was shown."""
    fits = [o for o in others.values() if o.result.feasible and o.plan is not None]
    def score(o: Outcome) -> float:
        return (o.result.step_time if by_step else o.result.iteration_time) or 0.0

    faster = min(fits, key=score, default=None)
    if faster is None or (adaptis.result.feasible and score(adaptis) <= score(faster)):
        skipped = [n for n, o in others.items() if (o.result.reason or "").startswith("not tried")]
        if not skipped or not adaptis.result.feasible:
            return adaptis
        had = adaptis.result.cut_short or ""
        note = (f"{had}, {', '.join(skipped)}" if "baselines not tried: " in had
                else f"{had}; baselines not tried: {', '.join(skipped)}" if had
                else f"baselines not tried: {', '.join(skipped)}")
        return replace(adaptis, result=adaptis.result.model_copy(update={"cut_short": note}))
    assert faster.plan is not None  # filtered above
    note = (f"the baseline {faster.name} replays faster than the joint search's plan"
            + (f" found within the time limit ({limit.seconds:g} s)" if limit.seconds else ""))
    return Outcome("adaptis", faster.plan.model_copy(update={"strategy": "adaptis"}), faster.simulation,
                   faster.result.model_copy(update={"cut_short": note if limit.seconds else None,
                                                    "search_seconds": adaptis.result.search_seconds}))


# A structure scheduled for the adaptis plan: (stages, owner, schedule, recompute flags or None).
_Tried = tuple[list[tuple[int, int]], list[int], Schedule, tuple[bool, ...] | None]


def _recomputed(costs: Costs, *, tried: list[_Tried], limit: _Limit, beat: float,
                binds: bool = False) -> list[Recomputed]:
    """The recomputing variants (:mod:`adaptis.planner.recompute`) of the structures tried so
    far and of the memory-driven cuts, each scheduled only if its busiest device can beat
    ``beat``: the caller keeps one only where it is faster. Empty once the time limit passes.
    ``binds``: memory is known to bind (the memory-driven cuts are tried whatever was tried)."""
    out: list[Recomputed] = []
    structures = [(stages, owner) for stages, owner, _schedule, _flags in tried]
    try:
        if binds or any(tight_devices(costs, stages=st, owner=ow) for st, ow in structures):
            # Memory is tight: the memory-driven cuts (fewer layers where memory is short)
            # recompute cheaper than a cut by time (on the memory sweep's x1.2 caps they win).
            structures += [cut for cut in memory_cuts(costs) if cut not in structures]
        for stages, owner in structures:
            out += recompute_variants(costs, stages=stages, owner=owner, beat=beat, deadline=limit.deadline)
    except OutOfTime:
        log.info("recompute: the time limit ran out; keeping the variants found so far")
    return out


def _least_memory_reason(costs: Costs, seen: dict[str, Outcome]) -> str:
    """Why adaptis found nothing: the leanest simulated plan's worst device, how many devices
    are over, and the lever that would help (:mod:`adaptis.planner.reasons`), in one bounded
    sentence whatever the device count.

    The search starts from the baselines and only keeps plans that fit; when none does, the
    baseline whose worst device overshoots least says how far off the cluster is, so the user
    can size memory.
    """
    peaks = {name: o.simulation.peak_memory for name, o in seen.items() if o.simulation is not None}
    if not peaks:
        return f"no partition fits in device memory; {memory_lever(costs)}"

    def worst(name: str) -> float:
        return max(p / c if c > 0 else math.inf for p, c in zip(peaks[name], costs.memory, strict=True))

    lean = min(peaks, key=worst)
    over = over_memory(peaks[lean], costs.memory) or "every device fits"  # not reached: none fit
    return (f"no partition fits in device memory: in the leanest plan seen ({lean}) {over}; "
            f"{memory_lever(costs)}")


def plan_strategy(problem: Problem, name: str, *, on_progress: Progress | None = None,
                  time_limit_s: float | None = None) -> Outcome:
    """Plan ``problem`` with strategy ``name`` (one of the contract's names), within
    ``time_limit_s`` seconds if given (see the module's docstring)."""
    if not is_strategy_name(name):
        raise PlannerError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGY_NAMES)}")
    limit = _Limit.start(time_limit_s)
    costs = Costs.from_problem(problem)
    if name == "adaptis":
        return _adaptis(costs, _baselines(costs, limit, names=SEEDS), on_progress=on_progress, limit=limit)
    t0 = time.perf_counter()
    plan = BASELINES[name](costs, deadline=limit.deadline)
    return _outcome(name, costs, plan=plan, seconds=time.perf_counter() - t0)


def compare(
    problem: Problem, *, on_progress: Progress | None = None, time_limit_s: float | None = None,
    bound: bool = True,
) -> tuple[Comparison, dict[str, Outcome]]:
    """Every strategy of the contract, ``adaptis`` first, within ``time_limit_s`` if given.

    ``bound=False``: the comparison's lower bound is 0 (trivially true), for callers that use
    only the outcomes; the granularity term takes seconds on thousands of layers."""
    limit = _Limit.start(time_limit_s)
    costs = Costs.from_problem(problem)
    # adaptis exactly as plan_strategy plans it (the seeds, then the search with the whole
    # limit), so --compare and --strategy adaptis give the same plan for the same budget;
    # the other baselines are the comparison, run in what time is left.
    seeds = _baselines(costs, limit, names=SEEDS)
    adaptis = _adaptis(costs, seeds, on_progress=on_progress, limit=limit)
    rest = _Limit(limit.seconds, limit.deadline, limit.deadline)
    others = _baselines(costs, rest, names=tuple(n for n in BASELINES if n not in SEEDS),
                        first_always=False)
    baselines: dict[str, Outcome] = {name: seeds.get(name) or others[name] for name in BASELINES}
    outcomes: dict[str, Outcome] = {
        "adaptis": _never_slower(adaptis, others, limit=limit, by_step=costs.by_step), **baselines}
    comparison = Comparison(
        name=problem.name,
        time_unit=problem.time_unit,
        # Past the limit, the granularity term (seconds on thousands of layers) is left out:
        # the pipeline terms alone are still a lower bound, only a looser one.
        lower_bound=0.0 if not bound else max(pipeline_bound(costs), memory_bound(costs)) if limit.passed()
        else lower_bound(costs, deadline=limit.deadline),
        strategies={name: o.result for name, o in outcomes.items()},
    )
    return comparison, outcomes
