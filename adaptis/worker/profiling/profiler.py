"""The layer profiler: measure each distinct layer of a job's model into a planning problem.

Sits in the worker layer between the model zoo (:mod:`adaptis.worker.models.zoo`, whose modules it
times, so what is profiled is what is trained) and the planner's input contract
(:class:`adaptis.api.problem.Problem`, docs/problem.md); ``adaptis profile`` is its CLI face;
:mod:`adaptis.worker.profiling.job_problem`'s ``measure_problem`` (what ``adaptis run`` uses) calls
it with few repeats, next to its FLOP-count estimate.

For every distinct layer kind (embedding, head, each block kind with its expert settings) at
the job's microbatch size and sequence length, on one device, in one precision (fp32, or bf16
as the ranks run it: fp32 weights, the forward under bf16 autocast inside the timed region,
bf16 activations between layers; docs/precision.md):

- **F**: the forward with autograd recording (as training runs it; the head includes the loss).
- **B** and **W**: torch's split backward exactly as the executor runs it for split plans:
  its input pass (``stage_backward_input``: input gradients, the intermediate gradients kept)
  then its weight pass (``stage_backward_weight``), through the adapter
  (:mod:`adaptis.worker.runtime.pipelining`). The first layer takes token ids: B is 0 and W its
  fused backward, as torch's first stage runs it.
- **fused backward**: torch's one-pass ``stage_backward`` (a plan's ``BW``), written as the
  problem's optional ``backward_fused``: the split passes cost more than the fused one (+36-44 %
  on Mamba and dense blocks on CPU: the input pass walks the graph once more to find what W
  needs), so the planner charges BW actions the fused time and can choose, per plan, whether
  splitting the backward pays for itself.
- **per-action overhead** (``action_overhead_s``): :func:`measure_action_overhead`.
- **the weight pass's graph walks** (``weight_groups``, ``graph_walk``): torch's split weight pass
  makes one autograd call per parameter group, and each call walks the autograd graph of every
  earlier layer of its stage, so a deep stage's W costs more than its layers' sum (quadratic in
  depth: +30-60 % on 8 Mamba blocks on CPU). Each layer's nodes and groups are counted on its graph
  (:func:`adaptis.worker.runtime.pipelining.weight_pass_graph`) and the time per node walked is
  measured on the job's own blocks (:func:`measure_graph_visit`).
- each timed with ``warmup`` untimed runs then the median (or min) of ``repeats``, on the device's own
  clock (CUDA events; ``perf_counter`` on CPU, where compute is synchronous), by
  :mod:`adaptis.worker.profiling.module_timing` (whose names this module re-exports).
- **activation bytes**: unique storages autograd saves in the forward
  (``saved_tensors_hooks``; parameters excluded), plus the output of every module that owns
  parameters: the gradient there is what a B/W split keeps from B until W.
- **param bytes**: parameters x bytes per parameter of the optimizer: AdamW 16 (weight,
  grad, two moments in fp32; with bf16 weights+grads plus an fp32 master copy it is also
  2 + 2 + 4 + 8 = 16), SGD 8 (weight and grad; fp32 or bf16 plus master).
- **output bytes**: the layer's output (0 for the head: only the scalar loss leaves it).
- **optimizer** and **gradient bytes**: one step of the job's optimizer over the layer's parameters,
  and their gradient's bytes (:mod:`adaptis.worker.profiling.optimizer_timing`): the step after the
  pipeline, and what data-parallel replicas all-reduce.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from adaptis.api.job import JobSpec
from adaptis.api.model import ZooModel, expect_kind
from adaptis.api.problem import IdenticalDevices, Layer, Network, Problem
from adaptis.worker.errors import WorkerError
from adaptis.worker.models.precision import wrap_stage
from adaptis.worker.models.zoo import LayerInfo, StageModule, build_layer, model_layers, token_loss
from adaptis.worker.profiling.contention import co_runner_count, co_runners
from adaptis.worker.profiling.module_timing import (
    ModuleProfile,
    ProfileSettings,
    measure_action_overhead,
    measure_graph_visit,
    profile_module,
)
from adaptis.worker.profiling.optimizer_timing import gradient_bytes, time_optimizer_step

__all__ = [
    "LayerProfile",
    "ModuleProfile",
    "ProfileSettings",
    "bytes_per_param",
    "measure_action_overhead",
    "measure_graph_visit",
    "profile_layers",
    "profile_layers_among_ranks",
    "profile_module",
    "problem_from_profiles",
]

log = logging.getLogger(__name__)

#: Bytes per parameter held all iteration: weight + grad (+ moments) (+ fp32 master), see above.
_BYTES_PER_PARAM = {"adamw": 16, "sgd": 8}


@dataclass(frozen=True, slots=True)
class LayerProfile:
    """One layer's measurement: seconds and bytes of one microbatch."""

    name: str
    kind: str
    forward_s: float
    backward_s: float
    weight_s: float
    activation_bytes: int
    param_bytes: int
    output_bytes: int
    # torch's fused backward (input and weight gradients in one pass): a plan's BW action.
    fused_backward_s: float = 0.0
    # the split weight pass's view of the layer: autograd nodes and parameter groups.
    graph_nodes: int = 0
    weight_groups: int = 0
    # the step after the pipeline: one optimizer step over the layer, its gradient's bytes.
    optimizer_s: float = 0.0
    gradient_bytes: int = 0

    def to_layer(self, *, unit_seconds: float, graph_visit_s: float = 0.0) -> Layer:
        # F must be > 0 in the contract: a layer too fast for the clock still costs a tick.
        def r(x: float) -> float:  # five significant digits: more is clock noise
            return float(f"{x:.5g}")

        return Layer(
            name=self.name, kind=self.kind,
            forward=max(r(self.forward_s / unit_seconds), 1e-6),
            backward=r(self.backward_s / unit_seconds), weight=r(self.weight_s / unit_seconds),
            activation_bytes=float(self.activation_bytes), param_bytes=float(self.param_bytes),
            output_bytes=float(self.output_bytes),
            backward_fused=r(self.fused_backward_s / unit_seconds) if self.fused_backward_s else None,
            weight_groups=self.weight_groups or None,
            graph_walk=(r(self.graph_nodes * graph_visit_s / unit_seconds)
                        if self.graph_nodes and graph_visit_s else None),
            optimizer=r(self.optimizer_s / unit_seconds) if self.optimizer_s else None,
            gradient_bytes=float(self.gradient_bytes) if self.gradient_bytes else None,
        )


