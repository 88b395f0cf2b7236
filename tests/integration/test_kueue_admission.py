"""AdaPtisJobs queued by the real Kueue: quota first, then the nodes Kueue gave.

The real Kueue manager (built from sigs.k8s.io/kueue by hack/build-control-plane.sh, run by
``kueue.py``) manages pods in this module's namespace only; the operator subprocess watches the
same namespace. The fake GPU nodes of this module form a pool of their own: four nodes of two
GPUs (8 GPUs), every one labelled with the ResourceFlavor's node label. The ClusterQueue grants
4 of them, so capacity is never what holds a job back here: the quota is.

- job A (2 ranks x 2 GPUs = the whole quota): Kueue's Workload is admitted to the flavor, the
  gates go, Kueue adds the flavor's node label to the pods' nodeSelector and they run there;
- job B (the same, while A runs): its pods exist but stay gated (no node, not runnable), the
  job says WaitingForAdmission, its Workload says why (no quota); once A has finished, B is
  admitted and runs to the end;
- job C, whose LocalQueue does not exist: its pods stay gated, its Workload is inadmissible;
  deleted, its pods go (Kueue lets them go once the unretriable group has terminated);
- job R, whose ranks fail: the gang restarts as a new pod group (Workload ``job-r-a1``),
  admitted again, and the job fails at its backoff limit; no pod is left held by Kueue.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from kueue import ADMISSION_GATE, KueueManager
from operator_process import OperatorProcess, install_crd, wait_for
from processes import ControlPlaneError

NS = "kueue-e2e"
POOL = {"adaptis.io/test-pool": "kueue-e2e"}
FLAVOR_LABEL = {"adaptis.io/kueue-flavor": "kueue-e2e-gpu"}
NODES = [f"kueue-gpu-{i}" for i in range(4)]
FLAVOR, CLUSTER_QUEUE, LOCAL_QUEUE = "kueue-e2e-gpu", "kueue-e2e-cq", "team-a"
GPU_QUOTA = 4
T = TypeVar("T")


def _job(name: str, *, queue: str, run_seconds: int) -> dict[str, Any]:
    return {"apiVersion": "adaptis.io/v1alpha1", "kind": "AdaPtisJob",
            "metadata": {"name": name, "namespace": NS},
            "spec": {
                "model": {"vocabSize": 512, "hidden": 32, "heads": 2,
                          "blocks": [{"kind": "attention", "count": 4}]},
                "training": {"steps": 2, "microbatches": 4, "sequenceLength": 16},
                "parallelism": {"workers": 2, "gpusPerWorker": 2},
                "queueName": queue,
                "worker": {"nodeSelector": dict(POOL),
                           "annotations": {"adaptis.io/fake-run-seconds": str(run_seconds)}},
            }}


def _queues() -> list[dict[str, Any]]:
    api = "kueue.x-k8s.io/v1beta2"
    return [
        {"apiVersion": api, "kind": "ResourceFlavor", "metadata": {"name": FLAVOR},
         "spec": {"nodeLabels": dict(FLAVOR_LABEL)}},
        {"apiVersion": api, "kind": "ClusterQueue", "metadata": {"name": CLUSTER_QUEUE},
         "spec": {"namespaceSelector": {},
                  # The worker pods request GPUs only (no cpu/memory unless the job asks).
                  "resourceGroups": [{"coveredResources": ["nvidia.com/gpu"],
                                      "flavors": [{"name": FLAVOR, "resources": [
                                          {"name": "nvidia.com/gpu",
                                           "nominalQuota": GPU_QUOTA}]}]}]}},
        {"apiVersion": api, "kind": "LocalQueue",
         "metadata": {"name": LOCAL_QUEUE, "namespace": NS},
         "spec": {"clusterQueue": CLUSTER_QUEUE}},
    ]


class Env:
    """The operator and Kueue on the control plane, and the reads of these tests."""

    def __init__(self, cp: Any, op: OperatorProcess, kueue: KueueManager) -> None:
        self.cp, self.op, self.kueue = cp, op, kueue

    def wait(self, what: str, predicate: Callable[[], T | None], timeout: float = 90) -> T:
        """Poll ``predicate`` until truthy; on timeout fail with both processes' logs."""
        return wait_for(what, predicate, timeout=timeout, logs=self._logs, alive=[
            ("operator", self.op.proc), ("kueue", self.kueue.process and self.kueue.process.popen)])

    def _logs(self) -> str:
        return (f"operator log ({self.op.log_path}):\n{self.op.log_tail()}\n"
                f"kueue log ({self.kueue.log_path}):\n{self.kueue.log_tail(40)}")

    def pods(self, job: str) -> list[dict[str, Any]]:
        items = self.cp.get_json("pods", "-n", NS, "-l", f"adaptis.io/job={job}")["items"]
        return sorted(items, key=lambda p: int(p["metadata"]["labels"]["adaptis.io/rank"]))

    def workload(self, job: str) -> dict[str, Any]:
        # Kueue names a pod group's Workload after the group, which the operator names after
        # the job.
        return dict(self.cp.get_json("workloads.kueue.x-k8s.io", job, "-n", NS))

    def condition(self, obj: dict[str, Any], type_: str) -> dict[str, Any] | None:
        return next((c for c in (obj.get("status") or {}).get("conditions") or []
                     if c["type"] == type_), None)

    def phase(self, job: str) -> str | None:
        return self.op.status(job).get("phase")

    def held_back(self, job: str) -> list[dict[str, Any]] | None:
        """The job's pods if all exist and all are held by Kueue's gate, else None."""
        pods = self.pods(job)
        if len(pods) != 2:
            return None
        gated = all(any(g["name"] == ADMISSION_GATE for g in p["spec"].get("schedulingGates")
                        or []) for p in pods)
        return pods if gated else None

    def waiting_for_admission(self, job: str) -> dict[str, Any] | None:
        cond = self.condition(self.op.job(job), "Running")
        return cond if cond and cond["reason"] == "WaitingForAdmission" else None


