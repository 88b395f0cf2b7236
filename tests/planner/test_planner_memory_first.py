"""The memory-first plan (adaptis.planner.memory_first, issue 32): where no seed fits, a cut
priced with the recomputation each stage needs gives a feasible plan before the search, and
only the devices that need it recompute."""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from layer_strategies import LAYER

from adaptis.api.plan import Plan
from adaptis.api.problem import parse_problem
from adaptis.planner import screening
from adaptis.planner.costs import Costs
from adaptis.planner.evaluator import Candidate, Evaluator
from adaptis.planner.memory_first import memory_first, recompute_cut
from adaptis.planner.scheduler import Policy
from adaptis.planner.search import joint_search
from adaptis.planner.simulator import simulate
from adaptis.planner.strategies import compare, lower_bound, plan_strategy

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench import workloads


def _bound(devices: int = 16) -> Costs:
    """Nemotron-H-like at 8K sequence, 6 blocks a device, 80 GB: 1F1B's device 0 is over memory."""
    doc = workloads.problem("nemotron-h", "M", seq=8192, devices=devices, blocks=6 * devices,
                            microbatches_per_device=8)
    return Costs.from_problem(parse_problem(doc))


def test_the_cut_recomputes_only_where_the_pipeline_depth_does_not_fit() -> None:
    costs = _bound(64)  # 64 stages deep: the first devices cannot hold 64 microbatches
    stages, owner, flags = recompute_cut(costs) or ([], [], ())
    assert owner == list(range(64)) and stages[0][0] == 0 and stages[-1][1] == costs.layers
    # The early devices hold the pipeline's depth; the last ones (the head's) keep activations.
    assert flags[0] and not flags[-1], flags


def test_memory_first_plans_fit_and_replay_where_no_seed_fits() -> None:
    costs = _bound(32)
    found = memory_first(costs)
    # Screened (32 x 256): the global admission rule's estimate (12,073 ms in full) cannot
    # beat per-device admission's 11,980 ms, so it is not scheduled; split backwards are.
    assert [round(sched.iteration_time) for _st, _ow, sched, _f in found] == [11_980, 11_918]
    for stages, _owner, sched, _flags in found:
        assert sched.feasible and len(stages) == 32


def test_compare_and_plan_give_the_same_plan() -> None:
    doc = workloads.problem("nemotron-h", "M", seq=8192, devices=16, blocks=96, microbatches_per_device=8)
    problem = parse_problem(doc)
    alone = plan_strategy(problem, "adaptis", time_limit_s=60)
    _, outcomes = compare(problem, time_limit_s=60, bound=False)
    assert alone.result.feasible and alone.plan is not None
    assert alone.result.iteration_time == outcomes["adaptis"].result.iteration_time
    sim = simulate(Costs.from_problem(problem), alone.plan)
    assert sim.feasible and sim.iteration_time == alone.result.iteration_time


def test_a_screened_search_schedules_nothing_in_full_that_cannot_beat_the_plan_in_hand(
        monkeypatch: pytest.MonkeyPatch) -> None:
    costs = _bound(32)  # 32 x 256: screened
    full: list[float] = []
    run = Evaluator.run

    def counted(self: Evaluator, *args: Any, **kwargs: Any) -> Candidate:
        cand = run(self, *args, **kwargs)
        full.append(cand.time)
        return cand

    monkeypatch.setattr(Evaluator, "run", counted)
    # Just under the search's best here (11,902 ms): every estimate reaches it, so no
    # candidate is confirmed (each a full schedule) and none is refined.
    assert joint_search(costs, prune_at=11_800.0) is None
    assert full == []
    # Within reach, the search still runs, confirms and refines as before.
    found = joint_search(costs, prune_at=11_950.0)
    assert found is not None and found.schedule.iteration_time < 11_950.0 and full


