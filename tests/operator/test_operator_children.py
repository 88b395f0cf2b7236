"""Refusals of a job's children by the API server: the spec's fault fails the job naming the
field, a policy's makes it wait, the API server's own failures propagate (the queue retries)."""

from __future__ import annotations

from typing import Any

import pytest

from adaptis.operator.control.reconcile import Reconciler
from adaptis.operator.kube.children import refusal
from adaptis.operator.kube.cluster import ApiError

POD = {"kind": "Pod", "metadata": {"name": "demo-worker-0"}}

# Messages as kube-apiserver v1.37 words them (seen on the integration control plane).
TOLERATION_400 = ('POST /api/v1/namespaces/ns/pods: 400 Pod in version "v1" cannot be handled '
                  'as a Pod: json: cannot unmarshal number into Go struct field '
                  'Toleration.spec.tolerations.key of type string')
LABEL_422 = ('POST /api/v1/namespaces/ns/pods: 422 Pod "demo-worker-0" is invalid: '
             'metadata.labels: Invalid value: "h\u00e9": a valid label must be an empty string or '
             'consist of alphanumeric characters')
QUANTITY_400 = ('POST /api/v1/namespaces/ns/pods: 400 Pod in version "v1" cannot be handled as '
                "a Pod: quantities must match the regular expression '^([+-]?[0-9.]+)$'")
POLICY_422 = ('POST /api/v1/namespaces/ns/pods: 422 pods "demo-worker-0" is forbidden: '
              "ValidatingAdmissionPolicy 'no-gpus' with binding 'b' denied request: no")
PSA_403 = ('POST /api/v1/namespaces/ns/pods: 403 pods "demo-worker-0" is forbidden: violates '
           'PodSecurity "restricted:latest": hostPath volumes')
CM_422 = ('POST /api/v1/namespaces/ns/configmaps: 422 ConfigMap "demo-config" is invalid: '
          '[]: Too long: must have at most 1048576 bytes')


@pytest.mark.parametrize(("status", "text", "obj", "invalid", "field"), [
    (400, TOLERATION_400, POD, True, "spec.worker.tolerations"),
    (422, LABEL_422, POD, True, "spec.worker.labels"),
    (400, QUANTITY_400, POD, True, "spec.worker.volumes"),
    (422, POLICY_422, POD, False, "spec.worker"),
    (403, PSA_403, POD, False, "spec.worker"),
    (404, "POST /api/v1/namespaces/gone/pods: 404 namespaces \"gone\" not found", POD, False,
     "spec.worker"),
    (422, CM_422, {"kind": "ConfigMap", "metadata": {"name": "demo-config"}}, True,
     "spec.training.microbatches, spec.parallelism.workers"),
])
def test_refusals_are_classified_and_name_the_spec_field(
        status: int, text: str, obj: dict[str, Any], invalid: bool, field: str) -> None:
    found = refusal(ApiError(text, status=status), obj=obj)
    assert found is not None
    assert (found.invalid, found.field) == (invalid, field)
    assert found.message.startswith(f"{field}: the API server ")
    assert text in found.message


@pytest.mark.parametrize("status", [409, 429, 500, 503])
def test_the_api_servers_own_failures_are_not_refusals(status: int) -> None:
    assert refusal(ApiError("POST pods: busy", status=status), obj=POD) is None


class Refusing:
    """The conftest's in-memory API, refusing creates of one kind with a given error."""

    def __init__(self, inner: Any, *, kind: str, status: int, text: str) -> None:
        self._inner, self._kind, self._status, self._text = inner, kind, status, text

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def create(self, obj: Any) -> bool:
        if obj["kind"] == self._kind:
            self._inner.calls.append(f"refused {obj['kind']}")
            raise ApiError(self._text, status=self._status)
        return bool(self._inner.create(obj))

    def replace_config_map(self, obj: Any) -> None:
        if self._kind == "ConfigMap":
            raise ApiError(self._text, status=self._status)
        self._inner.replace_config_map(obj)


