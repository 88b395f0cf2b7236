"""Planning off the reconcile workers (adaptis.operator.scheduling.plan_runner) with the fake cluster.

A plan that blocks must not hold up another job's pass; a finished plan wakes its job; a
planner killed for time or memory becomes the 1F1B fallback, or Planned=False naming
spec.planner.timeLimitSeconds; a plan cut by its time limit says so in the Planned condition.
The planning functions are module-level so that they cross into the planner processes.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from adaptis.api.job import JobSpec
from adaptis.operator.control.reconcile import Reconciler
from adaptis.operator.core.records import PlanRecord
from adaptis.operator.scheduling.plan_runner import PlannerLimits, PlanRunner, plan_size
from adaptis.operator.scheduling.planning import plan_job, spec_hash

# Above PlannerLimits.inline_below (so it goes to the runner), still fast to really plan.
BIG = {"model": {"vocabSize": 32000, "hidden": 256, "heads": 4,
                 "blocks": [{"kind": "attention", "count": 30}]},
       "training": {"steps": 4, "microbatches": 256, "sequenceLength": 128}}


def _condition(cluster: Any, name: str, type_: str) -> dict[str, Any]:
    conds = cluster.job(name)["status"]["conditions"]
    return next(c for c in conds if c["type"] == type_)


def _wait_for(what: Callable[[], bool], *, message: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        if time.monotonic() > deadline:
            pytest.fail(f"after {timeout_s} s: {message}")
        time.sleep(0.02)


class _Wakes:
    def __init__(self) -> None:
        self.keys: list[Any] = []

    def __call__(self, key: Any) -> None:
        self.keys.append(key)


def sleep_unless_fallback(spec: Any, candidates: Any, **kw: Any) -> PlanRecord:
    """The search hangs (past any limit); the 1F1B fallback plans for real."""
    if kw.get("strategy") is None:
        time.sleep(3600)
    return plan_job(spec, candidates, **kw)


def always_sleep(spec: Any, candidates: Any, **kw: Any) -> PlanRecord:
    time.sleep(3600)
    raise AssertionError("unreachable")


def hog_memory_unless_fallback(spec: Any, candidates: Any, **kw: Any) -> PlanRecord:
    if kw.get("strategy") is None:
        hog = bytearray(2 << 30)  # 2 GiB, over the 512 MiB cap of the test
        hog[-1] = 1
    return plan_job(spec, candidates, **kw)


def tiny_limit(spec: Any, candidates: Any, **kw: Any) -> PlanRecord:
    """plan_job with a limit far below what the search needs (the spec's minimum is 1 s)."""
    return plan_job(spec, candidates, **{**kw, "time_limit_s": 1e-9})


def test_a_long_plan_does_not_delay_another_jobs_pass(cluster: Any, make_job: Any) -> None:
    release = threading.Event()
    started = threading.Event()

    def blocking(spec: Any, candidates: Any, **kw: Any) -> PlanRecord:
        if spec.training.microbatches == 256:  # the big job: held until the test says so
            started.set()
            release.wait(60)
        return plan_job(spec, candidates, **kw)

    wakes = _Wakes()
    runner = PlanRunner(limits=PlannerLimits(max_concurrent=1, isolate=False), wake=wakes,
                        plan=blocking)
    rec = Reconciler(cluster, planner=runner)
    cluster.add_job(make_job("big", spec=BIG))
    cluster.add_job(make_job("small"))
    assert plan_size(JobSpec.model_validate(cluster.job("big")["spec"])) >= \
        PlannerLimits().inline_below > plan_size(JobSpec.model_validate(cluster.job("small")["spec"]))
    t0 = time.monotonic()
    rec.reconcile("ns", "big")
    assert _condition(cluster, "big", "Planned")["reason"] == "Planning"
    assert "planning in a separate process" in _condition(cluster, "big", "Planned")["message"] \
        or "waiting for one of" in _condition(cluster, "big", "Planned")["message"]
    _wait_for(started.is_set, message="the big plan never started")
    # The big plan holds the only planner slot; the small job is planned in its own pass.
    rec.reconcile("ns", "small")
    assert time.monotonic() - t0 < 10
    assert cluster.job("small")["status"]["phase"] == "Planned"
    assert len([p for p in cluster.pods() if p["metadata"]["name"].startswith("small-")]) == 4
    assert not wakes.keys
    # A pass of the big job while it plans changes nothing and returns at once.
    rec.reconcile("ns", "big")
    assert _condition(cluster, "big", "Planned")["reason"] == "Planning"
    # The result wakes the job; its next pass takes the plan and creates the pods.
    release.set()
    _wait_for(lambda: ("ns", "big") in wakes.keys, message="the finished plan did not wake the job")
    rec.reconcile("ns", "big")
    assert _condition(cluster, "big", "Planned")["status"] == "True"
    assert len([p for p in cluster.pods() if p["metadata"]["name"].startswith("big-")]) == 4
    runner.shutdown()


def test_a_second_big_job_waits_for_a_slot_then_plans(cluster: Any, make_job: Any) -> None:
    release = threading.Event()

    def blocking(spec: Any, candidates: Any, **kw: Any) -> PlanRecord:
        release.wait(60)
        return plan_job(spec, candidates, **kw)

    wakes = _Wakes()
    runner = PlanRunner(limits=PlannerLimits(max_concurrent=1, isolate=False), wake=wakes,
                        plan=blocking)
    rec = Reconciler(cluster, planner=runner)
    for name in ("first", "second"):
        cluster.add_job(make_job(name, spec=BIG))
        rec.reconcile("ns", name)
    def first_runs() -> bool:
        rec.reconcile("ns", "first")  # the message says "planning" once its thread took it
        return "planning in a separate" in _condition(cluster, "first", "Planned")["message"]

    _wait_for(first_runs, message="the first plan never started")
    rec.reconcile("ns", "second")
    assert "waiting for one of the operator's 1 planner slot" in \
        _condition(cluster, "second", "Planned")["message"]
    release.set()
    _wait_for(lambda: {("ns", "first"), ("ns", "second")} <= set(wakes.keys),
              message="both plans should finish and wake their jobs")
    for name in ("first", "second"):
        rec.reconcile("ns", name)
        assert _condition(cluster, name, "Planned")["status"] == "True"
    runner.shutdown()


def _planned_after_wake(cluster: Any, make_job: Any, *, plan: Any,
                        limits: PlannerLimits) -> dict[str, Any]:
    wakes = _Wakes()
    runner = PlanRunner(limits=limits, wake=wakes, plan=plan)
    rec = Reconciler(cluster, planner=runner)
    cluster.add_job(make_job("big", spec={**BIG, "planner": {"strategy": "adaptis",
                                                             "timeLimitSeconds": 1}}))
    rec.reconcile("ns", "big")
    assert _condition(cluster, "big", "Planned")["reason"] == "Planning"
    _wait_for(lambda: ("ns", "big") in wakes.keys, message="the planner never reported back")
    rec.reconcile("ns", "big")
    runner.shutdown()
    return _condition(cluster, "big", "Planned")


def test_a_planner_past_its_time_is_killed_and_1f1b_runs_instead(
        cluster: Any, make_job: Any) -> None:
    t0 = time.monotonic()
    cond = _planned_after_wake(cluster, make_job, plan=sleep_unless_fallback,
                               limits=PlannerLimits(kill_grace_s=0.5))
    assert time.monotonic() - t0 < 20  # 1 s limit + 0.5 s grace, then a real 1F1B plan
    assert cond["status"] == "True" and cond["reason"] == "BaselineFallback"
    assert "ran past spec.planner.timeLimitSeconds (1 s)" in cond["message"]
    assert cond["message"].startswith("1f1b:")
    assert len(cluster.pods()) == 4


def test_a_planner_over_its_memory_cap_falls_back_too(cluster: Any, make_job: Any) -> None:
    cond = _planned_after_wake(cluster, make_job, plan=hog_memory_unless_fallback,
                               limits=PlannerLimits(memory_bytes=512 << 20, kill_grace_s=5))
    assert cond["reason"] == "BaselineFallback"
    assert "memory cap (512 MiB)" in cond["message"]


def test_a_planner_stopped_twice_names_the_time_limit_and_leaves_no_process(
        cluster: Any, make_job: Any) -> None:
    cond = _planned_after_wake(cluster, make_job, plan=always_sleep,
                               limits=PlannerLimits(kill_grace_s=0.3))
    assert cond["status"] == "False" and cond["reason"] == "PlanningBudgetExceeded"
    assert cond["message"].startswith("spec.planner.timeLimitSeconds: planning 4 workers x "
                                      "32 layers x 256 microbatches was stopped")
    assert "shrink spec.training.microbatches" in cond["message"]
    assert not cluster.pods()
    # Both stopped planners are gone, not left sleeping beside the operator.
    assert not [c for c in multiprocessing.active_children() if c.name.startswith("adaptis-plan")]


def test_a_plan_cut_by_its_time_limit_says_so(cluster: Any, make_job: Any) -> None:
    cond = _planned_after_wake(cluster, make_job, plan=tiny_limit,
                               limits=PlannerLimits(isolate=True))
    assert cond["status"] == "True" and cond["reason"] == "TimeLimitReached"
    assert "spec.planner.timeLimitSeconds (1e-09 s) ran out" in cond["message"]


def test_new_inputs_replace_a_pending_plan(cluster: Any, make_job: Any) -> None:
    release = threading.Event()
    seen: list[int] = []

    def blocking(spec: Any, candidates: Any, **kw: Any) -> PlanRecord:
        seen.append(spec.training.microbatches)
        release.wait(60)
        return plan_job(spec, candidates, **kw)

    wakes = _Wakes()
    runner = PlanRunner(limits=PlannerLimits(isolate=False), wake=wakes, plan=blocking)
    rec = Reconciler(cluster, planner=runner)
    cluster.add_job(make_job("big", spec=BIG))
    rec.reconcile("ns", "big")
    cluster.job("big")["spec"]["training"]["microbatches"] = 512
    rec.reconcile("ns", "big")
    release.set()
    _wait_for(lambda: len(seen) == 2 and wakes.keys.count(("ns", "big")) >= 1,
              message="the plan of the new inputs should run after the old one")
    def planned() -> bool:
        rec.reconcile("ns", "big")
        return bool(_condition(cluster, "big", "Planned")["status"] == "True")

    _wait_for(planned, message="the job should take the plan of its current spec")
    assert seen == [256, 512]
    runner.shutdown()


def test_a_new_time_limit_does_not_replan_a_running_job(make_job: Any) -> None:
    spec = JobSpec.model_validate(make_job(spec=BIG)["spec"])
    longer = spec.model_copy(update={"planner": spec.planner.model_copy(
        update={"time_limit_seconds": 300})})
    assert spec_hash(longer) == spec_hash(spec)
    fewer = spec.model_copy(update={"training": spec.training.model_copy(
        update={"microbatches": 128})})
    assert spec_hash(fewer) != spec_hash(spec)


def test_the_pass_a_finished_plan_wakes_gets_that_plan(cluster: Any, make_job: Any) -> None:
    # The queue may run the woken key at once: the result must be there by then.
    seen: list[str] = []

    def wake(key: Any) -> None:
        rec.reconcile(*key)
        seen.append(_condition(cluster, "big", "Planned")["status"])

    runner = PlanRunner(limits=PlannerLimits(isolate=False), wake=wake, plan=plan_job)
    rec = Reconciler(cluster, planner=runner)
    cluster.add_job(make_job("big", spec=BIG))
    rec.reconcile("ns", "big")
    _wait_for(lambda: bool(seen), message="the finished plan did not wake the job")
    assert seen == ["True"]
    runner.shutdown()