def bytes_per_param(optimizer: str) -> int:
    try:
        return _BYTES_PER_PARAM[optimizer]
    except KeyError:
        raise WorkerError(f"profile: no memory rule for optimizer {optimizer!r}") from None


# --- a job's model -----------------------------------------------------------------------------
def _kind_key(info: LayerInfo) -> tuple[str, str]:
    # Blocks of one kind differ when their spec does (experts, topK, ffnHidden, auxLossCoef):
    # the whole block spec but its count is the key, so runs that differ are measured apart.
    spec = info.block.model_dump_json(exclude={"count"}) if info.block is not None else ""
    return (info.kind, spec)


def profile_layers(spec: JobSpec, *, settings: ProfileSettings) -> list[LayerProfile]:
    """Every layer of the model in pipeline order; each distinct kind is measured once per
    round, the times combined over ``settings.rounds`` rounds with the settings' estimator.

    One untimed pass over every kind comes first: a fresh process measured its first pass
    40-50 % slower than the next ones (heap growth, lazy initialisation), whatever the
    per-measurement warm-up, and ``adaptis profile`` and ``adaptis run`` profile in fresh ones."""
    _profile_pass(spec, settings=replace(settings, warmup=0, repeats=1))
    passes = [_profile_pass(spec, settings=settings) for _ in range(settings.rounds)]
    if len(passes) == 1:
        return passes[0]
    pick = min if settings.estimator == "min" else statistics.median
    return [replace(first, **{f: pick(getattr(p[i], f) for p in passes) for f in _TIMES})
            for i, first in enumerate(passes[0])]


def profile_layers_among_ranks(spec: JobSpec, *, settings: ProfileSettings, ranks_on_host: int) -> list[LayerProfile]:
    """:func:`profile_layers` beside the co-runners that stand for the host's other ranks
    (:mod:`adaptis.worker.profiling.contention`; none on a GPU, or as ``settings.co_runners``
    says)."""
    count = co_runner_count(device=settings.device, ranks_on_host=ranks_on_host, asked=settings.co_runners)
    with co_runners(spec, count=count, dtype=settings.dtype):
        return profile_layers(spec, settings=settings)

