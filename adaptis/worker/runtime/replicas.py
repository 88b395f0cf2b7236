"""Data parallelism across pipeline replicas: the rank mesh, its process groups, the bucketed
gradient all-reduce and ZeRO-1 optimizer-state sharding.

Sits under :mod:`adaptis.worker.runtime.executor`, which builds one of each per rank. The job's
ranks form a ``replicas x pipeline`` mesh (:class:`adaptis.api.mesh.Mesh`, the operator's too),
pipeline innermost: global rank = replica x P + pipeline rank (docs/parallelism.md says why). A
pipeline's ranks talk point to point every microbatch over the *pipeline group*; the R copies of a
stage average their gradients once per step over the *replica group* of their pipeline rank.

The gradient reduction is launched per stage, asynchronously, as soon as the stage's last
weight-gradient action of the step has run (the pipeline runtime reports it), so it overlaps
the backward of the rank's other stages and the rest of the pipeline; the executor waits for
it before the tied-embedding exchange and clipping. Gradients travel in flat buckets of about
``bucket_bytes`` (few large messages, not one per parameter), each with one presence flag per
parameter so a parameter no replica touched keeps ``grad = None``, as single-process training
would leave it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from adaptis.api.mesh import Mesh
from adaptis.worker.errors import PlanMismatchError
from adaptis.worker.runtime.dtensors import like_parameter, local, settle_grad

__all__ = ["BUCKET_BYTES", "GradReducer", "MeshGroups", "ZeroOptimizer", "create_groups", "world_mesh"]

log = logging.getLogger(__name__)

#: Gradient bucket size: large enough that per-message latency does not dominate, small enough
#: that the first buckets of a stage go out while later stages still compute.
BUCKET_BYTES = 25 * 2**20


def world_mesh(*, world_size: int, data_parallel: int, tensor_parallel: int = 1) -> Mesh:
    """The ``replicas x pipeline x tensor`` mesh of ``world_size`` ranks
    (:class:`adaptis.api.mesh.Mesh`; which pod a rank runs in does not matter here beyond
    keeping a tensor group together, so each tensor group is a pod of its own)."""
    group = data_parallel * tensor_parallel
    if data_parallel < 1 or tensor_parallel < 1 or world_size % group:
        tensor = f" x tensor_parallel {tensor_parallel}" if tensor_parallel > 1 else ""
        what = f"data_parallel {data_parallel}{tensor}"
        raise PlanMismatchError(
            f"{what} does not divide the world size {world_size}; the world must be "
            "data_parallel x the plan's devices x tensor_parallel")
    return Mesh(pods=world_size // tensor_parallel, per_pod=tensor_parallel,
                replicas=data_parallel, tensor=tensor_parallel)


@dataclass(frozen=True, slots=True)
class MeshGroups:
    """This rank's pipeline group and replica group (None: the world group / no replicas), and
    ``work``: the group torch's pipelining runs in, the pipeline's ranks that have actions
    (the pipeline group itself when the plan idles none; None on an idle rank, which is in
    no such group); ``tensor``: its tensor group (None without tensor parallelism)."""

    pipeline: dist.ProcessGroup | None
    replica: dist.ProcessGroup | None
    work: dist.ProcessGroup | None = None
    tensor: dist.ProcessGroup | None = None


def _new_groups(members: Sequence[list[int]], *, rank: int) -> dist.ProcessGroup | None:
    """Create every group of ``members`` (collective, in order); return the one holding ``rank``."""
    mine = None
    for ranks in members:
        g = dist.new_group(ranks)
        if rank in ranks:
            mine = g
    return mine


def create_groups(mesh: Mesh, *, rank: int, busy: Sequence[int] | None = None) -> MeshGroups:
    """Collective: every rank creates every group, in the same order (``new_group`` requires
    it), before any pipeline stage exists: subgroups created next to torch pipelining's peer
    warm-up broke gloo on torch 2.11. With one replica, one tensor rank and no idle rank
    nothing is created: the pipeline is the world, as before data parallelism.

    A pipeline group is the P ranks of one replica with one tensor rank (torch's pipelining
    sends between matching tensor ranks of adjacent stages); a replica group the R ranks with
    one pipeline position and tensor rank; a tensor group the T ranks of one position.

    ``busy``: the pipeline ranks the plan gives actions (None: all). torch's pipelining runs
    only a group whose every rank has actions, so a plan that idles ranks gets one more group
    per pipeline, of its busy ranks; the idle ranks create it too but stay out of it."""
    busy = list(range(mesh.pipeline)) if busy is None else sorted(busy)
    idles = len(busy) < mesh.pipeline
    lines = [(r, t) for r in range(mesh.replicas) for t in range(mesh.tensor)]
    positions = [(p, t) for p in range(mesh.pipeline) for t in range(mesh.tensor)]
    mine_pipe = mine_rep = mine_tensor = None
    if mesh.replicas > 1 or mesh.tensor > 1:
        mine_pipe = _new_groups([mesh.pipeline_ranks(r, tensor_rank=t) for r, t in lines], rank=rank)
    if mesh.replicas > 1:
        mine_rep = _new_groups([mesh.replica_ranks(p, tensor_rank=t) for p, t in positions], rank=rank)
    if mesh.tensor > 1:
        mine_tensor = _new_groups([mesh.tensor_ranks(replica=r, pipeline_rank=p)
                                   for r in range(mesh.replicas) for p in range(mesh.pipeline)], rank=rank)
    mine_work = mine_pipe
    if idles:
        mine_work = _new_groups([[mesh.rank(replica=r, pipeline_rank=p, tensor_rank=t) for p in busy]
                                 for r, t in lines], rank=rank)
    return MeshGroups(pipeline=mine_pipe, replica=mine_rep, work=mine_work, tensor=mine_tensor)


def _buckets(params: Sequence[nn.Parameter], *, bucket_bytes: int) -> list[list[nn.Parameter]]:
    out: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if out and size + nbytes <= bucket_bytes:
            out[-1].append(p)
            size += nbytes
        else:
            out.append([p])
            size = nbytes
    return out


class GradReducer:
    """Averages each stage's gradients over the replica group, one async all-reduce per bucket.

    ``stage_params``: the parameters whose reduction starts when that stage's gradients are
    complete (each parameter under exactly one stage). Per step: :meth:`reset`, then
    :meth:`stage_ready` per stage (from the runtime's hook), then :meth:`wait`."""

    def __init__(self, *, stage_params: dict[int, list[nn.Parameter]], group: dist.ProcessGroup | None,
                 replicas: int, bucket_bytes: int = BUCKET_BYTES) -> None:
        self.group = group
        self.replicas = replicas
        self._buckets = {s: _buckets(ps, bucket_bytes=bucket_bytes) for s, ps in stage_params.items() if ps}
        self._pending: list[tuple[list[nn.Parameter], torch.Tensor, dist.Work]] = []
        self._launched: set[int] = set()
        self.overlapped = 0

    @property
    def stages(self) -> int:
        """Stages with gradients to reduce on this rank."""
        return len(self._buckets)

    def reset(self) -> None:
        self._pending.clear()
        self._launched.clear()

    def stage_ready(self, stage: int) -> None:
        """Launch the all-reduce of ``stage``'s buckets (once per step)."""
        if stage in self._launched or stage not in self._buckets:
            return
        self._launched.add(stage)
        for bucket in self._buckets[stage]:
            flat = _flatten(bucket)
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            self._pending.append((bucket, flat, work))

    def wait(self) -> float:
        """Launch what was not launched yet, wait for every reduction and write the averaged
        gradients back; returns the seconds spent blocked here (the exposed reduction)."""
        start = time.perf_counter()
        # Stages the runtime reported during the step (their reduction overlapped the rest);
        # any other is launched only now, fully exposed.
        self.overlapped = len(self._launched)
        for stage in sorted(self._buckets):
            self.stage_ready(stage)
        for bucket, flat, work in self._pending:
            work.wait()
            _unflatten(bucket, flat, replicas=self.replicas)
        self._pending.clear()
        return time.perf_counter() - start


def _flatten(bucket: list[nn.Parameter]) -> torch.Tensor:
    # Tensor-parallel parameters are DTensors: each replica group reduces one tensor rank's
    # shards, so the local parts are what travels.
    p0 = local(bucket[0])
    grads = [settle_grad(p) for p in bucket]
    parts = [(local(g).detach() if g is not None else torch.zeros_like(local(p))).reshape(-1).to(p0.dtype)
             for p, g in zip(bucket, grads, strict=True)]
    flags = torch.tensor([p.grad is not None for p in bucket], dtype=p0.dtype, device=p0.device)
    return torch.cat([*parts, flags])


def _unflatten(bucket: list[nn.Parameter], flat: torch.Tensor, *, replicas: int) -> None:
    flags = flat[-len(bucket):].tolist()  # one device sync per bucket, not one per parameter
    offset = 0
    for i, p in enumerate(bucket):
        mine = local(p)
        n = mine.numel()
        if flags[i] > 0:  # some replica produced a gradient: average it
            g = flat[offset:offset + n].view_as(mine).div_(replicas)
            if p.grad is None:
                p.grad = like_parameter(p, g.to(p.dtype).clone())
            else:
                local(p.grad).copy_(g)
        offset += n


class ZeroOptimizer:
    """ZeRO stage 1: each of the R replicas of a stage keeps the optimizer state of only a
    share of its parameters (about 1/R), steps that share, and broadcasts the updated weights
    to the other replicas. Gradients are still all-reduced in full (that is stage 2's saving).

    Shares are chosen greedily by size, in parameter order, so every replica computes the same
    assignment without talking. :meth:`state_dict` is this rank's shard only."""

    def __init__(self, params: Sequence[nn.Parameter], *, make: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                 mesh: Mesh, rank: int, group: dist.ProcessGroup | None) -> None:
        self.mesh = mesh
        self.group = group
        self.replica = mesh.replica(rank)
        # The global rank of each owner: the replicas of this rank's position and tensor rank.
        self._src = mesh.replica_ranks(mesh.pipeline_rank(rank), tensor_rank=mesh.tensor_rank(rank))
        load = [0] * mesh.replicas
        self.owned: list[list[nn.Parameter]] = [[] for _ in range(mesh.replicas)]
        for p in params:
            owner = min(range(mesh.replicas), key=lambda r: (load[r], r))
            self.owned[owner].append(p)
            load[owner] += local(p).numel()
        mine = self.owned[self.replica]
        # A replica may own nothing (fewer tensors than replicas): it then only receives.
        self.local: torch.optim.Optimizer | None = make(mine) if mine else None

    @property
    def param_groups(self) -> list[dict]:
        return self.local.param_groups if self.local is not None else []

    def step(self) -> None:
        if self.local is not None:
            self.local.step()
        for owner, params in enumerate(self.owned):
            if not params:
                continue
            flat = torch.cat([local(p).detach().reshape(-1) for p in params])
            dist.broadcast(flat, src=self._src[owner], group=self.group)
            if owner != self.replica:
                offset = 0
                with torch.no_grad():
                    for p in params:
                        mine = local(p)
                        mine.copy_(flat[offset:offset + mine.numel()].view_as(mine))
                        offset += mine.numel()

    def state_dict(self) -> dict:
        return self.local.state_dict() if self.local is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.local is not None:
            self.local.load_state_dict(state)

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (the ZeRO-1 saving, measurable)."""
        if self.local is None:
            return 0
        return sum(t.numel() * t.element_size() for s in self.local.state.values()
                   for t in s.values() if isinstance(t, torch.Tensor))
