"""``adaptis plan``: the real CLI, as a subprocess and in-process, on the example problems.

Checks the contract's JSON, that adaptis never loses to a feasible baseline, that a saved
plan replays to the figure reported, that timelines are drawn, and that bad input gets one
line naming the key and exit status 2.
"""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from adaptis.api.plan import STRATEGY_NAMES, load_plan
from adaptis.api.problem import load_problem
from adaptis.cli import main
from adaptis.cli.plan import ProgressLine
from adaptis.planner.costs import Costs
from adaptis.planner.simulator import simulate

ROOT = Path(__file__).resolve().parents[2]
SMALL = ROOT / "examples" / "problems" / "nemotron-h-small.yaml"
HETERO = ROOT / "examples" / "problems" / "heterogeneous-cluster.yaml"
EXAMPLES = [SMALL, HETERO]
RESULT_KEYS = {"feasible", "iteration_time", "bubble_ratio", "peak_memory_bytes", "stages", "placement",
               "search_seconds"}


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def _check_contract(doc: dict[str, Any], *, problem: Path, strategies: tuple[str, ...]) -> None:
    prob = load_problem(problem)
    assert set(doc) == {"name", "time_unit", "lower_bound", "strategies"}
    assert doc["name"] == prob.name and doc["time_unit"] == prob.time_unit
    assert list(doc["strategies"]) == list(strategies)
    for name, r in doc["strategies"].items():
        if r["feasible"]:
            assert set(r) >= RESULT_KEYS, name
            assert len(r["peak_memory_bytes"]) == len(r["placement"]) == prob.device_count
            assert sorted(s for p in r["placement"] for s in p) == list(range(r["stages"]))
            assert 0 <= r["bubble_ratio"] < 1
            assert r["iteration_time"] >= doc["lower_bound"] * (1 - 1e-9), name
        else:
            assert r["reason"], name


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_compare_json_in_process(example: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(["plan", str(example), "--compare", "--json"], capsys)
    assert code == 0
    doc = json.loads(out)  # nothing but the JSON on stdout
    _check_contract(doc, problem=example, strategies=STRATEGY_NAMES)
    best = doc["strategies"]["adaptis"]
    assert best["feasible"]
    for name, r in doc["strategies"].items():
        if r["feasible"]:
            assert best["iteration_time"] <= r["iteration_time"] * (1 + 1e-9), name


def test_compare_json_as_a_real_process() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "adaptis", "plan", str(HETERO), "--compare", "--json"],
        capture_output=True, text=True, cwd=ROOT, timeout=120, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    _check_contract(doc, problem=HETERO, strategies=STRATEGY_NAMES)
    feasible = [r["iteration_time"] for n, r in doc["strategies"].items() if n != "adaptis" and r["feasible"]]
    assert doc["strategies"]["adaptis"]["iteration_time"] <= min(feasible)
    # The slow devices hold 40 GB: gpipe's head keeps every microbatch's logits and cannot fit.
    assert doc["strategies"]["gpipe"]["feasible"] is False
    assert "device 7 needs" in doc["strategies"]["gpipe"]["reason"]


