"""Screening (issue 13 item 4): large problems ranked from schedules of p and 2p microbatches.

What must hold: the estimate tracks the full schedule on the scale workload's shape; the
paper-sized problems are never screened (their plans stay as they were); a screened search
returns only candidates it scheduled in full, so every plan replays at exactly the time it
reports and within memory, on random problems with mixed speeds and tight memory (screening
forced on by lowering ``SCREEN_ABOVE``); and ``plan_strategy(..., "adaptis")`` seeds from the
one-order baselines only; ``adaptis plan`` has a default time limit (``none`` lifts it).
"""

from __future__ import annotations

import math
from typing import Any
from unittest import mock

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adaptis.api.plan import Plan
from adaptis.api.problem import parse_problem
from adaptis.cli import main
from adaptis.planner import baselines, screening, strategies
from adaptis.planner.costs import Costs
from adaptis.planner.partition import balanced_partition
from adaptis.planner.scheduler import Policy, list_schedule
from adaptis.planner.screening import Screen
from adaptis.planner.search import joint_search
from adaptis.planner.simulator import simulate
from adaptis.planner.strategies import SEEDS, plan_strategy
from adaptis.planner.structures import loads, patterns, prefix_work


def _scale_like(devices: int, microbatches: int) -> dict[str, Any]:
    """The scale workload's shape, small: a cheap embedding, mamba-like blocks with an
    attention-like one every sixth, a heavy head; 6 blocks a device."""
    body = []
    for i in range(6 * devices):
        heavy = i % 6 == 5
        body.append({"name": f"b{i}", "forward": 3.1 if heavy else 1.0, "backward": 5.0 if heavy else 2.8,
                     "weight": 0.5 if heavy else 0.02, "activation_bytes": 1.4e8, "param_bytes": 2e8,
                     "output_bytes": 8e6})
    layers = [{"name": "embedding", "kind": "embedding", "forward": 0.02, "weight": 0.02,
               "param_bytes": 1e9, "output_bytes": 8e6},
              *body,
              {"name": "head", "kind": "head", "forward": 40.0, "backward": 10.3, "weight": 3.2,
               "activation_bytes": 4e9, "param_bytes": 1e10}]
    return {"name": "scale-like", "microbatches": microbatches, "layers": layers,
            "devices": {"count": devices, "per_node": 8, "memory_bytes": 8e10},
            "network": {"intra_node": {"bandwidth_bytes_per_s": 4e11, "latency_s": 5e-6},
                        "inter_node": {"bandwidth_bytes_per_s": 2.5e10, "latency_s": 2e-5}}}


def _replayed(costs: Costs, *, stages: list[tuple[int, int]], owner: list[int],
              actions: tuple[tuple[tuple[str, int, int], ...], ...]) -> Any:
    placement = [[s for s, d in enumerate(owner) if d == dev] for dev in range(costs.devices)]
    plan = Plan.model_construct(stages=stages, placement=placement, actions=[list(a) for a in actions])
    return simulate(costs, plan)


def test_problems_up_to_the_papers_largest_are_never_screened() -> None:
    # 16 x 128 is the paper's largest: scheduled in full, plans unchanged by screening.
    assert Screen.of(Costs.from_problem(parse_problem(_scale_like(16, 128)))) is None
    # Too few microbatches for the extrapolation to save anything: also in full.
    assert Screen.of(Costs.from_problem(parse_problem(_scale_like(48, 96)))) is None
    screen = Screen.of(Costs.from_problem(parse_problem(_scale_like(24, 96))))
    assert screen is not None
    assert (screen.small.microbatches, screen.large.microbatches, screen.microbatches) == (24, 48, 96)


@pytest.mark.parametrize("looped", [1, 2])
def test_the_estimate_tracks_the_full_schedule(looped: int) -> None:
    costs = Costs.from_problem(parse_problem(_scale_like(24, 192)))
    screen = Screen.of(costs)
    assert screen is not None
    owner = dict(patterns(costs))[f"looped-v{looped}"]
    stages = balanced_partition(costs, stages_count=len(owner))
    cuts = [lo for lo, _ in stages] + [stages[-1][1]]
    busiest = max(loads(costs, owner, cuts=cuts, pre=prefix_work(costs)))
    policy = Policy(admit_per_device=True)
    est = screen.estimate(stages=stages, owner=owner, policy=policy, busiest=busiest,
                          beat=math.inf, deadline=None)
    full = list_schedule(costs, stages=stages, owner=owner, policy=policy).iteration_time
    # Measured: +0.0 % (v1), +2.0 % (v2, per-device admission); the p-microbatch schedule alone
    # is 5.8-6x below the full one.
    assert abs(est / full - 1) < 0.03, (est, full)


