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

import pytest
import yaml
from worker_harness import step_event

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "tiny-heterogeneous.yaml"


def _adaptis(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "adaptis", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, check=False)


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
    assert summary["precision"] == "fp32"  # auto on CPU ranks, recorded in the plan
    assert summary["final_loss"] > 0 and summary["tokens_per_second"] > 0
    assert 0.0 <= summary["measured_bubble_ratio"] < 1.0
    assert 0.0 <= summary["predicted_bubble_ratio"] < 1.0
    assert summary["predicted_iteration_seconds"] > 0 and summary["measured_iteration_seconds"] > 0
    assert "step    1/2" in out.stderr  # progress goes to stderr under --json
    # The whole step, split into its phases (rank 0's last step: the first is left out).
    phases = summary["phases"]
    assert set(phases) == {"pipeline_busy", "bubble", "post_pipeline", "data"}
    assert sum(p["share"] for p in phases.values()) == pytest.approx(1.0)
    assert phases["pipeline_busy"]["seconds"] > 0 and phases["post_pipeline"]["seconds"] > 0
    # The step is the pipeline part and the post-pipeline part (the data phase precedes it).
    assert summary["measured_step_seconds"] == pytest.approx(
        sum(p["seconds"] for k, p in phases.items() if k != "data"))
    assert (phases["pipeline_busy"]["seconds"] + phases["bubble"]["seconds"]
            == pytest.approx(summary["measured_iteration_seconds"]))


def test_summary_prints_the_step_phases(capsys: pytest.CaptureFixture[str]) -> None:
    from adaptis.api.plan import Plan
    from adaptis.cli.run_summary import print_summary as _print_summary
    from adaptis.cli.run_summary import summary as _summary

    plan = Plan(stages=[(0, 1)], placement=[[0]], actions=[[("F", 0, 0), ("BW", 0, 0)]],
                predicted={"iteration_time": 500.0, "bubble_ratio": 0.2, "time_unit": "ms",
                           "post_pipeline_time": 50.0, "step_time": 550.0})
    # Two steps; the first (one-off costs) is left out: 0.6 s pipeline with 25 % bubble, 0.1 s
    # after it, 0.3 s of data.
    steps = [step_event(step=i, loss=1.0, tokens_per_second=1.0, bubble_ratio=0.25, iteration_seconds=0.6 * i,
                        post_pipeline_seconds=0.1, data_seconds=0.3, step_seconds=0.6 * i + 0.1) for i in (9, 1)]
    summary = _summary("j", strategy="1f1b", plan=plan, workers=1, steps=steps, mesh=(1, 1, 0), reduce=[],
                       seconds=2.0, workdir=Path("w"), ports=[None], checkpoints=(Path("c"), 0, 0))
    assert summary["measured_step_seconds"] == pytest.approx(0.7)
    assert summary["phases"]["bubble"] == pytest.approx({"seconds": 0.15, "share": 0.15})
    _print_summary(summary)
    out = capsys.readouterr().out
    assert ("  step            measured 700.0 ms, predicted 550.0 ms (pipeline + post-pipeline); "
            "share of the training time:\n") in out
    assert "    pipeline        600.0 ms  60.0%  (busy 450.0 ms, bubble 150.0 ms)\n" in out
    assert "    post-pipeline   100.0 ms  10.0%  (predicted 50.0 ms)\n" in out
    assert "    data            300.0 ms  30.0%  (before the step: batch fetch, wait for every rank)\n" in out


