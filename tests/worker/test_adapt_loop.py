"""The decision half of ``adaptis run``'s loop (adaptis.cli.adapt.Adapter) on synthetic step
events, and the slowdown knob's timer (adaptis.worker.runtime.slowdown): fast, no processes.

The events are what the ranks would report if device 1 ran at half its profiled speed; the
planner and the drift window are the real ones.
"""

from __future__ import annotations

import time

import pytest
from worker_harness import step_event

from adaptis.api.adaptation import AdaptationSpec
from adaptis.api.plan import STRATEGY_NAMES
from adaptis.api.problem import Problem, parse_problem
from adaptis.cli.adapt import Adapter, Segment, layers_per_device
from adaptis.planner.drift import idle_devices, predicted_busy
from adaptis.planner.strategies import plan_strategy
from adaptis.worker.runtime.slowdown import Slowdown, SlowedTimer, parse_slowdown, slowed
from adaptis.worker.runtime.timers import WallActionTimer

DEVICES = 4


def _problem() -> Problem:
    layer = {"name": "block", "forward": 1.0, "backward": 1.0, "weight": 1.0,
             "activation_bytes": 1e6, "param_bytes": 1e6, "output_bytes": 1e5}
    return parse_problem({
        "time_unit": "ms", "microbatches": 8, "layers": [{"repeat": 16, "layers": [layer]}],
        "devices": {"count": DEVICES, "per_node": 4},
        "network": {"intra_node": {"bandwidth_bytes_per_s": 1e11}},
    })


def _adapter(policy: str, *, max_replans: int = 3, said: list[str] | None = None) -> Adapter:
    problem = _problem()
    plan = plan_strategy(problem, "1f1b").plan
    spec = AdaptationSpec(policy=policy, window_steps=4, min_gain=0.05, max_replans=max_replans)
    return Adapter(problem=problem, plan=plan, spec=spec, strategy="adaptis", total_steps=100_000, replicas=1,
                   ranks=DEVICES, time_limit_s=None, say=(said if said is not None else []).append)


def _feed(adapter: Adapter, *, steps: range, slow: float = 2.0) -> list[bool]:
    """Every rank's step events, device 1 ``slow`` times its predicted compute; the stops asked."""
    busy = predicted_busy(adapter.problem, adapter.plan)
    seg = Segment(plan=adapter.plan, launched_at=0.0)
    stops = []
    for step in steps:
        seg.steps.append(step_event(step=step, iteration_seconds=1.0))
        for rank in range(DEVICES):
            total = step * busy[rank] * (slow if rank == 1 else 1.0)
            stops.append(adapter.observe(step_event(rank=rank, step=step, busy_seconds_total=total),
                                         segment=seg, restart_seconds=10.0))
    return stops


def test_auto_stops_the_ranks_once_for_a_plan_that_unloads_the_slow_device() -> None:
    said: list[str] = []
    adapter = _adapter("auto", said=said)
    stops = _feed(adapter, steps=range(1, 20))
    assert stops.count(True) == 1  # then it waits for the relaunch: nothing more is decided
    assert adapter.pending is not None and adapter.pending.plan is not None
    [record] = adapter.history
    assert record.action == "applied" and record.device_speed[1] == pytest.approx(0.5, rel=1e-3)
    assert record.new_predicted_iteration_seconds < record.old_predicted_iteration_seconds
    assert layers_per_device(adapter.pending.plan)[1] < 4  # of 16 layers on 4 devices
    assert any("adaptation re-planning at step" in s for s in said)
    # The relaunch under the new plan, for the corrected problem: the same slowdown is now the
    # prediction, so the loop stays quiet.
    adapter.start(problem=adapter.pending.problem, plan=adapter.pending.plan)
    assert not any(_feed(adapter, steps=range(30, 50), slow=1.0))


