"""The step after the pipeline: data-parallel gradient all-reduce and the optimizer step.

Sits in the planner beside :mod:`adaptis.planner.simulator`, which calls it on the timeline it
has replayed. The pipeline's figures (``iteration_time``, bubbles, memory) stay what they were;
this module adds what a training step does after them, so the prediction covers a whole step:

- with ``R = problem.data_parallel`` replicas, every stage all-reduces its weight gradient
  (the sum of its layers' ``gradient_bytes``) with its R - 1 replicas: a ring all-reduce,
  ``2(R-1) latency + 2(R-1)/R bytes / bandwidth`` over ``network.data_parallel``
  (:meth:`adaptis.planner.costs.Costs.allreduce_time`);
- a stage's reduction starts when its last W (or fused BW) of the step ends, and runs on its
  device's communication channel: it overlaps the device's remaining compute, and a device's
  reductions run one at a time, in the order their gradients are ready (stage index breaks
  ties). Replicas run the same plan, so one replica's timeline stands for all of them;
- a device's gradients are final when its last action and its last reduction have ended.
  The global gradient norm (clipping) needs every device's, so the optimizer step starts
  everywhere at the latest of those, and takes the sum of its stages' ``optimizer`` times
  divided by the device's speed; the step ends when the slowest device's optimizer ends.

``post_pipeline_time`` is the step's end minus the pipeline's; with one replica and no
optimizer times it is 0 and the step is the pipeline. Not modelled: the tied-embedding
gradient exchange and the clipping norm's own all-reduce (one scalar: latency only), the
problem carries neither whether weights are tied nor the world's latency tree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from adaptis.api.plan import Plan
from adaptis.planner.costs import Costs

__all__ = ["PostPipeline", "Reduction", "post_pipeline", "step_time"]


class _Timed(Protocol):
    """What this module reads of one action of the replayed timeline (the simulator's
    ``TimedAction``, which imports this module: named by its shape, not imported back)."""

    @property
    def kind(self) -> str: ...
    @property
    def stage(self) -> int: ...
    @property
    def end(self) -> float: ...


@dataclass(frozen=True, slots=True)
class Reduction:
    """One stage's gradient all-reduce on its device's communication channel."""

    stage: int
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class PostPipeline:
    """What a step does after the pipeline, in the problem's ``time_unit``."""

    reductions: tuple[tuple[Reduction, ...], ...]  # per device, in channel order
    gradients_ready: float  # every device's gradients final: the optimizer may start
    optimizer: tuple[float, ...]  # per device, speed applied
    step_time: float
    post_pipeline_time: float


def post_pipeline(*, costs: Costs, plan: Plan, timeline: Sequence[Sequence[_Timed]]) -> PostPipeline:
    """The reductions and optimizer step after ``timeline`` (the simulator's, per device)."""
    stages = [(lo, hi) for lo, hi in plan.stages]
    pipeline_end = max((t[-1].end for t in timeline if t), default=0.0)
    last_w = [0.0] * len(stages)
    for acts in timeline:
        for a in acts:
            if a.kind in ("W", "BW"):
                last_w[a.stage] = max(last_w[a.stage], a.end)
    ends = [acts[-1].end if acts else 0.0 for acts in timeline]
    reductions, ready, optimizer = _after(costs, stages=stages, placement=plan.placement,
                                          last_w=last_w, device_end=ends)
    step = ready + max(optimizer, default=0.0)
    return PostPipeline(
        reductions=reductions,
        gradients_ready=ready,
        optimizer=optimizer,
        step_time=step,
        post_pipeline_time=max(0.0, step - pipeline_end),
    )


def step_time(costs: Costs, *, stages: list[tuple[int, int]], placement: Sequence[Sequence[int]],
              last_w: Sequence[float], device_end: Sequence[float]) -> float:
    """The step's end from each stage's last W (or BW) end and each device's last action's end
    (0 for an empty device): what :func:`post_pipeline` reports as ``step_time``, without a
    timeline (the list scheduler's replay has these figures, :mod:`adaptis.planner.scheduler`)."""
    _red, ready, optimizer = _after(costs, stages=stages, placement=placement, last_w=last_w,
                                    device_end=device_end)
    return ready + max(optimizer, default=0.0)


def _after(costs: Costs, *, stages: list[tuple[int, int]], placement: Sequence[Sequence[int]],
           last_w: Sequence[float], device_end: Sequence[float]
           ) -> tuple[tuple[tuple[Reduction, ...], ...], float, tuple[float, ...]]:
    """Per device its reductions in channel order, when every gradient is final, and per
    device its optimizer time (speed applied)."""
    grad = costs.stage_sums(costs.grad_bytes, stages)
    opt = costs.stage_sums(costs.optimizer, stages)
    reductions: list[tuple[Reduction, ...]] = []
    ready = 0.0
    optimizer: list[float] = []
    for d, end in enumerate(device_end):
        free = 0.0
        done: list[Reduction] = []
        for s in sorted(placement[d], key=lambda s: (last_w[s], s)):
            dur = costs.allreduce_time(grad[s])
            if dur <= 0:
                continue
            start = max(free, last_w[s])
            free = start + dur
            done.append(Reduction(s, start, free))
        reductions.append(tuple(done))
        ready = max(ready, end, free)
        optimizer.append(sum(opt[s] for s in placement[d]) / costs.speed[d])
    return tuple(reductions), ready, tuple(optimizer)
