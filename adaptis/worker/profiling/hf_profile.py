"""The measured planning problem of a Hugging Face model: each of its layer kinds timed here.

Sits beside :mod:`adaptis.worker.profiling.profiler` (the zoo's layer profiler) and uses its timing
(:func:`adaptis.worker.profiling.module_timing.profile_module`: F, torch's split B and W and the
fused backward, as the executor runs them) on the real modules: one single-layer stage
(:class:`adaptis.worker.models.hf.stages.HFStage`, so the rotary embedding and mask each decoder
layer's stage computes are timed with it) per distinct kind, the embedding, a dense attention layer,
an MoE layer, a Mamba layer, the head with the loss; in the job's precision as the ranks run it
(fp32, or bf16: fp32 weights, the stage under autocast, its output rounded to bf16,
docs/precision.md); with the optimizer step over each kind's parameters and its gradient bytes (the
step after the pipeline, what replicas all-reduce) and the split weight pass's graph walks, as the
zoo's profiler. ``adaptis run`` uses it when the job asks for ``planner.profile: measure``; the
operator and ``--dry-run`` use the estimate (:mod:`adaptis.planner.hf_estimate`).
"""

from __future__ import annotations

import logging

import torch

from adaptis.api.job import JobSpec
from adaptis.api.model import HuggingFaceModel, expect_kind
from adaptis.api.problem import Problem
from adaptis.worker.models.hf.stages import HFStage, build_hf_stages
from adaptis.worker.models.precision import wrap_stage
from adaptis.worker.models.zoo import token_loss
from adaptis.worker.profiling.module_timing import (
    ModuleProfile,
    ProfileSettings,
    measure_action_overhead,
    measure_graph_visit,
    profile_module,
)
from adaptis.worker.profiling.optimizer_timing import gradient_bytes, time_optimizer_step
from adaptis.worker.profiling.profiler import LayerProfile, bytes_per_param, problem_from_profiles

__all__ = ["measure_hf_problem", "profile_hf_layers"]

log = logging.getLogger(__name__)


def profile_hf_layers(spec: JobSpec, *, settings: ProfileSettings) -> list[LayerProfile]:
    """Every layer in pipeline order; each distinct kind measured once (its first layer)."""
    model, train = expect_kind(spec.model, HuggingFaceModel, what="the layer profiler"), spec.training
    layout = model.layout
    names = layout.layer_names
    kinds = ["embedding", *layout.kinds, "head"]
    dev, dtype = settings.device, settings.dtype
    gen = torch.Generator(device=dev).manual_seed(train.seed)
    b, s = train.microbatch_size, train.sequence_length
    tokens = torch.randint(layout.vocab_size, (b, s), generator=gen, device=dev)
    hidden = torch.randn(b, s, layout.hidden, generator=gen, device=dev, dtype=dtype)
    per_param = bytes_per_param(train.optimizer.name)
    measured: dict[str, tuple[ModuleProfile, int, float, int]] = {}
    last = len(kinds) - 1
    for index, kind in enumerate(kinds):
        if kind in measured:
            continue
        stage, = build_hf_stages(model, stages=[(index, index + 1)], seed=train.seed)
        stage = _as_run(stage, settings=settings)
        first = index == 0
        m = profile_module(stage, example=tokens if first else hidden, settings=settings,
                           input_grad=not first,
                           loss=(lambda o: token_loss(o, tokens)) if index == last else None)
        # The step after the pipeline, as the zoo's profiler times it: the job's optimizer over
        # the layer's parameters, and the gradient bytes replicas all-reduce (last: the step
        # changes the weights).
        step_s = time_optimizer_step(stage, optimizer=train.optimizer, settings=settings)
        measured[kind] = (m, sum(p.numel() for p in stage.parameters()) * per_param, step_s,
                          gradient_bytes(stage))
        log.info("profiled %-10s F %.3f ms  B %.3f ms  W %.3f ms  step %.3f ms", kind,
                 m.forward_s * 1e3, m.backward_s * 1e3, m.weight_s * 1e3, step_s * 1e3)
    out: list[LayerProfile] = []
    for name, kind in zip(names, kinds, strict=True):
        m, pb, step_s, grad_b = measured[kind]
        out.append(LayerProfile(
            name=name, kind=kind, forward_s=m.forward_s, backward_s=m.backward_s,
            weight_s=m.weight_s, activation_bytes=m.activation_bytes, param_bytes=pb,
            output_bytes=m.output_bytes, fused_backward_s=m.fused_backward_s,
            graph_nodes=m.graph_nodes, weight_groups=m.weight_groups, optimizer_s=step_s,
            gradient_bytes=grad_b))
    return out


def _as_run(stage: HFStage, *, settings: ProfileSettings) -> torch.nn.Module:
    """The stage as the executor runs it: fp32 itself; bf16 with fp32 weights, the whole stage
    under autocast and its output rounded to bf16 (:mod:`adaptis.worker.models.precision`), so the
    timed region holds the casts the ranks pay and the bytes are bf16's."""
    stage = stage.to(device=settings.device)
    if settings.dtype != torch.bfloat16:
        return stage.to(dtype=settings.dtype)
    return wrap_stage(stage, precision="bf16", recompute=False, device=settings.device)


def measure_hf_problem(spec: JobSpec, *, devices: int, repeats: int = 3,
                       precision: str = "fp32") -> Problem:
    """The planning problem from this process's measurements, as ``measure_problem`` makes
    the zoo's (no memory limit), in ``precision`` (bf16: under autocast, as the ranks run)."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    settings = ProfileSettings(warmup=1, repeats=repeats, dtype=dtype)
    return problem_from_profiles(
        profile_hf_layers(spec, settings=settings), name=spec.model.name,
        microbatches=spec.training.microbatches, devices=devices, memory_bytes=None,
        action_overhead_s=measure_action_overhead(settings=settings),
        # The split weight pass's graph walks, on the default blocks (the zoo's profiler times
        # them on its own blocks; these decoder layers are not built by its model_layers).
        graph_visit_s=measure_graph_visit(settings=settings))
