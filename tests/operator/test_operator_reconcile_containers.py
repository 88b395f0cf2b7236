"""Worker containers the kubelet cannot start (issue 27), on the in-memory API: a container
waiting with CreateContainerConfigError (a missing Secret), an image that cannot be pulled or
named, or a runtime's refusal becomes the job's ``ContainersCreated=False`` condition and one
Warning Event naming the pod, the container and what is missing; the job waits (it never
fails for it) and the condition turns True once the gang runs. ConfigMaps the workers
reference are looked at before any pod is created: the job waits for them by name.
(The real control plane: tests/integration/test_operator_containers_e2e.py.)"""

from __future__ import annotations

from typing import Any

import pytest

from adaptis.api.conditions import ConditionType
from adaptis.api.job import JobSpec
from adaptis.operator.control.reconcile import Reconciler
from adaptis.operator.resources.hf_config import RETRY_MAX_S
from adaptis.operator.resources.status import MAX_WAITING_MESSAGE
from adaptis.operator.resources.validation import absent_config_maps

SECRET_MISSING = 'secret "hf-token" not found'


def _cond(job: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in job.get("status", {}).get("conditions", [])
                 if c["type"] == type_), None)


def _wait(cluster: Any, pod: str, reason: str, message: str, *, phase: str = "Pending",
          init: bool = False, container: str = "worker") -> None:
    """Play the kubelet: ``pod``'s container waits with ``reason``."""
    waiting = {"name": container, "ready": False, "restartCount": 0,
               "state": {"waiting": {"reason": reason, "message": message}}}
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": [{"type": "PodScheduled", "status": "True"},
                       {"type": "Ready", "status": "False"}],
        "initContainerStatuses" if init else "containerStatuses": [waiting]}
    cluster.objects[("Pod", "ns", pod)]["status"] = status


def _run_all(cluster: Any) -> None:
    for pod in cluster.pods():
        cluster.set_pod_phase(pod["metadata"]["name"], "Running")


def _started(cluster: Any, make_job: Any, clock: Any, **spec: Any) -> Reconciler:
    cluster.add_job(make_job(spec=spec or None))
    rec = Reconciler(cluster, clock=clock)
    rec.reconcile("ns", "demo")
    assert len(cluster.pods()) == 4
    return rec


@pytest.mark.parametrize(("kubelet", "reason", "message"), [
    ("CreateContainerConfigError", "ContainerConfigError", SECRET_MISSING),
    ("CreateContainerConfigError", "ContainerConfigError",
     "couldn't find key token in Secret ns/hf-token"),
    ("ErrImagePull", "ImagePullBackOff",
     'failed to pull image "registry.example/trainer:v9": not found'),
    ("ImagePullBackOff", "ImagePullBackOff", 'Back-off pulling image "registry.example/t:v9"'),
    ("ErrImageNeverPull", "ImagePullBackOff",
     'Container image "t:v9" is not present with pull policy of Never'),
    ("InvalidImageName", "InvalidImageName", 'Failed to apply default image tag "Bad:Image"'),
    ("CreateContainerError", "CreateContainerError", "context deadline exceeded"),
])
def test_a_container_the_kubelet_cannot_start_is_a_condition_and_one_warning(
        cluster: Any, make_job: Any, clock: Any, kubelet: str, reason: str,
        message: str) -> None:
    rec = _started(cluster, make_job, clock)
    _wait(cluster, "demo-worker-1", kubelet, message)
    for _ in range(3):  # every pass sees it; the Event is posted once
        rec.reconcile("ns", "demo")
    job = cluster.job()
    cond = _cond(job, ConditionType.CONTAINERS_CREATED)
    assert cond is not None
    assert (cond["status"], cond["reason"]) == ("False", reason)
    assert cond["message"] == f"demo-worker-1: worker: {kubelet}: {message}"
    warnings = [e for e in cluster.events if e[1] == "Warning"]
    assert warnings == [("demo", "Warning", reason, cond["message"])]
    # The job waits (the user may still create the Secret or push the image): no failure, no
    # restart, its pods kept.
    st = job["status"]
    assert st["phase"] == "Planned" and st.get("restarts", 0) == 0
    assert st["message"] == f"worker containers cannot start: {cond['message']}"
    assert _cond(job, "Failed") is None
    assert len(cluster.pods()) == 4
    assert not any(pod["metadata"].get("deletionTimestamp") for pod in cluster.pods())


