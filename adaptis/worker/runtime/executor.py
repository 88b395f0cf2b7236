"""The unified pipeline executor: one rank of a plan, trained step by step.

Sits between the worker's run loop (:mod:`adaptis.worker.run.runner`) and the torch adapter
(:mod:`adaptis.worker.runtime.pipelining`). Given the worker configuration and the process group, it
builds this rank's stage modules (seeded, so weights do not depend on the partition), runs the
plan's actions for a batch, then does what a pipeline step needs around them: the tied
embedding gradient sync between the ranks holding embedding and head, global gradient-norm
clipping across ranks, the optimizer step, and per-step statistics shared by every rank
(loss, busy time of each rank, the iteration time) with a single all-gather.

With ``data_parallel`` R > 1 the world is a replicas x pipeline mesh
(:mod:`adaptis.worker.runtime.replicas`): the runtime, the tied exchange and the clipping norm stay
inside this rank's pipeline replica, each stage's gradients are averaged over its R replicas
(launched as the stage finishes its backward, waited before clipping), and the optimizer
state may be sharded across the replicas (ZeRO-1).

A rank the plan gives no stage (an idle rank) builds no stage and no torch runtime (torch's
pipelining runs in a group of the busy ranks only) but joins every collective of a step.
"""

from __future__ import annotations

import contextlib
import logging
import math
import resource
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from adaptis.api.errors import SpecError
from adaptis.api.job import Model, TrainingSpec, WorkerConfig
from adaptis.api.model import ZooModel
from adaptis.api.plan import Plan
from adaptis.api.rules import layer_count
from adaptis.worker.data.sources import Batch
from adaptis.worker.errors import PlanMismatchError
from adaptis.worker.models.build import build_model_stages
from adaptis.worker.models.hf.stages import hf_config
from adaptis.worker.models.precision import PRECISION_DTYPE, resolve_precision, wrap_stage
from adaptis.worker.models.zoo import (
    set_aux_loss_scale,
    token_loss,
)
from adaptis.worker.runtime.components import build_optimizer, build_reducer, unique_params
from adaptis.worker.runtime.dtensors import is_sharded, local, settle_grad
from adaptis.worker.runtime.lr_schedule import learning_rate
from adaptis.worker.runtime.ownership import tie_peer
from adaptis.worker.runtime.pipelining import IdleRuntime, PipelineRuntime, StageShapes
from adaptis.worker.runtime.replicas import ZeroOptimizer, create_groups, world_mesh
from adaptis.worker.runtime.tensor_parallel import (
    loss_parallel,
    shard_hf_stages,
    shard_stages,
    vocab_parallel_loss,
)
from adaptis.worker.runtime.timers import ActionTimer, device_timer

