"""Reconciler paths the lifecycle tests pass through without pinning: the exact requeue delays,
the re-plan of a placement that stays unschedulable and how long its nodes stay avoided, the
messages and events a user reads (in-memory API, as test_operator_reconcile.py)."""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta
from typing import Any

from adaptis.operator.control.reconcile import Reconciler
from adaptis.operator.core.settings import ReconcileSettings
from adaptis.operator.scheduling.capacity import CapacityLedger


def _cond(job: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in job["status"]["conditions"] if c["type"] == type_)


def _nodes(cluster: Any) -> set[str]:
    return {r["node"] for r in cluster.job()["status"]["placement"]}


def _unschedulable(cluster: Any, stamp: str) -> None:
    for pod in cluster.pods():
        pod["status"] = {"phase": "Pending", "conditions": [{
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
            "message": "0/4 nodes are available", "lastTransitionTime": stamp}]}


def test_a_placement_unschedulable_past_its_limit_is_replanned_without_its_nodes(
        cluster: Any, make_job: Any, clock: Any) -> None:
    cluster.add_job(make_job(spec={"parallelism": {"workers": 2, "gpusPerWorker": 1}}))
    rec = Reconciler(cluster, clock=clock, settings=ReconcileSettings(unschedulable_replan_s=60))
    rec.reconcile("ns", "demo")
    first = _nodes(cluster)
    _unschedulable(cluster, clock.now.strftime("%Y-%m-%dT%H:%M:%SZ"))
    clock.advance(20)
    # 40 s left of the 60, and a second's margin past it.
    assert rec.reconcile("ns", "demo").requeue_after == 41.0
    assert not any(p["metadata"].get("deletionTimestamp") for p in cluster.pods())
    assert cluster.job()["status"]["message"].startswith("unschedulable: ")
    assert not any(c["type"] == "Restarting" for c in cluster.job()["status"]["conditions"])
    clock.advance(40)
    calls = len(cluster.calls)
    result = rec.reconcile("ns", "demo")
    assert result.requeue_after == 2.0  # the deleted pods' names free up soon
    job = cluster.job()
    assert job["status"]["phase"] == "Restarting"
    restarting = _cond(job, "Restarting")
    message = (f"unschedulable for 60s on {', '.join(sorted(first))}: re-planning on the GPUs free now, "
               "without those nodes for a while")
    assert (restarting["status"], restarting["reason"], restarting["message"]) == ("True", "Unschedulable", message)
    assert ("Warning", "Unschedulable", message) in [e[1:4] for e in cluster.events]
    assert all(p["metadata"].get("deletionTimestamp") for p in cluster.pods())
    # The status is written before the pods go (a crash in between still says why).
    new = cluster.calls[calls:]
    assert new.index("patch_status") < new.index("delete Pod")
    cluster.finish_deletions()
    rec.reconcile("ns", "demo")
    assert not _nodes(cluster) & first and len(cluster.pods()) == 2
    # The nodes stay avoided for 5 limits (300 s): a re-plan within them still leaves them out,
    # one after them may use them again.
    clock.advance(100)
    cluster.job()["spec"]["parallelism"]["workers"] = 1
    cluster.job()["metadata"]["generation"] = 2
    rec.reconcile("ns", "demo")
    cluster.finish_deletions()
    rec.reconcile("ns", "demo")
    assert not _nodes(cluster) & first
    clock.advance(201)
    cluster.job()["spec"]["parallelism"]["workers"] = 2
    cluster.job()["metadata"]["generation"] = 3
    rec.reconcile("ns", "demo")
    cluster.finish_deletions()
    rec.reconcile("ns", "demo")
    assert _nodes(cluster) == first


def _run_all(cluster: Any) -> None:
    for pod in cluster.pods():
        cluster.set_pod_phase(pod["metadata"]["name"], "Running")