def test_confirm_skips_estimates_at_or_past_the_plan_in_hand() -> None:
    costs = _bound(32)
    ev = Evaluator(costs, budget=10)
    assert ev.screen is not None
    ev.prune_at = 10_000.0
    stages = [(i * 6, (i + 1) * 6) for i in range(32)]
    stages[-1] = (stages[-1][0], costs.layers)
    cand = Candidate("contiguous", list(range(32)), stages, None, Policy(), estimate=10_000.0)
    assert ev.confirm([cand]) is None and ev.evals == 0
    ev.prune_at = math.inf
    assert ev.confirm([cand]) is not None and ev.evals == 1


@st.composite
def tight(draw: st.DrawFn) -> dict[str, Any]:
    """Memory for every parameter and from 0.3x to 3x one microbatch's activations, so the
    pipeline's depth often does not fit; mixed speeds."""
    layers = [{"name": f"l{i}", **draw(LAYER)} for i in range(draw(st.integers(min_value=1, max_value=14)))]
    acts = sum(layer["activation_bytes"] for layer in layers)
    params = sum(layer["param_bytes"] for layer in layers)
    count = draw(st.integers(min_value=1, max_value=6))
    memory = params + acts * draw(st.floats(min_value=0.3, max_value=3.0))
    return {
        "microbatches": draw(st.integers(min_value=1, max_value=16)),
        "layers": layers,
        "devices": {"list": [{"node": f"n{d % 2}", "speed": draw(st.floats(min_value=0.5, max_value=2.0)),
                              "memory_bytes": memory} for d in range(count)]},
    }


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tight(), st.booleans())
def test_memory_first_plans_are_correct_plans(doc: dict[str, Any], screened: bool) -> None:
    """Every schedule memory_first returns is a contiguous cut in device order, recomputes
    only fused-backward stages, replays in the simulator at exactly its claimed time within
    every device's memory, and is no faster than the lower bound; where no cut fits even
    recomputing, there is none. ``screened``: screening forced on (where the problem has the
    microbatches for it), so the policies it skips by estimate are skipped here too."""
    costs = Costs.from_problem(parse_problem(doc))
    cut = recompute_cut(costs)
    with mock.patch.object(screening, "SCREEN_ABOVE", 0 if screened else screening.SCREEN_ABOVE):
        found = memory_first(costs)
    if cut is None:
        event("no cut fits")
        assert found == []
        return
    stages, owner, flags = cut
    event(f"recomputes: {'some' if any(flags) else 'none'}, schedules: {len(found)}")
    assert stages[0][0] == 0 and stages[-1][1] == costs.layers
    assert all(a[1] == b[0] for a, b in itertools.pairwise(stages))
    assert owner == sorted(owner) and len(set(owner)) == len(owner)
    assert len(flags) == len(stages)
    # Only where needed: a stage recomputes only if its device cannot keep its activations
    # for the microbatches it holds in flight (min(p - d, m)).
    plain = costs.stage_costs(stages)
    for s, d in enumerate(owner):
        inflight = min(costs.devices - d, costs.microbatches)
        if flags[s]:
            assert plain.param_bytes[s] + plain.activation_bytes[s] * inflight > costs.memory[d]
    bound = lower_bound(costs)
    for got_stages, got_owner, sched, got_flags in found:
        assert (got_stages, got_owner, got_flags) == (stages, owner, flags)
        assert sched.feasible
        placement = [[s for s, d in enumerate(got_owner) if d == dev] for dev in range(costs.devices)]
        plan = Plan(stages=got_stages, placement=placement, actions=[list(a) for a in sched.actions],
                    recompute=list(got_flags) if any(got_flags) else None)  # Plan checks: fused BW only
        sim = simulate(costs, plan)
        assert sim.feasible, sim.reason
        assert math.isclose(sim.iteration_time, sched.iteration_time, rel_tol=1e-9)
        assert sim.iteration_time >= bound * (1 - 1e-9)
