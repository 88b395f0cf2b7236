"""The executor's parts, each built from its own slice of the configuration.

Sits under :mod:`adaptis.worker.runtime.executor`, which assembles one rank from them (the mesh
and groups from :mod:`adaptis.worker.runtime.replicas`, the stages from
:mod:`adaptis.worker.models.build`, and these): the optimizer from the job's optimizer spec, the
ZeRO stage and this rank's replica group; the gradient reducer from the plan's actions and the
rank's stages; the action timer from the device and the process environment (the testing knobs
live there, not in the step loop). The layer profiler
(:mod:`adaptis.worker.profiling.optimizer_timing`) builds its optimizer here too, so the step it
times is the one the job runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from adaptis.api.job import OptimizerSpec
from adaptis.api.mesh import Mesh
from adaptis.api.plan import Action
from adaptis.worker.runtime.ownership import reducing_stage
from adaptis.worker.runtime.replicas import GradReducer, ZeroOptimizer
from adaptis.worker.runtime.slowdown import slowed
from adaptis.worker.runtime.timers import ActionTimer, device_timer
from adaptis.worker.runtime.trace import traced

__all__ = ["action_timer", "build_optimizer", "build_reducer", "make_optimizer", "unique_params"]


def make_optimizer(params: Sequence[nn.Parameter], spec: OptimizerSpec) -> torch.optim.Optimizer:
    """The job's optimizer (AdamW or SGD, its rate and weight decay) over ``params``.

    One explicit group, even when empty: torch refuses an empty parameter list, which an idle
    rank has (its optimizer then steps nothing, but keeps the rate and a state to checkpoint).
    Sharded (DTensor) parameters get a group of their own: torch's multi-tensor (foreach)
    kernels take one kind of tensor per call."""
    plain = [p for p in params if not isinstance(p, DTensor)]
    sharded = [p for p in params if isinstance(p, DTensor)]
    groups: list[dict[str, Any]] = [{"params": plain}]
    if sharded:
        groups.append({"params": sharded})
    if spec.name == "sgd":
        return torch.optim.SGD(groups, lr=spec.lr, weight_decay=spec.weight_decay)
    return torch.optim.AdamW(groups, lr=spec.lr, weight_decay=spec.weight_decay)


def build_optimizer(params: list[nn.Parameter], *, spec: OptimizerSpec, zero_stage: int, mesh: Mesh,
                    rank: int, replica_group: dist.ProcessGroup | None) -> torch.optim.Optimizer | ZeroOptimizer:
    """The training optimizer over this rank's parameters; ZeRO-1 shards its state across the
    replicas when asked and there are replicas to shard over."""
    if zero_stage == 1 and mesh.replicas > 1:
        # Looked up at each call, so a test may stand in a slower optimizer for one rank.
        return ZeroOptimizer(params, make=lambda ps: make_optimizer(ps, spec), mesh=mesh, rank=rank,
                             group=replica_group)
    return make_optimizer(params, spec)


def build_reducer(*, params: list[nn.Parameter], actions: Sequence[Action], stage_ids: list[int],
                  modules: list[nn.Module], mesh: Mesh,
                  replica_group: dist.ProcessGroup | None) -> GradReducer | None:
    """With replicas, the reducer that starts each parameter's all-reduce when its reducing
    stage (:func:`adaptis.worker.runtime.ownership.reducing_stage`) finishes its backward; None
    without replicas."""
    if mesh.replicas == 1:
        return None
    owner = reducing_stage(actions, stage_ids=stage_ids, modules=modules)
    by_stage: dict[int, list[nn.Parameter]] = {sid: [] for sid in stage_ids}
    for p in params:
        by_stage[owner[id(p)]].append(p)
    return GradReducer(stage_params=by_stage, group=replica_group, replicas=mesh.replicas)


def action_timer(*, rank: int, device: torch.device, environ: Mapping[str, str]) -> ActionTimer:
    """The timer of rank ``rank``'s actions: the device's clock, slowed by ADAPTIS_SLOWDOWN (a
    testing knob, :mod:`adaptis.worker.runtime.slowdown`: this rank as a slower device) and traced
    to a file per rank by ADAPTIS_TRACE (``adaptis run --trace``) when ``environ`` sets them."""
    env = dict(environ)
    timer = device_timer(device)
    timer = slowed(timer, rank=rank, environ=env, sync=torch.cuda.synchronize if device.type == "cuda" else None)
    return traced(timer, rank=rank, environ=env, device=device)


def unique_params(modules: list[nn.Module]) -> list[nn.Parameter]:
    """The modules' parameters, each once (a weight tied across two local stages is one)."""
    seen: set[int] = set()
    out: list[nn.Parameter] = []
    for module in modules:
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out
