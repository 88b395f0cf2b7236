"""Node profiling from GPU Feature Discovery labels, capacity and topology labels."""

from __future__ import annotations

import json
from typing import Any

from adaptis.operator.core.settings import DEFAULT_TOPOLOGY_KEYS
from adaptis.operator.profiling.gpus import lookup_gpu
from adaptis.operator.profiling.nodes import (
    PROFILE_ANNOTATION,
    candidate_nodes,
    parse_quantity,
    profile_node,
    tolerates,
)

KEYS = ("topology.kubernetes.io/zone", "topology.adaptis.io/rack", "nvidia.com/gpu.clique")


def test_known_gpus_by_gfd_product_label() -> None:
    cases = {
        "NVIDIA-H100-80GB-HBM3": ("H100 SXM", 989.0),
        "NVIDIA-H100-PCIe": ("H100 PCIe", 756.0),
        "NVIDIA-A100-SXM4-40GB": ("A100 40GB", 312.0),
        "NVIDIA-A100-SXM4-80GB": ("A100 80GB", 312.0),
        "NVIDIA-L4": ("L4", 121.0),
        "NVIDIA-L40S": ("L40S", 362.0),
        "NVIDIA-A10G": ("A10G", 70.0),
        "Tesla-T4": ("T4", 65.0),
        "NVIDIA-B200": ("B200", 2250.0),
        "NVIDIA-H200": ("H200", 989.0),
    }
    for product, (name, tflops) in cases.items():
        gpu = lookup_gpu(product)
        assert gpu is not None and (gpu.name, gpu.bf16_tflops) == (name, tflops), product
    assert lookup_gpu("Mystery-9000") is None
    hopper = lookup_gpu("Mystery-9000", family="hopper")
    assert hopper is not None and hopper.bf16_tflops == 989.0


def test_profile_reads_labels_capacity_and_topology(make_node: Any) -> None:
    node = make_node("n1", product="NVIDIA-A100-SXM4-80GB", gpus=4, memory_mib=81920,
                     zone="z1", rack="r7", extra_labels={"nvidia.com/gpu.clique": "c3"})
    p = profile_node(node, topology_keys=KEYS)
    assert (p.name, p.hostname, p.gpus) == ("n1", "n1", 4)
    assert p.gpu_memory_bytes == 81920 * 2**20
    assert p.gpu_tflops == 312.0 and p.intra_node_bandwidth == 300e9
    assert p.topology == ("z1", "r7", "c3")
    assert p.ready and p.schedulable and not p.measured


def test_measured_figures_override_the_table(make_node: Any) -> None:
    node = make_node("n1")
    p = profile_node(node, topology_keys=KEYS, measured={"tflops": 500.0, "memory_bytes": 7e10})
    assert p.measured and p.gpu_tflops == 500.0 and p.gpu_memory_bytes == 7e10
    assert p.intra_node_bandwidth == 450e9  # not measured: the table's NVLink figure


def test_the_node_annotation_of_earlier_versions_is_ignored(make_node: Any) -> None:
    # Anyone who may patch a node could write it; profiles come from the operator's store.
    node = make_node("n1")
    node["metadata"]["annotations"][PROFILE_ANNOTATION] = json.dumps(
        {"tflops": 500.0, "memory_bytes": 7e10})
    p = profile_node(node, topology_keys=KEYS)
    assert not p.measured and p.gpu_tflops == 989.0


def test_fingerprint_ignores_heartbeats_but_not_hardware(make_node: Any) -> None:
    a = make_node("n1")
    b = make_node("n1")
    b["status"]["conditions"][0]["lastHeartbeatTime"] = "2026-01-01T00:00:10Z"
    fa = profile_node(a, topology_keys=KEYS).fingerprint()
    assert fa == profile_node(b, topology_keys=KEYS).fingerprint()
    c = make_node("n1", gpus=4)
    assert fa != profile_node(c, topology_keys=KEYS).fingerprint()


def test_candidates_filter_readiness_selector_taints_and_size(make_node: Any) -> None:
    taint = {"key": "dedicated", "value": "x", "effect": "NoSchedule"}
    nodes = [
        make_node("ok", extra_labels={"pool": "train"}),
        make_node("not-ready", ready=False, extra_labels={"pool": "train"}),
        make_node("other-pool", extra_labels={"pool": "infer"}),
        make_node("tainted", taints=[taint], extra_labels={"pool": "train"}),
        make_node("small", gpus=1, extra_labels={"pool": "train"}),
    ]
    profiles = [profile_node(n, topology_keys=DEFAULT_TOPOLOGY_KEYS) for n in nodes]
    got = candidate_nodes(profiles, node_selector={"pool": "train"}, tolerations=[],
                          gpus_per_worker=2)
    assert [p.name for p in got] == ["ok"]
    tol = [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}]
    got = candidate_nodes(profiles, node_selector={"pool": "train"}, tolerations=tol,
                          gpus_per_worker=2)
    assert [p.name for p in got] == ["ok", "tainted"]


def test_tolerations_follow_core_rules() -> None:
    taint = ("k", "v", "NoSchedule")
    assert tolerates([{"key": "k", "value": "v"}], taint)
    assert not tolerates([{"key": "k", "value": "w"}], taint)
    assert tolerates([{"operator": "Exists"}], taint)
    assert not tolerates([{"key": "k", "operator": "Exists", "effect": "NoExecute"}], taint)
    assert tolerates([], ("k", "v", "PreferNoSchedule"))


def test_quantities() -> None:
    assert parse_quantity("500m") == 0.5
    assert parse_quantity("16Gi") == 16 * 2**30
    assert parse_quantity(8) == 8.0
