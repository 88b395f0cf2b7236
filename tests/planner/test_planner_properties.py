"""Property tests: every baseline plan, on random problems, is a correct plan.

Random layer costs (with or without an embedding and a head), 1-8 devices (identical or a
heterogeneous list), 1-16 microbatches, optional memory, optional network, optional tensor
parallelism (each device a group of 2-4 ranks, layers split and all-reducing at random). For every plan:
the contract's structural check passes; it simulates without deadlock; every F, B, W (or
BW) runs exactly once; the simulated timeline keeps every dependency, including transfers,
and never overlaps two actions on a device; and the peak memory the simulator reports
equals an independent recomputation from the timeline.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adaptis.api.plan import Plan
from adaptis.api.problem import parse_problem
from adaptis.planner.baselines import BASELINES
from adaptis.planner.bounds import pipeline_bound
from adaptis.planner.costs import Costs
from adaptis.planner.errors import PlannerError
from adaptis.planner.partition import balanced_partition, bottleneck, megatron_partition
from adaptis.planner.simulator import Simulation, simulate
from adaptis.planner.strategies import compare

EPS = 1e-7

_time = st.floats(min_value=0.0, max_value=5.0, allow_nan=False)
_bytes = st.one_of(st.just(0.0), st.floats(min_value=1e6, max_value=2e9))


@st.composite
def layer(draw: st.DrawFn, *, name: str, kind: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": name,
        "forward": draw(st.floats(min_value=0.05, max_value=5.0)),
        "backward": draw(_time),
        "weight": draw(st.floats(min_value=0.0, max_value=3.0)),
        "activation_bytes": draw(_bytes),
        "param_bytes": draw(_bytes),
        "output_bytes": draw(_bytes),
    }
    if kind:
        out["kind"] = kind
    return out


@st.composite
def problem_docs(draw: st.DrawFn) -> dict[str, Any]:
    body = draw(st.integers(min_value=1, max_value=12))
    layers = [draw(layer(name=f"l{i}")) for i in range(body)]
    if draw(st.booleans()):
        layers.insert(0, draw(layer(name="embedding", kind="embedding")))
    if draw(st.booleans()):
        layers.append(draw(layer(name="head", kind="head")))
    count = draw(st.integers(min_value=1, max_value=8))
    memory = draw(st.one_of(st.none(), st.floats(min_value=5e8, max_value=4e10)))
    if draw(st.booleans()):
        devices: dict[str, Any] = {"count": count, "per_node": draw(st.integers(min_value=1, max_value=4))}
        if memory is not None:
            devices["memory_bytes"] = memory
    else:
        devices = {
            "list": [
                {
                    "node": f"n{draw(st.integers(min_value=0, max_value=2))}",
                    "speed": draw(st.floats(min_value=0.25, max_value=3.0)),
                    **({"memory_bytes": memory} if memory is not None else {}),
                }
                for _ in range(count)
            ]
        }
    doc: dict[str, Any] = {
        "microbatches": draw(st.integers(min_value=1, max_value=16)),
        "layers": layers,
        "devices": devices,
    }
    if draw(st.booleans()):
        link = {"bandwidth_bytes_per_s": draw(st.floats(min_value=1e9, max_value=1e12)),
                "latency_s": draw(st.floats(min_value=0.0, max_value=1e-3))}
        doc["network"] = {"inter_node": link, **({"intra_node": link} if draw(st.booleans()) else {})}
    if draw(st.booleans()):  # tensor parallelism: each device a group of T ranks
        doc["tensor_parallel"] = draw(st.integers(min_value=2, max_value=4))
        for lay in layers:
            lay["tensor_split"] = draw(st.floats(min_value=0.0, max_value=1.0))
            lay["tensor_all_reduces"] = draw(st.integers(min_value=0, max_value=3))
        doc.setdefault("network", {})["tensor"] = {
            "bandwidth_bytes_per_s": draw(st.floats(min_value=1e10, max_value=1e12)),
            "latency_s": draw(st.floats(min_value=0.0, max_value=1e-4))}
    return doc


def problems() -> st.SearchStrategy[Costs]:
    return problem_docs().map(lambda doc: Costs.from_problem(parse_problem(doc)))


def _check_plan(costs: Costs, plan: Plan, sim: Simulation) -> None:
    m = costs.microbatches
    n_st = len(plan.stages)
    owner = plan.stage_device()
    sc = costs.stage_costs(plan.stages)
    # Each action exactly once (B and W, or one fused BW, per stage and microbatch).
    seen = Counter((a.kind, a.stage, a.microbatch) for tl in sim.timeline for a in tl)
    assert sum(seen.values()) == sum(len(a) for a in plan.actions)
    for s in range(n_st):
        for mb in range(m):
            assert seen[("F", s, mb)] == 1
            fused = seen[("BW", s, mb)]
            assert fused in (0, 1)
            assert seen[("B", s, mb)] == seen[("W", s, mb)] == 1 - fused
    timed = {(a.kind, a.stage, a.microbatch): a for tl in sim.timeline for a in tl}

    def back(s: int, mb: int) -> Any:
        return timed.get(("B", s, mb)) or timed[("BW", s, mb)]

    def hop(s: int) -> float:  # stage s-1 -> s (and the gradient back)
        return costs.transfer_time(owner[s - 1], owner[s], nbytes=sc.output_bytes[s - 1])

    for (kind, s, mb), a in timed.items():
        d = owner[s]
        dur = {"F": sc.forward[s], "B": sc.backward[s], "W": sc.weight[s], "BW": sc.backward[s] + sc.weight[s]}
        assert math.isclose(a.end - a.start, dur[kind] / costs.speed[d], rel_tol=1e-9, abs_tol=EPS)
        if kind == "F" and s > 0:
            assert a.start >= timed[("F", s - 1, mb)].end + hop(s) - EPS
        if kind in ("B", "BW"):
            assert a.start >= timed[("F", s, mb)].end - EPS
            if s + 1 < n_st:
                assert a.start >= back(s + 1, mb).end + hop(s + 1) - EPS
        if kind == "W":
            assert a.start >= timed[("B", s, mb)].end - EPS
    for d, tl in enumerate(sim.timeline):
        assert [(a.kind, a.stage, a.microbatch) for a in tl] == [tuple(x) for x in plan.actions[d]]
        for prev, nxt in itertools.pairwise(tl):
            assert nxt.start >= prev.end - EPS
        # Peak memory: parameters + activations from F start to W/BW end, frees first on ties.
        events = []
        for a in tl:
            if a.kind == "F":
                events.append((a.start, 1, sc.activation_bytes[a.stage]))
            elif a.kind in ("W", "BW"):
                events.append((a.end, 0, -sc.activation_bytes[a.stage]))
        cur = peak = 0.0
        for _, _, delta in sorted(events):
            cur += delta
            peak = max(peak, cur)
        params = sum(sc.param_bytes[s] for s in plan.placement[d])
        assert math.isclose(sim.peak_memory[d], params + peak, rel_tol=1e-9, abs_tol=1.0)
    fits = all(sim.peak_memory[d] <= costs.memory[d] * (1 + 1e-9) for d in range(costs.devices))
    assert sim.feasible == fits
    assert sim.iteration_time == max((tl[-1].end for tl in sim.timeline if tl), default=0.0)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_every_baseline_plan_is_correct(costs: Costs) -> None:
    for name, make in BASELINES.items():
        try:
            plan = make(costs)
        except PlannerError as err:
            # The only refusal: a 2-chunk strategy on a model of a single layer.
            assert name in ("i1f1b", "zb-v") and costs.layers < 2, (name, err)
            continue
        assert plan.strategy == name and plan.microbatches == costs.microbatches
        plan.check(layers=costs.layers, microbatches=costs.microbatches, devices=costs.devices)
        sim = simulate(costs, plan)  # raises DeadlockError on a deadlock
        _check_plan(costs, plan, sim)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_zero_bubble_h1_is_never_slower_than_1f1b(costs: Costs) -> None:
    """Same partition and memory: splitting B from W can only help (else the baseline is weak)."""
    plain = simulate(costs, BASELINES["1f1b"](costs))
    split = simulate(costs, BASELINES["zb-h1"](costs))
    if plain.feasible:
        assert split.feasible
        assert split.iteration_time <= plain.iteration_time * (1 + 1e-9)


@settings(max_examples=150, deadline=None)
@given(problems(), st.integers(min_value=1, max_value=8), st.booleans())
def test_balanced_partition_is_never_worse_than_megatron(costs: Costs, parts: int, use_speed: bool) -> None:
    parts = min(parts, costs.layers)
    speeds = [1.0 + (i % 3) * 0.5 for i in range(parts)] if use_speed else None
    stages = balanced_partition(costs, stages_count=parts, speeds=speeds)
    assert stages[0][0] == 0 and stages[-1][1] == costs.layers
    assert all(lo < hi for lo, hi in stages)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(stages))
    reference = megatron_partition(costs, stages_count=parts)
    assert bottleneck(costs, stages, speeds=speeds) <= bottleneck(costs, reference, speeds=speeds) * (1 + 1e-9)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem_docs())
def test_no_plan_of_any_strategy_beats_the_lower_bound(doc: dict[str, Any]) -> None:
    """The granularity-aware bound is still a bound: adaptis (V-shape, looped, packed,
    non-contiguous placements) and every baseline end at or after it."""
    comparison, _ = compare(parse_problem(doc))
    costs = Costs.from_problem(parse_problem(doc))
    assert comparison.lower_bound >= pipeline_bound(costs)
    for name, res in comparison.strategies.items():
        # The bound knows memory: it bounds the plans that fit, not an over-memory baseline's.
        if res.feasible and res.iteration_time is not None:
            assert res.iteration_time >= comparison.lower_bound * (1 - 1e-9), (name, res.iteration_time)


@settings(max_examples=150, deadline=None)
@given(problems(), st.integers(min_value=1, max_value=8), st.booleans())
def test_spread_partition_keeps_the_bottleneck_and_evens_the_rest(costs: Costs, parts: int, use_speed: bool) -> None:
    parts = min(parts, costs.layers)
    speeds = [1.0 + (i % 3) * 0.5 for i in range(parts)] if use_speed else None
    first = balanced_partition(costs, stages_count=parts, speeds=speeds)
    even = balanced_partition(costs, stages_count=parts, speeds=speeds, spread=True)
    assert even[0][0] == 0 and even[-1][1] == costs.layers and all(lo < hi for lo, hi in even)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(even))
    assert bottleneck(costs, even, speeds=speeds) <= bottleneck(costs, first, speeds=speeds) * (1 + 1e-9)

    def squares(stages: list[tuple[int, int]]) -> float:
        work = costs.layer_work()
        v = speeds or [1.0] * parts
        return sum((sum(work[lo:hi]) / v[i]) ** 2 for i, (lo, hi) in enumerate(stages))

    assert squares(even) <= squares(first) * (1 + 1e-9) + 1e-12


def test_spread_partition_leaves_no_idle_tail() -> None:
    """10 equal layers on 4 stages: the greedy fills 3, 3, 3, 1; spread gives two stages 2."""
    doc = {"microbatches": 1, "devices": {"count": 4},
           "layers": [{"name": f"l{i}", "forward": 1.0, "backward": 1.0, "weight": 1.0} for i in range(10)]}
    costs = Costs.from_problem(parse_problem(doc))
    assert [hi - lo for lo, hi in balanced_partition(costs, stages_count=4)] == [3, 3, 3, 1]
    sizes = sorted(hi - lo for lo, hi in balanced_partition(costs, stages_count=4, spread=True))
    assert sizes == [2, 2, 3, 3]
