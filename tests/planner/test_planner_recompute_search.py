"""Recomputation chosen by the planner (:mod:`adaptis.planner.recompute`): under tight memory
adaptis marks the stages of the devices that cannot fill the pipeline, and keeps that only
where it is faster; the plan replays at its claimed time and within memory."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import pytest

from adaptis.api.plan import Plan
from adaptis.api.problem import Problem, parse_problem
from adaptis.planner import strategies
from adaptis.planner.costs import Costs
from adaptis.planner.errors import PlannerError
from adaptis.planner.feasibility import memory_partition
from adaptis.planner.recompute import busiest_work, recompute_variants, tight_devices
from adaptis.planner.scheduler import Policy, list_schedule
from adaptis.planner.simulator import simulate

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench import workloads  # noqa: E402

ACT = 100.0


def _small_problem(memory: list[float], *, microbatches: int = 8) -> Problem:
    layer = {"forward": 1.0, "backward": 1.0, "weight": 1.0, "backward_fused": 1.8,
             "activation_bytes": ACT, "output_bytes": 10.0, "param_bytes": 1000.0}
    return parse_problem({
        "microbatches": microbatches, "layers": [{"name": f"l{i}", **layer} for i in range(4)],
        "devices": {"list": [{"node": "n0", "memory_bytes": m} for m in memory]},
    })


def _small(memory: list[float]) -> Costs:
    return Costs.from_problem(_small_problem(memory))


def test_only_the_tight_devices_stages_recompute() -> None:
    stages, owner = [(0, 1), (1, 2), (2, 3), (3, 4)], [0, 1, 0, 1]
    # Device 0: 2000 of parameters and 200 a microbatch: 4 stages want 4 in flight, 2600 holds 3.
    costs = _small([2600.0, 1e9])
    assert tight_devices(costs, stages=stages, owner=owner) == [0]
    found = recompute_variants(costs, stages=stages, owner=owner)
    assert found, "recomputing device 0's stages fits"
    assert found[0][3] == (True, False, True, False)
    assert (True,) * 4 in [flags for *_rest, flags in found]  # the every-stage variant too
    for st, ow, sched, flags in found:
        assert all(kind in ("F", "BW") for acts in sched.actions for kind, _s, _mb in acts)
        assert sched.feasible and st == stages and ow == owner and len(flags) == 4
        # The scheduler's clock is the simulator's: the plan replays at the time it claims.
        plan = Plan(stages=st, placement=[[s for s, d in enumerate(ow) if d == dev] for dev in range(2)],
                    actions=[list(a) for a in sched.actions], recompute=list(flags))
        sim = simulate(costs, plan)
        assert sim.feasible and sim.iteration_time == pytest.approx(sched.iteration_time, rel=1e-12)
    assert recompute_variants(_small([1e9, 1e9]), stages=stages, owner=owner) == []


def test_variants_that_cannot_beat_the_time_are_not_scheduled() -> None:
    stages, owner = [(0, 1), (1, 2), (2, 3), (3, 4)], [0, 1, 0, 1]
    costs = _small([2600.0, 1e9])
    found = recompute_variants(costs, stages=stages, owner=owner)
    bounds = [busiest_work(costs, stages=stages, owner=owner, recompute=flags) for *_r, flags in found]
    for (*_r, sched, _flags), bound in zip(found, bounds, strict=True):
        assert bound <= sched.iteration_time  # a true bound: pruning by it loses nothing
    assert recompute_variants(costs, stages=stages, owner=owner, beat=min(bounds)) == []
    kept = recompute_variants(costs, stages=stages, owner=owner, beat=max(bounds) * 1.0001)
    assert len(kept) == len(found)


def test_list_schedule_refuses_recompute_with_split_backwards() -> None:
    costs = _small([1e9, 1e9])
    with pytest.raises(PlannerError, match="split_backward=False"):
        list_schedule(costs, stages=[(0, 2), (2, 4)], owner=[0, 1], recompute=(True, False))
    fused = list_schedule(costs, stages=[(0, 2), (2, 4)], owner=[0, 1],
                          policy=Policy(split_backward=False), recompute=(True, False))
    plain = list_schedule(costs, stages=[(0, 2), (2, 4)], owner=[0, 1], policy=Policy(split_backward=False))
    assert fused.iteration_time > plain.iteration_time  # stage 0's forward runs again


def _tight(name: str, factor: float) -> dict:
    """A memory sweep configuration at ``factor`` x the witness's least need (bench/planner_bench.py)."""
    doc = next(d for d in workloads.end_to_end() if d["name"] == name)
    costs = Costs.from_problem(parse_problem(doc))
    lo, hi = 0.0, sum(costs.param_bytes) + sum(costs.activation_bytes)
    for _ in range(50):
        mid = (lo + hi) / 2
        shrunk = dataclasses.replace(costs, memory=(mid,) * costs.devices)
        lo, hi = (mid, hi) if memory_partition(shrunk, order=list(range(costs.devices))) is None else (lo, mid)
    return {**doc, "devices": {**doc["devices"], "memory_bytes": hi * factor * (1 + 1e-9)}}