def test_a_crashing_rank_stops_the_run_and_is_named(tmp_path: Path) -> None:
    job = _manifest(tmp_path, steps=3, data={"source": "token-file", "path": str(tmp_path / "missing.bin")})
    out = _adaptis("run", str(job), "--profile", "estimate", "--workdir", str(tmp_path / "w"),
                   "--metrics-port", "0", "--strategy", "1f1b", "--checkpoint-every", "0",
                   timeout=120)  # every 0: the example's 10 would exceed the 3 steps (refused)
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
        # communicate, not wait: the run goes on printing until its ranks agree on where to
        # stop, and a full pipe nobody reads would block it there.
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err[-3000:]
        assert "interrupted" in err
        gone = time.monotonic() + 15
        while _worker_pids(str(workdir)) and time.monotonic() < gone:
            time.sleep(0.1)  # the launcher reaps its ranks before it exits; /proc may lag
        assert _worker_pids(str(workdir)) == [], "ranks still running 15 s after the launcher exited"
        # The ranks' SIGTERM handler stopped them at a step boundary with a checkpoint of it
        # (docs/checkpoints.md), although no periodic one was asked for: the rerun resumes.
        saved = sorted(p.parent.name for p in (workdir / "checkpoints").glob("step-*/rank-*.pt"))
        assert len(saved) == 2 and len(set(saved)) == 1, f"no checkpoint of one step on both ranks: {saved}"
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _worker_pids(str(workdir)):
            os.kill(pid, signal.SIGKILL)


def test_rerun_resumes_incompatible_is_refused_and_only_fresh_deletes(tmp_path: Path) -> None:
    job = _manifest(tmp_path, steps=2)
    workdir = tmp_path / "w"
    ckpts = workdir / "checkpoints"
    flags = ["--profile", "estimate", "--workdir", str(workdir), "--metrics-port", "0",
             "--checkpoint-every", "1", "--json"]

    out = _adaptis("run", str(job), *flags)
    assert out.returncode == 0, out.stderr[-3000:]
    first = json.loads(out.stdout)
    assert first["resumed_from_step"] is None and first["checkpoint_dir"] == str(ckpts)
    saved = sorted(ckpts.glob("step-*/rank-*.pt"))
    assert len(saved) == 4  # steps 1 and 2, two ranks each

    # Another model in the same workdir: refused before any rank starts, nothing deleted.
    other = yaml.safe_load(job.read_text())
    other["spec"]["model"]["hidden"] = 32
    other_job = tmp_path / "other.yaml"
    other_job.write_text(yaml.safe_dump(other))
    out = _adaptis("run", str(other_job), *flags)
    assert out.returncode == 2 and out.stdout == ""
    assert "cannot resume" in out.stderr and "model.hidden: 16 there, 32 in this job" in out.stderr
    assert "--fresh" in out.stderr and "Nothing was deleted" in out.stderr
    assert sorted(ckpts.glob("step-*/rank-*.pt")) == saved

    # The plain rerun (what one types after Ctrl-C) continues from step 2.
    out = _adaptis("run", str(job), *flags, "--steps", "3")
    assert out.returncode == 0, out.stderr[-3000:]
    second = json.loads(out.stdout)
    assert second["resumed_from_step"] == 2 and second["steps"] == 3
    assert "resuming from the checkpoint of step 2" in out.stderr
    assert "step    3/3" in out.stderr and "step    1/3" not in out.stderr

    # Run again once the checkpoint completes the steps: nothing to train, said at once.
    out = _adaptis("run", str(job), *flags, "--steps", "3")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "already completes the 3 steps: nothing to train" in out.stderr
    assert json.loads(out.stdout)["trained_steps"] == 0 and "planned" not in out.stderr

    # --fresh deletes (steps 2 and 3 are kept: two per rank) and says so; it starts at step 1.
    out = _adaptis("run", str(job), *flags, "--steps", "1", "--checkpoint-every", "0", "--fresh")
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"--fresh: removed 4 checkpoint files (steps 2, 3) from {ckpts}" in out.stderr
    third = json.loads(out.stdout)
    assert third["resumed_from_step"] is None and third["steps"] == 1
    assert list(ckpts.glob("step-*/rank-*.pt")) == []

    # Nothing left to resume: --resume says so and fails.
    out = _adaptis("run", str(job), *flags, "--resume")
    assert out.returncode == 2
    assert f"--resume: no checkpoint in {ckpts}; run without --resume to start fresh" in out.stderr