_TIMES = ("forward_s", "backward_s", "weight_s", "fused_backward_s", "optimizer_s")


def _profile_pass(spec: JobSpec, *, settings: ProfileSettings) -> list[LayerProfile]:
    model, train = expect_kind(spec.model, ZooModel, what="the layer profiler"), spec.training
    infos = model_layers(model)
    b, s, h = train.microbatch_size, train.sequence_length, model.hidden
    dev, dtype = settings.device, settings.dtype
    gen = torch.Generator(device=dev).manual_seed(train.seed)
    tokens = torch.randint(model.vocab_size, (b, s), generator=gen, device=dev)
    hidden = torch.randn(b, s, h, generator=gen, device=dev, dtype=dtype)
    per_param = bytes_per_param(train.optimizer.name)
    cache: dict[tuple[str, str], tuple[ModuleProfile, int, float, int]] = {}
    out: list[LayerProfile] = []
    last = len(infos) - 1
    for index, info in enumerate(infos):
        # The head is measured with the loss; position matters only for embedding and head.
        key = _kind_key(info)
        if key not in cache:
            module = _as_run(build_layer(model, index=index, seed=train.seed), index=index,
                             settings=settings)
            first = index == 0
            m = profile_module(
                module, example=tokens if first else hidden, settings=settings, input_grad=not first,
                loss=(lambda o: token_loss(o, tokens)) if index == last else None,
            )
            n_params = sum(p.numel() for p in module.parameters())
            # Last: the step changes the weights (adaptis.worker.profiling.optimizer_timing).
            step_s = time_optimizer_step(module, optimizer=train.optimizer, settings=settings)
            cache[key] = (m, n_params * per_param, step_s, gradient_bytes(module))
            log.info("profiled %-10s F %.3f ms  B %.3f ms  W %.3f ms  fused %.3f ms  act %.3g B", info.kind,
                     m.forward_s * 1e3, m.backward_s * 1e3, m.weight_s * 1e3, m.fused_backward_s * 1e3,
                     m.activation_bytes)
            del module
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        m, pb, step_s, grad_b = cache[key]
        out.append(LayerProfile(name=info.name, kind=info.kind, forward_s=m.forward_s, backward_s=m.backward_s,
                                weight_s=m.weight_s, activation_bytes=m.activation_bytes, param_bytes=pb,
                                output_bytes=m.output_bytes, fused_backward_s=m.fused_backward_s,
                                graph_nodes=m.graph_nodes, weight_groups=m.weight_groups,
                                optimizer_s=step_s, gradient_bytes=grad_b))
    return out


def _as_run(layer: torch.nn.Module, *, index: int, settings: ProfileSettings) -> torch.nn.Module:
    """The layer as the executor runs it: in fp32 itself; in bf16 with fp32 weights, its forward
    under autocast and its output rounded to bf16 (:mod:`adaptis.worker.models.precision`), so the
    timed region includes the autocast casts the ranks pay."""
    layer = layer.to(device=settings.device)
    if settings.dtype != torch.bfloat16:
        return layer.to(dtype=settings.dtype)
    return wrap_stage(StageModule([layer], lo=index, hi=index + 1), precision="bf16",
                      recompute=False, device=settings.device)


def problem_from_profiles(profiles: Sequence[LayerProfile], *, name: str, microbatches: int, devices: int,
                          memory_bytes: float | None, speed: float = 1.0, per_node: int | None = None,
                          network: Network | None = None, action_overhead_s: float = 0.0,
                          graph_visit_s: float = 0.0) -> Problem:
    """The planning problem (time unit ms) of measured layers on ``devices`` identical devices."""
    if devices < 1:
        raise WorkerError(f"profile: devices must be >= 1, got {devices}")
    return Problem(
        name=name, time_unit="ms", microbatches=microbatches,
        layers=[p.to_layer(unit_seconds=1e-3, graph_visit_s=graph_visit_s) for p in profiles],
        devices=IdenticalDevices(count=devices, per_node=per_node or devices, memory_bytes=memory_bytes,
                                 speed=speed),
        network=network or Network(),
        action_overhead_s=float(f"{max(action_overhead_s, 0.0):.3g}"),
    )


