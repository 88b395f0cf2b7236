"""Node profiling: Kubernetes Node objects -> the devices a plan can use.

Sits between the Kubernetes API (plain node dicts, as the API returns them) and
:mod:`adaptis.operator.scheduling.planning`. A node is described by NVIDIA GPU Feature Discovery
labels (``nvidia.com/gpu.product``, ``.count``, ``.memory`` in MiB, ``.family``), its allocatable
``nvidia.com/gpu`` and its topology labels, read in a configurable order from the widest domain to
the narrowest (zone -> block/rack -> clique -> host). A measured hardware profile (the caller passes
its validated figures, read from :mod:`adaptis.operator.profiling.profile_store`) overrides the
table of known GPUs. The node annotation :data:`PROFILE_ANNOTATION`, where earlier versions cached
profiles, is ignored: anyone who may patch a node could forge it.

Everything here is a pure function of the node dicts, so it is unit-tested without a cluster.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from adaptis.operator.core.labels import GPU_RESOURCE, HOSTNAME_LABEL
from adaptis.operator.core.records import NodeProfile
from adaptis.operator.profiling.gpus import LINK_BANDWIDTH, lookup_gpu

__all__ = [
    "PROFILE_ANNOTATION",
    "candidate_nodes",
    "parse_quantity",
    "profile_node",
    "tolerates",
]

log = logging.getLogger(__name__)

# Read no more (see the module docstring); named so that tests can show it is ignored.
PROFILE_ANNOTATION = "adaptis.io/hardware-profile"


# A CPU-only "device" (gpusPerWorker: 0) is counted at this many TFLOP/s per core.
_CPU_TFLOPS_PER_CORE = 0.05
_CPU_LINK = "pcie3"
# An unknown GPU product is assumed as slow as the slowest part of the table (a T4).
_UNKNOWN_GPU_TFLOPS = 65.0


def parse_quantity(value: Any) -> float:
    """A Kubernetes quantity (``8``, ``500m``, ``16Gi``) as a number."""
    text = str(value).strip()
    suffixes = {
        "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
        "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
    }
    for suffix in sorted(suffixes, key=len, reverse=True):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * suffixes[suffix]
    return float(text)


def _int_label(labels: Mapping[str, str], key: str) -> int | None:
    try:
        return int(labels[key])
    except (KeyError, ValueError):
        return None


def profile_node(node: Mapping[str, Any], *, topology_keys: Sequence[str],
                 measured: Mapping[str, float] | None = None) -> NodeProfile:
    """Profile one Node object (a dict as the API returns it).

    ``measured``: validated figures of a measured profile (``tflops``, ``memory_bytes``,
    ``intra_node_bandwidth``), each overriding the table's.
    """
    meta = node.get("metadata") or {}
    status = node.get("status") or {}
    spec = node.get("spec") or {}
    name = str(meta.get("name", ""))
    labels: dict[str, str] = dict(meta.get("labels") or {})
    allocatable = status.get("allocatable") or status.get("capacity") or {}

    gpus = int(parse_quantity(allocatable[GPU_RESOURCE])) if GPU_RESOURCE in allocatable else 0
    if GPU_RESOURCE not in allocatable:
        gpus = _int_label(labels, "nvidia.com/gpu.count") or 0
    product = labels.get("nvidia.com/gpu.product")
    known = lookup_gpu(product, family=labels.get("nvidia.com/gpu.family"))
    memory_mib = _int_label(labels, "nvidia.com/gpu.memory")
    memory: float | None
    if memory_mib:
        memory = memory_mib * 2.0**20
    elif known is not None:
        memory = known.memory_gib * 2.0**30
    else:
        memory = None
    tflops = known.bf16_tflops if known is not None else 0.0
    link = known.link if known is not None else _CPU_LINK
    bandwidth = LINK_BANDWIDTH[link]
    if gpus and known is None:
        log.warning("node %s: unknown GPU %r; assuming the slowest known part", name, product)
        tflops = _UNKNOWN_GPU_TFLOPS
    cpus = parse_quantity(allocatable.get("cpu", 0))
    measured = dict(measured or {})
    if "tflops" in measured:
        tflops = measured["tflops"]
    if "memory_bytes" in measured:
        memory = measured["memory_bytes"]
    if "intra_node_bandwidth" in measured:
        bandwidth = measured["intra_node_bandwidth"]

    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    taints = tuple(
        (str(t.get("key", "")), str(t.get("value", "")), str(t.get("effect", "")))
        for t in spec.get("taints") or []
    )
    return NodeProfile(
        name=name,
        hostname=labels.get(HOSTNAME_LABEL, name),
        gpu_product=product,
        gpus=gpus,
        gpu_memory_bytes=memory,
        gpu_tflops=tflops if gpus else _CPU_TFLOPS_PER_CORE,
        intra_node_bandwidth=bandwidth,
        cpus=cpus,
        topology=tuple(labels.get(key, "") for key in topology_keys),
        ready=ready,
        schedulable=not spec.get("unschedulable", False),
        labels=tuple(sorted(labels.items())),
        taints=taints,
        measured=bool(measured),
    )


def tolerates(tolerations: Iterable[Mapping[str, Any]], taint: tuple[str, str, str]) -> bool:
    """Whether a pod with these tolerations may run on a node with this taint (core/v1 rules)."""
    key, value, effect = taint
    if effect == "PreferNoSchedule":
        return True
    for tol in tolerations:
        if tol.get("effect") and tol.get("effect") != effect:
            continue
        op = tol.get("operator", "Equal")
        if not tol.get("key") and op == "Exists":
            return True
        if tol.get("key") != key:
            continue
        if op == "Exists" or tol.get("value", "") == value:
            return True
    return False


def candidate_nodes(
    profiles: Iterable[NodeProfile],
    *,
    node_selector: Mapping[str, str],
    tolerations: Sequence[Mapping[str, Any]],
    gpus_per_worker: int,
) -> list[NodeProfile]:
    """The nodes a worker pod could run on: ready, schedulable, selected, tolerated, big enough."""
    out: list[NodeProfile] = []
    for p in profiles:
        labels = dict(p.labels)
        if not (p.ready and p.schedulable):
            continue
        if any(labels.get(k) != v for k, v in node_selector.items()):
            continue
        if any(t[2] in {"NoSchedule", "NoExecute"} and not tolerates(tolerations, t)
               for t in p.taints):
            continue
        if gpus_per_worker > 0 and p.gpus < gpus_per_worker:
            continue
        out.append(p)
    return sorted(out, key=lambda p: (p.topology, p.name))
