"""The plan step's memo of node profiles (adaptis/operator/scheduling/placement.py)."""

from __future__ import annotations

from typing import Any

import pytest

from adaptis.operator.control.reconcile import Reconciler
from adaptis.operator.scheduling import placement


def test_nodes_are_profiled_again_only_when_their_resource_version_moves(
        cluster: Any, make_job: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = placement.profile_node

    def counting(node: Any, **kwargs: Any) -> Any:
        calls.append(node["metadata"]["name"])
        return real(node, **kwargs)

    monkeypatch.setattr(placement, "profile_node", counting)
    for i, node in enumerate(cluster.nodes.values()):
        node["metadata"]["resourceVersion"] = str(i + 1)
    for name in ("a", "b"):
        cluster.add_job(make_job(name, spec={"parallelism": {"workers": 2, "gpusPerWorker": 1}}))
    rec = Reconciler(cluster)
    rec.reconcile("ns", "a")
    rec.reconcile("ns", "b")
    assert sorted(calls) == sorted(cluster.nodes)  # four nodes, profiled once for two jobs
    assert {r["node"] for r in cluster.job("a")["status"]["placement"]} == {"h100-0"}
    # A label change comes with a new resourceVersion: that node alone is read again, and
    # what it says now counts (the plan on it no longer holds).
    node = cluster.nodes["h100-0"]
    node["metadata"]["labels"]["nvidia.com/gpu.product"] = "NVIDIA-A100-SXM4-80GB"
    node["metadata"]["resourceVersion"] = "99"
    calls.clear()
    rec.reconcile("ns", "a")
    assert calls == ["h100-0"]
    assert cluster.job("a")["status"]["replans"] == 1
    del cluster.nodes["a100-1"]
    rec.reconcile("ns", "b")
    assert "a100-1" not in rec._placer._profiles  # a deleted node is forgotten
