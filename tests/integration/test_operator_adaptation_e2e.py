"""Closed-loop adaptation through the operator, on the real control plane with a real Prometheus.

A job runs on kwok nodes (its pods only pretend to train), so its workers' metrics come from
fakeworkers.py: the counters real workers serve, each rank doing the compute the running plan
predicts for it, rank 1 twice as slow (a throttling GPU). A real Prometheus scrapes them with
the PodMonitor's labels (``namespace`` the pod's), plus a second target in another namespace
that names the same job and lies (rank 0 five times slower): the operator must not listen.
``adaptis operator --prometheus-url`` then reads the drift: with policy suggest the better plan
shows in status and nothing restarts; switched to auto (no restart for the switch itself), the
job is re-planned, its ConfigMap holds the new plan and the new plan's pods run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from operator_process import OperatorProcess, install_crd, plan_record

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "charts"))
import chartkit
import promkit

from adaptis.operator.core.records import PlanRecord

NS = "adapt-e2e"
JOB = "drifting"
POOL = {"adaptis.io/test-pool": "adapt-e2e"}
HERE = Path(__file__).resolve().parent


def _job(policy: str) -> dict[str, Any]:
    return {"apiVersion": "adaptis.io/v1alpha1", "kind": "AdaPtisJob",
            "metadata": {"name": JOB, "namespace": NS},
            "spec": {
                # Blocks outweigh the head, so a slow device's blocks can move to the others.
                "model": {"vocabSize": 1024, "hidden": 512, "heads": 8,
                          "blocks": [{"kind": "attention", "count": 12}]},
                "training": {"steps": 10_000_000, "microbatches": 8, "sequenceLength": 128},
                "parallelism": {"workers": 4, "gpusPerWorker": 1},
                "planner": {"strategy": "adaptis", "timeLimitSeconds": 5},
                "adaptation": {"policy": policy, "windowSteps": 4, "driftThreshold": 0.15,
                               "minGain": 0.02, "maxReplans": 1},
                "worker": {"nodeSelector": dict(POOL),
                           # kwok keeps the pods Running: the job trains "forever".
                           "annotations": {"adaptis.io/fake-run-seconds": "3600"}},
            }}


class Env:
    def __init__(self, op: OperatorProcess, prom: promkit.PrometheusServer,
                 workers: Sequence[subprocess.Popen[bytes]], logs: Sequence[Path],
                 operator_metrics: str) -> None:
        self.op, self.prom, self.workers, self.logs = op, prom, workers, logs
        self.operator_metrics = operator_metrics

    def scrape_operator(self) -> dict[str, float]:
        """The operator's samples by name and labels, as its /metrics writes them."""
        with urllib.request.urlopen(self.operator_metrics, timeout=5) as resp:  # loopback
            lines = resp.read().decode().splitlines()
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                for line in lines if line and not line.startswith("#")}

    def wait(self, what: str, predicate: Any, timeout: float = 120) -> Any:
        for w in self.workers:
            assert w.poll() is None, f"a fake worker process exited: {self.logs}"
        return self.op.wait(what, predicate, timeout=timeout)


