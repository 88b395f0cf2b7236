"""The operator on a cluster other teams share: free GPUs only, a queue, lost ranks.

Real kube-apiserver, scheduler, controller-manager and kwok; the operator is the subprocess a
user runs, here with ``--unschedulable-replan-seconds 5`` so that a placement the scheduler
cannot bind is re-planned within the test. Each test uses node pools of its own.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from operator_process import OperatorProcess, install_crd

NS = "shared-cluster"
OTHER = "other-team"


def _job(name: str, *, pool: Mapping[str, str], workers: int = 2, run_s: int = 600,
         backoff_limit: int = 0, **worker: Any) -> dict[str, Any]:
    return {"apiVersion": "adaptis.io/v1alpha1", "kind": "AdaPtisJob",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"model": {"vocabSize": 512, "hidden": 32, "heads": 2,
                               "blocks": [{"kind": "attention", "count": 4}]},
                     "training": {"steps": 2, "microbatches": 4, "sequenceLength": 16},
                     "parallelism": {"workers": workers, "gpusPerWorker": 1},
                     "planner": {"strategy": "1f1b"},
                     "backoffLimit": backoff_limit,
                     "worker": {"nodeSelector": dict(pool),
                                "annotations": {"adaptis.io/fake-run-seconds": str(run_s)},
                                **worker}}}


@pytest.fixture(scope="module")
def operator(control_plane: Any, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[OperatorProcess]:
    cp = control_plane
    install_crd(cp)
    cp.create_namespace(NS)
    cp.create_namespace(OTHER)
    op = OperatorProcess(cp, tmp_path_factory.mktemp("shared") / "operator.log", namespace=NS)
    op.start(extra_args=["--unschedulable-replan-seconds", "5"])
    try:
        yield op
    finally:
        op.stop()


def _hog(name: str, *, node: str, gpus: int) -> dict[str, Any]:
    """Another team's pod, bound by hand, holding GPUs the operator must not plan on."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": OTHER},
            "spec": {"nodeName": node, "automountServiceAccountToken": False,
                     "containers": [{"name": "hog", "image": "hog", "resources": {
                         "limits": {"nvidia.com/gpu": str(gpus)}}}]}}


def test_jobs_fill_the_free_gpus_then_queue_and_start_when_gpus_free(
        operator: OperatorProcess) -> None:
    cp = operator.cp
    pool = {"adaptis.io/test-pool": "shared-fill"}
    for i in range(3):
        cp.add_fake_gpu_node(f"fill-{i}", gpu_count=4, zone="fill-zone", labels=pool)
    cp.apply(_hog("hog", node="fill-0", gpus=4))
    # Four jobs of two GPUs: exactly the 8 GPUs the hog leaves free.
    names = [f"fill-{i}" for i in range(4)]
    for name in names:
        cp.apply(_job(name, pool=pool))
    for name in names:
        operator.wait(f"{name} Running", operator.phase_is(name, "Running"), timeout=120)
    bound = [p["spec"].get("nodeName") for name in names for p in operator.pods(name)]
    assert len(bound) == 8 and "fill-0" not in bound, bound  # no pod on the hog's GPUs

    cp.apply(_job("late", pool=pool))

    def queued() -> dict[str, Any] | None:
        cond = operator.condition("late", "Queued")
        return cond if cond and cond["status"] == "True" else None

    cond = operator.wait("the fifth job Queued", queued)
    assert cond["reason"] == "WaitingForCapacity"
    assert "needs 2 GPUs (2 workers x 1); 0 free" in cond["message"], cond
    assert operator.status("late")["phase"] == "Queued"
    assert operator.pods("late") == []  # nothing runnable, nothing half-placed
    assert any(e["reason"] == "WaitingForCapacity" for e in operator.events("late"))

    # One job goes: its GPUs go to the waiting one, which its release wakes.
    cp.kubectl("delete", "apj", "fill-1", "-n", NS, "--wait=false")
    operator.wait("the queued job Running", operator.phase_is("late", "Running"), timeout=120)
    admitted = operator.condition("late", "Queued")
    assert admitted is not None and admitted["reason"] == "Admitted"
    assert all(p["spec"]["nodeName"] != "fill-0" for p in operator.pods("late"))
    for name in [*names, "late"]:
        cp.kubectl("delete", "apj", name, "-n", NS, "--wait=false", "--ignore-not-found")
    cp.kubectl("delete", "pod", "hog", "-n", OTHER, "--wait=false")


