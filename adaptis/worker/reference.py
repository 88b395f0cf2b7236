"""Single-process training of a whole model: the reference every pipeline must equal.

Sits beside :mod:`adaptis.worker.executor` and is used by the parity tests and the bench. It
runs the same microbatches in the same order with the same per-microbatch loss scaling as a
pipeline step, so the only differences left are floating-point reassociation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adaptis.api.job import ModelSpec, TrainingSpec
from adaptis.worker.data import Batch
from adaptis.worker.models import build_model, layer_parameters, moe_layers, token_loss

__all__ = ["ReferenceResult", "reference_step"]


@dataclass(frozen=True, slots=True)
class ReferenceResult:
    """The batch loss (mean over microbatches) and each parameter's gradient, by global name."""

    loss: float
    grads: dict[str, torch.Tensor]


def reference_step(model: ModelSpec, training: TrainingSpec, *, batch: Batch) -> ReferenceResult:
    """Forward and backward of one batch on one process, microbatch by microbatch.

    MoE load-balancing losses are added to each microbatch's loss explicitly (``auxLossCoef x
    aux / microbatches``): the independent route the pipeline's in-backward attachment
    (:mod:`adaptis.worker.moe`) must equal. The reported loss is the token loss alone, as a
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