@pytest.fixture(scope="module")
def env(control_plane: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    cp = control_plane
    install_crd(cp)
    cp.create_namespace(NS)
    for i in range(2):
        cp.add_fake_gpu_node(f"adapt-h100-{i}", product="NVIDIA-H100-80GB-HBM3", gpu_count=2,
                             zone="adapt-zone", rack="adapt-rack", labels=POOL)
    workdir = tmp_path_factory.mktemp("adaptation")
    honest, liar, metrics_port = (promkit.free_port() for _ in range(3))
    operator_metrics = f"http://127.0.0.1:{metrics_port}/metrics"
    config = promkit.write_config(workdir / "prometheus.yml", rule_files=[], targets=[
        # What the PodMonitor's relabelings give a worker pod's target: its own namespace.
        promkit.Target(port=honest, labels={"namespace": NS, "pod": f"{JOB}-worker-0"}),
        promkit.Target(port=liar, labels={"namespace": "another-tenant", "pod": "impostor"}),
    ])
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []
    with promkit.PrometheusServer(config, workdir=workdir) as prom:
        op = OperatorProcess(cp, workdir / "operator.log", namespace=NS)
        try:
            # The liar, in another tenant's namespace, also labels its samples with ours.
            for port, slow, claim in ((honest, "1=2.0", []), (liar, "0=5.0", ["--claim-namespace", NS])):
                log = workdir / f"fakeworkers-{port}.log"
                logs.append(log)
                procs.append(subprocess.Popen(  # our own helper
                    [sys.executable, str(HERE / "fakeworkers.py"), "--port", str(port),
                     "--job", JOB, "--operator", operator_metrics, "--slow", slow, *claim],
                    cwd=HERE, env=cp.env(), stdout=log.open("wb"), stderr=subprocess.STDOUT))
            op.start(extra_args=["--metrics-port", str(metrics_port), "--prometheus-url", prom.url,
                                 "--adaptation-poll-seconds", "1", "--restart-cost-seconds", "0"])
            yield Env(op, prom, procs, logs, operator_metrics)
        finally:
            op.stop()
            for p in procs:
                p.terminate()
                p.wait(timeout=20)


def _plan_hashes(env: Env) -> set[str]:
    return {p["metadata"]["labels"]["adaptis.io/plan-hash"] for p in env.op.pods(JOB)
            if not p["metadata"].get("deletionTimestamp")}


def _record(env: Env) -> Any:
    doc = plan_record(env.op.cp, job=JOB, namespace=NS)
    return None if doc is None else PlanRecord.model_validate(doc)


def test_suggest_then_auto_replans_the_running_job(env: Env) -> None:
    op = env.op
    op.cp.apply(_job("suggest"))
    env.wait("the job Running", op.phase_is(JOB, "Running"))
    first = _plan_hashes(env)
    assert len(first) == 1
    chartkit.poll_until(lambda: env.prom.query(f'adaptis_steps_total{{namespace="{NS}"}}'),
                        timeout=60, what="Prometheus to scrape the job's steps")

    def suggested() -> dict[str, Any] | None:
        return (op.status(JOB).get("adaptation") or {}).get("suggestion")

    suggestion = env.wait("a suggested re-plan", suggested)
    assert suggestion["newPredictedIterationSeconds"] < suggestion["oldPredictedIterationSeconds"]
    # Rank 1 is the slow one; the other namespace's lie about rank 0 was not heard.
    speeds = suggestion["deviceSpeed"]
    assert speeds[1] == pytest.approx(0.5, rel=0.1) and speeds[0] == pytest.approx(1.0, rel=0.1)
    cond = op.condition(JOB, "ReplanSuggested")
    assert cond is not None and (cond["status"], cond["reason"]) == ("True", "BetterPlan")
    assert op.status(JOB).get("replans", 0) == 0 and _plan_hashes(env) == first

    # The switch to auto is not a spec change that re-plans: the next full window does.
    old = _record(env)
    op.cp.kubectl("patch", "adaptisjob", JOB, "-n", NS, "--type=merge", "-p",
                  json.dumps({"spec": {"adaptation": {"policy": "auto"}}}))
    env.wait("the Replanned condition", lambda: (op.condition(JOB, "Replanned") or {}).get(
        "status") == "True")
    status = op.status(JOB)
    assert status["replans"] == 1
    (applied,) = status["adaptation"]["history"]
    assert applied["action"] == "applied" and applied["deviceSpeed"][1] == pytest.approx(0.5, rel=0.1)
    new = _record(env)
    assert new.plan != old.plan and new.device_speed == pytest.approx(applied["deviceSpeed"], rel=1e-3)
    events = {e["reason"] for e in op.events(JOB)}
    assert {"BetterPlan", "Drift"} <= events

    def new_gang_running() -> bool:
        pods = [p for p in op.pods(JOB) if not p["metadata"].get("deletionTimestamp")]
        return (len(pods) == 4 and all(p["status"].get("phase") == "Running" for p in pods)
                and _plan_hashes(env).isdisjoint(first)
                and op.status(JOB).get("phase") == "Running")

    env.wait("the new plan's pods Running", new_gang_running)
    metrics = env.scrape_operator()
    key = f'adaptis_operator_replans_total{{action="applied",adaptis_job="{JOB}",job_namespace="{NS}"}}'
    assert metrics.get(key) == 1.0, sorted(k for k in metrics if "replans" in k)