__all__ = ["Executor", "StepStats", "activation_bytes", "transfer_bytes", "parse_plan"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepStats:
    """One step as every rank sees it (identical on all ranks but for ``rank``)."""

    rank: int  # global rank; the tuples below are indexed by global rank
    loss: float  # of the replicas' combined batch (mean of the replicas' losses)
    iteration_seconds: float  # pipeline part, barrier to the last rank's end
    step_seconds: float  # whole step on this rank, optimizer included
    busy_seconds: tuple[float, ...]  # per rank
    busy_by_kind: dict[str, float]  # this rank
    grad_norm: float
    sent_bytes: int
    received_bytes: int
    peak_memory_bytes: int
    learning_rate: float = 0.0  # the rate this step's optimizer update used
    reduce_wait_seconds: float = 0.0  # this rank blocked on the replica gradient all-reduce

    @property
    def idle_seconds(self) -> float:
        return max(0.0, self.iteration_seconds - self.busy_seconds[self.rank])

    @property
    def rank_bubble_ratio(self) -> float:
        return self.idle_seconds / self.iteration_seconds if self.iteration_seconds > 0 else 0.0

    @property
    def bubble_ratio(self) -> float:
        """1 - sum of busy time / (ranks x iteration time): the plan's predicted quantity."""
        total = len(self.busy_seconds) * self.iteration_seconds
        return max(0.0, 1.0 - sum(self.busy_seconds) / total) if total > 0 else 0.0

    @property
    def post_pipeline_seconds(self) -> float:
        """The last rank's pipeline end to this rank's step end: the tied-gradient exchange,
        gradient reductions, clipping, the optimizer step and the stats all-gather."""
        return max(0.0, self.step_seconds - self.iteration_seconds)


def parse_plan(config: WorkerConfig, *, world_size: int) -> Plan:
    """The config's plan, checked against the model's layer count and the world size."""
    try:
        plan = config.plan if isinstance(config.plan, Plan) else Plan.model_validate(config.plan)
        plan.check(layers=layer_count(config.model),
                   microbatches=config.training.microbatches, devices=world_size)
    except SpecError as err:
        raise PlanMismatchError(str(err)) from None
    except ValueError as err:  # pydantic's ValidationError
        raise PlanMismatchError(f"plan: {err}") from None
    return plan


def activation_bytes(training: TrainingSpec, *, hidden: int, dtype: torch.dtype) -> int:
    """Bytes of one microbatch's activation (or its gradient) between two stages."""
    return training.microbatch_size * training.sequence_length * hidden * dtype.itemsize


def transfer_bytes(plan: Plan, *, rank: int, activation_bytes: int) -> tuple[int, int]:
    """Bytes this rank sends and receives per step: one activation per cross-rank F and one
    gradient per cross-rank input-gradient (B or BW; stage 0 sends none)."""
    owner = plan.stage_device()
    sent = received = 0
    for kind, stage, _mb in plan.actions[rank]:
        nxt = owner[stage + 1] if stage + 1 < len(owner) else rank
        prv = owner[stage - 1] if stage > 0 else rank
        if kind == "F":
            sent += activation_bytes * (nxt != rank)
            received += activation_bytes * (prv != rank)
        elif kind in ("B", "BW"):
            sent += activation_bytes * (prv != rank)
            received += activation_bytes * (nxt != rank)
    return sent, received


class Executor:
    """This rank's stages, optimizer and runtime. Collective calls: every rank constructs one
    and calls :meth:`step` the same number of times."""

    #: ``time.perf_counter()`` at the last step's common start (every rank leaves the barrier
    #: together): where the runner's data phase ends and the step's pipeline part begins.
    started_at: float = 0.0
    _lr: float  # the rate of the coming optimizer step: set_learning_rate

    def __init__(self, config: WorkerConfig, *, rank: int, world_size: int, device: torch.device,
                 timer: ActionTimer | None = None) -> None:
        """``timer`` times this rank's actions
        (:func:`adaptis.worker.runtime.components.action_timer`); None: the device's clock."""
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.mesh = world_mesh(world_size=world_size, data_parallel=config.data_parallel,
                               tensor_parallel=config.tensor_parallel)
        self.replica = self.mesh.replica(rank)
        self.pipeline_rank = self.mesh.pipeline_rank(rank)
        self.tensor_rank = self.mesh.tensor_rank(rank)
        self.plan = parse_plan(config, world_size=self.mesh.pipeline)
        # Before any PipelineStage exists (see create_groups). A rank the plan gives no action
        # (an idle rank) is left out of the group torch's pipelining runs in.
        self.busy_ranks = [r for r, acts in enumerate(self.plan.actions) if acts]
        self.groups = create_groups(self.mesh, rank=rank, busy=self.busy_ranks)
        spec, train = config.model, config.training
        self.precision = resolve_precision(train.precision, cuda=device.type == "cuda")
        if self.plan.precision is not None and self.plan.precision != self.precision:
            raise PlanMismatchError(
                f"plan: made for precision {self.plan.precision}, but this worker runs "
                f"{self.precision} (training.precision {train.precision} on {device.type}); plan "
                "again for this precision, or set training.precision to the plan's")
        recompute = self.plan.recompute or [False] * len(self.plan.stages)
        self.stage_ids = sorted(self.plan.placement[self.pipeline_rank])
        ranges = [tuple(self.plan.stages[s]) for s in self.stage_ids]
        # A Hugging Face model's stages come from its own modules (adaptis.worker.models.hf.stages).
        self.modules: list[nn.Module] = [
            m.to(device) for m in build_model_stages(spec, stages=ranges, seed=train.seed)  # type: ignore[arg-type]
        ]
        self.tensor_mesh = self._shard_tensor_parallel()
        # MoE load-balancing gradients scaled as each microbatch's token loss is (1/m).
        set_aux_loss_scale(self.modules, scale=1.0 / train.microbatches)
        hidden, vocab, self._tied = spec.hidden, spec.vocab_size, spec.tied
        self.params = unique_params(self.modules)
        self._tied_peer, self._count_in_norm = self._tie_embeddings()
        self.reducer = build_reducer(params=self.params, actions=self.plan.actions[self.pipeline_rank],
                                     stage_ids=self.stage_ids, modules=self.modules, mesh=self.mesh,
                                     replica_group=self.groups.replica)
        self.optimizer = build_optimizer(self.params, spec=train.optimizer, zero_stage=config.zero_stage,
                                         mesh=self.mesh, rank=rank, replica_group=self.groups.replica)
        self.set_learning_rate(step=0)  # sets self._lr, which the step statistics report
        self.timer = timer if timer is not None else device_timer(device)
        dtype = PRECISION_DTYPE[self.precision]
        # The last stage's output is this rank's vocabulary shard of the logits; with sequence
        # parallelism what passes between stages is this rank's 1/T of the sequence.
        shards = self.mesh.tensor if config.sequence_parallel else 1
        shapes = StageShapes(microbatch_size=train.microbatch_size, sequence_length=train.sequence_length,
                             hidden=hidden, vocab_size=vocab // self.mesh.tensor, dtype=dtype, device=device,
                             sequence_shards=shards)
        self.runtime = self._runtime(recompute=recompute, shapes=shapes)
        act = activation_bytes(train, hidden=hidden, dtype=dtype) // shards
        self.sent_bytes, self.received_bytes = transfer_bytes(self.plan, rank=self.pipeline_rank,
                                                              activation_bytes=act)

    def _shard_tensor_parallel(self) -> DeviceMesh | None:
        """With tensor parallelism, shard this rank's stages over its tensor group (torch's
        DTensor sharding, :mod:`adaptis.worker.runtime.tensor_parallel`); returns the group's
        1-D device mesh (None: T = 1)."""
        if self.mesh.tensor == 1:
            return None
        group = self.groups.tensor
        if group is None:  # created by create_groups whenever the mesh has T > 1
            raise PlanMismatchError("tensor_parallel > 1 but no tensor group was created")
        mesh = DeviceMesh.from_group(group, self.device.type)
        model = self.config.model
        if isinstance(model, ZooModel):
            shard_stages(self.modules, mesh=mesh, sequence=self.config.sequence_parallel)
        elif self.config.sequence_parallel:  # adaptis.api.rules refuses it first
            raise PlanMismatchError("spec.parallelism.sequenceParallel: not supported for Hugging "
                                    "Face models yet; remove it (tensorParallel alone works)")
        else:  # a Hugging Face model: the sharding its config declares
            shard_hf_stages(self.modules, mesh=mesh, config=hf_config(model))
        return mesh

    def _loss(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One microbatch's token loss, scaled by 1/m; on vocabulary-sharded logits under
        tensor parallelism."""
        scale = 1.0 / self.config.training.microbatches
        if self.tensor_mesh is not None:
            return vocab_parallel_loss(out, targets, mesh=self.tensor_mesh, scale=scale)
        return token_loss(out, targets, scale=scale)

    def _runtime(self, *, recompute: list[bool], shapes: StageShapes) -> PipelineRuntime | IdleRuntime:
        """What runs this rank's actions: torch's pipelining over the busy ranks, or nothing on
        an idle rank."""
        if self.pipeline_rank not in self.busy_ranks:
            return IdleRuntime()
        # The runtime runs the stages wrapped (precision, recompute); self.modules stay the bare
        # stages, which checkpoints and the tied embedding look into.
        runnable = [wrap_stage(mod, precision=self.precision, recompute=recompute[s], device=self.device)
                    for mod, s in zip(self.modules, self.stage_ids, strict=True)]
        m = self.config.training.microbatches
        # Keyed by rank in the work group: the busy ranks, in pipeline order.
        return PipelineRuntime(
            modules=runnable, stage_ids=self.stage_ids, num_stages=len(self.plan.stages),
            actions=[[(k, s, mb) for k, s, mb in self.plan.actions[r]] for r in self.busy_ranks],
            microbatches=m, shapes=shapes, timer=self.timer,
            loss_fn=self._loss,
            group=self.groups.work,
            on_stage_grads=self.reducer.stage_ready if self.reducer is not None else None,
        )

    @property
    def model(self) -> Model:
        return self.config.model

    @property
    def zero_stage(self) -> int:
        return self.config.zero_stage

    @property
    def optimizer_name(self) -> str:
        return self.config.training.optimizer.name

    @property
    def joins_checkpoint(self) -> bool:
        """Whether this rank takes part in writing checkpoints: with ZeRO-1 every rank (each
        holds its own optimizer shard), else only replica 0 (the other replicas hold the same
        state). Under tensor parallelism all T ranks of a position join (their shards are
        gathered whole) and tensor rank 0 writes the file."""
        return self.replica == 0 or isinstance(self.optimizer, ZeroOptimizer)

    @property
    def saves_checkpoint(self) -> bool:
        """Whether this rank writes a checkpoint file."""
        return self.joins_checkpoint and self.tensor_rank == 0

    @property
    def checkpoint_rank(self) -> int:
        """The rank whose checkpoint file this rank restores from: its own, or the one of tensor
        rank 0 of its position (of replica 0 when its replica saves none)."""
        if self.saves_checkpoint:
            return self.rank
        replica = self.replica if self.joins_checkpoint else 0
        return self.mesh.rank(replica=replica, pipeline_rank=self.pipeline_rank)

    def set_learning_rate(self, *, step: int) -> float:
        """Set the rate of the coming optimizer step, ``step`` steps having been done; returns it.
        A function of the step alone (:mod:`adaptis.worker.runtime.lr_schedule`): resuming is
        exact."""
        train = self.config.training
        lr = learning_rate(train.optimizer, step=step, total_steps=train.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self._lr = lr
        return lr

    @property
    def holds_first(self) -> bool:
        return self.runtime.holds_first

    @property
    def holds_last(self) -> bool:
        return self.runtime.holds_last

    def _tie_embeddings(self) -> tuple[int | None, list[bool]]:
        """With tied weights on two ranks, the peer rank to exchange the tied gradient with;
        the head's copy is then left out of the gradient norm so the shared weight counts once.

        A point-to-point exchange on the world group, not a 2-rank ``new_group``: subgroups
        created next to torch pipelining's own peer warm-up broke gloo on torch 2.11. The peer
        is returned as a global rank, in this rank's replica."""
        count = [True] * len(self.params)
        tie = tie_peer(self.plan, n_layers=layer_count(self.config.model),
                       pipeline_rank=self.pipeline_rank) if self._tied else None
        if tie is None:
            return None, count
        if tie.holds_head:
            head = self._head_weight()
            if head is not None:
                count = [p is not head for p in self.params]
        return self.mesh.rank(replica=self.replica, pipeline_rank=tie.peer,
                              tensor_rank=self.tensor_rank), count

    def _sync_tied(self, peer: int) -> None:
        """Both copies end with embedding grad + head grad (IEEE addition commutes: the two
        ranks compute bit-identical sums, so the copies stay equal after the update)."""
        weight = self._tied_weight()
        if weight is None:
            return
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        grad = local(weight.grad)  # under tensor parallelism: this tensor rank's vocabulary shard
        other = torch.empty_like(grad)
        if self.rank < peer:  # fixed order on both sides: no deadlock on blocking send/recv
            dist.send(grad, dst=peer)
            dist.recv(other, src=peer)
        else:
            dist.recv(other, src=peer)
            dist.send(grad, dst=peer)
        grad.add_(other)

    def _tied_weight(self) -> torch.Tensor | None:
        emb = next((m.embedding_weight for m in self.modules if m.embedding_weight is not None), None)
        return emb if emb is not None else self._head_weight()

    def _head_weight(self) -> torch.Tensor | None:
        return next((m.head_weight for m in self.modules if m.head_weight is not None), None)

    def step(self, batch: Batch | None, *, number: int = 0) -> StepStats:
        """One training step. ``batch`` is needed only on the ranks holding stage 0 or the
        last stage; other ranks may pass None. ``number``: which step of the training this is
        (1-based, as the step events count; 0: not counted), which the action timer sees (a
        testing slowdown starts at a step, a trace records it)."""
        for p in self.params:
            p.grad = None
        self.timer.reset(step=number)
        if self.reducer is not None:
            self.reducer.reset()
        dist.barrier()  # a common start, so iteration time and idle time are comparable
        start = self.started_at = time.perf_counter()
        inputs = batch.inputs.to(self.device) if batch is not None and self.holds_first else None
        targets = batch.targets.to(self.device) if batch is not None and self.holds_last else None
        # The vocabulary-parallel loss's backward runs inside the runtime's step.
        with loss_parallel() if self.tensor_mesh is not None else contextlib.nullcontext():
            self.runtime.step(inputs=inputs, targets=targets)
        for p in self.params:  # tensor parallelism: each gradient laid out as its parameter
            settle_grad(p)
        busy_by_kind = self.timer.collect()
        pipeline_end = time.perf_counter()
        # The replica average first: the tied exchange and the norm need the final gradients
        # (averaging is linear, so averaging each tied copy before adding them is exact).
        reduce_wait = self.reducer.wait() if self.reducer is not None else 0.0
        if self._tied_peer is not None:
            self._sync_tied(self._tied_peer)
        norm = self._clip()
        self.optimizer.step()
        # On the device: NCCL has no CPU collectives.
        local = torch.tensor([self.runtime.loss_sum(), pipeline_end - start, sum(busy_by_kind.values())],
                             dtype=torch.float64, device=self.device)
        gathered = [torch.zeros(3, dtype=torch.float64, device=self.device) for _ in range(self.world_size)]
        dist.all_gather(gathered, local)
        gathered = [g.cpu() for g in gathered]
        step_seconds = time.perf_counter() - start
        return StepStats(
            rank=self.rank,
            # Each replica's loss is the mean over its microbatches (reported by each of its
            # last stage's T tensor ranks); the combined batch's loss is the mean over replicas.
            loss=float(sum(g[0] for g in gathered)) / (self.mesh.replicas * self.mesh.tensor),
            iteration_seconds=float(max(g[1] for g in gathered)),
            step_seconds=step_seconds,
            busy_seconds=tuple(float(g[2]) for g in gathered),
            busy_by_kind=busy_by_kind,
            grad_norm=norm,
            sent_bytes=self.sent_bytes,
            received_bytes=self.received_bytes,
            peak_memory_bytes=self._peak_memory(),
            learning_rate=self._lr,
            reduce_wait_seconds=reduce_wait,
        )

    def _clip(self) -> float:
        """Global gradient norm over the pipeline's ranks (clipped when the job asks); returns
        the norm. Every replica holds the same averaged gradients, so one pipeline suffices.

        Under tensor parallelism the norm is the whole model's, as one process would take it:
        a sharded gradient (a DTensor with a Shard placement) adds its shard's squares on each
        tensor rank, a replicated one (norms, Mamba, router: identical on every tensor rank)
        is counted on tensor rank 0 only; then one sum over the tensor group."""
        sq = torch.zeros(1, dtype=torch.float64, device=self.device)
        for p, counted in zip(self.params, self._count_in_norm, strict=True):
            if counted and p.grad is not None and (self.tensor_rank == 0 or is_sharded(p.grad)):
                sq += local(p.grad).detach().double().pow(2).sum()
        if self.groups.tensor is not None:
            dist.all_reduce(sq, group=self.groups.tensor)
        dist.all_reduce(sq, group=self.groups.pipeline)
        norm = math.sqrt(float(sq.item()))
        clip = self.config.training.grad_clip
        if clip is not None and norm > clip:
            coef = clip / (norm + 1e-6)
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(coef)
        return norm

    def _peak_memory(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB

    def named_parameters(self) -> dict[str, nn.Parameter]:
        """Parameters by partition-independent name, as the reference model names them: the
        zoo's ``<global layer index>.<name inside the layer>``
        (:func:`adaptis.worker.models.zoo.layer_parameters`), a Hugging Face model's transformers
        names. A weight tied across two local stages keeps both names or one, as the reference
        does (``names_tied_weight_once``)."""
        out: dict[str, nn.Parameter] = {}
        for module in self.modules:
            seen = {id(p) for p in out.values()} if module.names_tied_weight_once else set()
            out.update({k: p for k, p in module.global_parameters().items() if id(p) not in seen})
        return out
