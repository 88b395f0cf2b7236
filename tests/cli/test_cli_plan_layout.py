"""``adaptis plan FILE --gpus N --global-batch B``: the real CLI, in-process and as a process,
on the example problem: the top layouts by predicted step, its JSON, the exit statuses, bad
input named by its flag, and ``adaptis plan`` without ``--gpus`` as it was."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from adaptis.api.problem import load_problem
from adaptis.cli import main
from adaptis.planner.layout import search_layouts

ROOT = Path(__file__).resolve().parents[2]
SMALL = ROOT / "examples" / "problems" / "nemotron-h-small.yaml"
HETERO = ROOT / "examples" / "problems" / "heterogeneous-cluster.yaml"
FAST = ["--gpus", "8", "--global-batch", "16", "--microbatch-sizes", "1,2"]


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_table_shows_the_top_five_by_step(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(["plan", str(SMALL), *FAST, "--seq-len", "4096"], capsys)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("nemotron-h-small: 8 GPUs, 16 sequences a step: ")
    head = next(i for i, text in enumerate(lines) if text.lstrip().startswith("#"))
    assert "tokens/s" in lines[head] and "why not first" in lines[head]
    rows = [text.split() for text in lines[head + 2:] if text.strip() and text.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == [1, 2, 3, 4, 5]
    steps = [float(r[7].replace(",", "")) for r in rows]
    assert steps == sorted(steps)
    assert rows[0][-1] == "(best)" and all("slower" in " ".join(r) or "as fast" in " ".join(r) for r in rows[1:])
    for r in rows:  # R x P x T = GPUs, M x m x R = the batch
        gpus, rep, pipe, ten, size, count = (int(x) for x in r[1:7])
        assert rep * pipe * ten == gpus == 8 and count * size * rep == 16


def test_json_is_the_library_result(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(["plan", str(SMALL), *FAST, "--json", "--top", "3"], capsys)
    assert code == 0
    doc = json.loads(out)  # nothing but the JSON on stdout
    assert doc["gpus"] == 8 and doc["global_batch"] == 16 and len(doc["layouts"]) == 3
    assert [x["step_time"] for x in doc["layouts"]] == sorted(x["step_time"] for x in doc["layouts"])
    assert doc["layouts"][0]["reason"] is None and doc["layouts"][0]["tokens_per_s"] is None
    ref = search_layouts(load_problem(SMALL), gpus=8, global_batch=16, microbatch_sizes=(1, 2), keep=3)
    best = ref.ranked[0].layout
    first = doc["layouts"][0]
    assert (first["data_parallel"], first["pipeline"], first["tensor"], first["microbatch_size"]) == (
        best.data_parallel, best.pipeline, best.tensor, best.microbatch_size)


def test_without_gpus_plan_is_unchanged(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(["plan", str(SMALL), "--json"], capsys)
    assert code == 0
    assert set(json.loads(out)) == {"name", "time_unit", "lower_bound", "strategies"}


def test_every_layout_over_memory_is_status_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = yaml.safe_load(SMALL.read_text())
    doc["devices"]["memory_bytes"] = 1.0e9  # the 4 GB head alone does not fit
    tight = tmp_path / "tight.yaml"
    tight.write_text(yaml.safe_dump(doc))
    code, out, err = _cli(["plan", str(tight), *FAST], capsys)
    assert code == 1
    assert "layouts refused over memory" in out
    assert "no layout of 8 GPUs fits in memory" in err and "over memory" in err


@pytest.mark.parametrize(("argv", "named"), [
    (["--gpus", "8"], "--global-batch"),
    (["--gpus", "23", "--global-batch", "16"], "--global-batch"),
    (["--gpus", "8", "--global-batch", "16", "--min-gpus", "9"], "--min-gpus"),
    (["--gpus", "8", "--global-batch", "16", "--compare"], "--compare"),
    (["--gpus", "8", "--global-batch", "16", "--layout-time-limit", "0"], "--layout-time-limit"),
])
def test_bad_input_names_the_flag(argv: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _cli(["plan", str(SMALL), *argv], capsys)
    assert code == 2
    assert named in err


def test_heterogeneous_problem_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _cli(["plan", str(HETERO), *FAST], capsys)
    assert code == 2 and "devices" in err and "without --gpus" in err


def test_as_a_real_process() -> None:
    proc = subprocess.run([sys.executable, "-m", "adaptis", "plan", str(SMALL), *FAST, "--json"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["layouts"]) == 5
