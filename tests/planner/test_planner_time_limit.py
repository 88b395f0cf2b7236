"""Planning within a time limit: the anytime joint search, baselines that stop trying, the CLI.

A limit far smaller than the search needs must still give a plan (the best found so far or
the best baseline) and say it was cut short; without a limit nothing changes.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from adaptis.api.problem import load_problem
from adaptis.cli import main
from adaptis.planner import baselines
from adaptis.planner.costs import Costs
from adaptis.planner.errors import OutOfTime, PlannerError
from adaptis.planner.scheduler import list_schedule
from adaptis.planner.search import joint_search
from adaptis.planner.simulator import simulate
from adaptis.planner.strategies import compare, plan_strategy

ROOT = Path(__file__).resolve().parents[2]
SMALL = ROOT / "examples" / "problems" / "nemotron-h-small.yaml"


def _costs(microbatches: int | None = None) -> Costs:
    problem = load_problem(SMALL)
    if microbatches is not None:
        problem = problem.model_copy(update={"microbatches": microbatches})
    return Costs.from_problem(problem)


def test_search_cut_after_one_candidate_returns_that_candidate_marked_cut_short() -> None:
    costs = _costs()
    seen: list[float] = []
    # The clock jumps past the deadline as soon as one candidate has been scheduled.
    result = joint_search(costs, deadline=1.0, clock=lambda: 2.0 if seen else 0.0,
                          on_progress=lambda evals, budget, best: seen.append(best))
    assert result is not None and result.cut_short
    assert result.evaluations == 1
    assert result.schedule.feasible and result.schedule.iteration_time == seen[0]
    full = joint_search(costs)
    assert full is not None and not full.cut_short and full.evaluations > 1


def test_search_past_its_deadline_before_any_candidate_finds_nothing() -> None:
    assert joint_search(_costs(), deadline=time.monotonic() - 1) is None


def test_list_schedule_stops_inside_a_long_schedule() -> None:
    costs = _costs(microbatches=2048)  # over 4096 scheduler steps: the clock is read
    stages = [(0, costs.layers // 2), (costs.layers // 2, costs.layers)]
    with pytest.raises(OutOfTime):
        list_schedule(costs, stages=stages, owner=[0, 1], deadline=time.monotonic() - 1)
    assert list_schedule(costs, stages=stages, owner=[0, 1]).feasible


def test_zb_h1_past_its_deadline_tries_one_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    costs = _costs()
    calls: list[int] = []

    def counting(c: Costs, plan: object) -> object:
        calls.append(1)
        return simulate(c, plan)  # type: ignore[arg-type]

    monkeypatch.setattr(baselines, "simulate", counting)
    plan = baselines.zb_h1(costs, deadline=time.monotonic() - 1)
    assert len(calls) == 1 and plan.strategy == "zb-h1"
    calls.clear()
    baselines.zb_h1(costs)
    assert len(calls) == 4  # handcrafted, 1F1B split, eager-W and lazy-W greedy


def test_compare_with_a_tiny_limit_still_plans_and_says_it_was_cut_short() -> None:
    comparison, outcomes = compare(load_problem(SMALL), time_limit_s=1e-9)
    adaptis = outcomes["adaptis"]
    assert adaptis.plan is not None and adaptis.result.feasible
    assert adaptis.result.cut_short and "best baseline (1f1b)" in adaptis.result.cut_short
    # The cheapest baseline ran; the rest were skipped with a reason saying why.
    assert comparison.strategies["1f1b"].feasible
    skipped = [n for n, r in comparison.strategies.items() if r.reason and "not tried" in r.reason]
    assert skipped and "1f1b" not in skipped
    assert list(comparison.strategies) == ["adaptis", *baselines.BASELINES]
    # The plan is real: it replays to the figure reported.
    sim = simulate(Costs.from_problem(load_problem(SMALL)), adaptis.plan)
    assert sim.feasible and math.isclose(sim.iteration_time, adaptis.result.iteration_time or 0)


def test_without_a_limit_nothing_is_cut_short() -> None:
    comparison, _ = compare(load_problem(SMALL))
    assert all(r.cut_short is None for r in comparison.strategies.values())
    assert all("not tried" not in (r.reason or "") for r in comparison.strategies.values())


def test_a_limit_must_be_positive() -> None:
    with pytest.raises(PlannerError, match="positive number of seconds"):
        plan_strategy(load_problem(SMALL), "adaptis", time_limit_s=0)


def test_cli_time_limit(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(SMALL), "--json", "--time-limit", "0.000001"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["strategies"]["adaptis"]["feasible"]
    assert "time limit" in doc["strategies"]["adaptis"]["cut_short"]
    assert main(["plan", str(SMALL), "--compare", "--time-limit", "0.000001"]) == 0
    assert "note: adaptis was cut short by --time-limit" in capsys.readouterr().out
    with pytest.raises(SystemExit) as bad:
        main(["plan", str(SMALL), "--time-limit", "0"])
    assert bad.value.code == 2
    assert "--time-limit: '0' is not a positive number of seconds" in capsys.readouterr().err


def test_zero_bubble_order_stops_inside_a_long_order() -> None:
    costs = _costs(microbatches=2048)  # over 1024 steps: the clock is read
    stages = [(0, costs.layers // 2), (costs.layers // 2, costs.layers)]
    with pytest.raises(OutOfTime):
        baselines.zero_bubble_actions(costs, stages=stages, owned=[[0], [1]], caps=[2, 1],
                                      deadline=time.monotonic() - 1)
    assert baselines.zero_bubble_actions(costs, stages=stages, owned=[[0], [1]], caps=[2, 1])


def test_compare_without_the_bound_reports_zero_and_the_same_plans() -> None:
    problem = load_problem(SMALL)
    with_bound, outcomes = compare(problem)
    without, again = compare(problem, bound=False)
    assert with_bound.lower_bound > 0 and without.lower_bound == 0.0
    assert again["adaptis"].result.iteration_time == outcomes["adaptis"].result.iteration_time


def test_adaptis_run_plans_within_the_specs_limit(capsys: pytest.CaptureFixture[str]) -> None:
    from adaptis.cli.run import _plan

    plan = _plan(load_problem(SMALL), "adaptis", time_limit_s=1e-9)
    assert plan.strategy == "adaptis" and plan.actions
    assert "planning cut short by spec.planner.timeLimitSeconds" in capsys.readouterr().err
