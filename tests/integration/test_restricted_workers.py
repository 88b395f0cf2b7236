"""Restricted workers and unforgeable profiles on a real control plane.

The real kube-apiserver enforces the Pod Security Standard ``restricted`` in every namespace
labelled ``pod-security.kubernetes.io/enforce=restricted``: it refuses to create a pod that
falls short, whoever asks (the operator included). Here the tenants' namespace and the
operator's own namespace (where profiler pods run and profiles are stored) both carry the
label, and a ``profile: measure`` job there is profiled, planned and run: its profiler and
worker pods are admitted, bound and Running (kwok plays the kubelet).

Then tenant B, in a namespace of its own, runs a ``profile: measure`` job and forges a fast
profile for it every way open to a tenant: a pod in its namespace that looks like that job's
finished profiler (what a tenant gets by exec-ing into its own pods, or by running its own
image as the profiler, as earlier versions did), and a ConfigMap like the operator's store in
its namespace; the node annotation earlier versions read is set too (with the admin's node
patch). Tenant A's next plan on that node uses the operator's own measurement, nothing forged.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from operator_process import OperatorProcess, install_crd, plan_record

from adaptis.operator.profiling.nodes import PROFILE_ANNOTATION
from adaptis.operator.profiling.profile_store import (
    hardware_fingerprint,
    profile_config_map_name,
    render_profile_config_map,
)

NS = "restricted-tenant-a"
TENANT_B = "restricted-tenant-b"
OPS = "restricted-adaptis"  # the operator's namespace (--profile-namespace)
POOL = {"adaptis.io/test-pool": "restricted"}
FORGED_POOL = {"adaptis.io/test-pool": "restricted-forged"}
NODES = ("rw-h100-0", "rw-h100-1")
TARGET = "rw-h100-target"  # the node tenant B forges a profile for
RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted",
              "pod-security.kubernetes.io/enforce-version": "latest"}
H100_TABLE_TFLOPS = 989.0
FAKE_PROFILER_TFLOPS = 500.0  # the adaptis-profiler stage of kwok-stages.yaml
T = TypeVar("T")


def _job(name: str, *, pool: dict[str, str], profile: str, workers: int = 2,
         namespace: str = NS) -> dict[str, Any]:
    return {
        "apiVersion": "adaptis.io/v1alpha1", "kind": "AdaPtisJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": {"vocabSize": 512, "hidden": 32, "heads": 2,
                      "blocks": [{"kind": "attention", "count": 4}]},
            "training": {"steps": 2, "microbatches": 4, "sequenceLength": 16},
            "parallelism": {"workers": workers, "gpusPerWorker": 1},
            "planner": {"strategy": "1f1b", "profile": profile},
            "worker": {"nodeSelector": dict(pool),
                       "annotations": {"adaptis.io/fake-run-seconds": "20"}},
        },
    }


class Session(OperatorProcess):
    def __init__(self, cp: Any, log_path: Path) -> None:
        super().__init__(cp, log_path, namespace=NS)

    def wait(self, what: str, predicate: Callable[[], T | None], timeout: float = 90) -> T:
        return super().wait(what, predicate, timeout)

    def pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        return list(self.cp.get_json("pods", "-n", namespace, "-l", selector)["items"])

    def planned(self, name: str, namespace: str = NS) -> bool:
        job = self.cp.get_json("adaptisjob", name, "-n", namespace)
        return any(c["type"] == "Planned" and c["status"] == "True"
                   for c in (job.get("status") or {}).get("conditions", []))

    def planned_tflops(self, name: str) -> dict[str, float]:
        record = plan_record(self.cp, job=name, namespace=NS, operator_namespace=OPS)
        assert record is not None
        return {node: json.loads(fp)[5] for node, fp in record["node_fingerprints"].items()}


@pytest.fixture(scope="module")
def session(control_plane: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    cp = control_plane
    install_crd(cp)
    for ns in (NS, OPS, TENANT_B):
        cp.create_namespace(ns)
    for ns in (NS, OPS):
        cp.kubectl("label", "namespace", ns, *(f"{k}={v}" for k, v in RESTRICTED.items()))
    for name in NODES:
        cp.add_fake_gpu_node(name, product="NVIDIA-H100-80GB-HBM3", gpu_count=2,
                             zone="rw-zone", rack="rw-rack", labels=POOL)
    cp.add_fake_gpu_node(TARGET, product="NVIDIA-H100-80GB-HBM3", gpu_count=2,
                         zone="rw-zone-f", rack="rw-rack-f", labels=FORGED_POOL)
    s = Session(cp, tmp_path_factory.mktemp("restricted") / "operator.log")
    s.start(extra_args=["--namespace", TENANT_B, "--profile-namespace", OPS])
    try:
        yield s
    finally:
        s.stop()


def test_the_namespace_really_enforces_restricted(session: Session) -> None:
    """The control: a pod without the restricted settings is refused in the tenants' namespace."""
    result = session.cp.kubectl("run", "plain", "-n", NS, "--image=busybox", "--restart=Never",
                                "--dry-run=server", check=False)
    assert result.returncode != 0 and "violates PodSecurity" in result.stderr, result


