"""What the operator knows and keeps: the job that owns the children, a node, a plan record.

Sits at the bottom of the operator layer (:mod:`adaptis.operator.core`), under every room that
passes these around: :class:`NodeProfile` is made by node profiling
(:mod:`adaptis.operator.profiling.nodes`) and read by scheduling, :class:`PlanRecord` is made by
:mod:`adaptis.operator.scheduling.planning`, kept by
:mod:`adaptis.operator.scheduling.plan_store` and rendered by
:mod:`adaptis.operator.resources.manifests`, and :class:`JobRef` names the owner of every child.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from adaptis.api.job import API_VERSION, KIND
from adaptis.api.mesh import Mesh
from adaptis.api.plan import Plan

__all__ = ["JobRef", "NodeProfile", "PlanRecord"]


@dataclass(frozen=True, slots=True)
class JobRef:
    """Who owns the children."""

    name: str
    namespace: str
    uid: str

    def owner_reference(self) -> dict[str, Any]:
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


@dataclass(frozen=True, slots=True)
class NodeProfile:
    """What the planner needs to know about one node."""

    name: str
    hostname: str
    gpu_product: str | None
    gpus: int
    gpu_memory_bytes: float | None
    gpu_tflops: float  # per GPU (per core for CPU nodes), peak dense BF16
    intra_node_bandwidth: float  # bytes/s between devices of this node
    cpus: float
    topology: tuple[str, ...]  # label values in the configured key order; "" when absent
    ready: bool
    schedulable: bool
    labels: tuple[tuple[str, str], ...]
    taints: tuple[tuple[str, str, str], ...]  # (key, value, effect)
    measured: bool

    def fingerprint(self) -> str:
        """What a plan depends on: changes here (not heartbeats) invalidate a cached plan."""
        return json.dumps(
            [self.name, self.hostname, self.gpu_product, self.gpus, self.gpu_memory_bytes,
             self.gpu_tflops, self.intra_node_bandwidth, self.cpus, list(self.topology)],
            separators=(",", ":"),
        )


class PlanRecord(BaseModel):
    """A plan and everything it was made from; kept in the operator's namespace
    (:mod:`adaptis.operator.scheduling.plan_store`), never read back from the job's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    spec_hash: str = Field(description="spec_hash() of the job spec the plan was made for.")
    plan: Plan
    nodes: list[str] = Field(description="nodes[w]: the node worker pod w runs on (its "
                             "ranks_per_pod ranks: w*N .. w*N + N - 1).")
    hostnames: list[str] = Field(description="kubernetes.io/hostname of nodes[w].")
    gpus: list[str | None] = Field(description="GPU product of nodes[w].")
    ranks_per_pod: int = Field(default=1, ge=1, description="N: ranks (GPUs) of each pod.")
    data_parallel: int = Field(default=1, ge=1, description="R: replicas of the plan's pipeline.")
    tensor_parallel: int = Field(default=1, ge=1, description="T: ranks of each pipeline position.")
    node_fingerprints: dict[str, str] = Field(description="NodeProfile.fingerprint() per node.")
    strategy: str
    predicted_iteration_seconds: float
    predicted_bubble_ratio: float
    predicted_step_seconds: float | None = Field(
        default=None, description="The whole step: the pipeline, then the gradient all-reduce "
        "across replicas and the optimizer (Predicted.step_time).")
    predicted_speedup_over_i1f1b: float | None = None
    budget_reason: str | None = Field(
        default=None, description="Set when the plan is not the full search's: TimeLimitReached "
        "(the best found within spec.planner.timeLimitSeconds) or BaselineFallback.")
    budget_note: str | None = Field(default=None, description="What budget_reason means here.")
    device_speed: list[float] = Field(
        default_factory=list, description="Speed factors of the pipeline devices the plan was "
        "made with (adaptation's corrected speeds; empty: as profiled).")

    def gpus_by_node(self, *, gpus_per_worker: int) -> dict[str, int]:
        """The GPUs the plan holds on each node."""
        out: dict[str, int] = {}
        for node in self.nodes:
            out[node] = out.get(node, 0) + gpus_per_worker
        return out

    @property
    def mesh(self) -> Mesh:
        return Mesh(pods=len(self.nodes), per_pod=self.ranks_per_pod, replicas=self.data_parallel,
                    tensor=self.tensor_parallel)

    def still_valid(self, *, spec_hash_now: str, candidates: Mapping[str, NodeProfile],
                    ranks_per_pod: int = 1) -> bool:
        """True while the spec is the same, the record has the pods' ranks the spec asks,
        and every planned node is there, unchanged, under the hostname the pods will be pinned
        to."""
        if (spec_hash_now != self.spec_hash or ranks_per_pod != self.ranks_per_pod
                or len(self.hostnames) != len(self.nodes)
                or set(self.node_fingerprints) != set(self.nodes)):
            return False
        return all(
            name in candidates and candidates[name].fingerprint() == fp
            for name, fp in self.node_fingerprints.items()
        ) and all(candidates[n].hostname == h for n, h in zip(self.nodes, self.hostnames, strict=True))
