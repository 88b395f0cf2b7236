"""Integration tests of the test control plane itself (etcd, apiserver, controllers, kwok).

They prove that what the operator's integration tests rely on is real: the scheduler binds pods
by node affinity or leaves them Pending, the controller-manager garbage-collects owned objects
and creates default ServiceAccounts, RBAC applies to ServiceAccount credentials, and kwok drives
the pod lifecycle (Running; Succeeded or Failed for AdaPtis-managed pods).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from controlplane import (
    FAKE_FAIL_ANNOTATION,
    FAKE_RUN_SECONDS_ANNOTATION,
    MANAGED_BY_LABEL,
    MANAGED_BY_VALUE,
    RACK_LABEL,
    ControlPlane,
    KubectlError,
    wait_until,
)

pytestmark = pytest.mark.integration

GPU_NODES = ("it-cp-gpu-a", "it-cp-gpu-b")


@pytest.fixture(scope="module")
def gpu_nodes(control_plane: ControlPlane) -> Iterator[tuple[str, ...]]:
    """Two fake H100 nodes in different racks of one zone."""
    for index, name in enumerate(GPU_NODES):
        control_plane.add_fake_gpu_node(
            name,
            product="NVIDIA-H100-80GB-HBM3",
            gpu_count=8,
            gpu_memory_mib=81559,
            zone="zone-a",
            rack=f"rack-{index}",
        )
    yield GPU_NODES
    for name in GPU_NODES:
        control_plane.kubectl("delete", "node", name, "--ignore-not-found", "--wait=false")


@pytest.fixture
def namespace(control_plane: ControlPlane) -> Iterator[str]:
    """A fresh namespace (with its default ServiceAccount), deleted after the test."""
    name = control_plane.create_namespace(f"it-cp-{uuid.uuid4().hex[:8]}")
    yield name
    control_plane.kubectl("delete", "namespace", name, "--wait=false", check=False)


def pod_manifest(
    name: str,
    *,
    node: str | None = None,
    affinity_label: tuple[str, str] | None = None,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    gpus: int = 1,
) -> dict[str, Any]:
    """A plain Pod (no controller) asking for ``gpus`` GPUs, with a required node affinity."""
    key, value = affinity_label or ("kubernetes.io/hostname", node or "")
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}, "annotations": annotations or {}},
        "spec": {
            "restartPolicy": "Never",
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {"key": key, "operator": "In", "values": [value]}
                                ]
                            }
                        ]
                    }
                }
            },
            "containers": [
                {
                    "name": "worker",
                    "image": "adaptis/worker:test",
                    "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
                }
            ],
        },
    }


def get_pod(cp: ControlPlane, namespace: str, name: str) -> dict[str, Any]:
    pod: dict[str, Any] = cp.get_json("pod", name, "-n", namespace)
    return pod


def wait_pod_phase(
    cp: ControlPlane, namespace: str, name: str, phase: str, timeout: float = 60.0
) -> dict[str, Any]:
    """Wait until the pod reaches ``phase`` and return it."""

    def reached() -> dict[str, Any] | None:
        pod = get_pod(cp, namespace, name)
        return pod if pod.get("status", {}).get("phase") == phase else None

    return wait_until(reached, timeout=timeout, what=f"pod {namespace}/{name} to be {phase}")


def test_version_reports_pinned_kubernetes(control_plane: ControlPlane, k8s_version: str) -> None:
    version = json.loads(control_plane.kubectl("get", "--raw", "/version").stdout)
    assert version["gitVersion"] == k8s_version
    assert version["major"] == "1"
    assert version["minor"] == k8s_version.split(".")[1]
    client = json.loads(control_plane.kubectl("version", "--client", "-o", "json").stdout)
    assert client["clientVersion"]["gitVersion"] == k8s_version


def test_helm_reports_its_version(control_plane: ControlPlane) -> None:
    out = control_plane.helm("version", "--short").stdout.strip()
    assert out.startswith("v3."), out
    assert not out.startswith("v3.0.0"), out


def test_fake_gpu_node_carries_gpu_and_topology_labels(
    control_plane: ControlPlane, gpu_nodes: tuple[str, ...]
) -> None:
    node = control_plane.get_json("node", gpu_nodes[1])
    labels = node["metadata"]["labels"]
    assert node["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert labels["nvidia.com/gpu.count"] == "8"
    assert labels["nvidia.com/gpu.memory"] == "81559"
    assert labels["nvidia.com/gpu.family"] == "hopper"
    assert labels["kubernetes.io/hostname"] == gpu_nodes[1]
    assert labels["topology.kubernetes.io/zone"] == "zone-a"
    assert labels[RACK_LABEL] == "rack-1"
    assert node["status"]["capacity"]["nvidia.com/gpu"] == "8"
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
    ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
    assert ready and ready[0]["status"] == "True"


def test_default_service_account_appears_in_new_namespace(control_plane: ControlPlane) -> None:
    name = f"it-cp-sa-{uuid.uuid4().hex[:8]}"
    control_plane.kubectl("create", "namespace", name)
    try:
        sa = wait_until(
            lambda: control_plane.get_json("serviceaccount", "default", "-n", name),
            timeout=60,
            what="the default ServiceAccount",
        )
        assert sa["metadata"]["namespace"] == name
        # The root-CA publisher of the controller-manager runs too.
        root_ca = wait_until(
            lambda: control_plane.get_json("configmap", "kube-root-ca.crt", "-n", name),
            timeout=60,
            what="kube-root-ca.crt",
        )
        assert "BEGIN CERTIFICATE" in root_ca["data"]["ca.crt"]
    finally:
        control_plane.kubectl("delete", "namespace", name, "--wait=false", check=False)


def test_scheduler_binds_pod_by_node_affinity_and_kwok_runs_it(
    control_plane: ControlPlane, gpu_nodes: tuple[str, ...], namespace: str
) -> None:
    target = gpu_nodes[1]
    control_plane.apply(pod_manifest("pinned", node=target), namespace=namespace)
    control_plane.wait_for_jsonpath(
        "pod/pinned", ".status.phase", "Running", namespace=namespace, timeout=60
    )
    pod = get_pod(control_plane, namespace, "pinned")
    assert pod["spec"]["nodeName"] == target
    conditions = {c["type"]: c["status"] for c in pod["status"]["conditions"]}
    assert conditions["PodScheduled"] == "True"
    assert conditions["Ready"] == "True"
    assert pod["status"]["containerStatuses"][0]["state"]["running"]
    # A plain (non-AdaPtis) pod keeps running.
    assert get_pod(control_plane, namespace, "pinned")["status"]["phase"] == "Running"


def test_unsatisfiable_affinity_stays_pending(
    control_plane: ControlPlane, gpu_nodes: tuple[str, ...], namespace: str
) -> None:
    control_plane.apply(
        pod_manifest("nowhere", affinity_label=(RACK_LABEL, "rack-that-does-not-exist")),
        namespace=namespace,
    )

    def unschedulable() -> dict[str, Any] | None:
        pod = get_pod(control_plane, namespace, "nowhere")
        for condition in pod.get("status", {}).get("conditions", []):
            if condition["type"] == "PodScheduled" and condition["status"] == "False":
                found: dict[str, Any] = condition
                return found
        return None

    condition = wait_until(unschedulable, timeout=60, what="PodScheduled=False")
    assert condition["reason"] == "Unschedulable"
    assert "node affinity" in condition["message"].lower() or "selector" in condition["message"]

    events = wait_until(
        lambda: control_plane.get_json(
            "events",
            "-n",
            namespace,
            "--field-selector",
            "involvedObject.name=nowhere,reason=FailedScheduling",
        )["items"],
        timeout=60,
        what="a FailedScheduling event",
    )
    assert events[0]["reason"] == "FailedScheduling"
    pod = get_pod(control_plane, namespace, "nowhere")
    assert pod["status"]["phase"] == "Pending"
    assert not pod["spec"].get("nodeName")


def test_too_many_gpus_is_unschedulable(
    control_plane: ControlPlane, gpu_nodes: tuple[str, ...], namespace: str
) -> None:
    control_plane.apply(pod_manifest("greedy", node=gpu_nodes[0], gpus=9), namespace=namespace)

    def message() -> str | None:
        pod = get_pod(control_plane, namespace, "greedy")
        for condition in pod.get("status", {}).get("conditions", []):
            if condition["type"] == "PodScheduled" and condition["status"] == "False":
                return str(condition.get("message", ""))
        return None

    assert "nvidia.com/gpu" in wait_until(message, timeout=60, what="PodScheduled=False")


def test_owned_configmap_is_garbage_collected(control_plane: ControlPlane, namespace: str) -> None:
    control_plane.kubectl("create", "configmap", "owner", "-n", namespace)
    owner_uid = control_plane.get_json("configmap", "owner", "-n", namespace)["metadata"]["uid"]
    control_plane.apply(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": "owned",
                "ownerReferences": [
                    {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner_uid}
                ],
            },
            "data": {"k": "v"},
        },
        namespace=namespace,
    )
    assert control_plane.get_json("configmap", "owned", "-n", namespace)["data"] == {"k": "v"}
    control_plane.kubectl("delete", "configmap", "owner", "-n", namespace)

    def gone() -> bool:
        result = control_plane.kubectl("get", "configmap", "owned", "-n", namespace, check=False)
        return result.returncode != 0 and "NotFound" in result.stderr

    wait_until(gone, timeout=60, what="the owned ConfigMap to be garbage-collected")


def test_managed_pod_completes(
    control_plane: ControlPlane, gpu_nodes: tuple[str, ...], namespace: str
) -> None:
    control_plane.apply(
        pod_manifest(
            "trainer",
            node=gpu_nodes[0],
            labels={MANAGED_BY_LABEL: MANAGED_BY_VALUE},
            annotations={FAKE_RUN_SECONDS_ANNOTATION: "2"},
        ),
        namespace=namespace,
    )
    wait_pod_phase(control_plane, namespace, "trainer", "Running")
    pod = wait_pod_phase(control_plane, namespace, "trainer", "Succeeded")
    terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 0
    assert terminated["reason"] == "Completed"


def test_managed_pod_with_fail_annotation_fails(
    control_plane: ControlPlane, gpu_nodes: tuple[str, ...], namespace: str
) -> None:
    control_plane.apply(
        pod_manifest(
            "crasher",
            node=gpu_nodes[0],
            labels={MANAGED_BY_LABEL: MANAGED_BY_VALUE},
            annotations={FAKE_FAIL_ANNOTATION: "true", FAKE_RUN_SECONDS_ANNOTATION: "1"},
        ),
        namespace=namespace,
    )
    pod = wait_pod_phase(control_plane, namespace, "crasher", "Failed")
    terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 1
    assert pod["spec"]["nodeName"] == gpu_nodes[0]


def test_deleted_pod_is_removed(
    control_plane: ControlPlane, gpu_nodes: tuple[str, ...], namespace: str
) -> None:
    control_plane.apply(pod_manifest("doomed", node=gpu_nodes[0]), namespace=namespace)
    wait_pod_phase(control_plane, namespace, "doomed", "Running")
    control_plane.kubectl(
        "delete", "pod", "doomed", "-n", namespace, "--wait=true", "--timeout=60s"
    )
    result = control_plane.kubectl("get", "pod", "doomed", "-n", namespace, check=False)
    assert "NotFound" in result.stderr


def test_service_account_kubeconfig_is_subject_to_rbac(
    control_plane: ControlPlane, namespace: str
) -> None:
    control_plane.kubectl("create", "serviceaccount", "operator", "-n", namespace)
    kubeconfig = control_plane.service_account_kubeconfig(namespace, "operator")
    with pytest.raises(KubectlError) as denied:
        control_plane.kubectl("get", "pods", kubeconfig=kubeconfig)
    assert "forbidden" in denied.value.stderr.lower()

    control_plane.kubectl(
        "create", "role", "pod-reader", "-n", namespace, "--verb=get,list", "--resource=pods"
    )
    control_plane.kubectl(
        "create",
        "rolebinding",
        "operator-reads-pods",
        "-n",
        namespace,
        "--role=pod-reader",
        f"--serviceaccount={namespace}:operator",
    )
    result = wait_until(
        lambda: control_plane.kubectl("get", "pods", "-o", "json", kubeconfig=kubeconfig),
        timeout=30,
        what="RBAC to allow listing pods",
    )
    assert json.loads(result.stdout)["kind"] == "List"
    whoami = json.loads(
        control_plane.kubectl("auth", "whoami", "-o", "json", kubeconfig=kubeconfig).stdout
    )
    assert whoami["status"]["userInfo"]["username"] == f"system:serviceaccount:{namespace}:operator"


def test_certificate_user_kubeconfig_carries_groups(control_plane: ControlPlane) -> None:
    kubeconfig = control_plane.make_user_kubeconfig("alice", groups=["adaptis-devs"])
    whoami = json.loads(
        control_plane.kubectl("auth", "whoami", "-o", "json", kubeconfig=kubeconfig).stdout
    )
    assert whoami["status"]["userInfo"]["username"] == "alice"
    assert "adaptis-devs" in whoami["status"]["userInfo"]["groups"]
    result = control_plane.kubectl("get", "nodes", kubeconfig=kubeconfig, check=False)
    assert result.returncode != 0 and "forbidden" in result.stderr.lower()
