"""The layout space: every data x pipeline x tensor mesh and microbatching of a GPU budget, and
the planning problem of each, with the cheap figures that prune it (memory floor, step bound).

Sits under :mod:`adaptis.planner.layout` (which ranks the layouts this module lists) and over
:mod:`adaptis.planner.costs`, :mod:`adaptis.planner.tensor_parallel` and the lower bounds of
:mod:`adaptis.planner.strategies`. A layout is ``R`` data-parallel replicas of a pipeline of
``P`` devices, each device a tensor group of ``T`` GPUs (``R x P x T`` GPUs), running ``M``
microbatches of ``m`` sequences per replica (``M x m x R`` = the global batch).

The problem a layout is planned as (:func:`layout_problem`) is the user's problem with:

- ``devices``: ``P`` identical devices of the problem's kind (its memory, speed), ``per_node
  // T`` of them a node (a tensor group never leaves its node: ``T`` divides ``per_node``);
- ``tensor_parallel: T``, every layer's ``tensor_split`` and ``tensor_all_reduces`` set from
  its kind where it does not say (:func:`adaptis.planner.tensor_parallel.mark_by_kind`), and
  the problem's ``sequence_parallel`` kept where ``T > 1``;
- ``data_parallel: R``, the replicas' all-reduce over ``network.data_parallel`` if given, else
  the intra-node link when the whole layout fits in one node, the inter-node link otherwise;
- ``microbatches: M`` and every layer's times, activation and output bytes scaled by ``m``
  over the profiled microbatch size (linear in tokens: a larger microbatch's better kernel
  efficiency is not modelled, only the per-action overhead it amortises); parameters,
  gradients and the optimizer step do not change with ``m``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from adaptis.api.problem import IdenticalDevices, Layer, Link, Problem
from adaptis.planner.costs import Costs
from adaptis.planner.errors import LayoutError
from adaptis.planner.reasons import show_bytes
from adaptis.planner.tensor_parallel import mark_by_kind

__all__ = ["Layout", "check_base", "enumerate_layouts", "layout_problem", "memory_floor", "step_bound"]

# The simulator lets a device exceed its memory by this fraction (adaptis.planner.reasons).
_MEMORY_SLACK = 1e-9
# The granularity term of the lower bound bisects within this many seconds per layout.
_BOUND_SECONDS = 0.2


@dataclass(frozen=True, slots=True)
class Layout:
    """One mesh and microbatching: ``R x P x T`` GPUs, ``M`` microbatches of ``m`` sequences."""

    data_parallel: int
    pipeline: int
    tensor: int
    microbatch_size: int
    microbatches: int

    @property
    def gpus(self) -> int:
        return self.data_parallel * self.pipeline * self.tensor

    @property
    def global_batch(self) -> int:
        return self.microbatches * self.microbatch_size * self.data_parallel

    def label(self) -> str:
        return (f"R{self.data_parallel} P{self.pipeline} T{self.tensor} "
                f"m{self.microbatch_size} M{self.microbatches}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_base(problem: Problem) -> IdenticalDevices:
    """The problem's device kind; a :class:`LayoutError` for a heterogeneous device list."""
    if not isinstance(problem.devices, IdenticalDevices):
        raise LayoutError("devices", "the layout search takes one device kind (devices: {count, "
                          "per_node, memory_bytes, speed}); a heterogeneous list is not searched "
                          "yet: plan it without --gpus")
    return problem.devices