def test_single_strategy_has_the_same_shape(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(["plan", str(SMALL), "--strategy", "zb-h1", "--json"], capsys)
    assert code == 0
    doc = json.loads(out)
    _check_contract(doc, problem=SMALL, strategies=("zb-h1",))
    code, out, _ = _cli(["plan", str(SMALL), "--json"], capsys)
    assert code == 0 and list(json.loads(out)["strategies"]) == ["adaptis"]  # the default


def test_table_lists_every_strategy_and_explains_infeasible(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(["plan", str(HETERO), "--compare"], capsys)
    assert code == 0
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("strategy"))
    assert "iteration (ms)" in lines[header] and "bubble" in lines[header] and "speedup" in lines[header]
    rows = {line.split()[0]: line.split() for line in lines[header + 2: header + 2 + len(STRATEGY_NAMES)]}
    assert set(rows) == set(STRATEGY_NAMES)
    assert rows["adaptis"][1] == "yes" and rows["gpipe"][1] == "no"
    assert float(rows["balanced"][4].rstrip("x")) >= 1.0  # adaptis speedup over balanced
    widths = {len(lines[header + 2 + i].rstrip()) for i in range(len(STRATEGY_NAMES))}
    assert len(widths) == 1  # aligned: numbers are right-aligned to the same edge
    assert any(line.startswith("lower bound: ") and "adaptis at" in line for line in lines)
    assert any(line.startswith("note: gpipe is infeasible: device 7 needs") for line in lines)


@pytest.mark.parametrize("argv, strategy", [
    ([], "adaptis"),
    (["--compare"], "adaptis"),
    (["--compare", "--strategy", "zb-v"], "zb-v"),
])
def test_saved_plan_replays_to_the_reported_time(
    argv: list[str], strategy: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = tmp_path / "plans" / "plan.json"
    code, out, err = _cli(["plan", str(SMALL), "--json", "--save-plan", str(saved), *argv], capsys)
    assert code == 0, err
    reported = json.loads(out)["strategies"][strategy]["iteration_time"]
    plan = load_plan(saved)
    assert plan.strategy == strategy
    sim = simulate(Costs.from_problem(load_problem(SMALL)), plan)
    assert sim.feasible
    assert sim.iteration_time == pytest.approx(reported, rel=1e-9)


def test_timeline_png_and_svg(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "t.png"
    code, _, err = _cli(["plan", str(HETERO), "--timeline", str(png)], capsys)
    assert code == 0, err
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    svg = tmp_path / "t.svg"
    code, _, _ = _cli(["plan", str(SMALL), "--compare", "--strategy", "1f1b", "--timeline", str(svg)], capsys)
    assert code == 0 and "BW fused backward" in svg.read_text()  # 1f1b's plan, not adaptis's
    code, _, err = _cli(["plan", str(SMALL), "--timeline", str(tmp_path / "t.pdf")], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and ".png or .svg" in err


def _small_doc() -> dict[str, Any]:
    return yaml.safe_load(SMALL.read_text())


def _set(doc: dict[str, Any], *, path: list[Any], value: Any) -> dict[str, Any]:
    node: Any = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return doc


BAD_DOCS = {
    "negative-forward": (["layers", 0, "forward"], -1.0, "layers[0].forward"),
    "unknown-key": (["layers", 1, "layers", 0, "flops"], 3, "layers[1].layers[0].flops"),
    "repeat-zero": (["layers", 1, "repeat"], 0, "layers[1].repeat"),
    "zero-devices": (["devices", "count"], 0, "devices.count"),
    "zero-microbatches": (["microbatches"], 0, "microbatches"),
}


@pytest.mark.parametrize("case", sorted(BAD_DOCS))
def test_bad_problem_is_one_line_naming_the_key(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, value, key = BAD_DOCS[case]
    bad = tmp_path / f"{case}.yaml"
    bad.write_text(yaml.safe_dump(_set(_small_doc(), path=path, value=value)))
    code, out, err = _cli(["plan", str(bad), "--compare"], capsys)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("adaptis plan: problem: ") and key in lines[0], err


@pytest.mark.parametrize("content, expected", [
    (None, "cannot read"),
    ("a: b: c\n  - [unclosed\n", "not valid YAML"),
    ("just some words\n", "expected a mapping"),
    ("\x00\x01binary", "not valid YAML"),
])
def test_unreadable_file_is_one_line(
    content: str | None, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "problem.yaml"
    if content is not None:
        path.write_text(content)
    code, out, err = _cli(["plan", str(path)], capsys)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], err


def test_missing_file_as_a_real_process(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "adaptis", "plan", str(tmp_path / "nope.yaml"), "--json"],
        capture_output=True, text=True, cwd=ROOT, timeout=60, check=False,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [f"adaptis plan: problem: cannot read {tmp_path / 'nope.yaml'}: "
                                                "No such file or directory"]


def test_one_layer_model_reports_strategies_that_need_more_layers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    one = tmp_path / "one.yaml"
    one.write_text(yaml.safe_dump({"microbatches": 4, "layers": [{"name": "only", "forward": 1.0, "backward": 1.0}],
                                   "devices": {"count": 2}}))
    code, out, err = _cli(["plan", str(one), "--compare", "--json"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    for name in ("i1f1b", "zb-v"):
        assert doc["strategies"][name]["feasible"] is False
        assert "needs at least 2 layers" in doc["strategies"][name]["reason"]
    assert doc["strategies"]["adaptis"]["feasible"] and doc["strategies"]["1f1b"]["feasible"]
    code, out, err = _cli(["plan", str(one), "--strategy", "zb-v"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "needs at least 2 layers" in err


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_line_on_a_terminal_only_after_a_second() -> None:
    stream, clock = io.StringIO(), _Clock()
    progress = ProgressLine(stream=stream, time_unit="ms", clock=clock, tty=True)
    progress(3, 50, float("inf"))
    clock.now += 0.5
    progress(10, 50, 812.5)
    assert stream.getvalue() == ""  # short searches do not flicker
    clock.now += 0.7
    progress(20, 50, 790.25)
    assert stream.getvalue() == "\r\x1b[Ksearching: 20/50 candidates, best 790.2 ms, 1.2 s"
    clock.now += 0.01
    progress(21, 50, 790.0)
    assert stream.getvalue().count("searching") == 1  # redraws are throttled
    clock.now += 0.2
    progress(22, 50, 780.0)
    progress.finish()
    assert stream.getvalue().count("searching") == 2
    assert stream.getvalue().endswith("\r\x1b[K")  # the line is erased, the table follows cleanly


def test_progress_on_a_terminal_leaves_no_log_line(caplog: pytest.LogCaptureFixture) -> None:
    clock = _Clock()
    progress = ProgressLine(stream=io.StringIO(), time_unit="ms", clock=clock, tty=True)
    with caplog.at_level(logging.INFO, logger="adaptis.cli.plan"):
        clock.now += 2.0
        progress(5, 5, 1.0)
        progress.finish()
    assert caplog.records == []


def test_progress_off_a_terminal_is_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    stream, clock = io.StringIO(), _Clock()
    progress = ProgressLine(stream=stream, time_unit="s", clock=clock, tty=False)
    with caplog.at_level(logging.INFO, logger="adaptis.cli.plan"):
        for i in range(30):
            clock.now += 0.1
            progress(i + 1, 30, 2.0 - i / 100)
        progress.finish()
    assert stream.getvalue() == ""
    assert [r.getMessage() for r in caplog.records] == ["search done: 30/30 candidates, best 1.710 s, 3.0 s"]


def test_plan_does_not_import_torch_or_kubernetes() -> None:
    code = ("import sys; from adaptis.cli import main; main(['plan', sys.argv[1], '--json']);"
            "print(sorted(m for m in ('torch', 'kubernetes', 'kopf') if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code, str(SMALL)], capture_output=True, text=True,
                         check=True, env=env, cwd=ROOT, timeout=60)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def _short_of_memory(tmp_path: Path, memory_bytes: float) -> Path:
    doc = yaml.safe_load(SMALL.read_text())
    doc["devices"]["memory_bytes"] = memory_bytes
    path = tmp_path / "short.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.parametrize("argv", [[], ["--compare"], ["--compare", "--json"]])
def test_infeasible_problem_exits_1_naming_the_memory_needed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    code, out, err = _cli(["plan", str(_short_of_memory(tmp_path, 1.0e9)), *argv], capsys)
    assert code == 1, err
    assert out  # the report is still printed: the status is what changes
    (line,) = [ln for ln in err.splitlines() if ln.startswith("adaptis plan:")]
    assert "strategy adaptis is infeasible: no partition fits in device memory" in line
    # The worst device of the leanest plan, the count and the lever; not a clause per device.
    assert "device 0 needs 10.2 GB, has 1.0 GB (10.20x), the worst of all 8 devices" in line, line
    assert "the parameters alone need 14.3 GB" in line and line.count("has 1.0 GB") == 1, line


def test_feasible_problem_exits_0_and_requested_baseline_decides(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _cli(["plan", str(SMALL), "--compare"], capsys)
    assert code == 0 and "infeasible" not in err, err
    # 12 GB: adaptis (and 1f1b) fit, gpipe's 26 GB on device 0 does not.
    short = _short_of_memory(tmp_path, 1.2e10)
    code, _, err = _cli(["plan", str(short), "--compare"], capsys)
    assert code == 0, err
    code, _, err = _cli(["plan", str(short), "--compare", "--strategy", "gpipe"], capsys)
    assert code == 1, err
    assert ("strategy gpipe is infeasible: device 7 needs 44.7 GB, has 12.0 GB (3.73x), "
            "the worst of 3 of the 8 devices over memory") in err, err
