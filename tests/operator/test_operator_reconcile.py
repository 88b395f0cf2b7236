"""The reconciler's lifecycle on an in-memory API (the real one: tests/integration)."""

from __future__ import annotations

from typing import Any

from adaptis.operator.control.reconcile import Reconciler


def _cond(job: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in job["status"]["conditions"] if c["type"] == type_)


def _run_all(cluster: Any, names: list[str] | None = None) -> None:
    """What the scheduler and the kubelet do: bind each pod where its affinity says, run it."""
    for pod in cluster.pods():
        if names is None or pod["metadata"]["name"] in names:
            cluster.set_pod_phase(pod["metadata"]["name"], "Running")
            terms = pod["spec"]["affinity"]["nodeAffinity"][
                "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
            pod["spec"]["nodeName"] = terms[0]["matchExpressions"][0]["values"][0]


def test_create_plans_and_starts_one_pod_per_rank(cluster: Any, make_job: Any) -> None:
    cluster.add_job(make_job())
    Reconciler(cluster).reconcile("ns", "demo")
    job = cluster.job()
    assert job["status"]["phase"] == "Planned"
    assert _cond(job, "Planned")["status"] == "True"
    assert _cond(job, "Profiling")["message"].startswith("4 candidate node(s) of 4")
    pods = cluster.pods()
    assert [p["metadata"]["name"] for p in pods] == [f"demo-worker-{r}" for r in range(4)]
    placement = job["status"]["placement"]
    for pod, rank in zip(pods, placement, strict=True):
        expr = pod["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
            "matchExpressions"][0]
        assert expr["values"] == [rank["node"]]
    # Four ranks fit the two H100 nodes of zone-a: the faster, single-zone choice.
    assert {r["node"] for r in placement} == {"h100-0", "h100-1"}
    assert ("ConfigMap", "ns", "demo-config") in cluster.objects
    assert ("Service", "ns", "demo-workers") in cluster.objects
    assert job["status"]["predictedSpeedupOverI1F1B"] > 0
    assert [e[2] for e in cluster.events] == ["Planned", "CreatedPods"]


def test_repeated_passes_and_operator_restarts_never_duplicate(cluster: Any,
                                                                make_job: Any) -> None:
    cluster.add_job(make_job())
    Reconciler(cluster).reconcile("ns", "demo")
    creates = cluster.calls.count("create Pod")
    status = dict(cluster.job()["status"])
    for _ in range(3):
        Reconciler(cluster).reconcile("ns", "demo")  # a fresh operator each time
    assert cluster.calls.count("create Pod") == creates == 4
    assert "replace ConfigMap" not in cluster.calls  # the cached plan was reused
    assert cluster.job()["status"] == status
    # A pod deleted by someone else restarts the gang (a lone new rank would wait forever
    # for peers that are mid-step): every pod of attempt 0 goes, attempt 1 starts.
    del cluster.objects[("Pod", "ns", "demo-worker-2")]
    Reconciler(cluster).reconcile("ns", "demo")
    job = cluster.job()
    assert job["status"]["restarts"] == 1
    assert _cond(job, "Restarting")["reason"] == "PodLost"
    assert "rank 2 (demo-worker-2)" in _cond(job, "Restarting")["message"]
    assert all(p["metadata"].get("deletionTimestamp") for p in cluster.pods())
    cluster.finish_deletions()
    Reconciler(cluster).reconcile("ns", "demo")
    assert {p["metadata"]["labels"]["adaptis.io/attempt"] for p in cluster.pods()} == {"1"}
    assert len(cluster.pods()) == 4


def test_running_then_succeeded_with_observed_bubble(cluster: Any, make_job: Any) -> None:
    cluster.add_job(make_job())
    rec = Reconciler(cluster)
    rec.reconcile("ns", "demo")
    _run_all(cluster)
    rec.reconcile("ns", "demo")
    job = cluster.job()
    assert job["status"]["phase"] == "Running" and job["status"]["workersReady"] == "4/4"
    for pod in cluster.pods():
        cluster.set_pod_phase(pod["metadata"]["name"], "Succeeded", ready=False,
                              message='{"observedBubbleRatio": 0.25}')
    rec.reconcile("ns", "demo")
    st = cluster.job()["status"]
    assert st["phase"] == "Succeeded" and st["completionTime"]
    assert st["observedBubbleRatio"] == 0.25
    assert _cond(cluster.job(), "Succeeded")["status"] == "True"


def test_failed_pod_restarts_the_gang_until_the_backoff_limit(cluster: Any,
                                                               make_job: Any) -> None:
    cluster.add_job(make_job(spec={"backoffLimit": 1}))
    rec = Reconciler(cluster)
    rec.reconcile("ns", "demo")
    _run_all(cluster)
    cluster.set_pod_phase("demo-worker-1", "Failed", ready=False)
    rec.reconcile("ns", "demo")
    st = cluster.job()["status"]
    assert st["phase"] == "Restarting" and st["restarts"] == 1
    assert all(p["metadata"].get("deletionTimestamp") for p in cluster.pods())
    rec.reconcile("ns", "demo")  # old pods still terminating: nothing created yet
    assert all(p["metadata"].get("deletionTimestamp") for p in cluster.pods())
    cluster.finish_deletions()
    rec.reconcile("ns", "demo")
    pods = cluster.pods()
    assert len(pods) == 4 and {p["metadata"]["labels"]["adaptis.io/attempt"] for p in pods} == {"1"}
    _run_all(cluster)
    rec.reconcile("ns", "demo")
    assert cluster.job()["status"]["phase"] == "Running"
    assert _cond(cluster.job(), "Restarting")["status"] == "False"
    cluster.set_pod_phase("demo-worker-0", "Failed", ready=False)
    rec.reconcile("ns", "demo")
    st = cluster.job()["status"]
    assert st["phase"] == "Failed" and _cond(cluster.job(), "Failed")["reason"] == (
        "BackoffLimitExceeded")
    # Running pods of a failed gang are stopped.
    running = [p for p in cluster.pods() if p["status"]["phase"] == "Running"]
    assert all(p["metadata"].get("deletionTimestamp") for p in running)


def test_invalid_spec_fails_with_field_condition_and_event(cluster: Any, make_job: Any) -> None:
    cluster.add_job(make_job(spec={"parallelism": {"workers": 20}}))
    Reconciler(cluster).reconcile("ns", "demo")
    job = cluster.job()
    assert job["status"]["phase"] == "Failed"
    failed = _cond(job, "Failed")
    assert failed["reason"] == "InvalidSpec"
    assert failed["message"].startswith("spec.parallelism.workers:")
    assert cluster.events[-1][1:3] == ("Warning", "InvalidSpec")
    assert cluster.pods() == []
    # Fixing the spec (a new generation) starts the job.
    job = cluster.job()
    job["spec"]["parallelism"]["workers"] = 2
    job["metadata"]["generation"] = 2
    Reconciler(cluster).reconcile("ns", "demo")
    assert cluster.job()["status"]["phase"] == "Planned" and len(cluster.pods()) == 2


def test_unsatisfiable_placement_shows_in_status(cluster: Any, make_job: Any) -> None:
    # 16 ranks, 4 replicas of a 4-rank pipeline (the model has too few layers for 16).
    cluster.add_job(make_job(spec={"parallelism": {"workers": 4, "gpusPerWorker": 4,
                                                   "dataParallel": 4}}))
    rec = Reconciler(cluster)
    result = rec.reconcile("ns", "demo")
    job = cluster.job()
    assert job["status"]["phase"] == "Pending"
    planned = _cond(job, "Planned")
    assert (planned["status"], planned["reason"]) == ("False", "Unsatisfiable")
    assert "spec.parallelism.workers" in planned["message"]
    assert result.requeue_after is not None and cluster.pods() == []
    # Retries on unchanged inputs neither search again nor flip the status through Profiling.
    writes = cluster.calls.count("patch_status")
    rec.reconcile("ns", "demo")
    assert cluster.calls.count("patch_status") == writes
    # New hardware is worth another try: two 4-GPU nodes make it satisfiable.
    for i in range(2):
        cluster.nodes[f"big-{i}"] = dict(cluster.nodes["h100-0"])
        cluster.nodes[f"big-{i}"]["metadata"] = {**cluster.nodes["h100-0"]["metadata"],
                                                 "name": f"big-{i}"}
        cluster.nodes[f"big-{i}"]["status"] = {**cluster.nodes["h100-0"]["status"],
                                               "allocatable": {"nvidia.com/gpu": "8"}}
    rec.reconcile("ns", "demo")
    assert cluster.job()["status"]["phase"] == "Planned" and len(cluster.pods()) == 4


def test_unschedulable_pods_show_in_status(cluster: Any, make_job: Any) -> None:
    cluster.add_job(make_job())
    rec = Reconciler(cluster)
    rec.reconcile("ns", "demo")
    pod = cluster.objects[("Pod", "ns", "demo-worker-0")]
    pod["status"] = {"phase": "Pending", "conditions": [{
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
        "message": "0/4 nodes are available: 1 Insufficient nvidia.com/gpu"}]}
    rec.reconcile("ns", "demo")
    running = _cond(cluster.job(), "Running")
    assert running["reason"] == "Unschedulable" and "Insufficient" in running["message"]
    assert cluster.events[-1][1:3] == ("Warning", "Unschedulable")


def test_suspend_removes_pods_and_resume_recreates(cluster: Any, make_job: Any) -> None:
    cluster.add_job(make_job(spec={"parallelism": {"workers": 4, "gpusPerWorker": 1}}))
    rec = Reconciler(cluster)
    rec.reconcile("ns", "demo")
    _run_all(cluster)  # bound to their nodes
    rec.reconcile("ns", "demo")
    cluster.job()["spec"]["suspend"] = True
    rec.reconcile("ns", "demo")
    st = cluster.job()["status"]
    assert st["phase"] == "Suspended"
    assert (st["message"], st["workersReady"], "startTime" in st) == ("spec.suspend is true", "0/4", False)
    assert _cond(cluster.job(), "Suspended")["status"] == "True"
    cluster.finish_deletions()
    assert cluster.pods() == []
    cluster.job()["spec"]["suspend"] = False
    rec.reconcile("ns", "demo")
    assert len(cluster.pods()) == 4
    resumed = _cond(cluster.job(), "Suspended")
    assert (resumed["status"], resumed["reason"], resumed["message"]) == ("False", "Resumed", "worker pods recreated")
    assert ("Normal", "Resumed", "worker pods recreated") in [e[1:4] for e in cluster.events]
    assert "replace ConfigMap" not in cluster.calls  # suspend is not a spec change


def test_active_deadline_fails_the_job(cluster: Any, make_job: Any, clock: Any) -> None:
    cluster.add_job(make_job(spec={"activeDeadlineSeconds": 60}))
    rec = Reconciler(cluster, clock=clock)
    first = rec.reconcile("ns", "demo")
    assert first.requeue_after == 60
    _run_all(cluster)
    clock.advance(30)
    assert rec.reconcile("ns", "demo").requeue_after == 30
    clock.advance(31)
    # The pass ends there: the pods it just stopped are not then counted as running.
    assert rec.reconcile("ns", "demo").phase == cluster.job()["status"]["phase"] == "Failed"
    assert _cond(cluster.job(), "Failed")["reason"] == "DeadlineExceeded"
    assert all(p["metadata"].get("deletionTimestamp") for p in cluster.pods())
    assert cluster.events[-1][1:3] == ("Warning", "DeadlineExceeded")


def test_ttl_deletes_the_finished_job(cluster: Any, make_job: Any, clock: Any) -> None:
    cluster.add_job(make_job(spec={"ttlSecondsAfterFinished": 10}))
    rec = Reconciler(cluster, clock=clock)
    rec.reconcile("ns", "demo")
    for pod in cluster.pods():
        cluster.set_pod_phase(pod["metadata"]["name"], "Succeeded", ready=False)
    assert rec.reconcile("ns", "demo").requeue_after == 10
    clock.advance(11)
    rec.reconcile("ns", "demo")
    assert ("ns", "demo") not in cluster.jobs


def test_lost_node_replans_on_what_is_left(cluster: Any, make_job: Any) -> None:
    cluster.add_job(make_job())
    rec = Reconciler(cluster)
    rec.reconcile("ns", "demo")
    _run_all(cluster)
    rec.reconcile("ns", "demo")
    del cluster.nodes["h100-1"]
    rec.reconcile("ns", "demo")
    # The pods on the lost node are force-deleted (no kubelet is left to confirm); the others
    # terminate gracefully.
    assert cluster.calls.count("force delete Pod") == 2
    assert cluster.calls.count("delete Pod") == 2
    st = cluster.job()["status"]
    assert st["replans"] == 1 and st["restarts"] == 0
    assert _cond(cluster.job(), "Restarting")["reason"] == "NodesChanged"
    assert "h100-1" in _cond(cluster.job(), "Restarting")["message"]
    nodes = {r["node"] for r in st["placement"]}
    assert "h100-1" not in nodes and len(st["placement"]) == 4
    cluster.finish_deletions()
    rec.reconcile("ns", "demo")
    assert len(cluster.pods()) == 4
    # A node added while running does not disturb the job.
    cluster.nodes["h100-9"] = dict(cluster.nodes["h100-0"])
    cluster.nodes["h100-9"]["metadata"] = {**cluster.nodes["h100-0"]["metadata"],
                                           "name": "h100-9"}
    rec.reconcile("ns", "demo")
    assert cluster.job()["status"]["replans"] == 1


def test_spec_change_replans_and_replaces_pods(cluster: Any, make_job: Any) -> None:
    cluster.add_job(make_job())
    rec = Reconciler(cluster)
    rec.reconcile("ns", "demo")
    cluster.job()["spec"]["parallelism"]["workers"] = 2
    cluster.job()["metadata"]["generation"] = 2
    rec.reconcile("ns", "demo")
    assert "replace ConfigMap" in cluster.calls
    cluster.finish_deletions()
    rec.reconcile("ns", "demo")
    assert [p["metadata"]["name"] for p in cluster.pods()] == ["demo-worker-0", "demo-worker-1"]
    assert cluster.job()["status"]["observedGeneration"] == 2
    assert cluster.job()["status"]["replans"] == 0


def test_a_plan_too_large_to_store_is_a_condition_not_a_retry_loop(
        cluster: Any, make_job: Any, monkeypatch: Any) -> None:
    from adaptis.operator.resources import manifests
    from adaptis.operator.scheduling import planning

    monkeypatch.setattr(manifests, "CONFIG_MAP_LIMIT_BYTES", 1000)
    plans: list[str] = []
    real = planning.plan_strategy  # what plan_job calls for the job's strategy (1f1b)
    monkeypatch.setattr(planning, "plan_strategy",
                        lambda *a, **k: plans.append("plan") or real(*a, **k))
    cluster.add_job(make_job())
    rec = Reconciler(cluster)
    result = rec.reconcile("ns", "demo")
    planned = _cond(cluster.job(), "Planned")
    assert (planned["status"], planned["reason"]) == ("False", "PlanTooLarge")
    assert planned["message"].startswith("spec.training.microbatches, spec.parallelism.workers:")
    assert any(e[2] == "PlanTooLarge" for e in cluster.events)
    assert cluster.get_config_map("ns", "demo-config") is None and cluster.pods() == []
    assert result.requeue_after is not None and result.requeue_after >= 30
    # Passes on the same inputs (every resync) neither plan again nor rewrite the status.
    writes, planned = cluster.calls.count("patch_status"), len(plans)
    rec.reconcile("ns", "demo")
    assert planned >= 1 and len(plans) == planned  # the strategy (and i1f1b), once
    assert cluster.calls.count("patch_status") == writes


def test_a_broken_update_stops_the_running_pods_once_and_a_fix_starts_again(
        cluster: Any, make_job: Any, clock: Any) -> None:
    cluster.add_job(make_job())
    rec = Reconciler(cluster, clock=clock)
    rec.reconcile("ns", "demo")
    _run_all(cluster)
    rec.reconcile("ns", "demo")
    assert cluster.job()["status"]["phase"] == "Running"
    first_start = cluster.job()["status"]["startTime"]
    # An update the validation refuses: the gang must not keep training on the old spec.
    cluster.job()["spec"]["parallelism"]["workers"] = 20
    cluster.job()["metadata"]["generation"] = 2
    clock.advance(5)
    rec.reconcile("ns", "demo")
    st = cluster.job()["status"]
    assert st["phase"] == "Failed" and st["observedGeneration"] == 2
    failed = _cond(cluster.job(), "Failed")
    assert failed["reason"] == "InvalidSpec"
    assert failed["message"].startswith("spec.parallelism.workers:")
    pods = cluster.pods()
    assert len(pods) == 4 and all(p["metadata"].get("deletionTimestamp") for p in pods), (
        "a broken update left the running pods of the old spec in place")
    # Later passes of the same generation (resyncs, pod events) are not retries: one status
    # write in all, the completion time stays, nothing is created or deleted.
    writes, done, calls = cluster.calls.count("patch_status"), st["completionTime"], len(
        cluster.calls)
    for _ in range(3):
        clock.advance(60)
        rec.reconcile("ns", "demo")
    assert cluster.calls.count("patch_status") == writes, "a failed job was written every pass"
    assert cluster.job()["status"]["completionTime"] == done
    assert [c for c in cluster.calls[calls:] if c != "get_job"] == []
    # A corrected spec is a new generation: the job starts again.
    cluster.finish_deletions()
    cluster.job()["spec"]["parallelism"]["workers"] = 4
    cluster.job()["metadata"]["generation"] = 3
    rec.reconcile("ns", "demo")
    st = cluster.job()["status"]
    assert st["phase"] == "Planned" and "completionTime" not in st and len(cluster.pods()) == 4
    assert "message" not in st, st["message"]  # the failure's message goes with it
    # Its stopped pods were not lost ranks (no restart used) and its deadline starts afresh.
    assert st["restarts"] == 0 and st["startTime"] != first_start, st
    failed = _cond(cluster.job(), "Failed")
    assert (failed["status"], failed["reason"], failed["message"]) == (
        "False", "SpecChanged", "the spec was corrected")


def test_only_an_invalid_spec_is_retried_on_a_new_generation(cluster: Any,
                                                             make_job: Any) -> None:
    cluster.add_job(make_job(spec={"backoffLimit": 0}))
    rec = Reconciler(cluster)
    rec.reconcile("ns", "demo")
    _run_all(cluster)
    cluster.set_pod_phase("demo-worker-1", "Failed", ready=False)
    rec.reconcile("ns", "demo")
    assert _cond(cluster.job(), "Failed")["reason"] == "BackoffLimitExceeded"
    cluster.finish_deletions()
    # Editing a job that failed for another reason does not restart it (as a batch Job).
    cluster.job()["spec"]["training"]["steps"] = 8
    cluster.job()["metadata"]["generation"] = 2
    creates = cluster.calls.count("create Pod")
    rec.reconcile("ns", "demo")
    assert cluster.job()["status"]["phase"] == "Failed"
    assert _cond(cluster.job(), "Failed")["reason"] == "BackoffLimitExceeded"
    assert cluster.calls.count("create Pod") == creates
