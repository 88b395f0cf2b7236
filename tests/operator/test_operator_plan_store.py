"""The plan record lives in the operator's namespace; what a tenant writes in its own is never
trusted (issue 27): the job's ConfigMap is hashed, never decoded, and restored when changed;
a record that fails a check is re-planned with a Warning; records of deleted jobs go."""

from __future__ import annotations

import base64
import json
import zlib
from datetime import UTC, datetime
from typing import Any

import pytest
from conftest import FakeCluster
from plan_kit import stored_record

from adaptis.api.job import JobSpec
from adaptis.api.plan_packing import PackLimits
from adaptis.operator.control.reconcile import Reconciler
from adaptis.operator.core.passes import PassState
from adaptis.operator.core.records import JobRef
from adaptis.operator.resources.status import parse_status
from adaptis.operator.scheduling.plan_store import (
    RECORD_KEY,
    PlanStore,
    StoredPlan,
    _Decoded,
    record_name,
)

OPS = "adaptis-system"  # ReconcileSettings' default operator namespace


def _bomb(actions: int = 59_652_321) -> str:
    """A packed plan whose header claims ``actions`` actions (536 MB raw) in ~700 kB."""
    raw = b"APK1" + (1).to_bytes(4, "little") + actions.to_bytes(4, "little")
    raw += bytes(4 + 9 * actions)
    return "apk1:" + base64.b64encode(zlib.compress(raw, 9)).decode("ascii")


def _pods(cluster: FakeCluster) -> dict[str, Any]:
    """What steers each worker pod: its labels, annotations and spec (the gang attempt left
    and its pod group left out: deleting every pod restarts the gang)."""
    return {p["metadata"]["name"]: (
        {k: v for k, v in p["metadata"]["labels"].items()
         if k not in {"adaptis.io/attempt", "kueue.x-k8s.io/pod-group-name"}},
        p["metadata"].get("annotations"), p["spec"])
        for p in cluster.pods() if not p["metadata"].get("deletionTimestamp")}


def _config(cluster: FakeCluster) -> dict[str, Any]:
    return cluster.objects[("ConfigMap", "ns", "demo-config")]


def _warnings(cluster: FakeCluster, reason: str) -> list[str]:
    return [msg for _, kind, why, msg in cluster.events if kind == "Warning" and why == reason]


@pytest.fixture
def started(cluster: FakeCluster, make_job: Any) -> tuple[FakeCluster, Reconciler, dict[str, Any]]:
    cluster.add_job(make_job())
    rec = Reconciler(cluster)
    rec.reconcile("ns", "demo")
    assert len(_pods(cluster)) == 4
    return cluster, rec, _pods(cluster)


def test_the_record_is_kept_in_the_operators_namespace_and_the_jobs_config_map_is_the_workers(
        started: tuple[FakeCluster, Reconciler, dict[str, Any]]) -> None:
    cluster, _, _ = started
    record = stored_record(cluster)
    assert record is not None and len(record.nodes) == 4
    assert ("ConfigMap", OPS, record_name("uid-demo")) in cluster.objects
    assert set(_config(cluster)["data"]) == {"worker.json"}


# Every key a tenant could forge: the worker's config (each field, and its plan's) and the
# record earlier versions kept beside it, with hostnames pointing at another tenant's node.
_FORGED_RECORD = json.dumps({"spec_hash": "0" * 16, "nodes": ["a100-0"] * 4,
                             "hostnames": ["other-tenants-node"] * 4, "gpus": [None] * 4,
                             "node_fingerprints": {}, "strategy": "1f1b",
                             "predicted_iteration_seconds": 1, "predicted_bubble_ratio": 0})


def _tamper_worker_field(field: str, value: Any) -> Any:
    def tamper(data: dict[str, str]) -> None:
        doc = json.loads(data["worker.json"])
        doc[field] = value
        data["worker.json"] = json.dumps(doc)
    return tamper


def _tamper_plan_field(field: str, value: Any) -> Any:
    def tamper(data: dict[str, str]) -> None:
        doc = json.loads(data["worker.json"])
        doc["plan"][field] = value
        data["worker.json"] = json.dumps(doc)
    return tamper


