"""Drift detection and the re-plan decision (adaptis.planner.drift), on a synthetic 4-device
problem whose measured busy times are the model's own predictions with one device slowed.
"""

from __future__ import annotations

import pytest

from adaptis.api.plan import Plan
from adaptis.api.problem import Problem, parse_problem
from adaptis.planner.drift import DriftWindow, corrected_problem, decide, predicted_busy
from adaptis.planner.errors import PlannerError
from adaptis.planner.strategies import plan_strategy


def _problem() -> Problem:
    layer = {"name": "block", "forward": 1.0, "backward": 1.0, "weight": 1.0,
             "activation_bytes": 1e6, "param_bytes": 1e6, "output_bytes": 1e5}
    return parse_problem({
        "time_unit": "ms", "microbatches": 8,
        "layers": [{"repeat": 16, "layers": [layer]}],
        "devices": {"count": 4, "per_node": 4},
        "network": {"intra_node": {"bandwidth_bytes_per_s": 1e11}},
    })


def _running(window_steps: int, *, replicas: int = 1) -> tuple[Problem, Plan, list[float], DriftWindow]:
    """The problem, its 1F1B plan, the plan's predicted busy seconds and an empty window."""
    problem = _problem()
    plan = plan_strategy(problem, "1f1b").plan
    busy = predicted_busy(problem, plan)
    return problem, plan, busy, DriftWindow(predicted=busy, window_steps=window_steps, replicas=replicas)


def _feed(window: DriftWindow, *, per_step: list[float], steps: range, start: list[float] | None = None,
           ) -> list[float]:
    totals = list(start or [0.0] * len(per_step))
    for step in steps:
        totals = [t + p for t, p in zip(totals, per_step, strict=True)]
        window.observe(step=step, busy_seconds_total=totals)
    return totals


def test_slow_device_is_detected_and_replan_moves_work_off_it() -> None:
    problem, plan, busy, window = _running(10)
    _feed(window, per_step=[b * (2.0 if d == 1 else 1.0) for d, b in enumerate(busy)], steps=range(1, 12))
    drift = window.drift(threshold=0.15)
    assert drift is not None and drift.worst == 1
    assert drift.ratios[1] == pytest.approx(2.0) and drift.ratios[0] == pytest.approx(1.0)
    decision = decide(problem, plan, drift=drift, strategy="adaptis", remaining_steps=1000,
                      restart_seconds=1.0, min_gain=0.05)
    assert decision.replan, decision.reason
    # The slowed device had 4 of 16 layers; the new plan gives it fewer.
    layers_on = [sum(end - first for s, (first, end) in enumerate(decision.plan.stages)
                     if s in decision.plan.placement[d]) for d in range(4)]
    assert layers_on[1] < 4, layers_on
    # The old plan on the corrected problem is as slow as the slowed device makes it.
    assert decision.old_iteration_seconds > 1.5 * plan.predicted.iteration_time * 1e-3
    assert decision.gain > 0.15


def test_uniform_model_error_is_not_drift() -> None:
    _, _plan, busy, window = _running(10)
    _feed(window, per_step=[b * 1.3 for b in busy], steps=range(1, 12))
    assert window.drift(threshold=0.15) is None


def test_one_slow_step_is_not_sustained_drift() -> None:
    _, _plan, busy, window = _running(10)
    totals = _feed(window, per_step=busy, steps=range(1, 10))
    totals = _feed(window, per_step=[b * (6.0 if d == 2 else 1.0) for d, b in enumerate(busy)],
                   steps=range(10, 11), start=totals)
    _feed(window, per_step=busy, steps=range(11, 13), start=totals)
    assert window.drift(threshold=0.15) is None


def test_window_waits_until_full_and_restarts_when_counters_reset() -> None:
    _, _, busy, window = _running(10)
    slow = [b * (2.0 if d == 3 else 1.0) for d, b in enumerate(busy)]
    _feed(window, per_step=slow, steps=range(1, 10))
    assert window.drift(threshold=0.15) is None  # 9 samples: 8 steps, not yet a window
    _feed(window, per_step=slow, steps=range(1, 5))  # a restart: steps and counters from 0
    assert window.drift(threshold=0.15) is None
    _feed(window, per_step=slow, steps=range(5, 12), start=[s * 4 for s in slow])
    assert window.drift(threshold=0.15) is not None


def test_slowest_replica_counts_for_its_pipeline_device() -> None:
    _, _, busy, window = _running(4, replicas=2)
    # Replica 1's device 0 (global rank 4) is slow; replica 0's is not.
    _feed(window, per_step=busy + [b * (1.8 if d == 0 else 1.0) for d, b in enumerate(busy)],
          steps=range(1, 6))
    drift = window.drift(threshold=0.15)
    assert drift is not None and drift.worst == 0 and drift.ratios[0] == pytest.approx(1.8)


def test_small_gain_or_short_remaining_run_does_not_restart() -> None:
    problem, plan, busy, window = _running(4)
    _feed(window, per_step=[b * (2.0 if d == 1 else 1.0) for d, b in enumerate(busy)], steps=range(1, 6))
    drift = window.drift(threshold=0.15)
    few = decide(problem, plan, drift=drift, strategy="adaptis", remaining_steps=3,
                 restart_seconds=60.0, min_gain=0.05)
    assert not few.replan and "restart" in few.reason
    greedy = decide(problem, plan, drift=drift, strategy="adaptis", remaining_steps=10**6,
                    restart_seconds=1.0, min_gain=0.9)
    assert not greedy.replan and "minGain" in greedy.reason


def test_corrected_problem_scales_speeds_and_refuses_bad_ratios() -> None:
    problem = _problem()
    fixed = corrected_problem(problem, ratios=[1.0, 2.0, 1.0, 0.5])
    assert [d.speed for d in fixed.device_specs()] == [1.0, 0.5, 1.0, 2.0]
    assert [d.node for d in fixed.device_specs()] == [d.node for d in problem.device_specs()]
    with pytest.raises(PlannerError, match="4 devices"):
        corrected_problem(problem, ratios=[1.0])
    with pytest.raises(PlannerError, match="positive"):
        corrected_problem(problem, ratios=[1.0, 0.0, 1.0, 1.0])
    with pytest.raises(PlannerError, match="window_steps"):
        DriftWindow(predicted=[1.0], window_steps=1)


def test_an_idle_device_takes_the_median_ratio_and_the_busy_ones_are_still_watched() -> None:
    busy = [1.0, 0.0, 2.0, 1.5]  # device 1 idle: nothing to measure
    window = DriftWindow(predicted=busy, window_steps=4)
    _feed(window, per_step=[b * 1.2 for b in busy], steps=range(1, 6))
    assert window.ratios() == pytest.approx([1.2, 1.2, 1.2, 1.2])
    assert window.drift(threshold=0.15) is None  # uniform: the idle device adds no deviation
    window = DriftWindow(predicted=busy, window_steps=4)
    _feed(window, per_step=[b * (3.0 if d == 3 else 1.0) for d, b in enumerate(busy)], steps=range(1, 6))
    drift = window.drift(threshold=0.15)
    assert drift is not None and drift.worst == 3 and drift.ratios[1] == pytest.approx(1.0)
    with pytest.raises(PlannerError, match="at least one device busy"):
        DriftWindow(predicted=[0.0, 0.0], window_steps=4)