def _cond(job: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in job["status"]["conditions"] if c["type"] == type_)


@pytest.mark.parametrize(("kind", "status", "text", "field"), [
    ("Pod", 400, TOLERATION_400, "spec.worker.tolerations"),
    ("Pod", 422, LABEL_422, "spec.worker.labels"),
    ("Service", 400, 'POST services: 400 Service in version "v1" cannot be handled', "spec.worker"),
    ("ConfigMap", 422, CM_422, "spec.training.microbatches"),
])
def test_an_invalid_child_fails_the_job_once_with_the_field_and_an_event(
        cluster: Any, make_job: Any, kind: str, status: int, text: str, field: str) -> None:
    cluster.add_job(make_job())
    api = Refusing(cluster, kind=kind, status=status, text=text)
    rec = Reconciler(api)
    result = rec.reconcile("ns", "demo")  # no exception: nothing for the queue to retry
    job = cluster.job()
    failed = _cond(job, "Failed")
    assert job["status"]["phase"] == "Failed"
    assert (failed["status"], failed["reason"]) == ("True", "InvalidSpec")
    assert failed["message"].startswith(field) and text in failed["message"]
    assert ("demo", "Warning", "InvalidSpec") in [e[:3] for e in cluster.events]
    assert result.requeue_after is None
    # Pods created before the refusal are deleted; later passes create nothing more.
    assert all(p["metadata"].get("deletionTimestamp") for p in cluster.pods())
    calls = len(cluster.calls)
    for _ in range(5):
        rec.reconcile("ns", "demo")
    assert [c for c in cluster.calls[calls:] if c.startswith(("create", "refused"))] == []


def test_a_corrected_spec_starts_again_after_a_refused_child(cluster: Any,
                                                             make_job: Any) -> None:
    cluster.add_job(make_job())
    Reconciler(Refusing(cluster, kind="Pod", status=400, text=TOLERATION_400)).reconcile(
        "ns", "demo")
    assert cluster.job()["status"]["phase"] == "Failed"
    cluster.finish_deletions()
    job = cluster.job()
    job["spec"]["worker"] = {"labels": {"team": "a"}}
    job["metadata"]["generation"] = 2
    Reconciler(cluster).reconcile("ns", "demo")
    assert cluster.job()["status"]["phase"] == "Planned" and len(cluster.pods()) == 4


@pytest.mark.parametrize(("kind", "reason"), [("ConfigMap", "ConfigMapRejected"),
                                              ("Service", "ServiceRejected"),
                                              ("Pod", "PodsRejected")])
def test_a_policy_refusal_waits_with_a_slow_retry(cluster: Any, make_job: Any, kind: str,
                                                  reason: str) -> None:
    cluster.add_job(make_job())
    result = Reconciler(Refusing(cluster, kind=kind, status=403, text=PSA_403)).reconcile(
        "ns", "demo")
    job = cluster.job()
    running = _cond(job, "Running")
    assert (running["status"], running["reason"]) == ("False", reason)
    assert "violates PodSecurity" in running["message"] and job["status"]["phase"] != "Failed"
    # A policy on a ConfigMap or Service says nothing of the spec: the namespace is named.
    assert running["message"].startswith("spec.worker: " if kind == "Pod"
                                         else "metadata.namespace: "), running["message"]
    assert result.requeue_after == 30.0


def test_a_lifted_policy_refusal_leaves_no_stale_message(cluster: Any, make_job: Any) -> None:
    cluster.add_job(make_job())
    Reconciler(Refusing(cluster, kind="Pod", status=403, text=PSA_403)).reconcile("ns", "demo")
    assert "violates PodSecurity" in cluster.job()["status"]["message"]
    Reconciler(cluster).reconcile("ns", "demo")  # the admin relaxed the policy: the pods start
    job = cluster.job()
    assert _cond(job, "Running")["reason"] == "Starting" and len(cluster.pods()) == 4
    assert "message" not in job["status"], job["status"].get("message")


