"""The performance model on hand-made plans with answers worked out by hand.

test_planner_properties.py checks every baseline's timeline against the model's rules on random
problems; these pin exact figures (issue 18: mutation testing of simulator.py).
"""

from __future__ import annotations

import pytest

from adaptis.api.plan import Plan
from adaptis.api.problem import parse_problem
from adaptis.planner.costs import Costs
from adaptis.planner.errors import DeadlockError
from adaptis.planner.simulator import simulate


def _costs(**devices: object) -> Costs:
    return Costs.from_problem(parse_problem({
        "microbatches": 1,
        "layers": [{"name": "a", "forward": 1.0, "backward": 2.0, "weight": 0.5},
                   {"name": "b", "forward": 1.0, "backward": 2.0, "weight": 0.5}],
        "devices": devices or {"count": 2},
    }))


def test_a_two_stage_plan_has_the_times_and_bubbles_worked_out_by_hand() -> None:
    plan = Plan(stages=[(0, 1), (1, 2)], placement=[[0], [1]],
                actions=[[("F", 0, 0), ("B", 0, 0), ("W", 0, 0)],
                         [("F", 1, 0), ("B", 1, 0), ("W", 1, 0)]])
    sim = simulate(_costs(), plan)
    # Device 1: F 1-2, B 2-4, W 4-4.5. Device 0: F 0-1, waits for stage 1's gradient until 4;
    # the first stage has no input gradient, so its B costs nothing and W holds it all: 4-6.5.
    assert [t for a in sim.timeline[0] for t in (a.start, a.end)] == pytest.approx(
        [0.0, 1.0, 4.0, 4.0, 4.0, 6.5])
    assert [t for a in sim.timeline[1] for t in (a.start, a.end)] == pytest.approx(
        [1.0, 2.0, 2.0, 4.0, 4.0, 4.5])
    assert sim.iteration_time == pytest.approx(6.5)
    assert sim.busy == pytest.approx((3.5, 3.5))
    assert sim.bubble_ratio == pytest.approx(1 - 7.0 / 13.0)
    assert sim.bubble == pytest.approx((3.0, 3.0))
    assert sim.warmup_bubble == pytest.approx((0.0, 1.0))
    assert sim.cooldown_bubble == pytest.approx((0.0, 2.0))
    # What is idle between the first action and the last: device 0 waits 1-4, device 1 never.
    assert sim.steady_bubble == pytest.approx((3.0, 0.0))
    assert sim.feasible and sim.reason is None


def test_times_scale_with_the_costs_even_when_every_action_ends_before_one_unit() -> None:
    # The model has no unit of its own: an action ending at 0.04 is as finished as one at 4.
    doc = {"microbatches": 1, "devices": {"count": 2},
           "layers": [{"name": n, "forward": 0.01, "backward": 0.02, "weight": 0.005}
                      for n in ("a", "b")]}
    plan = Plan(stages=[(0, 1), (1, 2)], placement=[[0], [1]],
                actions=[[("F", 0, 0), ("B", 0, 0), ("W", 0, 0)],
                         [("F", 1, 0), ("B", 1, 0), ("W", 1, 0)]])
    sim = simulate(Costs.from_problem(parse_problem(doc)), plan)
    assert sim.iteration_time == pytest.approx(0.065)
    assert [t for a in sim.timeline[0] for t in (a.start, a.end)] == pytest.approx(
        [0.0, 0.01, 0.04, 0.04, 0.04, 0.065])


def test_each_action_pays_the_fixed_overhead_once() -> None:
    doc = {"microbatches": 1, "devices": {"count": 1}, "action_overhead_s": 1e-4,
           "layers": [{"name": "a", "forward": 1.0, "backward": 2.0, "weight": 0.5}]}
    plan = Plan(stages=[(0, 1)], placement=[[0]], actions=[[("F", 0, 0), ("B", 0, 0), ("W", 0, 0)]])
    sim = simulate(Costs.from_problem(parse_problem(doc)), plan)
    # Layer times are in ms (the default time unit): 0.1 ms of overhead. F 0-1.1; the single
    # stage's B has no input gradient: 1.1-1.2; W does the whole backward: 1.2-3.8.
    assert [t for a in sim.timeline[0] for t in (a.start, a.end)] == pytest.approx(
        [0.0, 1.1, 1.1, 1.2, 1.2, 3.8])


def test_a_deadlock_names_each_stuck_device_and_what_it_waits_on() -> None:
    doc = {"microbatches": 1, "devices": {"count": 3},
           "layers": [{"name": f"l{i}", "forward": 1.0, "backward": 2.0, "weight": 0.5}
                      for i in range(3)]}
    # Device 1 puts W before its B: it waits for itself, and device 0 for device 1's gradient.
    # Device 2 finishes its list.
    plan = Plan(stages=[(0, 1), (1, 2), (2, 3)], placement=[[0], [1], [2]],
                actions=[[("F", 0, 0), ("B", 0, 0), ("W", 0, 0)],
                         [("F", 1, 0), ("W", 1, 0), ("B", 1, 0)],
                         [("F", 2, 0), ("B", 2, 0), ("W", 2, 0)]])
    with pytest.raises(DeadlockError) as caught:
        simulate(Costs.from_problem(parse_problem(doc)), plan)
    assert str(caught.value) == (
        "plan deadlocks: device 0 waits on ('B', 0, 0), device 1 waits on ('W', 1, 0)")
    assert caught.value.waiting == (("B", 0, 0), ("W", 1, 0), None)


def _memory_case(caps: tuple[float, float]) -> tuple[Costs, Plan]:
    doc = {"microbatches": 2,
           "devices": {"list": [{"node": "n0", "memory_bytes": caps[0]},
                                {"node": "n0", "memory_bytes": caps[1]}]},
           "layers": [{"name": "a", "forward": 1.0, "backward": 2.0, "weight": 0.5,
                       "activation_bytes": 100.0, "param_bytes": 1000.0},
                      {"name": "b", "forward": 1.0, "backward": 2.0, "weight": 0.5,
                       "activation_bytes": 200.0, "param_bytes": 2000.0}]}
    plan = Plan(stages=[(0, 1), (1, 2)], placement=[[0], [1]], actions=[
        [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("W", 0, 0), ("B", 0, 1), ("W", 0, 1)],
        [("F", 1, 0), ("B", 1, 0), ("W", 1, 0), ("F", 1, 1), ("B", 1, 1), ("W", 1, 1)]])
    return Costs.from_problem(parse_problem(doc)), plan


def test_peak_memory_is_parameters_plus_the_activations_held_at_once() -> None:
    # Device 0 holds both microbatches' activations before its first W; device 1 frees each
    # before the next F. A device with exactly its peak fits.
    sim = simulate(*_memory_case((1200.0, 2200.0)))
    assert sim.peak_memory == (1200.0, 2200.0)
    assert sim.feasible and sim.reason is None


def test_a_plan_over_any_devices_memory_is_infeasible_naming_the_worst_and_the_count() -> None:
    sim = simulate(*_memory_case((1199.0, 2199.0)))
    assert not sim.feasible
    # Device 0 is over by 1/1199, device 1 by 1/2199: the worst is by ratio, not by bytes.
    assert sim.reason == ("device 0 needs 1200 bytes, has 1199 bytes (1.00x), "
                          "the worst of all 2 devices, each over memory")
    sim = simulate(*_memory_case((1200.0, 2199.0)))
    assert sim.reason == "device 1 needs 2200 bytes, has 2199 bytes (1.00x), the only device over memory"