def enumerate_layouts(problem: Problem, *, gpus: int, global_batch: int, min_gpus: int | None = None,
                      microbatch_sizes: tuple[int, ...] | None = None,
                      tensor_widths: Mapping[str, int] | None = None) -> list[Layout]:
    """Every layout of ``min_gpus..gpus`` GPUs (default exactly ``gpus``) with ``M x m x R =
    global_batch``: ``T`` divides the GPUs per node and every ``tensor_widths`` value (heads,
    key/value heads, vocabulary, MLP width: every tensor rank holds an equal share), ``P`` is
    at most the layers, ``m`` one of ``microbatch_sizes`` (default: every divisor of the batch
    a replica runs, up to 16). A :class:`LayoutError` names the argument none fits (every GPU
    count factors as ``R = N``, ``P = T = 1``: a count that fits no mesh shows as a batch that
    divides by none of its replica counts)."""
    devices = check_base(problem)
    if gpus < 1:
        raise LayoutError("gpus", f"{gpus}: give a positive number of GPUs")
    if global_batch < 1:
        raise LayoutError("global_batch", f"{global_batch}: give a positive number of sequences")
    low = gpus if min_gpus is None else min_gpus
    if not 1 <= low <= gpus:
        raise LayoutError("min_gpus", f"{low}: give a count from 1 to gpus ({gpus})")
    if microbatch_sizes is not None and any(m < 1 for m in microbatch_sizes):
        raise LayoutError("microbatch_sizes", f"{microbatch_sizes}: every size must be positive")
    widths = dict(tensor_widths or {})
    for key, width in widths.items():
        if width < 1:
            raise LayoutError("tensor_widths", f"{key} = {width}: every width must be positive")
    layers = len(problem.expanded_layers())
    tensors = [t for t in _divisors(devices.per_node) if all(w % t == 0 for w in widths.values())]
    meshes = [(r, p, t) for n in range(low, gpus + 1) for t in tensors if n % t == 0
              for p in _divisors(n // t) if p <= layers for r in [n // (t * p)]]
    out = []
    for r, p, t in meshes:
        if global_batch % r:
            continue
        per_replica = global_batch // r
        sizes = microbatch_sizes or tuple(m for m in _divisors(per_replica) if m <= 16)
        out += [Layout(r, p, t, m, per_replica // m) for m in sizes if per_replica % m == 0]
    if not out:
        reps = sorted({r for r, _p, _t in meshes})
        sizes_said = list(microbatch_sizes) if microbatch_sizes else "any divisor up to 16"
        raise LayoutError("global_batch", f"{global_batch} sequences do not divide into M x m x R "
                          f"for any layout of {gpus} GPUs (R in {reps}, m in "
                          f"{sizes_said}); use a multiple of the replicas x the "
                          "microbatch size")
    return out


def _scaled(layer: Layer, factor: float) -> Layer:
    if factor == 1.0:
        return layer
    update: dict[str, Any] = {
        "forward": layer.forward * factor, "backward": layer.backward * factor,
        "weight": layer.weight * factor, "activation_bytes": layer.activation_bytes * factor,
        "output_bytes": layer.output_bytes * factor,
    }
    if layer.backward_fused is not None:
        update["backward_fused"] = layer.backward_fused * factor
    if layer.graph_walk is not None:
        update["graph_walk"] = layer.graph_walk * factor
    return layer.model_copy(update=update)


def layout_problem(problem: Problem, layout: Layout, *, profiled_microbatch: int = 1,
                   marked: list[Layer] | None = None) -> Problem:
    """The planning problem of one replica's pipeline under ``layout`` (module docstring);
    ``marked``: the problem's layers through ``mark_by_kind`` already (a cache)."""
    devices = check_base(problem)
    if devices.per_node % layout.tensor:
        raise LayoutError("tensor", f"{layout.tensor} does not divide the {devices.per_node} GPUs "
                          "per node: a tensor group never leaves its node")
    layers = marked if marked is not None else mark_by_kind(problem.expanded_layers())
    factor = layout.microbatch_size / profiled_microbatch
    net = problem.network
    if net.data_parallel is None:
        within = layout.gpus <= devices.per_node
        link = net.intra_node if within else net.inter_node
        # A free link (None) would fall back to inter_node: say free as an infinite bandwidth.
        free = Link.model_construct(bandwidth_bytes_per_s=math.inf, latency_s=0.0)
        net = net.model_copy(update={"data_parallel": free if link is None else link})
    return Problem.model_construct(
        name=f"{problem.name or 'problem'} {layout.label()}",
        time_unit=problem.time_unit,
        microbatches=layout.microbatches,
        layers=[_scaled(lay, factor) for lay in layers],
        devices=IdenticalDevices(count=layout.pipeline, per_node=max(1, devices.per_node // layout.tensor),
                                 memory_bytes=devices.memory_bytes, speed=devices.speed),
        network=net,
        data_parallel=layout.data_parallel,
        tensor_parallel=layout.tensor,
        sequence_parallel=problem.sequence_parallel and layout.tensor > 1,
        action_overhead_s=problem.action_overhead_s,
        objective=problem.objective,  # auto: each layout's search minimises its step where R > 1
    )


def memory_floor(costs: Costs) -> tuple[float, str | None]:
    """The least peak memory of the busiest GPU in any plan of ``costs``, and why no plan fits
    (None: the floor is within memory). Every device holds its layers' parameters, and one
    microbatch's activations through all of them at once (the first microbatch's W on a layer
    needs that microbatch's F through every later layer first; a recomputed stage counts its
    working set with its parameters, :meth:`Costs.stage_costs`); layers are indivisible and the
    busiest device holds at least the mean, so no plan's peak is below this."""
    held = [p + a for p, a in zip(costs.param_bytes, costs.activation_bytes, strict=True)]
    floor = max(sum(held) / costs.devices, max(held, default=0.0))
    cap = min(costs.memory)
    if floor <= cap * (1 + _MEMORY_SLACK):
        return floor, None
    params = sum(costs.param_bytes) / costs.devices
    return floor, (f"over memory on every plan: parameters, gradients and optimizer state "
                   f"({show_bytes(params)} a GPU at best) and one microbatch's activations need "
                   f"{show_bytes(floor)} a GPU, each has {show_bytes(cap)}")


def step_bound(costs: Costs) -> float:
    """No plan's step is shorter: the iteration's lower bound (the strategies' six terms), then
    the all-reduce of the stage whose W ends the iteration (at least the lightest layer's
    gradient) and the optimizer step spread perfectly over the devices."""
    from adaptis.planner.strategies import lower_bound

    iteration = lower_bound(costs, deadline=time.monotonic() + _BOUND_SECONDS)
    reduce = costs.allreduce_time(min(costs.grad_bytes, default=0.0))
    opt = sum(costs.optimizer) / (costs.devices * max(costs.speed))
    return iteration + reduce + opt if math.isfinite(iteration) else math.inf