def test_data_parallel_run_plans_one_pipeline_and_starts_every_replica(tmp_path: Path) -> None:
    """dataParallel 2 on 4 workers: the plan covers 2 devices, 4 ranks train, the summary is the
    job's (combined batch) with the all-reduce wait share, and only replica 0 checkpoints."""
    path = _manifest(tmp_path, steps=3)
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["parallelism"].update(workers=4, dataParallel=2)
    path.write_text(yaml.safe_dump(doc))
    out = _adaptis("run", str(path), "--json", "--profile", "estimate", "--workdir", str(tmp_path / "w"),
                   "--metrics-port", "0", "--checkpoint-every", "3")
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout)
    assert (summary["workers"], summary["ranks"], summary["data_parallel"], summary["pipeline_ranks"]) == (4, 4, 2, 2)
    assert len(summary["placement"]) == 2, "the plan is one pipeline replica of 2 devices"
    assert len(summary["metrics_ports"]) == 4, "every rank of both replicas started"
    assert 0.0 <= summary["reduce_wait_share"] < 1.0 and summary["measured_step_seconds"] > 0
    assert "on 2 ranks x 2 data-parallel replicas (4 ranks)" in out.stderr
    files = sorted(p.name for p in (tmp_path / "w" / "checkpoints" / "step-00000003").iterdir())
    assert files == ["rank-0.pt", "rank-1.pt"]


def test_local_replicas_charge_the_all_reduce_over_loopback() -> None:
    """A local run of R replicas plans with the replicas' all-reduce over loopback, unless its
    problem file says otherwise; one replica leaves the problem as it is."""
    from adaptis.api.problem import Link, parse_problem
    from adaptis.cli.run import _LOCAL_LINK, _local_mesh
    from adaptis.planner.strategies import plan_strategy

    doc = {"microbatches": 4, "devices": {"count": 2},
           "layers": [{"name": f"l{i}", "forward": 1.0, "backward": 1.0, "weight": 1.0,
                       "param_bytes": 4e8} for i in range(4)]}
    one = parse_problem(doc)
    assert _local_mesh(one, replicas=1, tensor=1) is one
    two = _local_mesh(one, replicas=2, tensor=1)
    assert two.data_parallel == 2 and two.network.data_parallel == _LOCAL_LINK
    step = {p.data_parallel: plan_strategy(p, "1f1b").plan.predicted.step_time for p in (one, two)}
    assert step[2] > step[1], "the replicas' gradient all-reduce is charged to the step"
    own = parse_problem({**doc, "data_parallel": 2,
                         "network": {"data_parallel": {"bandwidth_bytes_per_s": 1e9}}})
    assert _local_mesh(own, replicas=2, tensor=1).network.data_parallel == Link(bandwidth_bytes_per_s=1e9)


def test_local_ranks_sharing_cores_are_planned_slower() -> None:
    """More local rank threads than cores: each device runs at cores / threads of its profiled
    speed, so the predicted step doubles with twice the ranks on the same cores."""
    from adaptis.api.problem import parse_problem
    from adaptis.cli.run import _shared_cores
    from adaptis.planner.strategies import plan_strategy

    doc = {"microbatches": 4, "layers": [{"name": f"l{i}", "forward": 1.0, "backward": 2.0}
                                         for i in range(4)]}
    for devices in ({"count": 2}, {"list": [{"node": "a"}, {"node": "a", "speed": 2.0}]}):
        problem = parse_problem({**doc, "devices": devices})
        assert _shared_cores(problem, threads=2, cores=2) is problem
        shared = _shared_cores(problem, threads=4, cores=2)
        assert [d.speed for d in shared.device_specs()] == [d.speed / 2 for d in problem.device_specs()]
        alone, halved = (plan_strategy(p, "1f1b").plan.predicted.iteration_time for p in (problem, shared))
        assert halved == pytest.approx(2 * alone)