def test_suggest_and_auto_past_max_replans_only_record_a_suggestion() -> None:
    for policy, max_replans in (("suggest", 3), ("auto", 0)):
        said: list[str] = []
        adapter = _adapter(policy, max_replans=max_replans, said=said)
        assert not any(_feed(adapter, steps=range(1, 40)))
        # Every window finds the same plan again: said once, not every window.
        assert sum(s.startswith("adaptation suggestion") for s in said) == 1, said
        assert adapter.history == [] and adapter.pending is None
        assert adapter.suggestion is not None and adapter.suggestion.action == "suggested"
        report = adapter.report()
        assert report["suggestion"]["stages"] is not None and report["measured_ratio"][1] == pytest.approx(2.0)


def test_off_never_compares() -> None:
    adapter = _adapter("off")
    assert adapter.window is None
    assert not any(_feed(adapter, steps=range(1, 20), slow=5.0))
    assert adapter.history == [] and adapter.suggestion is None and adapter.report()["measured_ratio"] == []


def test_slowdown_entries_parse_and_bad_ones_are_named() -> None:
    assert parse_slowdown("1:3@5, 0:1.5@1") == {1: Slowdown(rank=1, factor=3.0, step=5),
                                                0: Slowdown(rank=0, factor=1.5, step=1)}
    assert parse_slowdown("") == {}
    for bad, says in (("1:3", "bad entry '1:3'"), ("x:2@1", "RANK:FACTOR@STEP"), ("1:0.5@1", "between 1 and 100"),
                      ("1:2@0", "step >= 1"), ("1:2@1,1:3@2", "rank 1 appears twice")):
        with pytest.raises(ValueError, match=says):
            parse_slowdown(bad)


def test_the_slowed_rank_counts_its_sleep_as_busy_time_from_its_step_on() -> None:
    timer = slowed(WallActionTimer(), rank=1, environ={"ADAPTIS_SLOWDOWN": "1:3@2"})
    assert isinstance(timer, SlowedTimer)
    assert not isinstance(slowed(WallActionTimer(), rank=0, environ={"ADAPTIS_SLOWDOWN": "1:3@2"}), SlowedTimer)

    def action(step: int) -> tuple[float, float]:
        timer.reset(step=step)
        with timer.measure("F"):
            inner = time.perf_counter()
            time.sleep(0.05)
            inner = time.perf_counter() - inner
        return timer.collect()["F"], inner

    busy, inner = action(1)
    assert busy < 2 * inner  # not slowed yet
    busy, inner = action(2)
    assert busy >= 3 * inner * 0.999  # the sleep is inside the timed action: the counter grows by the factor


def test_a_plan_that_idles_the_slow_device_is_taken_when_it_is_the_best() -> None:
    adapter = _adapter("auto")
    # 20x slower: the joint search leaves device 1 without a stage. The workers run such a plan
    # (tests/worker/test_worker_idle_ranks.py), so decide takes it: no other strategy's stands in.
    assert _feed(adapter, steps=range(1, 20), slow=20.0).count(True) == 1
    pending = adapter.pending
    assert pending is not None and pending.plan is not None
    assert idle_devices(pending.plan) == [1] and layers_per_device(pending.plan)[1] == 0
    assert "the new plan idles device(s) [1]" in adapter.history[0].reason
    # It is the adaptis strategy's own plan of the corrected problem, and the best of them all.
    best = plan_strategy(pending.problem, "adaptis")
    assert best.plan == pending.plan
    for name in STRATEGY_NAMES:
        other = plan_strategy(pending.problem, name)
        if other.simulation is not None:
            assert best.simulation.iteration_time <= other.simulation.iteration_time * (1 + 1e-9), name
    # The launch under the idle plan is still watched: the idle device's counter stays at zero.
    adapter.start(problem=pending.problem, plan=pending.plan)
    assert adapter.window is not None
    assert _feed(adapter, steps=range(1, 20), slow=1.0).count(True) == 0
