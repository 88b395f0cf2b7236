"""Single-process training of a whole model: the reference every pipeline must equal.

Sits beside :mod:`adaptis.worker.runtime.executor` and is used by the parity tests and the bench. It
runs the same microbatches in the same order with the same per-microbatch loss scaling as a
pipeline step, so the only differences left are floating-point reassociation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from adaptis.api.job import TrainingSpec
from adaptis.api.model import ZooModel
from adaptis.worker.data.sources import Batch, DataSource
from adaptis.worker.models.zoo import build_model, layer_parameters, moe_layers, token_loss

__all__ = ["ReferenceResult", "TrainedReference", "reference_step", "reference_train"]


@dataclass(frozen=True, slots=True)
class ReferenceResult:
    """The batch loss (mean over microbatches) and each parameter's gradient, by global name."""

    loss: float
    grads: dict[str, torch.Tensor]


def reference_step(model: ZooModel, training: TrainingSpec, *, batch: Batch) -> ReferenceResult:
    """Forward and backward of one batch on one process, microbatch by microbatch.

    MoE load-balancing losses are added to each microbatch's loss explicitly (``auxLossCoef x
    aux / microbatches``): the independent route the pipeline's in-backward attachment
    (:mod:`adaptis.worker.models.moe`) must equal. The reported loss is the token loss alone, as a
    pipeline step reports it."""
    net = build_model(model, seed=training.seed)
    moes = moe_layers([net])
    for moe in moes:
        moe.collected = []  # collect instead of attaching: this loss adds them itself
    m, b = training.microbatches, training.microbatch_size
    total = 0.0
    for mb in range(m):
        rows = slice(mb * b, (mb + 1) * b)
        loss = token_loss(net(batch.inputs[rows]), batch.targets[rows], scale=1.0 / m)
        aux = sum((moe.aux_loss_coef * moe.collected.pop() for moe in moes if moe.collected),
                  start=torch.zeros(()))
        (loss + aux / m).backward()
        total += float(loss.detach())
    grads = {
        name: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for name, p in layer_parameters(net).items()
    }
    return ReferenceResult(loss=total, grads=grads)


@dataclass(frozen=True, slots=True)
class TrainedReference:
    """Per-step losses, the last step's gradients and the final weights, by global name."""

    losses: list[float]
    norms: list[float]
    grads: dict[str, torch.Tensor]
    weights: dict[str, torch.Tensor]


def reference_train(model: ZooModel, training: TrainingSpec, *, source: DataSource,
                    steps: int) -> TrainedReference:
    """``steps`` optimizer steps of the whole model on one process, ``training.microbatches``
    microbatches a step read from ``source`` in order: what R data-parallel pipeline replicas
    of ``microbatches / R`` microbatches each must equal. Clipping and the optimizer as the
    executor applies them (norm over the unique parameters, coefficient clip / (norm + 1e-6))."""
    net = build_model(model, seed=training.seed)
    params = list(dict.fromkeys(net.parameters()))  # the tied weight once
    opt = training.optimizer
    optim = (torch.optim.SGD(params, lr=opt.lr, weight_decay=opt.weight_decay) if opt.name == "sgd"
             else torch.optim.AdamW(params, lr=opt.lr, weight_decay=opt.weight_decay))
    m, b = training.microbatches, training.microbatch_size
    losses: list[float] = []
    norms: list[float] = []
    grads: dict[str, torch.Tensor] = {}
    for step in range(steps):
        for p in params:
            p.grad = None
        batch = source.batch(position=step * m * b, sequences=m * b)
        total = 0.0
        for mb in range(m):
            rows = slice(mb * b, (mb + 1) * b)
            loss = token_loss(net(batch.inputs[rows]), batch.targets[rows], scale=1.0 / m)
            loss.backward()
            total += float(loss.detach())
        grads = {name: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
                 for name, p in layer_parameters(net).items()}
        norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params if p.grad is not None))
        clip = training.grad_clip
        if clip is not None and norm > clip:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(clip / (norm + 1e-6))
        optim.step()
        losses.append(total)
        norms.append(norm)
    weights = {name: p.detach().clone() for name, p in layer_parameters(net).items()}
    return TrainedReference(losses=losses, norms=norms, grads=grads, weights=weights)
