"""Fixtures of the operator's unit tests: node dicts shaped like GFD-labelled nodes, job bodies,
and an in-memory :class:`~adaptis.operator.kube.cluster.Cluster` that behaves as the API server does
for what the reconciler uses (409 on a taken name, 404-is-fine deletes, merge-patched status).

The real API server is exercised by tests/integration/test_operator_*.py; these fakes keep the
reconciler's decision logic testable in milliseconds.
"""

from __future__ import annotations

import copy
import itertools
import re
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from adaptis.api.pod_fields import LABEL_VALUE_PATTERN, MAX_LABEL_VALUE
from adaptis.operator.core.labels import LABEL_JOB
from adaptis.operator.core.records import JobRef
from adaptis.operator.kube.cluster import ApiError


def gpu_node(
    name: str,
    *,
    product: str = "NVIDIA-H100-80GB-HBM3",
    gpus: int = 8,
    memory_mib: int = 81559,
    zone: str = "zone-a",
    rack: str = "rack-0",
    ready: bool = True,
    extra_labels: Mapping[str, str] | None = None,
    taints: list[dict[str, str]] | None = None,
) -> dict[str, Any]:
    labels = {
        "kubernetes.io/hostname": name,
        "topology.kubernetes.io/zone": zone,
        "topology.adaptis.io/rack": rack,
        "nvidia.com/gpu.product": product,
        "nvidia.com/gpu.count": str(gpus),
        "nvidia.com/gpu.memory": str(memory_mib),
        "nvidia.com/gpu.family": "hopper",
        **(extra_labels or {}),
    }
    return {
        "metadata": {"name": name, "labels": labels, "annotations": {}},
        "spec": {"taints": taints or []},
        "status": {
            "allocatable": {"cpu": "96", "memory": "1Ti", "nvidia.com/gpu": str(gpus)},
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def job_body(name: str = "demo", *, spec: Mapping[str, Any] | None = None) -> dict[str, Any]:
    base: dict[str, Any] = {
        "model": {"vocabSize": 32000, "hidden": 256, "heads": 4,
                  "blocks": [{"kind": "attention", "count": 6}]},
        "training": {"steps": 4, "microbatches": 8, "sequenceLength": 128},
        "parallelism": {"workers": 4, "gpusPerWorker": 1},
        "planner": {"strategy": "1f1b"},
    }
    base.update(spec or {})
    return {
        "apiVersion": "adaptis.io/v1alpha1",
        "kind": "AdaPtisJob",
        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "generation": 1},
        "spec": base,
    }


class FakeCluster:
    """An in-memory stand-in for the API server (only what the reconciler calls)."""

    def __init__(self) -> None:
        self.jobs: dict[tuple[str, str], dict[str, Any]] = {}
        self.nodes: dict[str, dict[str, Any]] = {}
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}  # (kind, ns, name)
        self.events: list[tuple[str, str, str, str]] = []  # (job, type, reason, message)
        self.calls: list[str] = []
        self.priority_classes: dict[str, int] = {}
        self._rv = itertools.count(1)

    # helpers of the tests
    def add_job(self, body: Mapping[str, Any]) -> None:
        meta = body["metadata"]
        self.jobs[(meta["namespace"], meta["name"])] = copy.deepcopy(dict(body))

    def job(self, name: str = "demo", ns: str = "ns") -> dict[str, Any]:
        return self.jobs[(ns, name)]

    def pods(self) -> list[dict[str, Any]]:
        return [o for (kind, _, _), o in sorted(self.objects.items()) if kind == "Pod"]

    def set_pod_phase(self, name: str, phase: str, *, ready: bool = True,
                      message: str | None = None, ns: str = "ns") -> None:
        pod = self.objects[("Pod", ns, name)]
        status: dict[str, Any] = {"phase": phase,
                                  "conditions": [{"type": "Ready",
                                                  "status": "True" if ready else "False"}]}
        if message:
            status["containerStatuses"] = [{"state": {"terminated": {"message": message}}}]
        pod["status"] = status

    def finish_deletions(self) -> None:
        """What kwok's delete stage does: pods marked for deletion disappear."""
        for key in [k for k, o in self.objects.items() if o["metadata"].get("deletionTimestamp")]:
            del self.objects[key]

    # Cluster protocol
    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.calls.append("get_job")
        body = self.jobs.get((namespace, name))
        return copy.deepcopy(body) if body else None

    def patch_job_status(self, namespace: str, name: str, *,
                         status: Mapping[str, Any]) -> None:
        self.calls.append("patch_status")
        body = self.jobs[(namespace, name)]
        current = body.setdefault("status", {})
        for key, value in status.items():
            if value is None:
                current.pop(key, None)
            else:
                current[key] = copy.deepcopy(value)

    def delete_job(self, namespace: str, name: str) -> None:
        self.calls.append("delete_job")
        self.jobs.pop((namespace, name), None)

    def list_nodes(self) -> list[dict[str, Any]]:
        return copy.deepcopy(list(self.nodes.values()))

    def list_pods(self, namespace: str, job: str) -> list[dict[str, Any]]:
        if not re.match(LABEL_VALUE_PATTERN, job) or len(job) > MAX_LABEL_VALUE:
            # As the API server: a selector's value must be a valid label value.
            raise ApiError(f"GET pods: 400 unable to parse requirement: invalid label value: "
                           f"{job!r}", status=400)
        return copy.deepcopy([
            o for (kind, ns, _), o in sorted(self.objects.items())
            if kind == "Pod" and ns == namespace and o["metadata"]["labels"].get(LABEL_JOB) == job
        ])

    def list_active_pods(self) -> list[dict[str, Any]]:
        self.calls.append("list_active_pods")
        return copy.deepcopy([
            o for (kind, _, _), o in sorted(self.objects.items())
            if kind == "Pod" and (o.get("status") or {}).get("phase") not in {"Succeeded", "Failed"}
        ])

    def priority_of(self, priority_class: str | None) -> int:
        return self.priority_classes.get(priority_class or "", 0)

    def get_config_map(self, namespace: str, name: str) -> dict[str, Any] | None:
        cm = self.objects.get(("ConfigMap", namespace, name))
        return copy.deepcopy(cm) if cm else None

    def list_config_maps(self, namespace: str, *,
                         selector: Mapping[str, str]) -> list[dict[str, Any]]:
        return copy.deepcopy([
            o for (kind, ns, _), o in sorted(self.objects.items())
            if kind == "ConfigMap" and ns == namespace
            and all((o["metadata"].get("labels") or {}).get(k) == v for k, v in selector.items())
        ])

    def create(self, obj: Mapping[str, Any]) -> bool:
        meta = obj["metadata"]
        key = (obj["kind"], meta["namespace"], meta["name"])
        self.calls.append(f"create {obj['kind']}")
        if key in self.objects:
            return False
        stored = copy.deepcopy(dict(obj))
        stored["metadata"]["resourceVersion"] = str(next(self._rv))
        stored.setdefault("status", {"phase": "Pending"} if obj["kind"] == "Pod" else {})
        self.objects[key] = stored
        return True

    def dry_run_create(self, obj: Mapping[str, Any]) -> None:
        self.calls.append(f"dry-run {obj['kind']}")

    def replace_config_map(self, obj: Mapping[str, Any]) -> None:
        # As the API server's merge patch of data and annotations: a null removes a key.
        self.calls.append("replace ConfigMap")
        meta = obj["metadata"]
        key = ("ConfigMap", meta["namespace"], meta["name"])
        current = self.objects.get(key) or copy.deepcopy({**obj, "data": {}})
        data = {**(current.get("data") or {}), **copy.deepcopy(dict(obj["data"]))}
        current["data"] = {k: v for k, v in data.items() if v is not None}
        current["metadata"]["annotations"] = {**(current["metadata"].get("annotations") or {}),
                                              **(meta.get("annotations") or {})}
        current["metadata"]["resourceVersion"] = str(next(self._rv))
        self.objects[key] = current

    def delete_config_map(self, namespace: str, name: str) -> None:
        self.calls.append("delete ConfigMap")
        self.objects.pop(("ConfigMap", namespace, name), None)

    def delete_pod(self, namespace: str, name: str, *, force: bool = False) -> None:
        self.calls.append("force delete Pod" if force else "delete Pod")
        pod = self.objects.get(("Pod", namespace, name))
        if pod is not None and force:
            del self.objects[("Pod", namespace, name)]
        elif pod is not None:
            pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"

    def event(self, job: JobRef, *, type_: str, reason: str, message: str) -> None:
        self.events.append((job.name, type_, reason, message))


class Clock:
    """A settable clock for deadline and TTL tests."""

    def __init__(self) -> None:
        self.now = datetime(2026, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


@pytest.fixture
def cluster() -> FakeCluster:
    c = FakeCluster()
    for i in range(2):
        c.nodes[f"h100-{i}"] = gpu_node(f"h100-{i}", gpus=2, zone="zone-a", rack="rack-a")
    for i in range(2):
        c.nodes[f"a100-{i}"] = gpu_node(f"a100-{i}", product="NVIDIA-A100-SXM4-80GB", gpus=2,
                                        zone="zone-b", rack="rack-b")
    return c


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def make_node() -> Any:
    return gpu_node


@pytest.fixture
def make_job() -> Any:
    return job_body
