"""Measured node profiles (``spec.planner.profile: measure``) on a real control plane.

``adaptis operator`` runs as a subprocess against the real API server, scheduler and garbage
collector; kwok plays the kubelet. kwok runs no container, so the profiler pods' output is the
fixed document of the ``adaptis-profiler`` stage in kwok-stages.yaml (:data:`FAKE_HARDWARE_PROFILE`
here): what ``adaptis profile --hardware`` prints for a 500 TFLOP/s, 80 GiB GPU. The test checks
what a user would: one profiler pod per unmeasured node, in the operator's namespace
(``--profile-namespace``), bound to that node; the document stored in that namespace's profile
ConfigMaps (never on the node); the plan made from it; the pods gone; and the next job reusing
the store. tests/integration/test_restricted_workers.py shows what a tenant cannot forge.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from operator_process import OperatorProcess, install_crd, plan_record

from adaptis.operator.core.records import JobRef
from adaptis.operator.profiling.nodes import PROFILE_ANNOTATION
from adaptis.operator.profiling.profile_store import (
    hardware_fingerprint,
    profile_config_map_name,
    render_profile_config_map,
)
from adaptis.operator.profiling.profiler_pods import profiler_pod_name

NS = "operator-profiling"
PROFILE_NS = "operator-profiling-store"  # the operator's own namespace
POOL = {"adaptis.io/test-pool": "operator-profiling"}
FRESH = ("prof-h100-0", "prof-h100-1")
CACHED = "prof-h100-cached"
# The termination message of the adaptis-profiler kwok stage, parsed.
FAKE_HARDWARE_PROFILE = {
    "device": {"name": "kwok fake GPU", "speed": 0.5, "memory_bytes": 85899345920.0,
               "matmul_tflops": 500.0, "precision": "bfloat16", "speed_reference_tflops": 989.0},
    "links": {}, "tflops": 500.0, "memory_bytes": 85899345920.0,
    "intra_node_bandwidth": 450000000000.0,
}
CACHED_PROFILE = {"tflops": 123.0, "memory_bytes": 85899345920.0}
T = TypeVar("T")


def _job(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "adaptis.io/v1alpha1", "kind": "AdaPtisJob",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "model": {"vocabSize": 512, "hidden": 32, "heads": 2,
                      "blocks": [{"kind": "attention", "count": 4}]},
            "training": {"steps": 2, "microbatches": 4, "sequenceLength": 16},
            "parallelism": {"workers": 2, "gpusPerWorker": 1},
            "planner": {"strategy": "1f1b", "profile": "measure"},
            "worker": {"nodeSelector": dict(POOL),
                       "annotations": {"adaptis.io/fake-run-seconds": "2"}},
        },
    }


class Session(OperatorProcess):
    """The operator subprocess and the reads the test makes."""

    def __init__(self, cp: Any, log_path: Path) -> None:
        super().__init__(cp, log_path, namespace=NS)

    def wait(self, what: str, predicate: Callable[[], T | None], timeout: float = 90) -> T:
        return super().wait(what, predicate, timeout)

    def condition(self, name: str, type_: str) -> dict[str, Any]:
        return next(c for c in self.status(name)["conditions"] if c["type"] == type_)

    def events(self, involved: str, namespace: str = NS) -> list[dict[str, Any]]:
        return list(self.cp.get_json("events", "-n", namespace, "--field-selector",
                                     f"involvedObject.name={involved}")["items"])

    def profiler_pods(self) -> list[dict[str, Any]]:
        return [p for ns in (NS, PROFILE_NS) for p in self.cp.get_json(
            "pods", "-n", ns, "-l", "adaptis.io/role=profiler")["items"]]

    def node_profile(self, node: str) -> dict[str, Any] | None:
        """The document stored for the node's current hardware, if any."""
        result = self.cp.kubectl("get", "configmap", profile_config_map_name(node), "-n",
                                 PROFILE_NS, "-o", "json", check=False)
        if result.returncode != 0:
            return None
        raw = (json.loads(result.stdout).get("data") or {}).get(
            hardware_fingerprint(self.cp.get_json("node", node)))
        return None if raw is None else dict(json.loads(raw))


