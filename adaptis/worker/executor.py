"""The unified pipeline executor: one rank of a plan, trained step by step.

Sits between the worker's run loop (:mod:`adaptis.worker.runner`) and the torch adapter
(:mod:`adaptis.worker.pipelining`). Given the worker configuration and the process group, it
builds this rank's stage modules (seeded, so weights do not depend on the partition), runs the
plan's actions for a batch, then does what a pipeline step needs around them: the tied
embedding gradient sync between the ranks holding embedding and head, global gradient-norm
clipping across ranks, the optimizer step, and per-step statistics shared by every rank
(loss, busy time of each rank, the iteration time) with a single all-gather.
"""

from __future__ import annotations

import logging
import math
import resource
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from adaptis.api.errors import SpecError
from adaptis.api.hf_model import hf_layout
from adaptis.api.job import WorkerConfig
from adaptis.api.plan import Plan
from adaptis.api.rules import layer_count
from adaptis.worker.data import Batch
from adaptis.worker.errors import PlanMismatchError
from adaptis.worker.hf_stages import HFStage, build_hf_stages
from adaptis.worker.layers import Embedding, Head
from adaptis.worker.models import (
    StageModule,
    build_stages,
    find_layer,
    layer_parameters,
    token_loss,
)
from adaptis.worker.pipelining import (
    ActionTimer,
    CudaActionTimer,
    PipelineRuntime,
    StageShapes,
    WallActionTimer,
)