def test_a_failure_stops_only_live_pods_releases_the_gpus_and_says_why(cluster: Any, make_job: Any) -> None:
    ledger = CapacityLedger()
    cluster.add_job(make_job(spec={"backoffLimit": 0}))
    rec = Reconciler(cluster, ledger=ledger)
    rec.reconcile("ns", "demo")
    assert ledger.reservation(("ns", "demo"))
    _run_all(cluster)
    cluster.set_pod_phase("demo-worker-1", "Failed", ready=False)
    cluster.set_pod_phase("demo-worker-2", "Succeeded", ready=False)
    rec.reconcile("ns", "demo")
    st = cluster.job()["status"]
    assert st["phase"] == "Failed" and st["completionTime"]
    assert st["message"] == "spec.backoffLimit: 0 restart(s) used; demo-worker-1: failed"
    failed, running = _cond(cluster.job(), "Failed"), _cond(cluster.job(), "Running")
    assert (failed["status"], failed["reason"], failed["message"]) == ("True", "BackoffLimitExceeded", st["message"])
    assert (running["status"], running["reason"]) == ("False", "BackoffLimitExceeded")
    # The finished pods stay (their logs and exit codes); the two running ones are stopped.
    assert cluster.calls.count("delete Pod") == 2
    deleting = {p["metadata"]["name"] for p in cluster.pods() if p["metadata"].get("deletionTimestamp")}
    assert deleting == {"demo-worker-0", "demo-worker-3"}
    assert ledger.reservation(("ns", "demo")) is None
    assert ("Warning", "BackoffLimitExceeded", st["message"]) in [e[1:4] for e in cluster.events]


def test_a_finished_job_holds_no_gpus_and_ignores_a_ttl_that_is_not_a_number(
        cluster: Any, make_job: Any) -> None:
    ledger = CapacityLedger()
    cluster.add_job(make_job(spec={"ttlSecondsAfterFinished": "10"}))
    cluster.job()["status"] = {"phase": "Succeeded", "completionTime": "2026-01-01T00:00:00Z"}
    ledger.reserve(("ns", "demo"), {"h100-0": 2})  # e.g. left by a pass before the job ended
    result = Reconciler(cluster, ledger=ledger).reconcile("ns", "demo")
    assert ledger.reservation(("ns", "demo")) is None
    assert result.requeue_after is None and ("ns", "demo") in cluster.jobs


def test_the_ttl_counts_from_the_completion_to_the_second(cluster: Any, make_job: Any, clock: Any) -> None:
    cluster.add_job(make_job(spec={"ttlSecondsAfterFinished": 10}))
    cluster.job()["status"] = {"phase": "Succeeded", "completionTime": "2026-01-01T00:00:00Z"}
    rec = Reconciler(cluster, clock=clock)  # the clock starts at the completion time
    clock.advance(9.5)
    assert rec.reconcile("ns", "demo").requeue_after == 0.5
    assert ("ns", "demo") in cluster.jobs
    clock.advance(0.5)  # exactly the TTL: deleted now, not looked at again in 0 s
    assert rec.reconcile("ns", "demo").requeue_after is None
    assert ("ns", "demo") not in cluster.jobs and "delete_job" in cluster.calls


def test_success_counts_finished_ranks_as_ready_and_says_so(cluster: Any, make_job: Any) -> None:
    cluster.add_job(make_job())
    rec = Reconciler(cluster)
    rec.reconcile("ns", "demo")
    _run_all(cluster)
    rec.reconcile("ns", "demo")
    for name in ("demo-worker-0", "demo-worker-1"):
        cluster.set_pod_phase(name, "Succeeded", ready=False)
    rec.reconcile("ns", "demo")
    assert cluster.job()["status"]["workersReady"] == "4/4"  # 2 ready + 2 finished
    cluster.job()["status"]["message"] = "left from an earlier pass"
    for name in ("demo-worker-2", "demo-worker-3"):
        cluster.set_pod_phase(name, "Succeeded", ready=False)
    rec.reconcile("ns", "demo")
    job = cluster.job()
    assert job["status"]["phase"] == "Succeeded" and job["status"].get("message") is None
    succeeded, running = _cond(job, "Succeeded"), _cond(job, "Running")
    assert (succeeded["status"], succeeded["reason"], succeeded["message"]) == (
        "True", "Completed", "all 4 ranks finished")
    assert (running["status"], running["reason"]) == ("False", "Completed")
    assert cluster.events[-1][1:4] == ("Normal", "Completed", "all 4 ranks finished")


