"""A planning problem for a job's model: an analytic estimate, or a quick local measurement.

Sits between the worker's models and the planner's input contract
(:class:`adaptis.api.problem.Problem`). ``estimate_problem`` needs no torch work at all (FLOPs
and bytes from the sizes); ``measure_problem`` times each distinct layer once on this process's
device with the layer profiler (:mod:`adaptis.worker.profiler`; F, B and W as the executor
runs them, few repeats) and is what ``adaptis run`` uses.
"""

from __future__ import annotations

from adaptis.api.job import JobSpec, ModelSpec, TrainingSpec
from adaptis.api.problem import IdenticalDevices, Layer, Problem
from adaptis.worker.models import LayerInfo, model_layers
from adaptis.worker.profiler import (
    ProfileSettings,
    measure_action_overhead,
    measure_graph_visit,
    problem_from_profiles,
    profile_layers,
)

__all__ = ["estimate_problem", "measure_problem"]

_CPU_FLOPS = 2.0e10  # sustained FLOP/s of one CPU core thread in float32 matmuls (rough)
_GPU_FLOPS = 2.0e14  # one modern accelerator, mixed precision (rough)
_STATE_BYTES_PER_PARAM = 16  # fp32 weight + grad + two AdamW moments
_ELEM = 4  # float32


def _param_count(model: ModelSpec, info: LayerInfo) -> int:
    h, v = model.hidden, model.vocab_size
    if info.kind in ("embedding", "head"):
        return v * h + (h if info.kind == "head" else 0)
    attn = 4 * h * h + 2 * h
    if info.kind == "attention":
        return attn + 8 * h * h
    if info.kind == "dense":
        return 8 * h * h + h
    if info.kind == "moe" and info.block is not None:
        return attn + h * info.block.experts + info.block.experts * 4 * h * h
    inner = 2 * h  # mamba
    return h * (2 * inner + 32 + model.heads) + inner * h + 3 * model.heads + 2 * inner + h


def _layer_estimate(model: ModelSpec, training: TrainingSpec, info: LayerInfo, *, flops: float) -> Layer:
    """F, B, W from FLOPs (B and W each as costly as F for matmuls; attention's core only in B)."""
    b, s, h, v = training.microbatch_size, training.sequence_length, model.hidden, model.vocab_size
    tok = b * s
    core = 0.0
    if info.kind == "embedding":
        mm, act = 0.0, tok * h * _ELEM
        fwd = tok * h * 2.0
    elif info.kind == "head":
        mm, act = 2.0 * tok * h * v, 2 * tok * v * _ELEM
        fwd = mm + 5.0 * tok * v
    else:
        mm = 2.0 * tok * (_param_count(model, info) - 4 * h)
        if info.kind == "moe" and info.block is not None:
            experts = info.block.experts * 4 * h * h
            mm = mm - 2.0 * tok * experts + 2.0 * tok * experts * info.block.top_k / info.block.experts
        if info.kind in ("attention", "moe"):
            core = 4.0 * b * s * s * h
            act = tok * h * _ELEM * 16 + b * model.heads * s * s * _ELEM
        elif info.kind == "mamba":
            core = 2.0 * b * model.heads * s * s * (16 + 2 * h / model.heads)
            act = tok * h * _ELEM * 20 + b * model.heads * s * s * _ELEM * 2
        else:
            act = tok * h * _ELEM * 10
        fwd = mm + core
    params = _param_count(model, info)
    return Layer(
        name=info.name, kind=info.kind,
        forward=max(fwd, 1.0) / flops * 1e3,
        backward=(mm + 2.0 * core) / flops * 1e3 if info.kind != "embedding" else 0.0,
        weight=(mm if info.kind != "embedding" else fwd) / flops * 1e3,
        activation_bytes=float(act), param_bytes=float(params * _STATE_BYTES_PER_PARAM),
        output_bytes=float(0 if info.kind == "head" else tok * h * _ELEM),
    )


def _problem(spec: JobSpec, layers: list[Layer], *, devices: int) -> Problem:
    return Problem(
        name=f"{spec.model.blocks[0].kind}-model",
        time_unit="ms",
        microbatches=spec.training.microbatches,
        layers=layers,
        devices=IdenticalDevices(count=devices, per_node=max(devices, 1)),
    )


def estimate_problem(spec: JobSpec, *, devices: int) -> Problem:
    """Layer costs from FLOPs and bytes alone (no torch work): ms on a rough device speed."""
    flops = _GPU_FLOPS if spec.parallelism.gpus_per_worker > 0 else _CPU_FLOPS
    layers = [_layer_estimate(spec.model, spec.training, info, flops=flops)
              for info in model_layers(spec.model)]
    return _problem(spec, layers, devices=devices)


def measure_problem(spec: JobSpec, *, devices: int, repeats: int = 3) -> Problem:
    """Time each distinct layer kind once on this process (current thread count) with the
    layer profiler, as ``adaptis profile`` does, few repeats; no memory limit is set."""
    settings = ProfileSettings(warmup=1, repeats=repeats)
    profiles = profile_layers(spec, settings=settings)
    return problem_from_profiles(profiles, name=f"{spec.model.blocks[0].kind}-model",
                                 microbatches=spec.training.microbatches, devices=devices, memory_bytes=None,
                                 action_overhead_s=measure_action_overhead(settings=settings),
                                 graph_visit_s=measure_graph_visit(settings=settings, spec=spec))