TAMPERINGS = {
    "a decompression bomb as the plan's actions": _tamper_plan_field("actionsPacked", _bomb()),
    "the plan's stages": _tamper_plan_field("stages", [[0, 1]]),
    "the plan's placement": _tamper_plan_field("placement", [[0], [0], [0], [0]]),
    "the plan's strategy": _tamper_plan_field("strategy", "gpipe"),
    "the mesh (dataParallel)": _tamper_worker_field("dataParallel", 4),
    "the metrics port": _tamper_worker_field("metricsPort", 22),
    "the job's name": _tamper_worker_field("jobName", "someone-else"),
    "the checkpoint directory": _tamper_worker_field("checkpointDir", "/etc"),
    "worker.json as garbage": lambda data: data.update({"worker.json": "{" * 100_000}),
    "a forged record of an earlier version": lambda data: data.update(
        {"plan-record.json": _FORGED_RECORD}),
    "the whole ConfigMap emptied": lambda data: data.clear(),
}


@pytest.mark.parametrize("tamper", TAMPERINGS.values(), ids=TAMPERINGS.keys())
def test_a_tampered_job_config_map_is_never_trusted_and_is_restored(
        started: tuple[FakeCluster, Reconciler, dict[str, Any]], tamper: Any) -> None:
    cluster, rec, pods = started
    written = dict(_config(cluster)["data"])
    tamper(_config(cluster)["data"])
    for pod in list(_pods(cluster)):  # the next gang start reads whatever is there
        cluster.delete_pod("ns", pod, force=True)
    rec.reconcile("ns", "demo")  # the gang restarts ...
    rec.reconcile("ns", "demo")  # ... with new pods
    assert _pods(cluster) == pods  # the same nodes, hostnames, ranks, ports and plan hash
    assert _config(cluster)["data"] == written  # restored, forged keys gone
    assert _warnings(cluster, "ConfigMapRestored"), cluster.events
    assert cluster.job()["status"].get("replans", 0) == 0  # the record held: nothing re-planned


def test_a_deleted_job_config_map_is_written_again(
        started: tuple[FakeCluster, Reconciler, dict[str, Any]]) -> None:
    cluster, rec, pods = started
    written = dict(_config(cluster)["data"])
    del cluster.objects[("ConfigMap", "ns", "demo-config")]
    rec.reconcile("ns", "demo")
    assert _config(cluster)["data"] == written and _pods(cluster) == pods
    assert any("was deleted" in m for m in _warnings(cluster, "ConfigMapRestored"))


def test_an_untouched_config_map_is_neither_rewritten_nor_warned_about(
        started: tuple[FakeCluster, Reconciler, dict[str, Any]]) -> None:
    cluster, rec, _ = started
    cluster.calls.clear()
    rec.reconcile("ns", "demo")
    assert "replace ConfigMap" not in cluster.calls
    assert not _warnings(cluster, "ConfigMapRestored")


@pytest.mark.parametrize("corrupt", [
    pytest.param(lambda doc: doc["plan"].update(actionsPacked=_bomb()), id="bomb"),
    pytest.param(lambda doc: doc.update(hostnames=["elsewhere"] * 4), id="hostnames"),
    pytest.param(lambda doc: doc.update(nodes=["h100-0", "h100-0", "h100-0", "nowhere"]),
                 id="nodes"),
    pytest.param(lambda doc: doc.pop("spec_hash"), id="no-spec-hash"),
])
def test_a_record_that_fails_its_checks_is_re_planned_with_a_warning(
        started: tuple[FakeCluster, Reconciler, dict[str, Any]], corrupt: Any) -> None:
    # Only the operator (and the cluster's admins) write its namespace; still, a record that
    # does not check out is re-planned from the spec, never trusted and never fatal.
    cluster, rec, _ = started
    before = stored_record(cluster)
    cm = cluster.objects[("ConfigMap", OPS, record_name("uid-demo"))]
    doc = json.loads(cm["data"][RECORD_KEY])
    corrupt(doc)
    cm["data"][RECORD_KEY] = json.dumps(doc)
    rec.reconcile("ns", "demo")
    after = stored_record(cluster)
    assert after is not None and before is not None
    assert after.hostnames == before.hostnames and set(after.nodes) <= set(cluster.nodes)
    rejected = _warnings(cluster, "PlanRecordRejected")
    restarted = [c for c in cluster.job()["status"]["conditions"] if c["type"] == "Restarting"]
    assert rejected or restarted, cluster.events  # re-planned: as unreadable, or as changed


def test_a_record_of_another_job_is_not_read(cluster: FakeCluster, make_job: Any) -> None:
    cluster.add_job(make_job())
    rec = Reconciler(cluster)
    rec.reconcile("ns", "demo")
    cm = cluster.objects[("ConfigMap", OPS, record_name("uid-demo"))]
    cm["metadata"]["annotations"]["adaptis.io/job"] = "ns/other"
    rec.reconcile("ns", "demo")
    assert any("names another job" in m for m in _warnings(cluster, "PlanRecordRejected"))


