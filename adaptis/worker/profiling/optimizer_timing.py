"""The optimizer step over one layer's parameters, timed: the planning problem's
``Layer.optimizer`` (and ``Layer.gradient_bytes``, what data-parallel replicas all-reduce).

Sits beside :mod:`adaptis.worker.profiling.module_timing` (F, B, W of the same module) under the
layer profiler (:mod:`adaptis.worker.profiling.profiler`). The step is the job's optimizer (AdamW or
SGD, its learning rate and weight decay) over the module's parameters with random gradients, timed
on the device's clock after ``warmup`` untimed steps (AdamW allocates its moments on the first), the
median (or min) of ``repeats``. It is memory-bandwidth bound: its time scales with the parameter
bytes, as :mod:`adaptis.planner.estimate` assumes where nothing is measured.
"""

from __future__ import annotations

import statistics

import torch
from torch import nn

from adaptis.api.job import OptimizerSpec
from adaptis.worker.profiling.hardware import device_clock
from adaptis.worker.profiling.module_timing import ProfileSettings
from adaptis.worker.runtime.components import make_optimizer

__all__ = ["gradient_bytes", "time_optimizer_step"]


def gradient_bytes(module: nn.Module) -> int:
    """Bytes of the module's weight gradient (one element a parameter, of its dtype)."""
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


def time_optimizer_step(module: nn.Module, *, optimizer: OptimizerSpec,
                        settings: ProfileSettings) -> float:
    """Seconds of one optimizer step over ``module``'s parameters (0 without any). Changes the
    parameters: time a module only after everything else about it is measured."""
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        return 0.0
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = make_optimizer(params, optimizer)  # the job's optimizer, as the executor builds it
    clock = device_clock(settings.device)
    warmup = max(1, settings.warmup)  # AdamW's first step allocates its moments: never timed
    times = []
    for i in range(warmup + settings.repeats):
        t = clock(opt.step)
        if i >= warmup:
            times.append(t)
    for p in params:
        p.grad = None
    return min(times) if settings.estimator == "min" else statistics.median(times)
