"""The job's mesh: which GPU of which pod runs which rank, and the devices the planner sees.

Sits in the api layer, the one statement of the rank arithmetic: the operator builds the
planning problem (:mod:`adaptis.operator.scheduling.planning`), the pod commands and
status.placement from it, and every worker rank finds its replica, pipeline rank and process
groups with it (:mod:`adaptis.worker.runtime.replicas`). The contract
(adaptis.api.job.ParallelismSpec, docs/shared-cluster.md):

- a job has W worker pods of N = max(1, gpusPerWorker) ranks each, one rank per GPU (a CPU
  pod runs one rank); pod w holds global ranks w*N .. w*N + N - 1 (LOCAL_RANK 0..N-1);
- the ranks form a replicas x pipeline x tensor mesh, tensor innermost: rank g is tensor rank
  g % T of pipeline position (g // T) % P of replica g // (P*T), P = W*N / (R*T). T divides N,
  so the T ranks of one pipeline position share a pod (their all-reduces run every layer).
  The plan is one replica's pipeline over P devices, each a tensor group of T GPUs, run R
  times;
- heterogeneous replicas: the planner sees, at each pipeline position, the slowest and
  smallest GPU that any replica has there (the plan must run on every replica, and the step
  waits for the slowest one); two positions share the intra-node link only if they share a
  node in every replica;
- the gradient all-reduce of a stage runs between the R ranks of its pipeline position: over
  the intra-node link when every position's replicas share a node, else over the inter-node
  link (the mesh puts replicas on other pods, usually other nodes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from adaptis.api.job import JobSpec
from adaptis.api.problem import DeviceSpec

__all__ = ["Mesh", "pipeline_devices", "replicas_share_nodes"]


@dataclass(frozen=True, slots=True)
class Mesh:
    """W pods of N ranks, R replicas of a P-position pipeline of T-rank tensor groups
    (W*N = R*P*T)."""

    pods: int
    per_pod: int
    replicas: int = 1
    tensor: int = 1

    def __post_init__(self) -> None:
        if self.pods < 1 or self.per_pod < 1 or self.replicas < 1 or self.tensor < 1:
            raise ValueError(f"mesh: pods {self.pods}, ranks a pod {self.per_pod}, replicas "
                             f"{self.replicas} and tensor degree {self.tensor} must be at least 1")
        if self.per_pod % self.tensor:
            raise ValueError(f"spec.parallelism.tensorParallel: {self.tensor} does not divide the "
                             f"{self.per_pod} ranks of a worker pod (gpusPerWorker); a tensor group "
                             "must not leave its pod")
        if self.world % (self.replicas * self.tensor):
            groups = f" of tensor groups of {self.tensor}" if self.tensor > 1 else ""
            raise ValueError(f"spec.parallelism.dataParallel: {self.replicas} replicas{groups} do "
                             f"not divide {self.world} ranks; use a divisor of the ranks")

    @classmethod
    def of(cls, spec: JobSpec) -> Mesh:
        par = spec.parallelism
        return cls(pods=par.workers, per_pod=par.ranks_per_worker,
                   replicas=par.data_parallel, tensor=par.tensor_parallel)

    @property
    def world(self) -> int:
        return self.pods * self.per_pod

    @property
    def pipeline(self) -> int:
        """P: the pipeline positions of one replica, the devices of the plan."""
        return self.world // (self.replicas * self.tensor)

    def pod(self, rank: int) -> int:
        return rank // self.per_pod

    def local_rank(self, rank: int) -> int:
        return rank % self.per_pod

    def replica(self, rank: int) -> int:
        return rank // (self.pipeline * self.tensor)

    def pipeline_rank(self, rank: int) -> int:
        return (rank // self.tensor) % self.pipeline

    def tensor_rank(self, rank: int) -> int:
        return rank % self.tensor

    def rank(self, *, replica: int, pipeline_rank: int, tensor_rank: int = 0) -> int:
        return (replica * self.pipeline + pipeline_rank) * self.tensor + tensor_rank

    def pipeline_ranks(self, replica: int, *, tensor_rank: int = 0) -> list[int]:
        """Global ranks of one pipeline replica (those of one tensor rank), in pipeline order."""
        return [self.rank(replica=replica, pipeline_rank=p, tensor_rank=tensor_rank)
                for p in range(self.pipeline)]

    def replica_ranks(self, pipeline_rank: int, *, tensor_rank: int = 0) -> list[int]:
        """Global ranks holding the same shards of the same stages (one per replica)."""
        return [self.rank(replica=r, pipeline_rank=pipeline_rank, tensor_rank=tensor_rank)
                for r in range(self.replicas)]

    def tensor_ranks(self, *, replica: int, pipeline_rank: int) -> list[int]:
        """Global ranks of one tensor group (one pipeline position of one replica)."""
        first = self.rank(replica=replica, pipeline_rank=pipeline_rank)
        return list(range(first, first + self.tensor))


def pipeline_devices(mesh: Mesh, *, nodes: Sequence[str], speeds: Sequence[float],
                     memory: Sequence[float | None]) -> list[DeviceSpec]:
    """The plan's P devices from the pods' nodes, per-GPU speeds and memory (index: pod).

    Device p is the slowest and smallest GPU at pipeline position p over the replicas; its
    node label names the node of every replica's rank there, so that two devices share the
    intra-node link only where every replica's pair does."""
    if not (len(nodes) == len(speeds) == len(memory) == mesh.pods):
        raise ValueError(f"mesh: {mesh.pods} pods, got {len(nodes)} nodes, {len(speeds)} speeds "
                         f"and {len(memory)} memory sizes")
    out: list[DeviceSpec] = []
    for p in range(mesh.pipeline):
        pods = [mesh.pod(mesh.rank(replica=r, pipeline_rank=p)) for r in range(mesh.replicas)]
        mems = [m for w in pods if (m := memory[w]) is not None]
        out.append(DeviceSpec(
            name=f"rank{p}",
            node="|".join(nodes[w] for w in pods),
            speed=min(speeds[w] for w in pods),
            # None (unbounded) only when no replica's GPU there has a known size.
            memory_bytes=min(mems) if mems else None,
        ))
    return out


def replicas_share_nodes(mesh: Mesh, *, nodes: Sequence[str]) -> bool:
    """Whether at every pipeline position all replicas' ranks sit on one node (then the
    gradient all-reduce runs over the intra-node link)."""
    return all(
        len({nodes[mesh.pod(mesh.rank(replica=r, pipeline_rank=p))]
             for r in range(mesh.replicas)}) == 1
        for p in range(mesh.pipeline)
    )
