"""The mixture of experts of the MoE block, with its load-balancing loss made pipeline-safe.

Sits under :mod:`adaptis.worker.models.layers` (whose ``MoEBlock`` wraps it). A top-k router sends
each token to ``top_k`` of ``experts`` MLPs. The auxiliary load-balancing loss is the
Switch/Megatron one: ``aux = experts / top_k * sum_e f_e * P_e`` (``f_e`` the fraction of the
tokens routed to expert ``e``, ``P_e`` its mean router probability), 1.0 when perfectly
balanced; the training loss gains ``auxLossCoef * aux`` per microbatch (with the same
``1/microbatches`` scale as the token loss).

Why a custom autograd function: in a pipeline the MoE layer sits in a stage that never sees
the final loss, so its aux loss cannot simply be added to it. :class:`_AttachAuxLoss` returns
the layer's output unchanged and, when the output's gradient arrives in the backward, also
sends ``coef * scale`` as the gradient of ``aux``: the router receives ``d(coef * scale * aux)``
exactly as if the term had been added to the loss (the Megatron-LM approach). The reference
model instead *collects* the aux losses and adds them to its loss explicitly
(:attr:`MixtureOfExperts.collected`), so parity tests compare two independent routes.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ExpertSharding", "MixtureOfExperts", "load_balancing_loss"]


class ExpertSharding(Protocol):
    """What sharded experts need of the tensor group (the runtime's
    :class:`adaptis.worker.runtime.tensor_parallel.DTensorExperts`): a model holds no process
    group of its own, so its collectives are handed in."""

    def local(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's shard of an expert weight."""

    def reduce_in_backward(self, t: torch.Tensor) -> torch.Tensor:
        """Identity forward; the gradient summed over the tensor group."""

    def sum_partials(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor group's sum of the ranks' partial ``t``."""


def load_balancing_loss(*, probs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """``experts / top_k * sum_e f_e * P_e`` over the tokens of ``probs`` ``[tokens, experts]``
    with ``chosen`` ``[tokens, top_k]`` their experts. The counts carry no gradient (the
    routing is discrete); the gradient reaches the router through ``P``."""
    tokens, experts = probs.shape
    top_k = chosen.shape[-1]
    counts = F.one_hot(chosen, experts).sum(dim=(0, 1)).to(probs.dtype)
    return experts / top_k * torch.sum(counts / tokens * probs.mean(dim=0))


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``output``; in the backward, ``weight`` becomes the gradient of ``aux``."""

    @staticmethod
    def forward(  # noqa: PLR0917 - autograd.Function.apply passes its inputs positionally only
            ctx: Any, output: torch.Tensor, aux: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight = weight
        ctx.aux_meta = (aux.dtype, aux.device)
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        dtype, device = ctx.aux_meta
        return grad_output, torch.tensor(ctx.weight, dtype=dtype, device=device), None


class MixtureOfExperts(nn.Module):
    """Top-k routed experts (gelu or swiglu MLPs of width ``inner``). Every expert runs
    (possibly on zero tokens) so that every parameter is in the autograd graph of every
    microbatch: gradients are zeros, never missing.

    ``aux_grad_scale`` is the per-microbatch loss scale (``1/microbatches``; the executor and
    the reference set it); ``collected``, when a list, receives each forward's aux loss
    instead of attaching its gradient to the output."""

    def __init__(self, *, hidden: int, experts: int, top_k: int, inner: int, mlp: str = "gelu",
                 aux_loss_coef: float = 0.0) -> None:
        super().__init__()
        self.top_k = min(top_k, experts)
        self.mlp = mlp
        self.aux_loss_coef = aux_loss_coef
        self.aux_grad_scale = 1.0
        self.collected: list[torch.Tensor] | None = None
        #: Set once the experts are sharded on their inner width over a tensor group
        #: (:mod:`adaptis.worker.runtime.tensor_parallel`); None: whole experts.
        self.sharding: ExpertSharding | None = None
        self.router = nn.Linear(hidden, experts, bias=False)
        self.w_up = nn.Parameter(torch.empty(experts, hidden, inner))
        if mlp == "swiglu":
            self.w_gate = nn.Parameter(torch.empty(experts, hidden, inner))
        self.w_down = nn.Parameter(torch.empty(experts, inner, hidden))

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        # Under tensor parallelism the weights are DTensor shards of the inner width: the
        # expert computes on this rank's slice, its output is a partial sum.
        local = self.sharding.local if self.sharding is not None else _whole
        up, down = local(self.w_up)[e], local(self.w_down)[e]
        if self.mlp == "swiglu":
            return (F.silu(x @ local(self.w_gate)[e]) * (x @ up)) @ down
        return F.gelu(x @ up) @ down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = torch.softmax(self.router(flat), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        xe, we = flat, weights
        if self.sharding is not None:
            # Each rank's experts see a shard: the gradients of their inputs and of the routing
            # weights are partial, summed over the tensor group in the backward.
            xe = self.sharding.reduce_in_backward(flat)
            we = self.sharding.reduce_in_backward(weights)
        out = torch.zeros_like(flat)
        for e in range(self.w_up.shape[0]):
            token, slot = torch.nonzero(chosen == e, as_tuple=True)
            routed = self._expert(e, xe[token]) * we[token, slot].unsqueeze(-1)
            out = out.index_add(0, token, routed)
        if self.sharding is not None:
            out = self.sharding.sum_partials(out)  # one all-reduce for every expert
        out = out.view(shape)
        if self.aux_loss_coef > 0 and torch.is_grad_enabled():
            aux = load_balancing_loss(probs=probs, chosen=chosen)
            if self.collected is not None:
                self.collected.append(aux)
            else:
                out = _AttachAuxLoss.apply(out, aux, self.aux_loss_coef * self.aux_grad_scale)
        return out


def _whole(weight: torch.Tensor) -> torch.Tensor:
    return weight