def test_a_screened_search_returns_a_plan_scheduled_in_full() -> None:
    costs = Costs.from_problem(parse_problem(_scale_like(24, 96)))
    assert Screen.of(costs) is not None
    found = joint_search(costs)
    assert found is not None and found.schedule.feasible
    sim = _replayed(costs, stages=found.stages, owner=found.owner, actions=found.schedule.actions)
    assert sim.iteration_time == found.schedule.iteration_time


@st.composite
def _screened_docs(draw: st.DrawFn) -> dict[str, Any]:
    count = draw(st.integers(min_value=2, max_value=5))
    layers = [{"name": f"l{i}", "forward": draw(st.floats(min_value=0.1, max_value=4.0)),
               "backward": draw(st.floats(min_value=0.0, max_value=6.0)),
               "weight": draw(st.floats(min_value=0.0, max_value=2.0)),
               "activation_bytes": draw(st.floats(min_value=1e6, max_value=2e9)),
               "param_bytes": draw(st.floats(min_value=1e6, max_value=4e9)),
               "output_bytes": draw(st.floats(min_value=0.0, max_value=1e8))}
              for i in range(draw(st.integers(min_value=count, max_value=4 * count)))]
    memory = draw(st.one_of(st.none(), st.floats(min_value=1e10, max_value=6e10)))
    devices = [{"node": f"n{d // 2}", "speed": draw(st.sampled_from((0.6, 0.8, 1.0, 1.4))),
                **({"memory_bytes": memory} if memory is not None else {})} for d in range(count)]
    return {"name": "screened", "layers": layers, "devices": {"list": devices},
            "microbatches": draw(st.integers(min_value=4 * count, max_value=6 * count)),
            "network": {"intra_node": {"bandwidth_bytes_per_s": 1e11, "latency_s": 1e-5},
                        "inter_node": {"bandwidth_bytes_per_s": 1e10, "latency_s": 1e-4}}}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_screened_docs())
def test_screened_plans_replay_at_their_time_and_within_memory(doc: dict[str, Any]) -> None:
    costs = Costs.from_problem(parse_problem(doc))
    with mock.patch.object(screening, "SCREEN_ABOVE", 0):  # screen these small problems too
        assert Screen.of(costs) is not None
        found = joint_search(costs)
    if found is None:  # nothing fits in memory: the fallback's business, not screening's
        return
    sim = _replayed(costs, stages=found.stages, owner=found.owner, actions=found.schedule.actions)
    assert sim.feasible, sim.reason
    assert math.isclose(sim.iteration_time, found.schedule.iteration_time, rel_tol=1e-12)
    for d, peak in enumerate(sim.peak_memory):
        assert peak <= costs.memory[d] * (1 + 1e-9)


def test_adaptis_alone_seeds_from_the_one_order_baselines(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[str] = []
    for name, make in list(baselines.BASELINES.items()):
        def counting(costs: Costs, *, deadline: float | None = None, _n: str = name, _m: Any = make) -> Plan:
            ran.append(_n)
            return _m(costs, deadline=deadline)
        monkeypatch.setitem(baselines.BASELINES, name, counting)
    out = plan_strategy(parse_problem(_scale_like(4, 16)), "adaptis")
    assert out.result.feasible
    assert sorted(ran) == sorted(SEEDS)


@pytest.mark.parametrize(("flag", "want"), [([], 60.0), (["--time-limit", "none"], None),
                                            (["--time-limit", "7.5"], 7.5)])
def test_adaptis_plan_has_a_default_time_limit(monkeypatch: pytest.MonkeyPatch, flag: list[str],
                                               want: float | None, tmp_path: Any) -> None:
    seen: list[float | None] = []
    real = strategies.plan_strategy

    def spy(problem: Any, name: str, **kw: Any) -> Any:
        seen.append(kw.get("time_limit_s"))
        return real(problem, name, **kw)

    monkeypatch.setattr(strategies, "plan_strategy", spy)
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(_scale_like(2, 4)))
    assert main(["plan", str(path), "--json", *flag]) == 0
    assert seen == [want]
