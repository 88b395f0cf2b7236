"""The operator on a real control plane, as a new user meets it.

``adaptis operator`` runs as a subprocess with the admin kubeconfig (what a user runs) and
watches one namespace of its own. The fake GPU nodes of this module carry a pool label and
every job selects it, so nodes other tests add never take part in these plans. kwok plays the
kubelet: pods become Running, complete after ``adaptis.io/fake-run-seconds`` or fail when
annotated ``adaptis.io/fake-fail``. The scheduler and the garbage collector are the real ones.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from memcg import MemoryCgroup
from operator_process import OperatorProcess, install_crd

from adaptis.api.events import DoneEvent, parse_event_line
from adaptis.api.job import WorkerConfig

NS = "operator-e2e"
POOL = {"adaptis.io/test-pool": "operator-e2e"}


def _job(name: str, **spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "model": {"vocabSize": 512, "hidden": 32, "heads": 2,
                  "blocks": [{"kind": "attention", "count": 2}, {"kind": "mamba", "count": 2},
                             {"kind": "attention", "count": 2}]},
        "training": {"steps": 2, "microbatches": 4, "sequenceLength": 16},
        "parallelism": {"workers": 2, "gpusPerWorker": 1},
        "worker": {"nodeSelector": dict(POOL),
                   "annotations": {"adaptis.io/fake-run-seconds": "3"}},
    }
    for key, value in spec.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return {"apiVersion": "adaptis.io/v1alpha1", "kind": "AdaPtisJob",
            "metadata": {"name": name, "namespace": NS}, "spec": base}


class Operator(OperatorProcess):
    """The operator subprocess (with its liveness endpoint) and the reads of these tests."""

    def __init__(self, cp: Any, log_path: Path) -> None:
        super().__init__(cp, log_path, namespace=NS)
        self.liveness = ""
        self.metrics = ""

    def start(self, *, extra_args: Sequence[str] = (),
              cgroup: MemoryCgroup | None = None) -> None:
        self.liveness = f"http://127.0.0.1:{_free_port()}/healthz"
        port = _free_port()
        self.metrics = f"http://127.0.0.1:{port}/metrics"
        super().start(extra_args=["--liveness", self.liveness, "--metrics-port", str(port), "--topology-keys",
                                  "topology.kubernetes.io/zone,topology.adaptis.io/rack",
                                  *extra_args], cgroup=cgroup)

    def scrape(self) -> dict[str, float]:
        """The operator's metrics, by sample name with labels, e.g. ``adaptis_operator_jobs{phase="Failed"}``."""
        with urllib.request.urlopen(self.metrics, timeout=5) as resp:  # a local test server
            text = resp.read().decode()
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines() if line and not line.startswith("#")}



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def operator(control_plane: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    cp = control_plane
    install_crd(cp)
    cp.create_namespace(NS)
    # Two kinds of GPU in two zones: H100 in zone-a, A100 in zone-b, two GPUs per node.
    for i in range(2):
        cp.add_fake_gpu_node(f"e2e-h100-{i}", product="NVIDIA-H100-80GB-HBM3", gpu_count=2,
                             zone="e2e-zone-a", rack="rack-a", labels=POOL)
        cp.add_fake_gpu_node(f"e2e-a100-{i}", product="NVIDIA-A100-SXM4-80GB", gpu_count=2,
                             gpu_memory_mib=81920, zone="e2e-zone-b", rack="rack-b", labels=POOL)
    op = Operator(cp, tmp_path_factory.mktemp("operator") / "operator.log")
    op.start()
    try:
        yield op
    finally:
        op.stop()


def test_liveness_endpoint_answers(operator: Operator) -> None:
    def probe() -> int:
        with urllib.request.urlopen(operator.liveness, timeout=5) as resp:
            return int(resp.status)

    assert operator.wait("the liveness probe", probe) == 200


def test_crd_installs_and_kubectl_explain_teaches_the_spec(operator: Operator) -> None:
    out = operator.cp.kubectl("explain", "adaptisjobs.spec.parallelism.workers").stdout
    assert "Worker pods" in out
    out = operator.cp.kubectl("explain", "apj.spec.planner.strategy").stdout
    assert "adaptis" in out and "i1f1b" in out


@pytest.mark.parametrize(("patch", "needle"), [
    ({"parallelism": {"workers": 0}}, "spec.parallelism.workers"),
    ({"planner": {"strategy": "fastest"}}, "spec.planner.strategy"),
    ({"parallelism": {"wrokers": 2}}, "wrokers"),
    ({"model": {"vocabSize": 512, "hidden": 30, "heads": 4, "blocks": [{"kind": "dense"}]}},
     "heads must divide hidden"),
])
def test_invalid_manifest_is_rejected_by_the_api_server(
        operator: Operator, patch: dict[str, Any], needle: str) -> None:
    bad = _job("rejected", **patch)
    result = operator.cp.kubectl("apply", "-f", "-", input=json.dumps(bad), check=False)
    assert result.returncode != 0, result.stdout
    assert needle in result.stderr, result.stderr


def test_semantically_invalid_job_fails_with_condition_and_event(operator: Operator) -> None:
    # An operator-only rule (the rendezvous port): the job-level rules that CEL can express
    # (workers > layers, ...) the API server refuses before the operator sees them
    # (tests/integration/test_crd_rules.py).
    operator.cp.apply(_job("port-clash", metrics={"port": 29500}))
    operator.wait("phase Failed", operator.phase_is("port-clash", "Failed"))
    failed = operator.condition("port-clash", "Failed")
    assert failed is not None and failed["reason"] == "InvalidSpec"
    assert failed["message"].startswith("spec.metrics.port:")

    def event() -> list[dict[str, Any]]:
        items = operator.cp.get_json(
            "events", "-n", NS, "--field-selector", "involvedObject.name=port-clash")["items"]
        return [e for e in items if e["reason"] == "InvalidSpec" and e["type"] == "Warning"]

    (ev,) = operator.wait("an InvalidSpec event", event)
    assert "spec.metrics.port" in ev["message"]
    assert operator.pods("port-clash") == []


def test_job_is_planned_bound_as_planned_and_succeeds(operator: Operator) -> None:
    name = "hetero"
    # Six ranks of one GPU do not fit zone-a's four H100s: the plan spans both GPU kinds.
    operator.cp.apply(_job(name, parallelism={"workers": 6},
                           worker={"nodeSelector": dict(POOL),
                                   "annotations": {"adaptis.io/fake-run-seconds": "6"}}))
    operator.wait("phase Running", operator.phase_is(name, "Running"), timeout=90)
    status = operator.status(name)
    placement = status["placement"]
    assert len(placement) == 6 and status["workersReady"] == "6/6"
    assert {p["gpu"] for p in placement} == {"NVIDIA-H100-80GB-HBM3", "NVIDIA-A100-SXM4-80GB"}
    assert status["stages"] >= 6 and 0 <= status["predictedBubbleRatio"] < 1
    assert status["predictedSpeedupOverI1F1B"] > 0
    for type_, want in (("Profiling", "False"), ("Planned", "True"), ("Running", "True")):
        cond = operator.condition(name, type_)
        assert cond is not None and cond["status"] == want, cond
    pods = operator.pods(name)
    assert [p["spec"]["nodeName"] for p in pods] == [p["node"] for p in placement]
    cm = operator.cp.get_json("configmap", f"{name}-config", "-n", NS)
    config = WorkerConfig.model_validate_json(cm["data"]["worker.json"])
    assert len(config.plan["placement"]) == 6
    table = operator.cp.kubectl("get", "apj", name, "-n", NS).stdout
    assert table.split("\n")[0].split()[:7] == ["NAME", "PHASE", "READY", "STAGES", "BUBBLE",
                                                "OBSERVED", "SPEEDUP"]
    operator.wait("phase Succeeded", operator.phase_is(name, "Succeeded"), timeout=90)
    final = operator.status(name)
    assert final["completionTime"] >= final["startTime"]
    assert operator.condition(name, "Succeeded")["status"] == "True"  # type: ignore[index]
    # The operator's own metrics, as Prometheus scrapes them: passes ran, the job is counted.
    metrics = operator.wait("the job counted as Succeeded in the operator's metrics",
                            lambda: (m := operator.scrape()).get('adaptis_operator_jobs{phase="Succeeded"}', 0) >= 1
                            and m)
    assert metrics['adaptis_operator_reconciles_total{result="ok"}'] >= 3  # pending, planned, running...
    assert (metrics["adaptis_operator_reconcile_seconds_count"]
            >= metrics['adaptis_operator_reconciles_total{result="ok"}'])
    assert "adaptis_operator_queue_depth" in metrics


def test_unsatisfiable_placement_shows_in_status(operator: Operator) -> None:
    operator.cp.apply(_job("too-big", parallelism={"workers": 2, "gpusPerWorker": 4}))

    def unsatisfiable() -> dict[str, Any] | None:
        cond = operator.condition("too-big", "Planned")
        return cond if cond and cond["reason"] == "Unsatisfiable" else None

    cond = operator.wait("Planned=False Unsatisfiable", unsatisfiable)
    assert cond["status"] == "False" and "spec.parallelism.workers" in cond["message"]
    assert operator.status("too-big")["phase"] == "Pending"
    assert operator.pods("too-big") == []


def test_failed_pod_restarts_the_gang_then_fails_at_the_backoff_limit(
        operator: Operator) -> None:
    name = "flaky"
    operator.cp.apply(_job(name, backoffLimit=1,
                           worker={"nodeSelector": dict(POOL),
                                   "annotations": {"adaptis.io/fake-run-seconds": "2",
                                                   "adaptis.io/fake-fail": "true"}}))
    operator.wait("phase Failed", operator.phase_is(name, "Failed"), timeout=120)
    status = operator.status(name)
    assert status["restarts"] == 1
    failed = operator.condition(name, "Failed")
    assert failed is not None and failed["reason"] == "BackoffLimitExceeded"
    events = operator.cp.get_json("events", "-n", NS, "--field-selector",
                                  f"involvedObject.name={name}")["items"]
    assert any(e["reason"] == "PodFailed" for e in events)


def test_suspend_removes_pods_and_resume_recreates_them(operator: Operator) -> None:
    name = "pausable"
    operator.cp.apply(_job(name, worker={"nodeSelector": dict(POOL),
                                         "annotations": {"adaptis.io/fake-run-seconds": "600"}}))
    operator.wait("phase Running", operator.phase_is(name, "Running"), timeout=90)
    operator.cp.kubectl("patch", "apj", name, "-n", NS, "--type=merge",
                        "-p", '{"spec": {"suspend": true}}')
    operator.wait("phase Suspended", operator.phase_is(name, "Suspended"))
    operator.wait("no pods", lambda: operator.pods(name) == [])
    operator.cp.kubectl("patch", "apj", name, "-n", NS, "--type=merge",
                        "-p", '{"spec": {"suspend": false}}')
    operator.wait("phase Running again", operator.phase_is(name, "Running"), timeout=90)
    assert len(operator.pods(name)) == 2
    resumed = operator.condition(name, "Suspended")
    assert resumed is not None and resumed["reason"] == "Resumed"


def test_delete_removes_every_child(operator: Operator) -> None:
    name = "pausable"
    cp = operator.cp
    assert operator.pods(name)
    cp.kubectl("delete", "apj", name, "-n", NS, "--wait=true", "--timeout=60s")

    def gone() -> bool:
        left = cp.kubectl("get", "pods,configmaps,services", "-n", NS, "-l",
                          f"adaptis.io/job={name}", "-o", "name").stdout.split()
        return not left

    operator.wait("the garbage collector", gone, timeout=90)


def test_operator_restart_keeps_the_same_pods(operator: Operator) -> None:
    name = "steady"
    operator.cp.apply(_job(name, worker={"nodeSelector": dict(POOL),
                                         "annotations": {"adaptis.io/fake-run-seconds": "600"}}))
    operator.wait("phase Running", operator.phase_is(name, "Running"), timeout=90)
    before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in operator.pods(name)}
    operator.stop()
    operator.start()  # resumes: lists every job and reconciles it again
    jobs = len(operator.cp.get_json("adaptisjobs", "-A")["items"])

    def passed_twice() -> bool:
        # The new process's own counters: it has left a job Running, and made two passes per
        # job (the first on start, then a resync), any of which could have replaced a pod.
        seen = operator.scrape()
        return (seen.get('adaptis_operator_jobs{phase="Running"}', 0) >= 1
                and seen.get('adaptis_operator_reconciles_total{result="ok"}', 0) >= 2 * jobs)

    operator.wait("the restarted operator to pass every job twice", passed_twice, timeout=90)
    operator.wait("phase Running", operator.phase_is(name, "Running"))
    after = {p["metadata"]["name"]: p["metadata"]["uid"] for p in operator.pods(name)}
    assert after == before
    operator.cp.kubectl("delete", "apj", name, "-n", NS, "--wait=false")