def test_measured_job_runs_in_restricted_namespaces(session: Session) -> None:
    s = session
    s.cp.apply(_job("measured", pool=POOL, profile="measure"))

    # Each node was profiled by a pod the restricted operator namespace admitted and kwok ran.
    def stored() -> list[dict[str, Any]] | None:
        cms = [s.cp.get_json("configmap", "-n", OPS, profile_config_map_name(n)) for n in NODES]
        return cms
    cms = s.wait("both nodes' profiles stored in the operator's namespace", stored)
    for node, cm in zip(NODES, cms, strict=True):
        assert cm["metadata"]["annotations"]["adaptis.io/node"] == node
        (document,) = cm["data"].values()
        assert json.loads(document)["tflops"] == FAKE_PROFILER_TFLOPS
    assert not s.pods(NS, "adaptis.io/role=profiler")  # never in the tenant's namespace

    # The workers: admitted under restricted, bound to the planned nodes, Running.
    def running() -> list[dict[str, Any]] | None:
        pods = s.pods(NS, "adaptis.io/job=measured")
        return pods if len(pods) == 2 and all(
            p.get("status", {}).get("phase") == "Running" for p in pods) else None
    pods = s.wait("two Running worker pods", running)
    for pod in pods:
        assert pod["spec"]["nodeName"] in NODES
        psc = pod["spec"]["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["runAsUser"] == 10001
        assert psc["seccompProfile"] == {"type": "RuntimeDefault"}
        csc = pod["spec"]["containers"][0]["securityContext"]
        assert csc["readOnlyRootFilesystem"] is True
        assert csc["allowPrivilegeEscalation"] is False
        assert csc["capabilities"] == {"drop": ["ALL"]}
    assert set(s.planned_tflops("measured").values()) == {FAKE_PROFILER_TFLOPS}
    s.wait("job measured to succeed",
           lambda: s.status("measured").get("phase") == "Succeeded", timeout=120)


def test_a_job_gets_no_more_than_the_namespace_allows(session: Session) -> None:
    """A job asking for a host path in a restricted namespace: its pods are refused by the API
    server (not by the operator), and the job says so."""
    s = session
    job = _job("hostpath", pool=POOL, profile="estimate", workers=1)
    job["spec"]["worker"]["volumes"] = [{"name": "host", "hostPath": {"path": "/var"}}]
    job["spec"]["worker"]["volumeMounts"] = [{"name": "host", "mountPath": "/host"}]
    s.cp.apply(job)
    cond = s.wait("the refusal in the job's status", lambda: next(
        (c for c in s.status("hostpath").get("conditions", [])
         if c["type"] == "Running" and c["reason"] == "PodsRejected"), None))
    assert "violates PodSecurity" in cond["message"] and "hostPath" in cond["message"]
    assert not s.pods(NS, "adaptis.io/job=hostpath")
    s.cp.kubectl("delete", "adaptisjob", "hostpath", "-n", NS, "--wait=false")


def test_a_tenants_forged_profile_changes_no_other_tenants_plan(session: Session) -> None:
    s = session
    fake = json.dumps({"tflops": 20000.0, "memory_bytes": 85899345920.0})
    # 1. Tenant B's pod with the profiler's labels for its own job "attacker" and the target
    # node, finished with a forged termination message. It is never scheduled (its selector
    # matches no node), so kwok leaves it alone; the status is what a tenant who writes the
    # termination log of its own pod would get.
    s.cp.apply({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "forged-profiler", "namespace": TENANT_B,
                     "labels": {"app.kubernetes.io/managed-by": "adaptis",
                                "adaptis.io/role": "profiler", "adaptis.io/job": "attacker",
                                "adaptis.io/job-namespace": TENANT_B},
                     "annotations": {"adaptis.io/node": TARGET}},
        "spec": {"restartPolicy": "Never", "nodeSelector": {"adaptis.io/nowhere": "true"},
                 "containers": [{"name": "profiler", "image": "tenant-b/forger:1"}]},
    })
    s.cp.kubectl("patch", "pod", "forged-profiler", "-n", TENANT_B, "--subresource=status",
                 "--type=merge", "-p", json.dumps({"status": {
                     "phase": "Succeeded",
                     "containerStatuses": [{
                         "name": "profiler", "image": "tenant-b/forger:1", "imageID": "",
                         "ready": False, "restartCount": 0,
                         "state": {"terminated": {"exitCode": 0, "reason": "Completed",
                                                  "message": fake}}}]}}))
    # 2. A ConfigMap like the operator's store, in tenant B's namespace.
    node = s.cp.get_json("node", TARGET)
    s.cp.apply(render_profile_config_map(namespace=TENANT_B, node=TARGET,
                                         fingerprint=hardware_fingerprint(node),
                                         document=fake))
    # 3. The node annotation earlier versions read (needs node patch: here, the admin's).
    s.cp.kubectl("annotate", "node", TARGET, f"{PROFILE_ANNOTATION}={fake}")

    # Tenant B's measured job: the operator profiles the node itself, in its namespace.
    s.cp.apply(_job("attacker", pool=FORGED_POOL, profile="measure", workers=1,
                    namespace=TENANT_B))
    s.wait("the plan of tenant B's job", lambda: s.planned("attacker", TENANT_B))
    stored = s.cp.get_json("configmap", profile_config_map_name(TARGET), "-n", OPS)
    assert [json.loads(d)["tflops"] for d in stored["data"].values()] == [FAKE_PROFILER_TFLOPS]

    # Tenant A's job on the same node plans from the operator's measurement, not the forgery.
    s.cp.apply(_job("victim", pool=FORGED_POOL, profile="estimate", workers=1))
    s.wait("the plan of tenant A's job", lambda: s.planned("victim"))
    assert s.planned_tflops("victim") == {TARGET: FAKE_PROFILER_TFLOPS}