__all__ = ["Executor", "StepStats", "transfer_bytes", "parse_plan"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepStats:
    """One step as every rank sees it (identical on all ranks but for ``rank``)."""

    rank: int
    loss: float
    iteration_seconds: float  # pipeline part, barrier to the last rank's end
    step_seconds: float  # whole step on this rank, optimizer included
    busy_seconds: tuple[float, ...]  # per rank
    busy_by_kind: dict[str, float]  # this rank
    grad_norm: float
    sent_bytes: int
    received_bytes: int
    peak_memory_bytes: int

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

    def __init__(self, config: WorkerConfig, *, rank: int, world_size: int, device: torch.device) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.plan = parse_plan(config, world_size=world_size)
        spec, train = config.model, config.training
        self.stage_ids = sorted(self.plan.placement[rank])
        ranges = [tuple(self.plan.stages[s]) for s in self.stage_ids]
        # A Hugging Face model's stages come from its own modules (adaptis.worker.hf_stages).
        build = build_hf_stages if spec.huggingface is not None else build_stages
        self.modules: list[nn.Module] = [
            m.to(device) for m in build(spec, stages=ranges, seed=train.seed)  # type: ignore[arg-type]
        ]
        hidden, vocab, self._tied = _dims(config)
        self.params = _unique_params(self.modules)
        self._tied_peer, self._count_in_norm = self._tie_embeddings()
        self.optimizer = _optimizer(self.params, config)
        self.timer: ActionTimer = CudaActionTimer() if device.type == "cuda" else WallActionTimer()
        m = train.microbatches
        shapes = StageShapes(microbatch_size=train.microbatch_size, sequence_length=train.sequence_length,
                             hidden=hidden, vocab_size=vocab, device=device)
        self.runtime = PipelineRuntime(
            modules=self.modules, stage_ids=self.stage_ids, num_stages=len(self.plan.stages),
            actions=[[(k, s, mb) for k, s, mb in acts] for acts in self.plan.actions],
            microbatches=m, shapes=shapes, timer=self.timer,
            loss_fn=lambda out, tgt: token_loss(out, tgt, scale=1.0 / m),
        )
        act = train.microbatch_size * train.sequence_length * hidden * 4
        self.sent_bytes, self.received_bytes = transfer_bytes(self.plan, rank=rank, activation_bytes=act)

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
        created next to torch pipelining's own peer warm-up broke gloo on torch 2.11."""
        count = [True] * len(self.params)
        if not self._tied:
            return None, count
        owner = self.plan.stage_device()
        n_layers = layer_count(self.config.model)
        first = next(s for s, (lo, _hi) in enumerate(self.plan.stages) if lo == 0)
        last = next(s for s, (_lo, hi) in enumerate(self.plan.stages) if hi == n_layers)
        emb_rank, head_rank = owner[first], owner[last]
        if emb_rank == head_rank or self.rank not in (emb_rank, head_rank):
            return None, count  # same rank: one Parameter, shared by build_stages
        if self.rank == head_rank:
            head = self._head_weight()
            if head is not None:
                count = [p is not head for p in self.params]
        return (head_rank if self.rank == emb_rank else emb_rank), count

    def _sync_tied(self, peer: int) -> None:
        """Both copies end with embedding grad + head grad (IEEE addition commutes: the two
        ranks compute bit-identical sums, so the copies stay equal after the update)."""
        weight = self._tied_weight()
        if weight is None:
            return
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        other = torch.empty_like(weight.grad)
        if self.rank < peer:  # fixed order on both sides: no deadlock on blocking send/recv
            dist.send(weight.grad, dst=peer)
            dist.recv(other, src=peer)
        else:
            dist.recv(other, src=peer)
            dist.send(weight.grad, dst=peer)
        weight.grad.add_(other)

    def _tied_weight(self) -> torch.Tensor | None:
        for m in self.modules:
            if isinstance(m, HFStage) and m.embed_tokens is not None:
                return m.embed_tokens.weight
        emb = find_layer(self.modules, Embedding)
        return emb.weight if emb is not None else self._head_weight()

    def _head_weight(self) -> torch.Tensor | None:
        for m in self.modules:
            if isinstance(m, HFStage) and m.lm_head is not None:
                return m.lm_head.weight
        head = find_layer(self.modules, Head)
        return head.weight if head is not None else None

    def step(self, batch: Batch | None) -> StepStats:
        """One training step. ``batch`` is needed only on the ranks holding stage 0 or the
        last stage; other ranks may pass None."""
        for p in self.params:
            p.grad = None
        self.timer.reset()
        dist.barrier()  # a common start, so iteration time and idle time are comparable
        start = time.perf_counter()
        inputs = batch.inputs.to(self.device) if batch is not None and self.holds_first else None
        targets = batch.targets.to(self.device) if batch is not None and self.holds_last else None
        self.runtime.step(inputs=inputs, targets=targets)
        busy_by_kind = self.timer.collect()
        pipeline_end = time.perf_counter()
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
            loss=float(sum(g[0] for g in gathered)),
            iteration_seconds=float(max(g[1] for g in gathered)),
            step_seconds=step_seconds,
            busy_seconds=tuple(float(g[2]) for g in gathered),
            busy_by_kind=busy_by_kind,
            grad_norm=norm,
            sent_bytes=self.sent_bytes,
            received_bytes=self.received_bytes,
            peak_memory_bytes=self._peak_memory(),
        )

    def _clip(self) -> float:
        """Global gradient norm over all ranks (clipped when the job asks); returns the norm."""
        sq = torch.zeros(1, dtype=torch.float64, device=self.device)
        for p, counted in zip(self.params, self._count_in_norm, strict=True):
            if counted and p.grad is not None:
                sq += p.grad.detach().double().pow(2).sum()
        dist.all_reduce(sq)
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
        """Parameters named ``<global layer index>.<name inside the layer>``, as the reference
        model names them (see :func:`adaptis.worker.models.layer_parameters`)."""
        out: dict[str, nn.Parameter] = {}
        for module in self.modules:
            if isinstance(module, StageModule):
                out.update(layer_parameters(module))
            elif isinstance(module, HFStage):  # by transformers' names; a shared tie once
                seen = {id(p) for p in out.values()}
                out.update({k: p for k, p in module.hf_parameters().items() if id(p) not in seen})
        return out


def _dims(config: WorkerConfig) -> tuple[int, int, bool]:
    """Hidden size, vocabulary and tied embeddings of the zoo model or the Hugging Face one."""
    spec = config.model
    if spec.huggingface is not None:
        layout = hf_layout(spec.huggingface)
        return layout.hidden, layout.vocab_size, layout.tied
    return spec.hidden, spec.vocab_size, spec.tie_embeddings  # type: ignore[return-value]


def _unique_params(modules: list[nn.Module]) -> list[nn.Parameter]:
    seen: set[int] = set()
    out: list[nn.Parameter] = []
    for module in modules:
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def _optimizer(params: list[nn.Parameter], config: WorkerConfig) -> torch.optim.Optimizer:
    opt = config.training.optimizer
    if opt.name == "sgd":
        return torch.optim.SGD(params, lr=opt.lr, weight_decay=opt.weight_decay)
    return torch.optim.AdamW(params, lr=opt.lr, weight_decay=opt.weight_decay)