def test_an_init_container_waiting_on_its_secret_is_reported_too(
        cluster: Any, make_job: Any, clock: Any) -> None:
    rec = _started(cluster, make_job, clock)
    _wait(cluster, "demo-worker-0", "CreateContainerConfigError", SECRET_MISSING, init=True,
          container="fetch-data")
    rec.reconcile("ns", "demo")
    cond = _cond(cluster.job(), ConditionType.CONTAINERS_CREATED)
    assert cond is not None and cond["reason"] == "ContainerConfigError"
    assert cond["message"] == f"demo-worker-0: fetch-data: CreateContainerConfigError: {SECRET_MISSING}"


def test_the_condition_clears_once_the_secret_is_there_and_the_gang_runs(
        cluster: Any, make_job: Any, clock: Any) -> None:
    rec = _started(cluster, make_job, clock)
    _wait(cluster, "demo-worker-0", "CreateContainerConfigError", SECRET_MISSING)
    rec.reconcile("ns", "demo")
    # The user creates the Secret: the kubelet creates the container (ContainerCreating).
    _wait(cluster, "demo-worker-0", "ContainerCreating", "")
    rec.reconcile("ns", "demo")
    job = cluster.job()
    cond = _cond(job, ConditionType.CONTAINERS_CREATED)
    assert cond is not None and (cond["status"], cond["reason"]) == ("False", "ContainerCreating")
    assert "cannot start" not in job["status"].get("message", "")
    _run_all(cluster)
    rec.reconcile("ns", "demo")
    job = cluster.job()
    cond = _cond(job, ConditionType.CONTAINERS_CREATED)
    assert cond is not None and (cond["status"], cond["reason"]) == ("True", "ContainersStarted")
    assert job["status"]["phase"] == "Running" and "message" not in job["status"]
    assert [e[1:3] for e in cluster.events if e[2] in {"ContainerConfigError",
                                                         "ContainersStarted"}] == [
        ("Warning", "ContainerConfigError"), ("Normal", "ContainersStarted")]
    # A job never stuck carries no such condition at all.
    cluster.add_job(make_job("plain"))
    Reconciler(cluster, clock=clock).reconcile("ns", "plain")
    assert _cond(cluster.job("plain"), ConditionType.CONTAINERS_CREATED) is None


def test_a_restarting_gang_says_its_containers_cannot_start_and_stops_saying_it(
        cluster: Any, make_job: Any, clock: Any) -> None:
    rec = _started(cluster, make_job, clock)
    _run_all(cluster)
    rec.reconcile("ns", "demo")
    cluster.set_pod_phase("demo-worker-3", "Failed", ready=False)
    rec.reconcile("ns", "demo")  # a gang restart
    cluster.finish_deletions()
    rec.reconcile("ns", "demo")  # the new attempt's pods
    assert cluster.job()["status"]["phase"] == "Restarting" and len(cluster.pods()) == 4
    _wait(cluster, "demo-worker-0", "ImagePullBackOff", 'Back-off pulling image "t"')
    rec.reconcile("ns", "demo")
    st = cluster.job()["status"]
    assert st["phase"] == "Restarting"
    assert st["message"].startswith("worker containers cannot start: demo-worker-0: worker: ")
    _wait(cluster, "demo-worker-0", "ContainerCreating", "")
    rec.reconcile("ns", "demo")
    assert "cannot start" not in cluster.job()["status"].get("message", "")