@pytest.fixture(scope="module")
def session(control_plane: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    cp = control_plane
    install_crd(cp)
    cp.create_namespace(NS)
    cp.create_namespace(PROFILE_NS)
    for name in FRESH:
        cp.add_fake_gpu_node(name, product="NVIDIA-H100-80GB-HBM3", gpu_count=2,
                             zone="prof-zone", rack="prof-rack", labels=POOL)
    # A node measured before: its profile is in the store (as the operator wrote it then); the
    # node annotation of earlier versions, which claims otherwise, is ignored.
    cached = cp.add_fake_gpu_node(
        CACHED, product="NVIDIA-H100-80GB-HBM3", gpu_count=2, zone="prof-zone",
        rack="prof-rack", labels=POOL,
        annotations={PROFILE_ANNOTATION: json.dumps({**CACHED_PROFILE, "tflops": 999.0})})
    cp.apply(render_profile_config_map(namespace=PROFILE_NS, node=CACHED,
                                       fingerprint=hardware_fingerprint(cached),
                                       document=json.dumps(CACHED_PROFILE)))
    s = Session(cp, tmp_path_factory.mktemp("operator-profiling") / "operator.log")
    s.start(extra_args=["--profile-namespace", PROFILE_NS])
    try:
        yield s
    finally:
        s.stop()


def _planned(s: Session, name: str) -> Callable[[], bool]:
    def check() -> bool:
        return any(c["type"] == "Planned" and c["status"] == "True"
                   for c in s.status(name).get("conditions", []))
    return check


def test_measure_profiles_each_new_node_once_and_caches_the_result(session: Session) -> None:
    s = session
    s.cp.apply(_job("measured"))
    s.wait("the plan of job measured", _planned(s, "measured"), timeout=120)

    # Each unmeasured node got the fake profiler's document, as is; the stored one was kept;
    # nothing was written on the nodes.
    for node in FRESH:
        assert s.node_profile(node) == FAKE_HARDWARE_PROFILE, node
        assert PROFILE_ANNOTATION not in (
            s.cp.get_json("node", node)["metadata"].get("annotations") or {})
    assert s.node_profile(CACHED) == CACHED_PROFILE

    # One profiler pod per unmeasured node, in the operator's namespace, each on its node.
    created = [e for e in s.events("measured") if e["reason"] == "CreatedProfilerPods"]
    assert [e["message"] for e in created] == [
        "created 2 profiler pod(s) (spec.planner.profile: measure)"]
    ref = JobRef(name="measured", namespace=NS, uid="")
    for node in FRESH:
        pod = profiler_pod_name(ref, node)
        scheduled = [e["message"] for e in s.events(pod, PROFILE_NS)
                     if e["reason"] == "Scheduled"]
        assert scheduled and scheduled[0].endswith(f"to {node}"), (pod, scheduled)
    assert not [e for e in s.events(profiler_pod_name(ref, CACHED), PROFILE_NS)
                if e["reason"] == "Scheduled"]

    # The plan was made from the measurements.
    assert "3 with a measured profile" in s.condition("measured", "Profiling")["message"]
    record = plan_record(s.cp, job="measured", namespace=NS, operator_namespace=PROFILE_NS)
    assert record is not None
    tflops = {node: json.loads(fp)[5] for node, fp in record["node_fingerprints"].items()}
    assert tflops and all(tflops[n] == (500.0 if n in FRESH else 123.0) for n in tflops), tflops

    # The profiler pods are gone once the plan exists; the workers run.
    s.wait("the profiler pods to go", lambda: not s.profiler_pods(), timeout=60)
    s.wait("job measured to succeed",
           lambda: s.status("measured").get("phase") == "Succeeded", timeout=120)

    # The next job on the same nodes reuses the cached profiles: no profiler pod at all.
    s.cp.apply(_job("reuses"))
    s.wait("the plan of job reuses", _planned(s, "reuses"), timeout=120)
    assert not [e for e in s.events("reuses") if e["reason"] == "CreatedProfilerPods"]
    assert "3 with a measured profile" in s.condition("reuses", "Profiling")["message"]
    assert not s.profiler_pods()
