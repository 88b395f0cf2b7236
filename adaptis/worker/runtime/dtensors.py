"""The DTensor conversions tensor parallelism needs outside ``parallelize_module``: a shard's
local part, whole tensors gathered and resharded by name (checkpoints), gradients laid out as
their parameters, and Megatron's two conjugate collectives (``f`` and ``g``).

Sits at the bottom of :mod:`adaptis.worker.runtime`: the sharded MoE experts (whose 3-D weights
no ``ParallelStyle`` covers; :mod:`adaptis.worker.runtime.tensor_parallel` hands them these) and
the executor's gradient arithmetic use them. Each is torch's
own collective (a DTensor redistribution), not a hand-written one.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

__all__ = ["gathered", "is_sharded", "like_parameter", "local", "reduce_in_backward", "settle_grad",
           "shard_like", "sum_partials"]


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (``t`` itself when it is not a DTensor); shares its storage."""
    return t.to_local() if isinstance(t, DTensor) else t


def gathered(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole: a DTensor's shards gathered (collective over its mesh), else ``t``."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def shard_like(param: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """The whole tensor ``whole`` laid out as ``param`` is: this rank's shard as a DTensor of
    ``param``'s mesh and placements (sliced here, no communication), else ``whole`` itself."""
    if isinstance(param, DTensor):
        return distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)
    return whole


def is_sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is split over its mesh (each rank holds a different part)."""
    return isinstance(t, DTensor) and any(p.is_shard() for p in t.placements)


def settle_grad(param: torch.Tensor) -> torch.Tensor | None:
    """``param.grad``, laid out as ``param`` is (set so in place): autograd may leave a DTensor
    parameter's gradient with other placements (the vocabulary-parallel loss leaves the head's
    replicated), and every reduction, exchange and update here works on matching local parts.
    Replicated to sharded is a local slice; from partial it is a reduce-scatter, so the ranks of
    a tensor group settle the same parameters in the same order."""
    grad = param.grad
    if isinstance(param, DTensor) and isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad = grad.redistribute(param.device_mesh, param.placements)
    return grad


def like_parameter(param: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """``part`` (this rank's local values) laid out as ``param`` is: a DTensor of the same mesh
    and placements when ``param`` is one (a gradient written back after a reduction)."""
    if isinstance(param, DTensor):
        return DTensor.from_local(part, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return part


def reduce_in_backward(t: torch.Tensor, *, mesh: DeviceMesh) -> torch.Tensor:
    """Identity in the forward; the gradient that comes back is summed over the tensor group
    (Megatron's ``f``): for a replicated input whose use on each rank sees one shard."""
    return DTensor.from_local(t, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def sum_partials(t: torch.Tensor, *, mesh: DeviceMesh) -> torch.Tensor:
    """The sum over the tensor group of each rank's partial ``t`` (Megatron's ``g``); its
    gradient passes back whole."""
    return DTensor.from_local(t, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()
