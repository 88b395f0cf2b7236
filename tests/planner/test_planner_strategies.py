"""Strategies by name (adaptis.planner.strategies) against known answers.

A pipeline of 4 equal layers (F 1, B 2, W 1 ms; 100 bytes of parameters and 10 of activations
each) on 2 devices with 4 microbatches: every baseline splits it 2 + 2, so a stage's F+B+W is
8 ms; GPipe and 1F1B take (m + p - 1) x 8 = 40 ms, and no plan beats the work spread evenly,
4 x 4 x 4 / 2 = 32 ms. Device 0 of 1F1B holds p = 2 microbatches (2 layers' activations each):
200 + 2 x 20 = 240 bytes; device 1 holds one: 220 bytes.
"""

from __future__ import annotations

import functools
import math
import time
from unittest import mock

import pytest

from adaptis.api.plan import STRATEGY_NAMES, Plan
from adaptis.api.problem import Problem, parse_problem
from adaptis.planner import strategies
from adaptis.planner.baselines import BASELINES
from adaptis.planner.bounds import assignment_bound, pipeline_bound
from adaptis.planner.costs import Costs
from adaptis.planner.errors import PlannerError
from adaptis.planner.strategies import compare, lower_bound, plan_strategy


def _problem(*, memory_bytes: float | None = None, microbatches: int = 4) -> Problem:
    layers = [{"name": f"l{i}", "forward": 1.0, "backward": 2.0, "weight": 1.0, "activation_bytes": 10.0,
               "param_bytes": 100.0} for i in range(4)]
    devices: dict[str, object] = {"count": 2}
    if memory_bytes is not None:
        devices["memory_bytes"] = memory_bytes
    return parse_problem({"name": "four", "microbatches": microbatches, "layers": layers, "devices": devices})


def test_a_baseline_by_name_reports_its_simulated_figures() -> None:
    out = plan_strategy(_problem(), "1f1b")
    r = out.result
    assert out.name == "1f1b" and r.feasible and r.reason is None
    assert (r.iteration_time, r.step_time, r.post_pipeline_time) == (40.0, 40.0, 0.0)
    assert r.bubble_ratio == pytest.approx(0.2)  # 1 - 32 / 40
    assert r.peak_memory_bytes == [240.0, 220.0]
    assert (r.stages, r.placement) == (2, [[0], [1]])
    assert r.search_seconds is not None and 0 <= r.search_seconds < 60
    assert r.cut_short is None
    plan = out.plan
    assert plan is not None and (plan.strategy, plan.microbatches) == ("1f1b", 4)
    p = plan.predicted
    assert p is not None and (p.iteration_time, p.time_unit, p.step_time, p.post_pipeline_time) == (
        40.0, "ms", 40.0, 0.0)
    assert p.bubble_ratio == pytest.approx(0.2) and p.peak_memory_bytes == [240.0, 220.0]
    assert out.simulation is not None and out.simulation.iteration_time == 40.0


def test_compare_runs_every_strategy_adaptis_first_and_bounds_them() -> None:
    comparison, outcomes = compare(_problem())
    assert list(comparison.strategies) == list(outcomes) == ["adaptis", *BASELINES]
    assert set(outcomes) == set(STRATEGY_NAMES)
    assert (comparison.name, comparison.time_unit) == ("four", "ms")
    costs = Costs.from_problem(_problem())
    assert comparison.lower_bound == lower_bound(costs) == max(pipeline_bound(costs), assignment_bound(costs))
    assert comparison.lower_bound == 32.0
    assert comparison.strategies["gpipe"].iteration_time == comparison.strategies["1f1b"].iteration_time == 40.0
    best = min(r.iteration_time or math.inf for n, r in comparison.strategies.items() if n != "adaptis")
    adaptis = outcomes["adaptis"]
    assert adaptis.plan is not None and adaptis.plan.strategy == "adaptis"
    assert 32.0 <= (adaptis.result.iteration_time or 0) <= best
    assert adaptis.result.cut_short is None
    assert adaptis.result.search_seconds is not None and 0 <= adaptis.result.search_seconds < 60
    # The adaptis plan is a real one of its own: it replays to its figure.
    assert adaptis.simulation is not None and adaptis.simulation.iteration_time == adaptis.result.iteration_time


