"""Kueue's pod-group metadata on the worker pods (adaptis/operator/resources/kueue.py via manifests).

The real Kueue admitting these pods is tests/integration/test_kueue_admission.py.
"""

from __future__ import annotations

from typing import Any

from adaptis.api.job import JobSpec
from adaptis.operator.core.records import JobRef
from adaptis.operator.core.settings import DEFAULT_TOPOLOGY_KEYS, ManifestSettings
from adaptis.operator.profiling.nodes import profile_node
from adaptis.operator.resources.manifests import render_pod
from adaptis.operator.scheduling.planning import plan_job

JOB = JobRef(name="demo", namespace="ns", uid="uid-1")


def _pods(make_node: Any, make_job: Any, *, queue_name: str | None,
          nodes: int = 9, attempt: int = 0) -> list[dict[str, Any]]:
    spec_raw = {**make_job()["spec"], "parallelism": {"workers": nodes, "gpusPerWorker": 1}}
    spec_raw["model"] = {**spec_raw["model"], "blocks": [{"kind": "attention", "count": nodes}]}
    if queue_name:
        spec_raw["queueName"] = queue_name
    spec = JobSpec.model_validate(spec_raw)
    # One GPU per node: the plan must put every rank on a node of its own.
    profiled = [profile_node(make_node(f"gpu-{i}", gpus=1), topology_keys=DEFAULT_TOPOLOGY_KEYS)
                for i in range(nodes)]
    record = plan_job(spec, profiled, name="ns/demo")
    return [render_pod(JOB, spec, record=record, rank=r, attempt=attempt, settings=ManifestSettings())
            for r in range(nodes)]


def _hostnames(pod: dict[str, Any]) -> tuple[str, ...]:
    term = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    return tuple(term["nodeSelectorTerms"][0]["matchExpressions"][0]["values"])


def test_ranks_on_nine_nodes_are_one_kueue_role(make_node: Any, make_job: Any) -> None:
    pods = _pods(make_node, make_job, queue_name="team-a")
    # Kueue's own role hash covers the node affinity, which differs on every rank: nine
    # PodSets, over Kueue's limit of eight. The annotation makes them one.
    assert len({_hostnames(p) for p in pods}) == 9
    roles = {p["metadata"]["annotations"]["kueue.x-k8s.io/role-hash"] for p in pods}
    assert roles == {"workers"}
    for pod in pods:
        labels, annotations = pod["metadata"]["labels"], pod["metadata"]["annotations"]
        assert labels["kueue.x-k8s.io/queue-name"] == "team-a"
        assert labels["kueue.x-k8s.io/pod-group-name"] == "demo"
        assert annotations["kueue.x-k8s.io/pod-group-total-count"] == "9"
        # The managed label is Kueue's to set (its webhook refuses other values).
        assert "kueue.x-k8s.io/managed" not in labels
        # A failed or deleted rank ends the group: Kueue lets the pods go, the operator's next
        # attempt is a new group.
        assert annotations["kueue.x-k8s.io/retriable-in-group"] == "false"


def test_each_attempt_of_the_gang_is_a_group_of_its_own(make_node: Any, make_job: Any) -> None:
    again = _pods(make_node, make_job, queue_name="team-a", nodes=2, attempt=1)
    assert {p["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] for p in again} == {"demo-a1"}
    last = _pods(make_node, make_job, queue_name="team-a", nodes=2, attempt=1000)
    group = last[0]["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"]
    # A label value; the longest job name (54 characters) still fits with the longest suffix.
    assert group == "demo-a1000" and len("j" * 54 + "-a1000") <= 63


def test_without_a_queue_name_kueue_finds_no_queue_and_no_role(
        make_node: Any, make_job: Any) -> None:
    pods = _pods(make_node, make_job, queue_name=None, nodes=2)
    for pod in pods:
        assert "kueue.x-k8s.io/queue-name" not in pod["metadata"]["labels"]
        assert "kueue.x-k8s.io/role-hash" not in pod["metadata"]["annotations"]
        assert "kueue.x-k8s.io/retriable-in-group" not in pod["metadata"]["annotations"]
        # The group is still named: a namespace's default LocalQueue sees one gang.
        assert pod["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] == "demo"
        assert pod["metadata"]["annotations"]["kueue.x-k8s.io/pod-group-total-count"] == "2"
