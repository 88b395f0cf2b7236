"""Fake GPU nodes of the integration-test cluster, played by kwok.

This module sits between ``kubeclient.py`` and ``controlplane.py``: :class:`FakeNodeClient`
adds to :class:`kubeclient.ClusterClient` the creation of kwok-managed Nodes that look like GPU
nodes to the operator (``nvidia.com/gpu`` capacity, NVIDIA GPU Feature Discovery labels,
zone/region/rack topology labels), waiting for them to be Ready, and deleting them.  It also
names the labels and annotations that ``kwok-stages.yaml`` reacts to, so tests can drive the
fake pod lifecycle (run for N seconds, then succeed or fail).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from kubeclient import ClusterClient
from processes import wait_until

#: Annotation that puts a node under kwok's control.
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
#: Topology label for the rack (or block) of a fake node.
RACK_LABEL = "topology.adaptis.io/rack"
#: Label that selects pods for kwok's AdaPtis completion / failure stages.
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY_VALUE = "adaptis"
#: Annotation: seconds a managed pod runs before kwok completes it (default 3).
FAKE_RUN_SECONDS_ANNOTATION = "adaptis.io/fake-run-seconds"
#: Annotation: ``"true"`` makes kwok fail a managed pod instead of completing it.
FAKE_FAIL_ANNOTATION = "adaptis.io/fake-fail"
#: Annotation: exit code of the failed containers (default 1).
FAKE_EXIT_CODE_ANNOTATION = "adaptis.io/fake-exit-code"

# Taints that keep pods off a node that is not (or no longer) Ready.
_NOT_READY_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")

# NVIDIA GPU Feature Discovery reports the architecture family of a product.
_GPU_FAMILIES: tuple[tuple[str, str], ...] = (
    ("GB200", "blackwell"),
    ("B200", "blackwell"),
    ("B100", "blackwell"),
    ("H200", "hopper"),
    ("H100", "hopper"),
    ("H800", "hopper"),
    ("GH200", "hopper"),
    ("L40", "ada-lovelace"),
    ("L4", "ada-lovelace"),
    ("RTX-4090", "ada-lovelace"),
    ("A100", "ampere"),
    ("A800", "ampere"),
    ("A10", "ampere"),
    ("A30", "ampere"),
    ("A40", "ampere"),
    ("T4", "turing"),
    ("V100", "volta"),
    ("P100", "pascal"),
)


def gpu_family(product: str) -> str:
    """Return the GPU Feature Discovery family (``hopper``, ``ampere``...) of a product name."""
    upper = product.upper()
    for marker, family in _GPU_FAMILIES:
        if marker in upper:
            return family
    return "unknown"


def _node_is_ready(node: Mapping[str, Any]) -> bool:
    """True if ``node`` (as JSON) is Ready and carries no not-ready/unreachable taint."""
    conditions = node.get("status", {}).get("conditions", [])
    is_ready = any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
    blocking = [t for t in node.get("spec", {}).get("taints", []) if t["key"] in _NOT_READY_TAINTS]
    return is_ready and not blocking


class FakeNodeClient(ClusterClient):
    """A :class:`ClusterClient` that also creates and deletes kwok-managed fake GPU nodes."""

    def add_fake_gpu_node(
        self,
        name: str,
        product: str = "NVIDIA-H100-80GB-HBM3",
        gpu_count: int = 8,
        gpu_memory_mib: int = 81559,
        zone: str = "zone-a",
        rack: str = "rack-0",
        *,
        family: str | None = None,
        region: str | None = None,
        cpu: str = "96",
        memory: str = "1Ti",
        pods: int = 110,
        ephemeral_storage: str = "2Ti",
        labels: Mapping[str, str] | None = None,
        annotations: Mapping[str, str] | None = None,
        taints: Sequence[Mapping[str, str]] = (),
        wait_ready: bool = True,
        timeout: float = 60.0,
    ) -> dict[str, Any]:
        """Create a kwok-managed Node that looks like a GPU node and return it (as JSON).

        The node carries ``nvidia.com/gpu`` capacity, the NVIDIA GPU Feature Discovery labels
        (``nvidia.com/gpu.product``, ``.count``, ``.memory`` in MiB, ``.family``) and the
        topology labels ``kubernetes.io/hostname``, ``topology.kubernetes.io/zone`` (and
        ``region``) and ``topology.adaptis.io/rack``.  With ``wait_ready`` it returns once kwok
        has made it Ready and no not-ready taint is left.
        """
        node_labels = {
            "kubernetes.io/hostname": name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            "type": "kwok",
            "topology.kubernetes.io/zone": zone,
            RACK_LABEL: rack,
            "nvidia.com/gpu.present": "true",
            "nvidia.com/gpu.product": product,
            "nvidia.com/gpu.count": str(gpu_count),
            "nvidia.com/gpu.memory": str(gpu_memory_mib),
            "nvidia.com/gpu.family": family or gpu_family(product),
        }
        if region:
            node_labels["topology.kubernetes.io/region"] = region
        node_labels.update(labels or {})
        node_annotations = {KWOK_NODE_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"}
        node_annotations.update(annotations or {})
        resources = {
            "cpu": cpu,
            "memory": memory,
            "pods": str(pods),
            "ephemeral-storage": ephemeral_storage,
            "nvidia.com/gpu": str(gpu_count),
        }
        node: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "labels": node_labels, "annotations": node_annotations},
            "spec": {"taints": [dict(t) for t in taints]} if taints else {},
            "status": {"capacity": resources, "allocatable": dict(resources)},
        }
        self.kubectl("create", "-f", "-", input=json.dumps(node))
        if wait_ready:
            self.wait_node_ready(name, timeout=timeout)
        return dict(self.get_json("node", name))

    def wait_node_ready(self, name: str, *, timeout: float = 60.0) -> None:
        """Wait until node ``name`` is Ready and carries no not-ready/unreachable taint."""

        wait_until(
            lambda: _node_is_ready(self.get_json("node", name)),
            timeout=timeout,
            what=f"node {name} to be Ready",
        )

    def delete_node(self, name: str) -> None:
        """Delete a node (its pods are then garbage-collected by the controller-manager)."""
        self.kubectl("delete", "node", name, "--wait=true")
