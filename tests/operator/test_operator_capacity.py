"""The allocation ledger through the reconciler: free GPUs, the queue, lost ranks, unschedulable
placements. The fake cluster of conftest.py has two H100 nodes (zone-a) and two A100 nodes
(zone-b) with two GPUs each; the real scheduler's side is in
tests/integration/test_operator_shared_cluster.py.
"""

from __future__ import annotations

from typing import Any

from adaptis.operator.control.reconcile import Reconciler
from adaptis.operator.core.settings import ReconcileSettings
from adaptis.operator.scheduling.capacity import CapacityLedger
from adaptis.operator.scheduling.inventory import ListedInventory


def _cond(job: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in job["status"].get("conditions", []) if c["type"] == type_)


def _nodes_of(cluster: Any, job: str) -> set[str]:
    return {r["node"] for r in cluster.job(job)["status"]["placement"]}


def _foreign_pod(cluster: Any, name: str, *, node: str, gpus: int, ns: str = "other") -> None:
    cluster.create({"apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": name, "namespace": ns, "labels": {}},
                    "spec": {"nodeName": node, "containers": [{
                        "name": "c", "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]}})
    cluster.objects[("Pod", ns, name)]["status"] = {"phase": "Running"}


def _job(make_job: Any, name: str, *, workers: int, created: str = "2026-01-01T00:00:00Z",
         priority_class: str | None = None) -> dict[str, Any]:
    body = make_job(name, spec={"parallelism": {"workers": workers, "gpusPerWorker": 1}})
    body["metadata"]["creationTimestamp"] = created
    if priority_class:
        body["spec"]["worker"] = {"priorityClassName": priority_class}
    return body


def _finish(cluster: Any, job: str) -> None:
    for pod in cluster.pods():
        if pod["metadata"]["labels"].get("adaptis.io/job") == job:
            cluster.set_pod_phase(pod["metadata"]["name"], "Succeeded", ready=False)


def test_gpus_held_by_other_pods_are_not_planned_on(cluster: Any, make_job: Any) -> None:
    # Someone else's pods hold both GPUs of h100-0 and one of h100-1.
    _foreign_pod(cluster, "theirs-0", node="h100-0", gpus=2)
    _foreign_pod(cluster, "theirs-1", node="h100-1", gpus=1)
    cluster.add_job(_job(make_job, "a", workers=3))
    Reconciler(cluster).reconcile("ns", "a")
    job = cluster.job("a")
    assert job["status"]["phase"] == "Planned"
    placement = [r["node"] for r in job["status"]["placement"]]
    assert "h100-0" not in placement and placement.count("h100-1") <= 1


def test_a_job_that_does_not_fit_the_free_gpus_queues_and_starts_when_they_free(
        cluster: Any, make_job: Any) -> None:
    woken: list[tuple[str, str]] = []
    rec = Reconciler(cluster, ledger=CapacityLedger(wake=woken.append))
    cluster.add_job(_job(make_job, "big", workers=6))
    cluster.add_job(_job(make_job, "next", workers=3, created="2026-01-01T00:01:00Z"))
    rec.reconcile("ns", "big")
    rec.reconcile("ns", "next")
    waiting = cluster.job("next")
    assert waiting["status"]["phase"] == "Queued"
    queued = _cond(waiting, "Queued")
    assert (queued["status"], queued["reason"]) == ("True", "WaitingForCapacity")
    assert "needs 3 GPUs (3 workers x 1); 2 free" in queued["message"]
    assert "1 of 1 waiting" in queued["message"]
    assert not [p for p in cluster.pods() if p["metadata"]["labels"]["adaptis.io/job"] == "next"]
    assert ("next", "Normal", "WaitingForCapacity") in {e[:3] for e in cluster.events}
    rec.reconcile("ns", "next")  # still nothing free: no second plan, no pods
    assert cluster.job("next")["status"]["phase"] == "Queued"

    _finish(cluster, "big")
    rec.reconcile("ns", "big")
    assert cluster.job("big")["status"]["phase"] == "Succeeded"
    assert woken == [("ns", "next")]  # the release wakes the queue
    rec.reconcile("ns", "next")
    job = cluster.job("next")
    assert job["status"]["phase"] == "Planned"
    assert _cond(job, "Queued")["reason"] == "Admitted"
    assert len([p for p in cluster.pods()
                if p["metadata"]["labels"]["adaptis.io/job"] == "next"]) == 3


def test_two_jobs_never_share_a_gpu_even_across_operator_restarts(cluster: Any,
                                                                 make_job: Any) -> None:
    for i in range(4):
        cluster.add_job(_job(make_job, f"j{i}", workers=2, created=f"2026-01-01T00:0{i}:00Z"))
    Reconciler(cluster).reconcile("ns", "j0")
    Reconciler(cluster).reconcile("ns", "j1")  # a restarted operator: an empty ledger
    rec = Reconciler(cluster)
    for name in ("j2", "j3", "j0", "j1"):
        rec.reconcile("ns", name)
    held: dict[str, int] = {}
    for pod in cluster.pods():
        node = pod["metadata"]["annotations"]["adaptis.io/node"]
        held[node] = held.get(node, 0) + 1
    assert held == {"h100-0": 2, "h100-1": 2, "a100-0": 2, "a100-1": 2}
    assert all(cluster.job(f"j{i}")["status"]["phase"] == "Planned" for i in range(4))


def test_queue_order_is_priority_then_age_and_a_starved_job_holds_back_the_rest(
        cluster: Any, make_job: Any) -> None:
    cluster.priority_classes["urgent"] = 1000
    now = [0.0]
    rec = Reconciler(cluster, ledger=CapacityLedger(strict_after_s=60, clock=lambda: now[0]))
    cluster.add_job(_job(make_job, "running", workers=6))
    rec.reconcile("ns", "running")  # holds 6 of the 8 GPUs
    cluster.add_job(_job(make_job, "large", workers=4, created="2026-01-01T00:01:00Z"))
    cluster.add_job(_job(make_job, "urgent", workers=4, created="2026-01-01T00:02:00Z",
                         priority_class="urgent"))
    cluster.add_job(_job(make_job, "small", workers=1, created="2026-01-01T00:03:00Z"))
    rec.reconcile("ns", "large")
    rec.reconcile("ns", "urgent")
    assert "1 of 2 waiting" in _cond(cluster.job("urgent"), "Queued")["message"]  # priority
    rec.reconcile("ns", "large")
    assert "2 of 2 waiting" in _cond(cluster.job("large"), "Queued")["message"]
    rec.reconcile("ns", "small")  # fits the 2 free GPUs; nobody has waited long: best effort
    assert cluster.job("small")["status"]["phase"] == "Planned"

    now[0] = 61.0  # urgent (first in the queue) has waited past the limit
    cluster.add_job(_job(make_job, "small2", workers=1, created="2026-01-01T00:04:00Z"))
    rec.reconcile("ns", "small2")
    job = cluster.job("small2")
    assert job["status"]["phase"] == "Queued"
    assert _cond(job, "Queued")["reason"] == "BehindStarvedJob"
    assert "behind ns/urgent" in _cond(job, "Queued")["message"]


def test_jobs_of_equal_priority_queue_by_age_not_by_name(cluster: Any, make_job: Any) -> None:
    rec = Reconciler(cluster)
    cluster.add_job(_job(make_job, "running", workers=6))
    rec.reconcile("ns", "running")  # holds 6 of the 8 GPUs
    # The older job's name sorts last: only its creation time puts it first.
    cluster.add_job(_job(make_job, "zeta", workers=4, created="2026-01-01T00:01:00Z"))
    cluster.add_job(_job(make_job, "alpha", workers=4, created="2026-01-01T00:02:00Z"))
    rec.reconcile("ns", "alpha")
    rec.reconcile("ns", "zeta")
    rec.reconcile("ns", "alpha")
    assert "1 of 2 waiting" in _cond(cluster.job("zeta"), "Queued")["message"]
    assert "2 of 2 waiting" in _cond(cluster.job("alpha"), "Queued")["message"]


def _running_gang(cluster: Any, make_job: Any) -> Reconciler:
    """Job ``a``: two ranks planned, their pods Running, seen so by a second pass."""
    cluster.add_job(_job(make_job, "a", workers=2))
    rec = Reconciler(cluster)
    rec.reconcile("ns", "a")
    for pod in cluster.pods():
        cluster.set_pod_phase(pod["metadata"]["name"], "Running")
    rec.reconcile("ns", "a")
    return rec


def test_a_deleted_or_evicted_rank_restarts_the_gang(cluster: Any, make_job: Any) -> None:
    rec = _running_gang(cluster, make_job)
    assert cluster.job("a")["status"]["phase"] == "Running"
    # Someone (a drain, a preemption) deletes rank 1: it terminates, not by our hand.
    cluster.objects[("Pod", "ns", "a-worker-1")]["metadata"]["deletionTimestamp"] = "x"
    rec.reconcile("ns", "a")
    job = cluster.job("a")
    assert job["status"]["restarts"] == 1 and job["status"]["phase"] == "Restarting"
    assert _cond(job, "Restarting")["reason"] == "PodLost"
    assert ("a", "Warning", "PodLost") in {e[:3] for e in cluster.events}
    cluster.finish_deletions()
    rec.reconcile("ns", "a")
    for pod in cluster.pods():
        cluster.set_pod_phase(pod["metadata"]["name"], "Running")
    rec.reconcile("ns", "a")
    # An eviction ends the pod Failed: the same gang restart, counted again.
    cluster.set_pod_phase("a-worker-0", "Failed", ready=False)
    cluster.objects[("Pod", "ns", "a-worker-0")]["status"]["reason"] = "Evicted"
    rec.reconcile("ns", "a")
    assert cluster.job("a")["status"]["restarts"] == 2


def test_a_preemption_seen_by_a_restarted_operator_counts_as_a_gang_restart(
        cluster: Any, make_job: Any) -> None:
    # Found by bench/soak.py: a preemptor took the GPUs of a lost rank while the operator was
    # down; the restarted operator (empty ledger) re-planned the job instead of counting it.
    _running_gang(cluster, make_job)
    launched = cluster.job("a")["status"]["launched"]
    node = sorted(_nodes_of(cluster, "a"))[0]
    # kube-scheduler preempts the job's pods on that node for a pod asking its two GPUs.
    for rank in cluster.job("a")["status"]["placement"]:
        if rank["node"] == node:
            cluster.delete_pod("ns", rank["pod"])
    cluster.finish_deletions()
    _foreign_pod(cluster, "preemptor", node=node, gpus=2)
    Reconciler(cluster).reconcile("ns", "a")  # the operator, started again
    job = cluster.job("a")
    assert job["status"]["restarts"] == 1 and job["status"]["phase"] == "Restarting", job["status"]
    assert _cond(job, "Restarting")["reason"] == "PodLost"
    assert job["status"].get("replans", 0) == 0 and job["status"]["launched"] == launched


def test_a_placement_that_stays_unschedulable_is_replanned_without_that_node(
        cluster: Any, make_job: Any, clock: Any) -> None:
    cluster.add_job(_job(make_job, "a", workers=2))
    rec = Reconciler(cluster, clock=clock,
                     settings=ReconcileSettings(unschedulable_replan_s=60))
    rec.reconcile("ns", "a")
    first = _nodes_of(cluster, "a")
    stamp = clock.now.strftime("%Y-%m-%dT%H:%M:%SZ")
    for pod in cluster.pods():
        pod["status"] = {"phase": "Pending", "conditions": [{
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
            "message": "0/4 nodes are available", "lastTransitionTime": stamp}]}
    result = rec.reconcile("ns", "a")
    assert cluster.job("a")["status"].get("replans", 0) == 0
    assert result.requeue_after is not None and result.requeue_after <= 61
    clock.advance(61)
    rec.reconcile("ns", "a")
    job = cluster.job("a")
    assert _cond(job, "Restarting")["reason"] == "Unschedulable"
    assert all(p["metadata"].get("deletionTimestamp") for p in cluster.pods())
    cluster.finish_deletions()
    rec.reconcile("ns", "a")
    job = cluster.job("a")
    assert job["status"]["replans"] == 1
    restarting = _cond(job, "Restarting")
    assert restarting["reason"] == "Unschedulable" and "stayed unschedulable" in restarting[
        "message"]
    assert not _nodes_of(cluster, "a") & first
    assert len(cluster.pods()) == 2


def test_a_job_kueue_holds_back_holds_no_gpus(cluster: Any, make_job: Any) -> None:
    # A job with a queueName is Kueue's to queue: the operator plans it (on free GPUs when
    # there are enough) but reserves nothing, and its gated pods hold no GPU.
    body = _job(make_job, "kueued", workers=6)
    body["spec"]["queueName"] = "team-a"
    cluster.add_job(body)
    cluster.add_job(_job(make_job, "direct", workers=6, created="2026-01-01T00:01:00Z"))
    inventory = ListedInventory(cluster, profile_namespace=ReconcileSettings().profile_namespace,
                                snapshot_ttl_s=0)  # every pass lists pods
    rec = Reconciler(cluster, inventory=inventory)
    rec.reconcile("ns", "kueued")
    for pod in cluster.pods():  # what Kueue's webhook does to them at creation
        pod["spec"]["schedulingGates"] = [{"name": "kueue.x-k8s.io/admission"}]
    rec.reconcile("ns", "kueued")
    assert cluster.job("kueued")["status"]["phase"] != "Queued"
    rec.reconcile("ns", "direct")  # all 8 GPUs are idle: it runs, not WaitingForCapacity
    assert cluster.job("direct")["status"]["phase"] == "Planned"
    # Released by Kueue, the ranks hold their pinned GPUs: a third job waits for them.
    for pod in cluster.pods():
        pod["spec"].pop("schedulingGates", None)
    cluster.add_job(_job(make_job, "third", workers=3, created="2026-01-01T00:02:00Z"))
    rec.reconcile("ns", "third")
    assert cluster.job("third")["status"]["phase"] == "Queued"


def test_a_cached_plan_whose_gpus_others_took_is_planned_again(cluster: Any, make_job: Any) -> None:
    # The job planned and ran; its pods went, and while the operator was down someone else's
    # pods took the GPUs its cached plan names. The launched gang lost its ranks: a restart
    # counted (Gang semantics), whether or not the operator was up; then the cache is not
    # trusted blindly: the new attempt re-plans onto free GPUs, and says why.
    cluster.add_job(_job(make_job, "a", workers=2))
    Reconciler(cluster).reconcile("ns", "a")
    first = _nodes_of(cluster, "a")
    for pod in cluster.pods():
        cluster.delete_pod("ns", pod["metadata"]["name"])
    cluster.finish_deletions()
    for i, node in enumerate(sorted(first)):
        _foreign_pod(cluster, f"theirs-{i}", node=node, gpus=2)
    rec = Reconciler(cluster)  # a restarted operator: an empty ledger
    rec.reconcile("ns", "a")
    assert cluster.job("a")["status"]["restarts"] == 1
    assert _cond(cluster.job("a"), "Restarting")["reason"] == "PodLost"
    rec.reconcile("ns", "a")
    job = cluster.job("a")
    assert _nodes_of(cluster, "a").isdisjoint(first)
    assert job["status"]["replans"] == 1
    assert _cond(job, "Restarting")["reason"] == "CapacityLost"