@pytest.mark.parametrize("factor", [1.2, 1.0])
def test_tight_memory_sweep_plan_recomputes_and_is_faster(factor: float, monkeypatch: pytest.MonkeyPatch) -> None:
    problem = parse_problem(_tight("gemma-M-8dev-2k", factor))
    costs = Costs.from_problem(problem)
    ours = strategies.plan_strategy(problem, "adaptis")
    assert ours.result.feasible and ours.plan is not None
    assert ours.plan.recompute is not None and any(ours.plan.recompute)
    sim = simulate(costs, ours.plan)
    assert sim.feasible
    assert sim.iteration_time == pytest.approx(ours.result.iteration_time, rel=1e-12)
    assert all(p <= c * (1 + 1e-9) for p, c in zip(sim.peak_memory, costs.memory, strict=True))
    monkeypatch.setattr(strategies, "recompute_variants", lambda *a, **k: [])
    monkeypatch.setattr(strategies, "memory_first", lambda *a, **k: [])  # it recomputes too
    without = strategies.plan_strategy(problem, "adaptis")
    assert without.plan is not None and not any(without.plan.recompute or [])
    # Measured: x1.2 4276 -> 2553, x1 6242 -> 2239 (ms); at least a third faster either way.
    assert ours.result.iteration_time < 0.75 * without.result.iteration_time


def test_roomy_memory_never_recomputes() -> None:
    doc = next(d for d in workloads.end_to_end() if d["name"] == "gemma-M-8dev-2k")
    ours = strategies.plan_strategy(parse_problem(doc), "adaptis")
    assert ours.plan is not None and not any(ours.plan.recompute or [])


def test_a_memory_driven_cut_recomputes_where_the_searchs_structure_cannot_win() -> None:
    """Device 0 (2200 bytes) holds 2 layers' parameters (2000) and one microbatch's
    activations (200) of the memory cut 2 + 2 on devices 0, 1: with stage 0 recomputing it
    holds no microbatch in flight but the working set (2200), so it never throttles, and
    runs 8 x (F 2 + BW 3.6 + F again 2) = 60.8: its own work, the best that cut can do.
    The search's 4 stages on 2 devices recompute no faster than 121.6 and nothing fits
    without recomputing under 70.4; the cut with the devices swapped recomputes at 66.4.
    So the plan is the first memory cut's, recomputed: the memory cuts are offered, and the
    variants of every structure are kept."""
    costs = _small([2200.0, 2400.0])
    ours = strategies.plan_strategy(_small_problem([2200.0, 2400.0]), "adaptis")
    assert ours.plan is not None and ours.result.feasible
    assert (ours.plan.stages, ours.plan.placement, ours.plan.recompute) == (
        [(0, 2), (2, 4)], [[0], [1]], [True, False])
    assert ours.result.iteration_time == pytest.approx(60.8, rel=1e-12)
    sim = simulate(costs, ours.plan)
    assert sim.feasible and sim.iteration_time == pytest.approx(60.8, rel=1e-12)
    assert all(p <= c for p, c in zip(sim.peak_memory, costs.memory, strict=True))


def test_recomputation_stops_at_the_calls_deadline() -> None:
    """Past the call's deadline the recomputing variants are not scheduled to their end: one
    list schedule of 2 stages x 1024 microbatches runs past its first check (every 4096
    steps) and stops there, and recomputation keeps what it found before: nothing."""
    costs = Costs.from_problem(_small_problem([2200.0, 2400.0], microbatches=1024))
    tried = [([(0, 2), (2, 4)], [0, 1], None, None)]
    unlimited = strategies._recomputed(costs, tried=tried, limit=strategies._Limit(None, None, None),
                                       beat=math.inf)
    assert unlimited, "device 0 is tight: its recomputing variants fit"
    now = strategies.time.monotonic()
    passed = strategies._Limit(1.0, now - 1.0, now - 1.5)
    assert strategies._recomputed(costs, tried=tried, limit=passed, beat=math.inf) == []
