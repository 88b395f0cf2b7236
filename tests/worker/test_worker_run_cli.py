"""``adaptis run``: the README's command end to end, a crashing rank, and Ctrl-C.

Real processes throughout: the CLI as a subprocess, which launches its ranks as processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "tiny-heterogeneous.yaml"


def _adaptis(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "adaptis", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def _manifest(tmp: Path, **training: object) -> Path:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = "cli-test"
    doc["spec"]["model"].update(vocabSize=512, hidden=16, heads=2)
    doc["spec"]["training"].update(microbatches=4, microbatchSize=1, sequenceLength=16, **training)
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _worker_pids(marker: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if marker in cmd and "worker" in cmd:
                pids.append(int(proc.name))
    return pids


def test_example_runs_and_reports_measured_and_predicted_bubble(tmp_path: Path) -> None:
    out = _adaptis("run", str(EXAMPLE), "--json", "--steps", "2", "--profile", "estimate",
                   "--workdir", str(tmp_path), "--metrics-port", "0", "--checkpoint-every", "0")
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout)
    assert summary["steps"] == 2 and summary["workers"] == 2 and summary["strategy"] == "adaptis"
    assert summary["final_loss"] > 0 and summary["tokens_per_second"] > 0
    assert 0.0 <= summary["measured_bubble_ratio"] < 1.0
    assert 0.0 <= summary["predicted_bubble_ratio"] < 1.0
    assert summary["predicted_iteration_seconds"] > 0 and summary["measured_iteration_seconds"] > 0
    assert "step    1/2" in out.stderr  # progress goes to stderr under --json


def test_a_crashing_rank_stops_the_run_and_is_named(tmp_path: Path) -> None:
    job = _manifest(tmp_path, steps=3, data={"source": "token-file", "path": str(tmp_path / "missing.bin")})
    out = _adaptis("run", str(job), "--profile", "estimate", "--workdir", str(tmp_path / "w"),
                   "--metrics-port", "0", "--strategy", "1f1b", timeout=120)
    assert out.returncode == 2
    assert "adaptis run: rank " in out.stderr and " failed: " in out.stderr
    assert "missing.bin does not exist" in out.stderr
    assert _worker_pids(str(tmp_path / "w")) == []


def test_ctrl_c_stops_every_rank(tmp_path: Path) -> None:
    job = _manifest(tmp_path, steps=100_000)
    workdir = tmp_path / "w"
    proc = subprocess.Popen([sys.executable, "-m", "adaptis", "run", str(job), "--profile", "estimate",
                             "--workdir", str(workdir), "--metrics-port", "0", "--checkpoint-every", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("step"):
                break
            assert time.monotonic() < deadline, "no progress line"
        assert len(_worker_pids(str(workdir))) == 2
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
        assert "interrupted" in proc.stderr.read() if proc.stderr else False
        time.sleep(0.5)
        assert _worker_pids(str(workdir)) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _worker_pids(str(workdir)):
            os.kill(pid, signal.SIGKILL)
