"""The memory-aware lower bound (adaptis.planner.memory_bound, issue 32 item 2): its value on a
problem small enough to work out by hand, where it binds, and, on random problems with tight
memory, that no plan that fits (baselines, random cuts, random recomputation) beats it."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from layer_strategies import LAYER

from adaptis.api.problem import parse_problem
from adaptis.planner.baselines import BASELINES
from adaptis.planner.bounds import pipeline_bound
from adaptis.planner.costs import Costs
from adaptis.planner.errors import PlannerError
from adaptis.planner.memory_bound import memory_bound
from adaptis.planner.scheduler import Policy, list_schedule
from adaptis.planner.simulator import simulate
from adaptis.planner.strategies import lower_bound


def _one_layer(*, act: float, memory: float, m: int = 4) -> Costs:
    return Costs.from_problem(parse_problem({
        "microbatches": m,
        "layers": [{"name": "l0", "forward": 1.0, "backward": 1.0, "weight": 0.0, "backward_fused": 1.0,
                    "activation_bytes": act, "output_bytes": 1.0, "param_bytes": 0.0}],
        "devices": {"count": 1, "memory_bytes": memory},
    }))


def test_the_bound_by_hand_recompute_what_memory_forces_and_no_more() -> None:
    # One layer, F = 1, backward 1, on one device: a microbatch's activations are held at
    # least 2 (its forward and backward). With activations twice the memory, recomputing a
    # fraction x costs m x (2 + x) of work and leaves m x (1 - x) x 2C x 2 of memory-time in
    # C x T: both meet at x = 0.4, T = 2.4 m.
    m = 4
    costs = _one_layer(act=2.0e9, memory=1.0e9, m=m)
    assert math.isclose(memory_bound(costs), 2.4 * m, rel_tol=1e-6)
    assert lower_bound(costs) >= memory_bound(costs) > pipeline_bound(costs)
    # Room for every microbatch's activations: the work alone.
    roomy = _one_layer(act=2.0e9, memory=1.0e12, m=m)
    assert math.isclose(memory_bound(roomy), 2.0 * m, rel_tol=1e-9)


def test_the_bound_rises_as_memory_shrinks() -> None:
    base = _one_layer(act=1.0e9, memory=1.0e9, m=8)
    times = [memory_bound(dataclasses.replace(base, memory=(cap,))) for cap in (4e9, 1e9, 5e8, 2.5e8)]
    assert times == sorted(times) and times[-1] > times[0]


@st.composite
def tight(draw: st.DrawFn) -> dict[str, Any]:
    """Problems whose memory is short: caps from a tenth of to twice one microbatch's
    activations, so plans throttle, recompute or do not fit."""
    layers = [{"name": f"l{i}", **draw(LAYER)} for i in range(draw(st.integers(min_value=1, max_value=10)))]
    count = draw(st.integers(min_value=1, max_value=5))
    acts = sum(layer["activation_bytes"] for layer in layers)
    params = sum(layer["param_bytes"] for layer in layers)
    memory = params + acts * draw(st.floats(min_value=0.1, max_value=2.0))
    speeds = [draw(st.floats(min_value=0.5, max_value=2.0)) for _ in range(count)]
    return {
        "microbatches": draw(st.integers(min_value=1, max_value=12)),
        "layers": layers,
        "devices": {"list": [{"node": f"n{d % 2}", "speed": v, "memory_bytes": memory}
                             for d, v in enumerate(speeds)]},
    }


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tight(), st.data())
def test_no_plan_that_fits_beats_the_memory_bound(doc: dict[str, Any], data: st.DataObject) -> None:
    costs = Costs.from_problem(parse_problem(doc))
    bound = memory_bound(costs)
    times = []
    for make in BASELINES.values():
        try:
            sim = simulate(costs, make(costs))
        except PlannerError:
            continue
        if sim.feasible:
            times.append(sim.iteration_time)
    # Random contiguous cuts on random devices, each stage recomputed or not (fused backwards).
    n = data.draw(st.integers(min_value=1, max_value=min(costs.layers, 2 * costs.devices)))
    cuts = sorted(data.draw(st.sets(st.integers(min_value=1, max_value=costs.layers - 1),
                                    min_size=n - 1, max_size=n - 1))) if n > 1 else []
    bounds = [0, *cuts, costs.layers]
    stages = [(bounds[i], bounds[i + 1]) for i in range(n)]
    owner = [data.draw(st.integers(min_value=0, max_value=costs.devices - 1)) for _ in stages]
    flags = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    for policy in (Policy(split_backward=False, admit_per_device=True), Policy(split_backward=False)):
        sched = list_schedule(costs, stages=stages, owner=owner, policy=policy, recompute=flags)
        if sched.feasible:
            times.append(sched.iteration_time)
    for t in times:
        assert t >= bound * (1 - 1e-9), (t, bound)
