"""Reconciler edges a user meets rarely but must not get wrong: the deadline to the second and
across a corrected spec, a corrected spec held by a policy, a job failed by an invalid child
while its gang runs, profiler pods on a node that went away, a re-plan message naming every
node (in-memory API, as test_operator_reconcile_paths.py)."""

from __future__ import annotations

import json
from typing import Any

from test_operator_children import CM_422, PSA_403, Refusing
from test_operator_profiler_pods import DOC, MeasuringCluster, _finish, _measure_job, _node_of, _profilers

from adaptis.operator.control.reconcile import Reconciler
from adaptis.operator.core.settings import ReconcileSettings


def _cond(job: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in job["status"]["conditions"] if c["type"] == type_)


def _run_all(cluster: Any) -> None:
    for pod in cluster.pods():
        cluster.set_pod_phase(pod["metadata"]["name"], "Running")


def test_the_deadline_is_kept_to_the_second(cluster: Any, make_job: Any, clock: Any) -> None:
    """activeDeadlineSeconds: 60 runs 60 s, not 59 nor 61."""
    cluster.add_job(make_job(spec={"activeDeadlineSeconds": 60}))
    rec = Reconciler(cluster, clock=clock)
    rec.reconcile("ns", "demo")  # pods created at the clock's start: startTime
    _run_all(cluster)
    clock.advance(59.5)
    assert rec.reconcile("ns", "demo").requeue_after == 0.5
    assert cluster.job()["status"]["phase"] == "Running"
    clock.advance(0.5)
    rec.reconcile("ns", "demo")
    assert _cond(cluster.job(), "Failed")["reason"] == "DeadlineExceeded"


def test_a_corrected_spec_runs_its_deadline_from_its_new_start(
        cluster: Any, make_job: Any, clock: Any) -> None:
    """A spec fixed after an InvalidSpec failure is a new start (reconcile.py): the deadline
    counts from the new pods, not from the first start before the failure."""
    cluster.add_job(make_job(spec={"activeDeadlineSeconds": 60}))
    rec = Reconciler(cluster, clock=clock)
    rec.reconcile("ns", "demo")
    _run_all(cluster)
    cluster.job()["spec"]["parallelism"]["workers"] = 20  # refused by the validation
    cluster.job()["metadata"]["generation"] = 2
    clock.advance(5)
    rec.reconcile("ns", "demo")
    assert _cond(cluster.job(), "Failed")["reason"] == "InvalidSpec"
    cluster.finish_deletions()
    clock.advance(120)  # the user fixes the spec two minutes later
    cluster.job()["spec"]["parallelism"]["workers"] = 4
    cluster.job()["metadata"]["generation"] = 3
    result = rec.reconcile("ns", "demo")
    st = cluster.job()["status"]
    assert st["phase"] == "Planned", st.get("message")
    assert len(cluster.pods()) == 4 and result.requeue_after == 60


def test_a_corrected_spec_that_a_policy_holds_waits_as_pending_and_starts_later(
        cluster: Any, make_job: Any, clock: Any) -> None:
    """The fix is a new start even when a policy then refuses its pods: the job waits as
    Pending with the policy's message (not Failed, which later passes would take as final),
    and starts once the policy allows the pods."""
    cluster.add_job(make_job())
    rec = Reconciler(cluster, clock=clock)
    rec.reconcile("ns", "demo")
    _run_all(cluster)
    cluster.job()["spec"]["parallelism"]["workers"] = 20
    cluster.job()["metadata"]["generation"] = 2
    rec.reconcile("ns", "demo")
    assert cluster.job()["status"]["phase"] == "Failed"
    cluster.finish_deletions()
    cluster.job()["spec"]["parallelism"]["workers"] = 4  # back to the spec of the cached plan
    cluster.job()["metadata"]["generation"] = 3
    held = Reconciler(Refusing(cluster, kind="Pod", status=403, text=PSA_403), clock=clock)
    assert held.reconcile("ns", "demo").requeue_after == 30.0
    st = cluster.job()["status"]
    assert st["phase"] == "Pending"
    assert st["message"].startswith("spec.worker: ") and PSA_403 in st["message"]
    assert _cond(cluster.job(), "Running")["reason"] == "PodsRejected"
    clock.advance(30)
    rec.reconcile("ns", "demo")  # the admin lifted the policy
    st = cluster.job()["status"]
    assert st["phase"] == "Planned" and len(cluster.pods()) == 4


def test_a_job_failed_by_an_invalid_child_stops_its_running_gang(cluster: Any, make_job: Any) -> None:
    """An update whose new plan the API server refuses as invalid (the plan's ConfigMap too
    large) fails the job, and the gang of the old plan must not train on."""
    cluster.add_job(make_job())
    Reconciler(cluster).reconcile("ns", "demo")
    _run_all(cluster)
    cluster.job()["spec"]["training"]["microbatches"] = 16  # a new plan
    cluster.job()["metadata"]["generation"] = 2
    Reconciler(Refusing(cluster, kind="ConfigMap", status=422, text=CM_422)).reconcile("ns", "demo")
    failed = _cond(cluster.job(), "Failed")
    assert (failed["status"], failed["reason"]) == ("True", "InvalidSpec")
    pods = cluster.pods()
    assert len(pods) == 4 and all(p["metadata"].get("deletionTimestamp") for p in pods)


def test_a_profiler_pod_on_a_node_gone_since_is_force_deleted(
        cluster: Any, clock: Any, make_job: Any) -> None:
    """Profiler pods go once the plan exists; one bound to a node that is gone has no kubelet
    left to confirm its deletion, so it is force-deleted (as the garbage collector would,
    much later); the others terminate gracefully."""
    api = MeasuringCluster(cluster, clock)
    job = _measure_job(make_job)
    job["spec"]["parallelism"] = {"workers": 2, "gpusPerWorker": 1}  # fits one node of zone-a
    cluster.add_job(job)
    rec = Reconciler(api, clock=clock)
    rec.reconcile("ns", "demo")
    pods = _profilers(cluster)
    assert sorted(_node_of(p) for p in pods) == ["h100-0", "h100-1"]
    for pod in pods:
        pod["spec"]["nodeName"] = _node_of(pod)  # bound by the scheduler
        _finish(cluster, pod, message=json.dumps(DOC))
    del cluster.nodes["h100-1"]
    rec.reconcile("ns", "demo")
    assert cluster.job()["status"]["phase"] == "Planned"
    assert cluster.calls.count("force delete Pod") == 1
    assert [_node_of(p) for p in _profilers(cluster)] == ["h100-0"]  # gracefully, terminating
    assert _profilers(cluster)[0]["metadata"].get("deletionTimestamp")


def test_a_replan_of_unschedulable_ranks_names_each_node_it_leaves_out(
        cluster: Any, make_job: Any, clock: Any) -> None:
    cluster.add_job(make_job())  # 4 ranks: two nodes of 2 GPUs
    rec = Reconciler(cluster, clock=clock, settings=ReconcileSettings(unschedulable_replan_s=60))
    rec.reconcile("ns", "demo")
    first = sorted({r["node"] for r in cluster.job()["status"]["placement"]})
    assert len(first) == 2
    for pod in cluster.pods():
        pod["status"] = {"phase": "Pending", "conditions": [{
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
            "message": "0/4 nodes are available", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}
    clock.advance(60)
    rec.reconcile("ns", "demo")
    message = _cond(cluster.job(), "Restarting")["message"]
    assert message.startswith(f"unschedulable for 60s on {first[0]}, {first[1]}: "), message