def test_lost_node_replans_on_the_nodes_left(operator: Operator) -> None:
    cp = operator.cp
    pool = {"adaptis.io/test-pool": "operator-lost"}
    for i in range(3):
        cp.add_fake_gpu_node(f"e2e-lost-{i}", gpu_count=2, zone="e2e-zone-d", labels=pool)
    name = "survivor"
    cp.apply(_job(name, parallelism={"workers": 2, "gpusPerWorker": 2},
                  worker={"nodeSelector": pool,
                          "annotations": {"adaptis.io/fake-run-seconds": "600"}}))
    operator.wait("phase Running", operator.phase_is(name, "Running"), timeout=90)
    first = [p["node"] for p in operator.status(name)["placement"]]
    assert len(set(first)) == 2
    cp.kubectl("delete", "node", first[0])

    def replanned() -> list[str] | None:
        st = operator.status(name)
        nodes = [p["node"] for p in st.get("placement", [])]
        return nodes if st.get("replans") == 1 and first[0] not in nodes else None

    operator.wait("a re-plan without the lost node", replanned, timeout=90)
    operator.wait("phase Running again", operator.phase_is(name, "Running"), timeout=90)
    pods = operator.pods(name)
    # status.placement lists every rank (2 a pod): each pod is bound where its ranks are.
    placement = operator.status(name)["placement"]
    assert len(placement) == 4
    assert {p["metadata"]["name"]: p["spec"]["nodeName"] for p in pods} == {
        a["pod"]: a["node"] for a in placement}
    cond = operator.condition(name, "Restarting")
    assert cond is not None and cond["reason"] == "Recovered"
    events = cp.get_json("events", "-n", NS, "--field-selector",
                         f"involvedObject.name={name}")["items"]
    assert any(e["reason"] == "NodesChanged" and first[0] in e["message"] for e in events)
    cp.kubectl("delete", "apj", name, "-n", NS, "--wait=false")