def test_a_rank_whose_old_pod_still_terminates_waits_for_it(cluster: Any, make_job: Any) -> None:
    cluster.add_job(make_job(spec={"backoffLimit": 2}))
    rec = Reconciler(cluster)
    rec.reconcile("ns", "demo")
    _run_all(cluster)
    cluster.set_pod_phase("demo-worker-1", "Failed", ready=False)
    rec.reconcile("ns", "demo")  # a gang restart: every pod of attempt 0 is deleted
    creates = cluster.calls.count("create Pod")
    # Only rank 3's old pod is gone: it gets its attempt-1 pod, the others wait for their names.
    del cluster.objects[("Pod", "ns", "demo-worker-3")]
    result = rec.reconcile("ns", "demo")
    assert cluster.calls.count("create Pod") == creates + 1
    assert result.requeue_after == 2.0
    assert cluster.job()["status"]["launched"].endswith("/0")  # attempt 1 is not launched yet
    cluster.finish_deletions()
    rec.reconcile("ns", "demo")
    assert cluster.calls.count("create Pod") == creates + 4
    assert cluster.job()["status"]["launched"].endswith("/1")
    assert {p["metadata"]["labels"]["adaptis.io/attempt"] for p in cluster.pods()} == {"1"}


def test_running_and_a_gang_restart_as_the_user_reads_them(cluster: Any, make_job: Any, clock: Any) -> None:
    cluster.add_job(make_job(spec={"backoffLimit": 3}))
    rec = Reconciler(cluster, clock=clock)
    rec.reconcile("ns", "demo")
    assert ("Normal", "CreatedPods", "created 4 worker pod(s)") in [e[1:4] for e in cluster.events]
    started = cluster.job()["status"]["startTime"]
    cluster.job()["status"]["message"] = "left from an earlier pass"
    _run_all(cluster)
    for name in ("demo-worker-0", "demo-worker-1"):
        cluster.set_pod_phase(name, "Succeeded", ready=False)
    rec.reconcile("ns", "demo")
    job = cluster.job()
    assert job["status"]["phase"] == "Running" and job["status"].get("message") is None
    running = _cond(job, "Running")
    assert (running["status"], running["reason"], running["message"]) == (
        "True", "AllRanksRunning", "2 running, 2 finished")
    assert cluster.events[-1][1:4] == ("Normal", "AllRanksRunning", "2 running, 2 finished")
    assert not any(c["type"] == "Restarting" for c in job["status"]["conditions"])  # never restarted
    # Every rank fails: the restart names the first three, restarts the gang, looks again soon.
    for r in range(4):
        cluster.set_pod_phase(f"demo-worker-{r}", "Failed", ready=False)
    result = rec.reconcile("ns", "demo")
    job = cluster.job()
    detail = "; ".join(f"demo-worker-{r}: failed" for r in range(3))
    assert job["status"]["message"] == detail and job["status"]["restarts"] == 1
    restarting, running = _cond(job, "Restarting"), _cond(job, "Running")
    assert (restarting["reason"], restarting["message"]) == ("PodFailed", f"gang restart 1/3: {detail}")
    assert (running["status"], running["reason"]) == ("False", "Restarting")
    assert result.requeue_after == 2.0
    # A pass while the old pods still terminate deletes nothing again.
    deletes = cluster.calls.count("delete Pod")
    assert deletes == 4
    rec.reconcile("ns", "demo")
    assert cluster.calls.count("delete Pod") == deletes
    cluster.finish_deletions()
    clock.advance(60)
    rec.reconcile("ns", "demo")
    assert len(cluster.pods()) == 4
    assert cluster.job()["status"]["startTime"] == started  # the job's start, not the attempt's
    # The new attempt's pods start: still Restarting; once they run, the restart is over.
    assert cluster.job()["status"]["phase"] == "Restarting"
    assert _cond(cluster.job(), "Running")["reason"] == "Restarting"
    _run_all(cluster)
    rec.reconcile("ns", "demo")
    job = cluster.job()
    assert job["status"]["phase"] == "Running"
    restarting = _cond(job, "Restarting")
    assert (restarting["status"], restarting["reason"], restarting["message"]) == (
        "False", "Recovered", "the gang runs again")