@pytest.mark.parametrize("kind", ["ConfigMap", "Service", "Pod"])
def test_api_server_failures_propagate_to_the_queue(cluster: Any, make_job: Any,
                                                    kind: str) -> None:
    cluster.add_job(make_job())
    with pytest.raises(ApiError):
        Reconciler(Refusing(cluster, kind=kind, status=503, text="etcd leader changed")
                   ).reconcile("ns", "demo")


VOLUME_400 = ('POST /api/v1/namespaces/ns/pods?dryRun=All: 400 Pod in version "v1" cannot be '
              "handled as a Pod: quantities must match the regular expression '^([+-]?[0-9.]+)$'")


class Probing:
    """The conftest's in-memory API whose dry-run create of a pod answers ``status``."""

    def __init__(self, inner: Any, *, status: int, text: str) -> None:
        self._inner, self._status, self._text = inner, status, text
        self.probes = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def dry_run_create(self, obj: Any) -> None:
        self.probes += 1
        assert obj["kind"] == "Pod" and obj["metadata"]["name"] == "demo-worker-0"
        raise ApiError(self._text, status=self._status)


def test_a_dry_run_of_rank_0_fails_an_invalid_spec_before_anything_exists(
        cluster: Any, make_job: Any) -> None:
    cluster.add_job(make_job())
    api = Probing(cluster, status=400, text=VOLUME_400)
    Reconciler(api).reconcile("ns", "demo")
    failed = _cond(cluster.job(), "Failed")
    assert failed["reason"] == "InvalidSpec"
    assert failed["message"].startswith("spec.worker.volumes: ")
    assert api.probes == 1 and cluster.objects == {}  # no ConfigMap, Service or pod


def test_a_dry_run_a_policy_refuses_still_stores_the_plan(cluster: Any, make_job: Any) -> None:
    # The real creates report the policy (PodsRejected) and the plan stays cached meanwhile.
    cluster.add_job(make_job())
    api = Probing(cluster, status=403, text=PSA_403)
    Reconciler(api).reconcile("ns", "demo")
    assert cluster.get_config_map("ns", "demo-config") is not None
    assert cluster.job()["status"]["phase"] != "Failed"


# --- strict field validation: a key no schema declares (issue 27) -------------------------------
def _strict_400(field: str, *, dry_run: bool = False) -> str:
    """A create the operator sends with fieldValidation=Strict, as kube-apiserver answers it."""
    query = "?dryRun=All&fieldValidation=Strict" if dry_run else "?fieldValidation=Strict"
    return (f'POST /api/v1/namespaces/ns/pods{query}: 400 Pod in version "v1" cannot be handled '
            f'as a Pod: strict decoding error: unknown field "{field}"')


# Rank 0's pod as the operator renders it: its own volumes, env and mounts come first.
STRICT_POD = {"kind": "Pod", "metadata": {"name": "demo-worker-0"}, "spec": {
    "volumes": [{"name": "adaptis-config", "configMap": {"name": "demo-config"}},
                {"name": "checkpoints", "emptyDir": {}},
                {"name": "data", "persistentVolumeClaim": {"claimNme": "x"}}],
    "containers": [{"name": "worker",
                    "env": [{"name": "RANK", "value": "0"},
                            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"nme": "s"}}}],
                    "volumeMounts": [{"name": "checkpoints", "mountPath": "/checkpoints"},
                                     {"name": "data", "mountPath": "/d", "readOnlyy": True}],
                    "resources": {"claims": [{"name": "gpu", "requst": "r"}]}}]}}