def test_active_deadline_and_ttl_after_finished(operator: Operator) -> None:
    cp = operator.cp
    cp.apply(_job("bounded", activeDeadlineSeconds=4,
                  worker={"nodeSelector": dict(POOL),
                          "annotations": {"adaptis.io/fake-run-seconds": "600"}}))
    cp.apply(_job("ephemeral", ttlSecondsAfterFinished=2,
                  worker={"nodeSelector": dict(POOL),
                          "annotations": {"adaptis.io/fake-run-seconds": "1"}}))
    operator.wait("bounded Failed", operator.phase_is("bounded", "Failed"), timeout=60)
    cond = operator.condition("bounded", "Failed")
    assert cond is not None and cond["reason"] == "DeadlineExceeded"
    operator.wait("bounded's pods gone", lambda: operator.pods("bounded") == [], timeout=60)

    def deleted() -> bool:
        out = cp.kubectl("get", "apj", "ephemeral", "-n", NS, check=False)
        return out.returncode != 0 and "NotFound" in out.stderr

    operator.wait("ephemeral deleted by its TTL", deleted, timeout=60)


@pytest.mark.slow  # two real torch ranks on CPU: about 30 s on 2 busy cores
def test_rendered_worker_pods_really_train(operator: Operator, tmp_path: Path) -> None:
    """Run each pod's command with its environment and its mounted worker.json locally."""
    name = "trains"
    operator.cp.apply(_job(name, parallelism={"workers": 2, "gpusPerWorker": 0},
                           worker={"nodeSelector": dict(POOL),
                                   "annotations": {"adaptis.io/fake-run-seconds": "600"}}))
    operator.wait("pods created", lambda: len(operator.pods(name)) == 2, timeout=60)
    cm = operator.cp.get_json("configmap", f"{name}-config", "-n", NS)
    mounted = tmp_path / "etc-adaptis"
    mounted.mkdir()
    config = json.loads(cm["data"]["worker.json"])
    # Pods have a network namespace each; local processes share one, so the metrics port
    # becomes "any free port" and rank 0's DNS name becomes loopback. Nothing else changes.
    config["metricsPort"] = 0
    # The checkpoint volume (an emptyDir at /checkpoints in the pod) is a local directory.
    config["checkpointDir"] = str(tmp_path / "checkpoints")
    (mounted / "worker.json").write_text(json.dumps(config))
    port = str(_free_port())
    procs = []
    for pod in operator.pods(name):
        (container,) = pod["spec"]["containers"]
        mount = next(m for m in container["volumeMounts"] if m["name"] == "adaptis-config")
        command = [str(Path(sys.executable).parent / container["command"][0]),
                   *[a.replace(mount["mountPath"], str(mounted)) for a in container["command"][1:]]]
        env = dict(os.environ)
        env.update({e["name"]: e["value"] for e in container["env"] if "value" in e})
        env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
        # The writable home (an emptyDir: HOME and the torch caches point into it), local.
        home = next(m["mountPath"] for m in container["volumeMounts"]
                    if m["name"] == "adaptis-home")
        local_home = tmp_path / pod["metadata"]["name"] / "home"
        env.update({k: str(local_home) + v[len(home):] for k, v in env.items()
                    if v == home or v.startswith(home + "/")})
        procs.append(subprocess.Popen(command, env=env, cwd=tmp_path,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        outputs.append((proc.returncode, out.decode(), err.decode()))
    for rc, _out, err in outputs:
        assert rc == 0, f"worker failed ({rc}):\n{err[-3000:]}"
    events = [e for rc, out, _ in outputs for e in map(parse_event_line, out.splitlines()) if e is not None]
    done = sorted((e.rank, e.steps) for e in events if isinstance(e, DoneEvent))
    assert done == [(0, 2), (1, 2)], outputs[0][1][-2000:]
    operator.cp.kubectl("delete", "apj", name, "-n", NS, "--wait=false")