def test_deleting_the_job_deletes_its_record_and_a_sweep_those_of_jobs_gone_meanwhile(
        cluster: FakeCluster, make_job: Any) -> None:
    for name in ("demo", "kept", "gone"):
        cluster.add_job(make_job(name, spec={"parallelism": {"workers": 1, "gpusPerWorker": 1}}))
    rec = Reconciler(cluster)
    for name in ("demo", "kept", "gone"):
        rec.reconcile("ns", name)
    assert all(stored_record(cluster, job=n) for n in ("demo", "kept", "gone"))
    cluster.delete_job("ns", "demo")
    rec.reconcile("ns", "demo")  # the job's last pass
    assert stored_record(cluster, job="demo") is None
    cluster.delete_job("ns", "gone")  # while no operator ran
    assert Reconciler(cluster).sweep() == 1
    assert stored_record(cluster, job="gone") is None and stored_record(cluster, job="kept")


# --- the decoded records kept in memory ---------------------------------------------------------


def _read_twice(store: PlanStore, cluster: FakeCluster, spec: JobSpec) -> StoredPlan | None:
    p = PassState(job=JobRef(name="demo", namespace="ns", uid="uid-demo"),
                  status=parse_status(None), now=datetime(2026, 1, 1, tzinfo=UTC))
    first = store.read(p, spec=spec)
    second = store.read(p, spec=spec)
    assert first == second
    return second


def test_an_unchanged_record_is_decoded_once_and_a_changed_one_again(
        started: tuple[FakeCluster, Reconciler, dict[str, Any]]) -> None:
    cluster, _, _ = started
    spec = JobSpec.model_validate(cluster.job()["spec"])
    store = PlanStore(cluster, namespace=OPS)
    kept = _read_twice(store, cluster, spec)
    assert kept is not None and store.decodes == 1
    # Written again (a new resourceVersion): decoded again, once.
    cm = cluster.objects[("ConfigMap", OPS, record_name("uid-demo"))]
    cluster.replace_config_map(cm)
    assert _read_twice(store, cluster, spec) is not None and store.decodes == 2
    assert len(store._decoded) == 1
    # Other limits (the spec changed): decoded within the new ones.
    smaller = spec.model_copy(update={"training": spec.training.model_copy(
        update={"microbatches": 4})})
    _read_twice(store, cluster, smaller)
    assert store.decodes == 3
    # Gone: nothing kept, nothing returned.
    cluster.delete_config_map(OPS, record_name("uid-demo"))
    assert _read_twice(store, cluster, spec) is None and len(store._decoded) == 0


def test_a_decoded_record_larger_than_the_bound_is_not_kept(
        started: tuple[FakeCluster, Reconciler, dict[str, Any]]) -> None:
    cluster, _, _ = started
    spec = JobSpec.model_validate(cluster.job()["spec"])
    size = len(cluster.objects[("ConfigMap", OPS, record_name("uid-demo"))]["data"][RECORD_KEY])
    store = PlanStore(cluster, namespace=OPS, decoded_bytes_max=size - 1)  # it cannot be kept
    _read_twice(store, cluster, spec)
    assert store.decodes == 2
    roomy = PlanStore(cluster, namespace=OPS, decoded_bytes_max=size)
    _read_twice(roomy, cluster, spec)
    assert roomy.decodes == 1


def test_decoded_records_past_the_bound_go_least_recently_used_first(
        started: tuple[FakeCluster, Reconciler, dict[str, Any]]) -> None:
    cluster, _, _ = started
    kept = PlanStore(cluster, namespace=OPS)
    p = PassState(job=JobRef(name="demo", namespace="ns", uid="uid-demo"),
                  status=parse_status(None), now=datetime(2026, 1, 1, tzinfo=UTC))
    stored = kept.read(p, spec=JobSpec.model_validate(cluster.job()["spec"]))
    assert stored is not None
    limits = PackLimits(max_devices=1, max_actions=1)
    decoded = _Decoded(max_bytes=10)
    keys = [(f"r{i}", "1", "ns", f"j{i}", "u", limits) for i in range(3)]
    decoded.put(keys[0], stored, size=4)
    decoded.put(keys[1], stored, size=4)
    assert decoded.get(keys[0]) is stored  # used: now the most recent
    decoded.put(keys[2], stored, size=4)  # 12 bytes > 10: the least recently used goes
    assert decoded.get(keys[1]) is None
    assert decoded.get(keys[0]) is stored and decoded.get(keys[2]) is stored