@pytest.fixture(scope="module")
def env(control_plane: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    cp = control_plane
    install_crd(cp)
    cp.create_namespace(NS)
    work: Path = tmp_path_factory.mktemp("kueue")
    kueue = KueueManager(cp, work, namespaces=[NS])
    error: ControlPlaneError | None = None
    try:
        kueue.start()
    except ControlPlaneError as err:
        error = err
    if error is not None:  # fail outside the except block: no chained traceback noise
        pytest.fail(f"Kueue did not start (logs in {work}):\n{error}", pytrace=False)
    for node in NODES:
        cp.add_fake_gpu_node(node, gpu_count=2, zone="kueue-zone", rack="kueue-rack",
                             labels={**POOL, **FLAVOR_LABEL})
    cp.apply(_queues())
    op = OperatorProcess(cp, work / "operator.log", namespace=NS)
    op.start()
    e = Env(cp, op, kueue)
    try:
        yield e
    finally:
        try:
            _delete_jobs(e)
        finally:
            op.stop()
            kueue.stop()


def _delete_jobs(e: Env) -> None:
    """Delete this module's jobs, and their Kueue Workloads, while Kueue still runs.

    Kueue holds a finalizer on the pods of a group until the group has finished or its Workload
    is deleted. The jobs here have all finished or were deleted by the tests; should a test
    have failed half way, a deleted job's still Running pods would stay Terminating here (kwok
    plays no kubelet that stops them), so the Workloads go too: Kueue's documented remedy.
    """
    cp = e.cp
    cp.kubectl("delete", "adaptisjobs", "--all", "-n", NS, "--wait=false")
    cp.kubectl("delete", "workloads.kueue.x-k8s.io", "--all", "-n", NS, "--wait=false")
    e.wait("the pods of this module to be gone",
           lambda: not cp.get_json("pods", "-n", NS)["items"], timeout=60)


def test_quota_admits_one_job_and_holds_the_next_until_it_finishes(env: Env) -> None:
    cp = env.cp
    # A runs long enough for B to be seen waiting behind it even on a loaded machine.
    cp.apply(_job("job-a", queue=LOCAL_QUEUE, run_seconds=40))

    # A fits the quota: Kueue admits its Workload (one PodSet, although the ranks are pinned
    # to two different nodes: the operator's role-hash annotation) to the flavor.
    def admitted(job: str) -> Callable[[], dict[str, Any] | None]:
        def check() -> dict[str, Any] | None:
            wl = env.workload(job)
            cond = env.condition(wl, "Admitted")
            return wl if cond and cond["status"] == "True" else None
        return check

    wl_a = env.wait("job-a's Workload to be admitted", admitted("job-a"))
    admission = wl_a["status"]["admission"]
    assert admission["clusterQueue"] == CLUSTER_QUEUE
    (assignment,) = admission["podSetAssignments"]
    assert assignment["flavors"] == {"nvidia.com/gpu": FLAVOR}
    assert assignment["count"] == 2
    assert [ps["count"] for ps in wl_a["spec"]["podSets"]] == [2]

    env.wait("job-a Running", lambda: env.phase("job-a") == "Running")
    pods_a = env.pods("job-a")
    assert len(pods_a) == 2
    for pod in pods_a:
        assert not pod["spec"].get("schedulingGates"), pod["spec"].get("schedulingGates")
        # Kueue injected the flavor's node label; the scheduler bound the pod on such a node,
        # the one the operator planned.
        assert pod["spec"]["nodeSelector"].items() >= FLAVOR_LABEL.items()
        node = pod["spec"]["nodeName"]
        assert node in NODES and node == pod["metadata"]["annotations"]["adaptis.io/node"]
        labels = cp.get_json("node", node)["metadata"]["labels"]
        assert labels.items() >= FLAVOR_LABEL.items()
        assert pod["metadata"]["labels"]["kueue.x-k8s.io/managed"] == "true"
    assert len({p["spec"]["nodeName"] for p in pods_a}) == 2

    # B asks for 4 more GPUs: the nodes have them, the quota does not.
    cp.apply(_job("job-b", queue=LOCAL_QUEUE, run_seconds=3))
    pods_b = env.wait("job-b's pods, all gated by Kueue", lambda: env.held_back("job-b"))
    cond = env.wait("job-b Running=False WaitingForAdmission",
                    lambda: env.waiting_for_admission("job-b"))
    assert ADMISSION_GATE in cond["message"]

    def pending_for_quota() -> dict[str, Any] | None:
        reserved = env.condition(env.workload("job-b"), "QuotaReserved")
        return reserved if reserved and reserved["status"] == "False" and \
            "nvidia.com/gpu" in reserved.get("message", "") else None

    reserved = env.wait("job-b's Workload pending on the GPU quota", pending_for_quota)
    assert "quota" in reserved["message"], reserved
    # Held back while A runs, not runnable: gated, on no node, Pending.
    assert env.phase("job-a") == "Running"
    for pod in env.pods("job-b"):
        assert not pod["spec"].get("nodeName") and pod["status"]["phase"] == "Pending"
        assert ADMISSION_GATE in [g["name"] for g in pod["spec"]["schedulingGates"]]
    assert {p["metadata"]["name"] for p in pods_b} == {"job-b-worker-0", "job-b-worker-1"}
    assert env.phase("job-b") == "Planned"

    # A finishes (kwok completes its pods), Kueue releases its quota and admits B.
    env.wait("job-a Succeeded", lambda: env.phase("job-a") == "Succeeded", timeout=120)
    finished = env.wait("job-a's Workload Finished",
                        lambda: env.condition(env.workload("job-a"), "Finished"))
    assert finished["status"] == "True"
    env.wait("job-b's Workload to be admitted", admitted("job-b"), timeout=120)
    env.wait("job-b Succeeded", lambda: env.phase("job-b") == "Succeeded", timeout=120)
    for pod in env.pods("job-b"):
        assert pod["spec"]["nodeName"] in NODES
        assert pod["spec"]["nodeSelector"].items() >= FLAVOR_LABEL.items()


def test_a_job_whose_local_queue_does_not_exist_never_runs(env: Env) -> None:
    # The quota is free again (the first test's jobs finished): only the missing queue holds C.
    env.cp.apply(_job("job-c", queue="no-such-queue", run_seconds=3))
    env.wait("job-c's pods, all gated by Kueue", lambda: env.held_back("job-c"))
    env.wait("job-c Running=False WaitingForAdmission", lambda: env.waiting_for_admission("job-c"))

    def inadmissible() -> dict[str, Any] | None:
        reserved = env.condition(env.workload("job-c"), "QuotaReserved")
        return reserved if reserved and reserved["status"] == "False" and \
            "no-such-queue" in reserved.get("message", "") else None

    reserved = env.wait("job-c's Workload to be inadmissible", inadmissible)
    assert reserved["reason"] == "Inadmissible"
    assert "LocalQueue no-such-queue doesn't exist" in reserved["message"]
    # Still held after the operator's resyncs (every 3 s): nothing ungated or bound them.
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline:
        pods = env.pods("job-c")
        assert all(not p["spec"].get("nodeName") for p in pods), pods
        assert env.held_back("job-c") is not None
        time.sleep(1)
    assert env.phase("job-c") == "Planned"

    # Deleted while waiting: the pods go, and so does the Workload (owned by the pods).
    env.cp.kubectl("delete", "adaptisjob", "job-c", "-n", NS, "--wait=false")
    env.wait("job-c's pods to be gone (Kueue's finalizer released)",
             lambda: not env.pods("job-c"), timeout=60)


def test_a_gang_restart_is_queued_again_as_a_new_group(env: Env) -> None:
    job = _job("job-r", queue=LOCAL_QUEUE, run_seconds=2)
    job["spec"]["backoffLimit"] = 1
    job["spec"]["worker"]["annotations"]["adaptis.io/fake-fail"] = "true"
    env.cp.apply(job)
    env.wait("job-r Failed at its backoff limit", lambda: env.phase("job-r") == "Failed",
             timeout=120)
    status = env.op.status("job-r")
    assert status["restarts"] == 1
    failed = env.condition(env.op.job("job-r"), "Failed")
    assert failed is not None and failed["reason"] == "BackoffLimitExceeded"
    # Attempt 1 was a group (and Workload) of its own, admitted and finished. Its failed pods
    # are kept (for their logs); a rank still running when the limit was reached is stopped, so
    # under load only the rank that failed first may be left.
    def settled() -> list[dict[str, Any]] | None:
        pods = env.pods("job-r")
        return pods if pods and all(p["status"].get("phase") == "Failed"
                                    and not p["metadata"].get("deletionTimestamp")
                                    for p in pods) else None

    pods = env.wait("job-r's last pods failed, the others deleted", settled)
    assert {p["metadata"]["labels"]["adaptis.io/attempt"] for p in pods} == {"1"}
    assert len(pods) <= 2
    assert {p["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] for p in pods} == {"job-r-a1"}
    def finished() -> dict[str, Any] | None:
        wl = env.workload("job-r-a1")
        return wl if env.condition(wl, "Finished") else None

    wl = env.wait("job-r-a1's Workload Finished", finished)
    admitted = env.condition(wl, "Admitted")
    assert admitted is not None and admitted["status"] == "True"
    # The failed pods of the last attempt are kept (for their logs), no longer held by Kueue.
    env.wait("Kueue's finalizer gone from job-r's pods",
             lambda: all("kueue.x-k8s.io/managed" not in (p["metadata"].get("finalizers") or [])
                         for p in env.pods("job-r")))