@pytest.mark.parametrize(("api_field", "field", "what"), [
    ("spec.volumes[2].persistentVolumeClaim.claimNme", "spec.worker.volumes",
     'volume "data": persistentVolumeClaim.claimNme'),
    ("spec.containers[0].env[1].valueFrom.secretKeyRef.nme", "spec.worker.env",
     'env var "TOKEN": valueFrom.secretKeyRef.nme'),
    ("spec.containers[0].volumeMounts[1].readOnlyy", "spec.worker.volumeMounts",
     'volume mount "data": readOnlyy'),
    ("spec.containers[0].resources.claims[0].requst", "spec.worker.resources",
     "spec.containers[0].resources.claims[0].requst"),
    # An index the pod does not have (the pod object not at hand): the pod's field as it is.
    ("spec.volumes[9].nfs.servr", "spec.worker.volumes", "spec.volumes[9].nfs.servr"),
])
def test_an_unknown_field_fails_the_job_naming_the_spec_field_and_the_entry(
        api_field: str, field: str, what: str) -> None:
    text = _strict_400(api_field)
    found = refusal(ApiError(text, status=400), obj=STRICT_POD)
    assert found is not None and found.invalid and found.reason == "InvalidSpec"
    assert found.field == field
    assert found.message.startswith(
        f"{field}: {what} is not a field Kubernetes knows (check its spelling); the API server "
        f"refused Pod demo-worker-0 (the Pod's {api_field}): "), found.message
    assert text in found.message


def test_a_field_not_declared_in_a_schema_is_named_too() -> None:
    # structured-merge-diff's wording (server-side apply, custom resources).
    text = ("POST /api/v1/namespaces/ns/pods: 400 .spec.volumes[2].persistentVolumeClaim.claimNme:"
            " field not declared in schema")
    found = refusal(ApiError(text, status=400), obj=STRICT_POD)
    assert found is not None and found.field == "spec.worker.volumes"
    assert found.message.startswith('spec.worker.volumes: volume "data": '
                                    "persistentVolumeClaim.claimNme is not a field"), found.message


class StrictProbing(Probing):
    """A dry run of rank 0's pod as a strict API server answers it: the first unknown key in
    the pod's volumes, at the pod's index (after the operator's own volumes)."""

    def dry_run_create(self, obj: Any) -> None:
        self.probes += 1
        for i, volume in enumerate(obj["spec"]["volumes"]):
            claim = volume.get("persistentVolumeClaim") or {}
            for key in claim:
                if key not in {"claimName", "readOnly"}:
                    field = f"spec.volumes[{i}].persistentVolumeClaim.{key}"
                    raise ApiError(_strict_400(field, dry_run=True), status=400)


def test_a_misspelt_key_in_a_volume_source_fails_the_job_once_with_nothing_created(
        cluster: Any, make_job: Any) -> None:
    volumes = [{"name": "scratch", "emptyDir": {}},
               {"name": "data", "persistentVolumeClaim": {"claimNme": "x"}}]
    cluster.add_job(make_job(spec={"worker": {"volumes": volumes}}))
    api = StrictProbing(cluster, status=400, text="")
    result = Reconciler(api).reconcile("ns", "demo")  # no exception: nothing to retry
    job = cluster.job()
    failed = _cond(job, "Failed")
    assert job["status"]["phase"] == "Failed" and result.requeue_after is None
    assert failed["reason"] == "InvalidSpec"
    assert failed["message"].startswith(
        'spec.worker.volumes: volume "data": persistentVolumeClaim.claimNme is not a field '
        "Kubernetes knows"), failed["message"]
    (event,) = [e for e in cluster.events if e[:3] == ("demo", "Warning", "InvalidSpec")]
    assert event[3].startswith('spec.worker.volumes: volume "data"'), event
    assert api.probes == 1 and cluster.objects == {}  # no ConfigMap, Service or pod
    calls = len(cluster.calls)
    for _ in range(3):  # no retry loop: later passes neither probe nor create
        Reconciler(api).reconcile("ns", "demo")
    assert api.probes == 1
    assert [c for c in cluster.calls[calls:] if c.startswith(("create", "dry-run"))] == []