def test_adaptis_alone_may_fit_where_most_baselines_do_not() -> None:
    # 230 bytes: parameters (200) and 3 microbatches' activations of one layer, or 1 of two.
    comparison, _outcomes = compare(_problem(memory_bytes=230))
    assert not comparison.strategies["1f1b"].feasible
    assert comparison.strategies["1f1b"].reason == (
        "device 0 needs 240 bytes, has 230 bytes (1.04x), the only device over memory")
    adaptis = comparison.strategies["adaptis"]
    assert adaptis.feasible and max(adaptis.peak_memory_bytes or [math.inf]) <= 230
    fitting = [r.iteration_time or math.inf for n, r in comparison.strategies.items() if n != "adaptis" and r.feasible]
    assert (adaptis.iteration_time or math.inf) <= min(fitting, default=math.inf)


def test_nothing_fits_names_the_leanest_plan_its_worst_device_and_the_lever() -> None:
    comparison, outcomes = compare(_problem(memory_bytes=205))
    adaptis = outcomes["adaptis"]
    assert adaptis.name == "adaptis"  # a caller reading the outcome alone knows what failed
    assert adaptis.plan is None and adaptis.simulation is None and not adaptis.result.feasible
    # 1F1B and balanced both need 240 bytes on device 0; the first in the contract's order wins.
    assert adaptis.result.reason == (
        "no partition fits in device memory: in the leanest plan seen (1f1b) device 0 needs 240 "
        "bytes, has 205 bytes (1.17x), the worst of all 2 devices, each over memory; add devices "
        "or memory per device, or shorten the sequence (fewer activations)")
    assert adaptis.result.cut_short is None and adaptis.result.search_seconds is not None
    assert not any(r.feasible for r in comparison.strategies.values())


def test_nothing_fits_and_nothing_simulated() -> None:
    assert strategies._least_memory_reason(Costs.from_problem(_problem()), {}) == (
        "no partition fits in device memory; add devices or memory per device, or shorten the "
        "sequence (fewer activations)")


@pytest.mark.parametrize("seconds", [0, -1.0, math.nan, math.inf])
def test_a_time_limit_must_be_a_positive_finite_number(seconds: float) -> None:
    with pytest.raises(PlannerError, match=f"^time limit: {seconds} s; give a positive number of seconds$"):
        plan_strategy(_problem(), "1f1b", time_limit_s=seconds)
    with pytest.raises(PlannerError, match="give a positive number of seconds"):
        compare(_problem(), time_limit_s=seconds)


def test_an_unknown_strategy_names_the_choices() -> None:
    with pytest.raises(PlannerError, match=r"^unknown strategy 'zb-2p'; choose one of adaptis, gpipe, 1f1b, "):
        plan_strategy(_problem(), "zb-2p")


def test_a_baseline_that_deadlocks_or_refuses_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    def deadlocking(costs: Costs, *, deadline: float | None = None) -> Plan:
        # Device 1's B waits on a forward that never comes first: each device waits on the other.
        return Plan(strategy="gpipe", microbatches=1, stages=[(0, 2), (2, 4)], placement=[[0], [1]],
                    actions=[[("B", 0, 0), ("F", 0, 0), ("W", 0, 0)], [("B", 1, 0), ("F", 1, 0), ("W", 1, 0)]])

    def refusing(costs: Costs, *, deadline: float | None = None) -> Plan:
        raise PlannerError("zb-v needs an even number of stages")

    monkeypatch.setitem(BASELINES, "gpipe", deadlocking)
    monkeypatch.setitem(BASELINES, "zb-v", refusing)
    comparison, outcomes = compare(_problem(microbatches=1))
    gpipe, zbv = comparison.strategies["gpipe"], comparison.strategies["zb-v"]
    assert not gpipe.feasible and "deadlock" in (gpipe.reason or "").lower()
    assert outcomes["gpipe"].plan is None and outcomes["gpipe"].simulation is None
    assert not zbv.feasible and zbv.reason == "zb-v needs an even number of stages"
    assert (outcomes["zb-v"].name, outcomes["gpipe"].name) == ("zb-v", "gpipe")
    assert comparison.strategies["adaptis"].feasible and comparison.strategies["1f1b"].feasible