def test_a_status_lost_after_the_plan_was_stored_is_filled_in_from_the_cached_plan(
        cluster: Any, make_job: Any) -> None:
    """The placer stores the plan's ConfigMap before the pass writes the status: an operator
    stopped in between, or a restore that brings back the job without its status, finds the
    cached plan still valid (the placer then returns it without writing a summary), and the
    pass fills the plan's summary in from it."""
    cluster.add_job(make_job())
    Reconciler(cluster).reconcile("ns", "demo")
    planned = copy.deepcopy(cluster.job()["status"])
    assert len(planned["placement"]) == 4
    cluster.job()["status"] = {}
    Reconciler(cluster).reconcile("ns", "demo")  # a fresh operator, as after a restart
    status = cluster.job()["status"]
    assert "replace ConfigMap" not in cluster.calls  # the cached plan, not a new one
    assert cluster.calls.count("create Pod") == 4  # the running ranks' pods are kept
    for key in ("placement", "stages", "strategy", "predictedIterationSeconds", "predictedBubbleRatio",
                "predictedSpeedupOverI1F1B"):
        assert status[key] == planned[key], key
    assert [r["pod"] for r in status["placement"]] == [f"demo-worker-{r}" for r in range(4)]


def test_starting_gated_and_suspended_as_the_user_reads_them(cluster: Any, make_job: Any) -> None:
    """The Running condition's reasons while the gang starts, waits for an admission
    controller's gate, and is suspended (kubectl and automation key on the reasons); each pass
    hands its caller the job's phase (the operator's jobs-by-phase gauge)."""
    cluster.add_job(make_job())
    rec = Reconciler(cluster)
    assert rec.reconcile("ns", "demo").phase == "Planned"
    running = _cond(cluster.job(), "Running")
    assert (running["status"], running["reason"], running["message"]) == (
        "False", "Starting", "0/4 ranks running, 4 pending")
    for pod in cluster.pods():
        pod["spec"]["schedulingGates"] = [{"name": "kueue.x-k8s.io/admission"}]
        pod["status"] = {"phase": "Pending"}
    assert rec.reconcile("ns", "demo").phase == "Planned"
    running = _cond(cluster.job(), "Running")
    gated = "; ".join(f"demo-worker-{r}: gated by kueue.x-k8s.io/admission" for r in range(3))
    assert (running["status"], running["reason"], running["message"]) == ("False", "WaitingForAdmission", gated)
    assert ("Normal", "WaitingForAdmission", gated) in [e[1:4] for e in cluster.events]
    cluster.job()["spec"]["suspend"] = True
    assert rec.reconcile("ns", "demo").phase == "Suspended"
    job = cluster.job()
    suspended, running = _cond(job, "Suspended"), _cond(job, "Running")
    assert (suspended["status"], suspended["reason"], suspended["message"]) == (
        "True", "Suspended", "worker pods removed")
    assert (running["status"], running["reason"]) == ("False", "Suspended")
    assert ("Normal", "Suspended", "worker pods removed") in [e[1:4] for e in cluster.events]


