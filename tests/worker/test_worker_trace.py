"""The measured timeline (``adaptis run --trace``): the rank's traced timer, the report's
alignment with the plan and its figures worked by hand, and the whole loop on real ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from adaptis.api.plan import Plan
from adaptis.api.problem import parse_problem
from adaptis.cli.trace_report import TraceMismatch, trace_report
from adaptis.worker.runtime.timers import WallActionTimer
from adaptis.worker.runtime.trace import ENV, TracedTimer, rank_trace_path, traced

REPO = Path(__file__).resolve().parents[2]
MS = 1e-3

#: Two stages on two ranks, 1F1B over 2 microbatches (fused backwards).
PLAN = Plan(stages=[(0, 1), (1, 2)], placement=[[0], [1]], strategy="1f1b", microbatches=2,
            actions=[[("F", 0, 0), ("F", 0, 1), ("BW", 0, 0), ("BW", 0, 1)],
                     [("F", 1, 0), ("BW", 1, 0), ("F", 1, 1), ("BW", 1, 1)]])
PROBLEM = parse_problem({
    "name": "two", "time_unit": "ms", "microbatches": 2,
    "layers": [{"name": "a", "kind": "embedding", "forward": 1.0, "weight": 2.0},
               {"name": "b", "kind": "head", "forward": 1.0, "backward": 1.5, "weight": 1.5}],
    "devices": {"count": 2},
})
#: What each rank timed, in ms: rank 1 times the loss as one more call after each forward.
CALLS = {
    0: [("F", 0.0, 1.0), ("F", 1.1, 2.1), ("BW", 6.0, 8.0), ("BW", 9.0, 11.0)],
    1: [("F", 1.3, 2.3), ("F", 2.3, 2.5), ("BW", 2.6, 5.5), ("F", 5.6, 6.6), ("F", 6.6, 6.8), ("BW", 6.9, 8.6)],
}


def _write(directory: Path, calls: dict[int, list[tuple[str, float, float]]]) -> None:
    for r, cs in calls.items():
        rank_trace_path(directory, rank=r).write_text(
            json.dumps({"step": 3, "calls": [[k, s * MS, e * MS] for k, s, e in cs]}))


def test_the_report_lines_the_calls_up_with_the_plan_and_works_out_the_figures(tmp_path: Path) -> None:
    _write(tmp_path, CALLS)
    report = trace_report(tmp_path, plan=PLAN, problem=PROBLEM, ranks=2)
    r0, r1 = report["ranks"][0], report["ranks"][1]
    assert r0["busy_s"] == pytest.approx(6.0 * MS) and r1["busy_s"] == pytest.approx(7.0 * MS)  # loss in F
    assert r0["median_gap_s"] == pytest.approx(1.0 * MS) and r1["median_gap_s"] == pytest.approx(0.1 * MS)
    # Waited for another rank: F1.0 (0.3 ms after F0.0), BW0.0 (0.5 after BW1.0), BW0.1 (0.4 after
    # BW1.1); F1.1's input was there before rank 1 was free, so it did not wait.
    assert report["hop_latency_s"] == {"count": 3, "median": pytest.approx(0.4 * MS), "max": pytest.approx(0.5 * MS)}
    assert report["iteration_s"] == pytest.approx(11.0 * MS)
    assert [(a["kind"], a["stage"], a["microbatch"]) for a in r1["actions"]] == [tuple(a) for a in PLAN.actions[1]]
    assert r1["actions"][0]["end"] == pytest.approx(2.5 * MS)  # the forward ends with its loss
    # The prediction beside it: the simulator's timeline of the same plan, in seconds.
    assert report["predicted_iteration_s"] > 0
    assert all(a["predicted_end"] > a["predicted_start"] >= 0 for a in r0["actions"] + r1["actions"])
    assert json.loads((tmp_path / "trace.json").read_text())["iteration_s"] == pytest.approx(11.0 * MS)


def test_a_trace_that_does_not_follow_the_plan_is_refused(tmp_path: Path) -> None:
    no_loss = {**CALLS, 1: [c for i, c in enumerate(CALLS[1]) if i != 1]}
    _write(tmp_path, no_loss)
    with pytest.raises(TraceMismatch, match=r"rank 1: no loss call after F1.0"):
        trace_report(tmp_path, plan=PLAN, problem=PROBLEM, ranks=2)
    _write(tmp_path, {**CALLS, 0: [*CALLS[0], ("W", 12.0, 13.0)]})
    with pytest.raises(TraceMismatch, match="1 timed calls beyond"):
        trace_report(tmp_path, plan=PLAN, problem=PROBLEM, ranks=2)


def test_the_traced_timer_writes_each_steps_calls_and_keeps_the_busy_accounting(tmp_path: Path) -> None:
    timer = traced(WallActionTimer(), rank=3, environ={ENV: str(tmp_path / "t")}, device=torch.device("cpu"))
    assert isinstance(timer, TracedTimer)
    for step in (1, 2):
        timer.reset(step=step)
        for kind in ("F", "BW"):
            with timer.measure(kind):
                pass
        busy = timer.collect()
    doc = json.loads(rank_trace_path(tmp_path / "t", rank=3).read_text())
    assert doc["step"] == 2 and [c[0] for c in doc["calls"]] == ["F", "BW"]  # the last step only
    assert all(s <= e for _k, s, e in doc["calls"]) and set(busy) == {"F", "BW"}
    plain = WallActionTimer()
    assert traced(plain, rank=0, environ={}, device=torch.device("cpu")) is plain
    assert traced(plain, rank=0, environ={ENV: str(tmp_path)}, device=torch.device("cuda")) is plain


def test_adaptis_run_trace_reports_the_last_step_of_real_ranks(tmp_path: Path) -> None:
    doc = yaml.safe_load((REPO / "examples" / "tiny-heterogeneous.yaml").read_text())
    doc["spec"]["model"].update(vocabSize=512, hidden=16, heads=2)
    doc["spec"]["training"].update(microbatches=4, microbatchSize=1, sequenceLength=16)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    done = subprocess.run(
        [sys.executable, "-m", "adaptis", "run", str(tmp_path / "job.yaml"), "--steps", "2", "--strategy", "1f1b",
         "--profile", "estimate", "--workdir", str(tmp_path / "w"), "--metrics-port", "0",
         "--checkpoint-every", "0", "--trace", str(tmp_path / "trace")],
        capture_output=True, text=True, timeout=300, cwd=REPO, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 0: busy" in done.stdout and "rank 1: busy" in done.stdout, done.stdout[-2000:]
    report = json.loads((tmp_path / "trace" / "trace.json").read_text())
    plan = json.loads((tmp_path / "w" / "worker.json").read_text())["plan"]
    for r in ("0", "1"):
        assert len(report["ranks"][r]["actions"]) == len(Plan.model_validate(plan).actions[int(r)])
        assert json.loads(rank_trace_path(tmp_path / "trace", rank=int(r)).read_text())["step"] == 2
    assert 0 < report["iteration_s"] < 60