def test_a_deleted_worker_pod_restarts_the_whole_gang(operator: OperatorProcess) -> None:
    cp = operator.cp
    pool = {"adaptis.io/test-pool": "shared-gang"}
    cp.add_fake_gpu_node("gang-0", gpu_count=4, zone="gang-zone", labels=pool)
    name = "gang"
    cp.apply(_job(name, pool=pool, backoff_limit=3))
    operator.wait("phase Running", operator.phase_is(name, "Running"), timeout=90)
    before = {p["metadata"]["uid"] for p in operator.pods(name)}
    cp.kubectl("delete", "pod", f"{name}-worker-1", "-n", NS, "--wait=false")

    def restarted() -> list[dict[str, Any]] | None:
        pods = operator.pods(name)
        fresh = [p for p in pods if p["metadata"]["labels"]["adaptis.io/attempt"] == "1"
                 and p["status"].get("phase") == "Running"]
        return pods if len(fresh) == len(pods) == 2 else None

    pods = operator.wait("both ranks running again as attempt 1", restarted, timeout=90)
    assert not before & {p["metadata"]["uid"] for p in pods}  # rank 0 was replaced too
    status = operator.status(name)
    assert status["restarts"] == 1
    lost = [e for e in operator.events(name) if e["reason"] == "PodLost"]
    assert lost and "rank 1" in lost[0]["message"] and "1/3" in lost[0]["message"]
    operator.wait("phase Running", operator.phase_is(name, "Running"))
    cp.kubectl("delete", "apj", name, "-n", NS, "--wait=false")


def test_a_placement_the_scheduler_cannot_bind_is_replanned(operator: OperatorProcess) -> None:
    cp = operator.cp
    pool = {"adaptis.io/test-pool": "shared-mem"}
    # Same GPUs, but the first node (first by name, so planned on first) is short of memory
    # for what the worker template asks: the plan cannot see it, the scheduler refuses it.
    cp.add_fake_gpu_node("mem-a-small", gpu_count=4, zone="mem-zone", memory="8Gi", labels=pool)
    cp.add_fake_gpu_node("mem-b-large", gpu_count=4, zone="mem-zone", labels=pool)
    name = "hungry"
    cp.apply(_job(name, pool=pool, resources={"requests": {"memory": "16Gi"}}))

    def replanned() -> dict[str, Any] | None:
        st = operator.status(name)
        return st if st.get("replans", 0) >= 1 and st.get("phase") == "Running" else None

    status = operator.wait("a re-plan that runs", replanned, timeout=120)
    assert {p["node"] for p in status["placement"]} == {"mem-b-large"}
    assert {p["spec"]["nodeName"] for p in operator.pods(name)} == {"mem-b-large"}
    events = operator.events(name)
    unschedulable = [e for e in events if e["reason"] == "Unschedulable"]
    assert any("Insufficient memory" in e["message"] for e in unschedulable), json.dumps(events)
    assert any("re-planning" in e["message"] and "mem-a-small" in e["message"]
               for e in unschedulable)
    cp.kubectl("delete", "apj", name, "-n", NS, "--wait=false")


def test_log_has_no_tracebacks(operator: OperatorProcess) -> None:
    log = Path(operator.log_path).read_text(errors="replace")
    assert "Traceback" not in log, operator.log_tail(80)