def test_unschedulable_ranks_are_named_three_at_most_and_a_gated_restart_clears_the_message(
        cluster: Any, make_job: Any, clock: Any) -> None:
    cluster.add_job(make_job(spec={"backoffLimit": 3}))
    rec = Reconciler(cluster, clock=clock)
    rec.reconcile("ns", "demo")
    _unschedulable(cluster, clock.now.strftime("%Y-%m-%dT%H:%M:%SZ"))  # within the re-plan limit
    rec.reconcile("ns", "demo")
    named = "; ".join(f"demo-worker-{r}: 0/4 nodes are available" for r in range(3))
    assert cluster.job()["status"]["message"] == f"unschedulable: {named}"
    assert _cond(cluster.job(), "Running")["message"] == named
    # A gang restart, then the new attempt's pods held by an admission controller's gate: the
    # job waits for admission (Planned), and the restart's failure message goes.
    for r in range(4):
        cluster.set_pod_phase(f"demo-worker-{r}", "Failed", ready=False)
    rec.reconcile("ns", "demo")
    assert cluster.job()["status"]["phase"] == "Restarting" and cluster.job()["status"]["message"]
    cluster.finish_deletions()
    rec.reconcile("ns", "demo")
    for pod in cluster.pods():
        pod["spec"]["schedulingGates"] = [{"name": "kueue.x-k8s.io/admission"}]
        pod["status"] = {"phase": "Pending"}
    rec.reconcile("ns", "demo")
    status = cluster.job()["status"]
    assert status["phase"] == "Planned" and "message" not in status
    assert _cond(cluster.job(), "Running")["reason"] == "WaitingForAdmission"


def test_a_job_being_deleted_gets_no_pass_and_frees_its_gpus_at_once(cluster: Any, make_job: Any) -> None:
    rec = Reconciler(cluster)
    cluster.add_job(make_job("big", spec={"parallelism": {"workers": 6, "gpusPerWorker": 1}}))
    rec.reconcile("ns", "big")  # holds 6 of the 8 GPUs
    pods = len(cluster.pods())
    cluster.job("big")["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"  # finalizers keep it
    assert rec.reconcile("ns", "big").phase is None  # gone or going: no pass
    assert len(cluster.pods()) == pods  # its pods go with it (owner references), none are added
    cluster.add_job(make_job("next", spec={"parallelism": {"workers": 4, "gpusPerWorker": 1}}))
    rec.reconcile("ns", "next")
    assert cluster.job("next")["status"]["phase"] == "Planned"  # not queued behind the GPUs of "big"


def test_the_children_are_owned_by_the_job_uid(cluster: Any, make_job: Any) -> None:
    """Owner references carry the job's uid: the garbage collector removes the children with
    the job (and only with this job of the name)."""
    cluster.add_job(make_job())
    Reconciler(cluster).reconcile("ns", "demo")
    for pod in cluster.pods():
        assert [o["uid"] for o in pod["metadata"]["ownerReferences"]] == ["uid-demo"]


def test_without_a_clock_the_operator_reads_utc_wall_time(cluster: Any, make_job: Any) -> None:
    cluster.add_job(make_job(spec={"activeDeadlineSeconds": 3600}))
    rec = Reconciler(cluster)
    rec.reconcile("ns", "demo")
    started = datetime.now(UTC) - timedelta(hours=2)
    cluster.job()["status"]["startTime"] = started.strftime("%Y-%m-%dT%H:%M:%SZ")
    rec.reconcile("ns", "demo")
    assert _cond(cluster.job(), "Failed")["reason"] == "DeadlineExceeded"


def test_a_suspended_job_frees_its_gpus_at_once(cluster: Any, make_job: Any) -> None:
    rec = Reconciler(cluster)
    cluster.add_job(make_job("big", spec={"parallelism": {"workers": 6, "gpusPerWorker": 1}}))
    rec.reconcile("ns", "big")  # holds 6 of the 8 GPUs
    cluster.job("big")["spec"]["suspend"] = True
    rec.reconcile("ns", "big")
    cluster.finish_deletions()
    cluster.add_job(make_job("next", spec={"parallelism": {"workers": 4, "gpusPerWorker": 1}}))
    rec.reconcile("ns", "next")
    assert cluster.job("next")["status"]["phase"] == "Planned"  # not queued behind "big"