def test_under_a_time_limit_the_baselines_run_cheapest_first(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[str] = []
    for name, make in list(BASELINES.items()):
        def tracked(costs: Costs, *, deadline: float | None = None, _name: str = name, _make=make) -> Plan:
            ran.append(_name)
            return _make(costs, deadline=deadline)
        monkeypatch.setitem(BASELINES, name, tracked)
    compare(_problem(), time_limit_s=3600)
    assert ran == ["1f1b", "balanced", "gpipe", "zb-h1", "zb-v", "i1f1b"]
    ran.clear()
    comparison, outcomes = compare(_problem(), time_limit_s=1e-9)
    assert ran == ["1f1b"]
    # The seed (balanced) within the baselines' half; the others after adaptis, in what is left.
    assert comparison.strategies["balanced"].reason == (
        "not tried: the baselines' half of the time limit (1e-09 s) ran out")
    for name in ("balanced", "gpipe", "zb-h1", "zb-v", "i1f1b"):
        if name != "balanced":
            assert comparison.strategies[name].reason == (
                "not tried: the time limit (1e-09 s) ran out while adaptis planned")
        assert not comparison.strategies[name].feasible
        assert (outcomes[name].name, outcomes[name].plan, outcomes[name].simulation) == (name, None, None)
    note = comparison.strategies["adaptis"].cut_short
    assert note == ("the best baseline (1f1b) found within the time limit (1e-09 s), 0 search "
                    "candidates; baselines not tried: balanced, gpipe, i1f1b, zb-h1, zb-v")
    # Past the limit, the comparison's bound is the pipeline terms only.
    assert comparison.lower_bound == pipeline_bound(Costs.from_problem(_problem()))


def test_the_leanest_plan_is_the_one_whose_worst_device_overshoots_least() -> None:
    """Layer 0 (work 2) holds 10 bytes of parameters, the others 1; 1 byte of activations each.
    1F1B splits by count (2 + 1 layers): device 0 holds 11 + 2 microbatches x 2 = 15 bytes.
    Balanced splits by work (1 + 2): device 0 holds 10 + 2 x 1 = 12, device 1 2 + 2 = 4."""
    layers = [{"name": "l0", "forward": 2.0, "activation_bytes": 1.0, "param_bytes": 10.0},
              *({"name": f"l{i}", "forward": 1.0, "activation_bytes": 1.0, "param_bytes": 1.0} for i in (1, 2))]
    problem = parse_problem({"name": "lean", "microbatches": 2, "layers": layers,
                             "devices": {"count": 2, "memory_bytes": 1.0}})
    comparison, _ = compare(problem, bound=False)
    assert comparison.lower_bound == 0.0
    assert comparison.strategies["1f1b"].peak_memory_bytes == [15.0, 2.0]
    assert comparison.strategies["adaptis"].reason == (
        "no partition fits in device memory: in the leanest plan seen (balanced) device 0 needs 12 "
        "bytes, has 1 bytes (12.00x), the worst of all 2 devices, each over memory; the parameters "
        "alone need 12 bytes, all devices together have 2 bytes: add devices or memory")


def test_adaptis_by_name_is_the_comparisons_adaptis_and_reports_its_progress() -> None:
    seen: list[tuple[int, int, float]] = []
    out = plan_strategy(_problem(), "adaptis", on_progress=lambda e, b, best: seen.append((e, b, best)))
    _, outcomes = compare(_problem())
    assert out.name == "adaptis" and out.plan is not None and out.plan.strategy == "adaptis"
    assert out.result.iteration_time == outcomes["adaptis"].result.iteration_time
    assert seen and all(best >= 32.0 for _e, _b, best in seen)


def test_plan_strategy_passes_its_time_limit_on(monkeypatch: pytest.MonkeyPatch) -> None:
    deadlines: list[float | None] = []
    make = BASELINES["1f1b"]

    def tracked(costs: Costs, *, deadline: float | None = None) -> Plan:
        deadlines.append(deadline)
        return make(costs, deadline=deadline)

    monkeypatch.setitem(BASELINES, "1f1b", tracked)
    before = strategies.time.monotonic()
    plan_strategy(_problem(), "1f1b", time_limit_s=100.0)
    # A baseline by name has the whole limit; under adaptis the baselines have its first half.
    assert deadlines[0] is not None and before + 100.0 <= deadlines[0] <= strategies.time.monotonic() + 100.0
    plan_strategy(_problem(), "1f1b")
    assert deadlines[1] is None
    plan_strategy(_problem(), "adaptis", time_limit_s=100.0)
    assert deadlines[2] is not None and before + 50.0 <= deadlines[2] <= strategies.time.monotonic() + 50.0
    out = plan_strategy(_problem(), "adaptis", time_limit_s=1e-9)
    # adaptis seeds with 1F1B and balanced only (strategies.SEEDS); 1F1B always runs.
    assert out.result.cut_short is not None and "baselines not tried: balanced" in out.result.cut_short


def test_the_bound_past_its_deadline_is_the_loosest_found() -> None:
    """Three equal layers (F+B+W 1) on two devices, 8 microbatches: one device runs two of
    the layers, 2 x 8 = 16; the work spread evenly gives only 3 x 8 / 2 = 12."""
    layers = [{"name": f"l{i}", "forward": 1.0} for i in range(3)]
    costs = Costs.from_problem(parse_problem({"microbatches": 8, "layers": layers, "devices": {"count": 2}}))
    assert lower_bound(costs) == pytest.approx(16.0, rel=1e-6)
    assert pipeline_bound(costs) == 12.0
    assert 12.0 <= lower_bound(costs, deadline=strategies.time.monotonic() - 1) < 15.9
    problem = parse_problem({"microbatches": 8, "layers": layers, "devices": {"count": 2}})
    assert compare(problem)[0].lower_bound == pytest.approx(16.0, rel=1e-6)


def test_the_comparisons_bound_runs_within_the_calls_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    deadlines: list[float | None] = []
    real = strategies.assignment_bound

    def tracked(costs: Costs, *, deadline: float | None = None) -> float:
        deadlines.append(deadline)
        return real(costs, deadline=deadline)

    monkeypatch.setattr(strategies, "assignment_bound", tracked)
    before = strategies.time.monotonic()
    compare(_problem(), time_limit_s=100.0)
    assert deadlines[0] is not None and before + 100.0 <= deadlines[0] <= strategies.time.monotonic() + 100.0


def test_compare_reports_the_searchs_progress() -> None:
    seen: list[float] = []
    comparison, _ = compare(_problem(), on_progress=lambda evals, budget, best: seen.append(best))
    assert seen and min(seen) == comparison.strategies["adaptis"].iteration_time


def test_without_a_search_result_adaptis_is_the_best_baseline(monkeypatch: pytest.MonkeyPatch) -> None:
    deadlines: list[float | None] = []

    def nothing(costs: Costs, **kwargs: object) -> None:
        deadlines.append(kwargs.get("deadline"))  # type: ignore[arg-type]

    monkeypatch.setattr(strategies, "joint_search", nothing)
    before = strategies.time.monotonic()
    comparison, outcomes = compare(_problem(), time_limit_s=100.0)
    best = min((n for n in BASELINES), key=lambda n: comparison.strategies[n].iteration_time or math.inf)
    assert comparison.strategies[best].iteration_time < comparison.strategies["gpipe"].iteration_time
    adaptis = outcomes["adaptis"]
    assert adaptis.plan is not None and adaptis.plan.strategy == "adaptis"
    assert adaptis.result.iteration_time == comparison.strategies[best].iteration_time
    assert adaptis.plan.actions == outcomes[best].plan.actions  # type: ignore[union-attr]
    # The search had the whole call's deadline.
    assert deadlines[0] is not None and before + 100.0 <= deadlines[0] <= strategies.time.monotonic() + 100.0
    # Every baseline's outcome is named and timed.
    for name in BASELINES:
        assert outcomes[name].name == name
        seconds = comparison.strategies[name].search_seconds
        assert seconds is not None and 0 <= seconds < 60


def test_nothing_fits_within_the_time_limit_says_both() -> None:
    _comparison, outcomes = compare(_problem(memory_bytes=205), time_limit_s=1e-9)
    adaptis = outcomes["adaptis"].result
    assert not adaptis.feasible and adaptis.cut_short == "no plan: the time limit ran out first"
    assert adaptis.reason == (
        "the time limit (1e-09 s) ran out before any plan fit; no partition fits in device memory: "
        "in the leanest plan seen (1f1b) device 0 needs 240 bytes, has 205 bytes (1.17x), the worst "
        "of all 2 devices, each over memory; add devices or memory per device, or shorten the "
        "sequence (fewer activations)")
    assert adaptis.search_seconds is not None and 0 <= adaptis.search_seconds < 60


def test_the_searched_plan_carries_its_microbatches_unit_and_search_time() -> None:
    """The search's plan is built from its schedule alone: the microbatches, the prediction's
    time unit (the problem's) and the seconds the call took are filled in for it."""
    doc = _problem().model_dump(mode="json", exclude_none=True) | {"time_unit": "s"}
    started = time.perf_counter()
    out = plan_strategy(parse_problem(doc), "adaptis")
    took = time.perf_counter() - started
    assert out.plan is not None and out.plan.predicted is not None
    assert (out.plan.strategy, out.plan.microbatches, out.plan.predicted.time_unit) == ("adaptis", 4, "s")
    assert out.result.search_seconds is not None and 0 < out.result.search_seconds <= took


def test_a_search_cut_short_by_the_limit_says_its_plan_is_the_searchs() -> None:
    """The deadline passes right after the search's first candidate (the real search, read
    through a clock that jumps past the deadline at its first progress report): with no
    baseline to compare, the plan is that candidate's and the note says so."""
    costs = Costs.from_problem(_problem())
    limit = strategies._Limit(2.0, time.monotonic() + 3600.0, None)
    now = [-math.inf]

    def first_report_ends_the_time(evals: int, budget: int, best: float) -> None:
        now[0] = math.inf

    search = functools.partial(strategies.joint_search, clock=lambda: now[0])
    with mock.patch.object(strategies, "joint_search", search):
        out = strategies._adaptis(costs, {}, on_progress=first_report_ends_the_time, limit=limit)
    assert out.name == "adaptis" and out.result.feasible
    assert out.result.cut_short == ("the best plan found within the time limit (2 s): the joint search's "
                                    "(1 search candidates)")


def test_a_search_that_ran_to_its_end_says_so_when_only_the_baselines_were_cut() -> None:
    """The baselines' half of the limit has passed (balanced is skipped), the call's deadline
    has not: the search runs to its end, and the note says so with its candidate count (the
    last progress report's), not as a search cut short."""
    costs = Costs.from_problem(_problem())
    now = time.monotonic()
    limit = strategies._Limit(10.0, now + 3600.0, now - 1.0)
    seeds = strategies._baselines(costs, limit, names=strategies.SEEDS)
    assert seeds["1f1b"].result.feasible and not seeds["balanced"].result.feasible
    seen: list[int] = []
    out = strategies._adaptis(costs, seeds, on_progress=lambda evals, budget, best: seen.append(evals),
                              limit=limit)
    assert out.result.feasible and seen
    assert (out.result.iteration_time or math.inf) < 40.0  # the search beat 1F1B (33 measured)
    assert out.result.cut_short == (f"the best plan found within the time limit (10 s): the joint search's "
                                    f"(the search ran to its end ({seen[-1]} candidates)); baselines not "
                                    f"tried: balanced")