def test_a_job_that_finishes_straight_from_stuck_clears_the_condition(
        cluster: Any, make_job: Any, clock: Any) -> None:
    rec = _started(cluster, make_job, clock)
    _wait(cluster, "demo-worker-2", "ImagePullBackOff", 'Back-off pulling image "t"')
    rec.reconcile("ns", "demo")
    for pod in cluster.pods():
        cluster.set_pod_phase(pod["metadata"]["name"], "Succeeded", ready=False)
    rec.reconcile("ns", "demo")
    job = cluster.job()
    assert job["status"]["phase"] == "Succeeded"
    cond = _cond(job, ConditionType.CONTAINERS_CREATED)
    assert cond is not None and cond["status"] == "True"


def test_image_pull_retries_do_not_repeat_the_warning(
        cluster: Any, make_job: Any, clock: Any) -> None:
    """The kubelet alternates ErrImagePull and ImagePullBackOff, each with its own message:
    the condition follows them, the Event is posted once."""
    rec = _started(cluster, make_job, clock)
    for i in range(4):
        kubelet = "ErrImagePull" if i % 2 == 0 else "ImagePullBackOff"
        _wait(cluster, "demo-worker-0", kubelet, f"attempt {i}: not found")
        rec.reconcile("ns", "demo")
    cond = _cond(cluster.job(), ConditionType.CONTAINERS_CREATED)
    assert cond is not None and cond["message"].endswith("ImagePullBackOff: attempt 3: not found")
    assert [e[2] for e in cluster.events if e[1] == "Warning"] == ["ImagePullBackOff"]


def test_the_message_stays_bounded_however_many_pods_and_however_long_their_messages(
        cluster: Any, make_job: Any, clock: Any) -> None:
    rec = _started(cluster, make_job, clock)
    long = 'secret "' + "x" * 5000 + '" not found\nsecond line\x1b[31m'
    for rank in range(4):
        _wait(cluster, f"demo-worker-{rank}", "CreateContainerConfigError", long)
    rec.reconcile("ns", "demo")
    job = cluster.job()
    cond = _cond(job, ConditionType.CONTAINERS_CREATED)
    assert cond is not None
    message = cond["message"]
    assert message.endswith("; and 1 more")
    assert message.count("demo-worker-") == 3 and "demo-worker-3" not in message
    assert len(message) < 3 * (MAX_WAITING_MESSAGE + 80)
    assert "\n" not in message and "\x1b" not in message
    assert len(job["status"]["message"]) < 2 * (MAX_WAITING_MESSAGE + 80)
    (event,) = [e for e in cluster.events if e[1] == "Warning"]
    assert event[3] == message


# --- ConfigMaps the workers reference: looked at before any pod is created.

def _config_map(name: str, data: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": "ns"}, "data": data}


ENV_REF = {"name": "DATA_URL", "valueFrom": {"configMapKeyRef": {"name": "data", "key": "url"}}}


def test_a_missing_config_map_of_the_env_keeps_the_pods_back_until_it_exists(
        cluster: Any, make_job: Any, clock: Any) -> None:
    cluster.add_job(make_job(spec={"worker": {"env": [ENV_REF]}}))
    rec = Reconciler(cluster, clock=clock)
    first = rec.reconcile("ns", "demo")
    job = cluster.job()
    assert not cluster.pods()
    cond = _cond(job, ConditionType.CONTAINERS_CREATED)
    assert cond is not None and (cond["status"], cond["reason"]) == ("False", "ConfigMapNotFound")
    assert cond["message"].startswith("spec.worker.env[0].valueFrom.configMapKeyRef.name: "
                                      "ConfigMap ns/data does not exist")
    assert job["status"]["phase"] == "Planned"
    assert job["status"]["message"] == f"waiting for ConfigMaps: {cond['message']}"
    assert first.requeue_after == 2.0
    clock.advance(30)  # nothing watches ConfigMaps: each look comes later than the last
    assert rec.reconcile("ns", "demo").requeue_after == 30.0
    clock.advance(600)
    assert rec.reconcile("ns", "demo").requeue_after == RETRY_MAX_S
    assert [e[1:3] for e in cluster.events if e[1] == "Warning"] == [
        ("Warning", "ConfigMapNotFound")]

    cluster.create(_config_map("data", {"other": "x"}))  # there now, but without the key
    rec.reconcile("ns", "demo")
    cond = _cond(cluster.job(), ConditionType.CONTAINERS_CREATED)
    assert cond is not None and cond["message"].startswith(
        "spec.worker.env[0].valueFrom.configMapKeyRef.key: ConfigMap ns/data has no key 'url' "
        "(its keys: other)")
    assert not cluster.pods()

    cluster.objects[("ConfigMap", "ns", "data")]["data"]["url"] = "s3://bucket/set"
    rec.reconcile("ns", "demo")
    assert len(cluster.pods()) == 4
    cond = _cond(cluster.job(), ConditionType.CONTAINERS_CREATED)
    assert cond is not None and (cond["status"], cond["reason"]) == ("False", "ContainerCreating")
    _run_all(cluster)
    rec.reconcile("ns", "demo")
    cond = _cond(cluster.job(), ConditionType.CONTAINERS_CREATED)
    assert cond is not None and cond["status"] == "True"


def test_a_config_map_deleted_under_a_running_gang_leaves_it_alone(
        cluster: Any, make_job: Any, clock: Any) -> None:
    """Its pods hold what they read: only pods still to create wait for it."""
    cluster.create(_config_map("data", {"url": "s3://x"}))
    rec = _started(cluster, make_job, clock, worker={"env": [ENV_REF]})
    _run_all(cluster)
    del cluster.objects[("ConfigMap", "ns", "data")]
    rec.reconcile("ns", "demo")
    job = cluster.job()
    assert job["status"]["phase"] == "Running" and _cond(job, ConditionType.CONTAINERS_CREATED) is None


def _spec(**worker: Any) -> JobSpec:
    base = {"model": {"vocabSize": 64, "hidden": 32, "heads": 2,
                      "blocks": [{"kind": "attention", "count": 2}]},
            "training": {"steps": 1, "microbatches": 2, "sequenceLength": 8},
            "parallelism": {"workers": 2}, "worker": worker}
    return JobSpec.model_validate(base)


def test_every_kind_of_config_map_reference_is_looked_at_and_optional_ones_are_not() -> None:
    spec = _spec(
        env=[ENV_REF,
             {"name": "OPT", "valueFrom": {"configMapKeyRef": {
                 "name": "gone", "key": "k", "optional": True}}},
             {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
        volumes=[{"name": "cfg", "configMap": {"name": "data",
                                               "items": [{"key": "url", "path": "u"},
                                                         {"key": "missing", "path": "m"}]}},
                 {"name": "opt", "configMap": {"name": "gone", "optional": True}},
                 {"name": "mix", "projected": {"sources": [
                     {"secret": {"name": "s"}},
                     {"configMap": {"name": "absent"}},
                     {"configMap": {"name": "gone", "optional": True}}]}}])
    reads: list[str] = []

    def read(name: str) -> dict[str, Any] | None:
        reads.append(name)
        return {"data": {"url": "x"}} if name == "data" else None

    assert absent_config_maps(spec, namespace="ns", read=read) == [
        "spec.worker.volumes[0].configMap.items[1].key: ConfigMap ns/data has no key "
        "'missing' (its keys: url); the job waits for it",
        "spec.worker.volumes[2].projected.sources[1].configMap.name: ConfigMap ns/absent does "
        "not exist; the job waits for it (create it, or set optional: true on the reference)",
    ]
    assert reads == ["data", "absent"]  # each ConfigMap once; optional and Secret ones never
    assert absent_config_maps(_spec(), namespace="ns", read=read) == []


def test_a_config_map_s_many_keys_are_not_all_listed() -> None:
    spec = _spec(env=[ENV_REF])
    many = {"data": {f"key-{i:03}": "v" for i in range(50)}}
    (message,) = absent_config_maps(spec, namespace="ns", read=lambda _: many)
    assert "key-004 and 45 more)" in message and "key-005" not in message
