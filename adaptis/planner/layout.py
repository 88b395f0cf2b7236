"""The layout search: which data x pipeline x tensor mesh and microbatching of a GPU budget
trains fastest, by the predicted step (issue 30).

Sits at the top of the planner beside :mod:`adaptis.planner.strategies`, whose ``adaptis``
strategy (the joint partition x placement x schedule search) it runs once per promising
layout; the layout space, each layout's problem and the cheap figures that prune it are in
:mod:`adaptis.planner.layout_space`. ``adaptis plan PROBLEM --gpus N --global-batch B``
(:mod:`adaptis.cli.plan_layout`) is its CLI face; docs/planner-search.md, "Choosing the
layout", is the user's account.

The objective is the **step** a user pays for: the pipeline iteration, the part of the
replicas' gradient all-reduce that does not hide under the cooldown, and the optimizer step
(:mod:`adaptis.planner.post_pipeline`, as the simulator replays it), i.e. tokens per second
of the job; a layout counts only where every device fits in memory. In order:

1. every layout is enumerated (:func:`adaptis.planner.layout_space.enumerate_layouts`);
2. a layout whose memory floor (parameters, gradients and optimizer state, and one
   microbatch's activations through its layers, on the busiest GPU at best) exceeds a GPU's
   memory is refused with that reason, unsearched;
3. the others are sorted by a lower bound on their step (the iteration's bounds, the last
   all-reduce and the optimizer: :func:`adaptis.planner.layout_space.step_bound`) and
   searched in full in that order, each within ``per_layout_s`` seconds, until the next
   bound cannot beat the ``keep``-th best step found: no layout left can enter the top
   ``keep``. A searched layout whose best plan is still over memory is refused with the
   simulator's reason (the device that is over);
4. the searched layouts are ranked by predicted step; each runner-up says why it loses to
   the first: how much slower and the part of the step that grew most (the busiest GPU's
   work, the bubble, or the exposed all-reduce and optimizer).

The search of one layout optimises its iteration; its step is then what the simulator
replays (issue 30 item 3, ordering the last W's for the all-reduce, is not done here).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from adaptis.api.problem import TIME_UNIT_SECONDS, Problem
from adaptis.planner.costs import Costs
from adaptis.planner.errors import LayoutError
from adaptis.planner.layout_space import (
    Layout,
    enumerate_layouts,
    layout_problem,
    memory_floor,
    step_bound,
)
from adaptis.planner.strategies import plan_strategy
from adaptis.planner.tensor_parallel import mark_by_kind

__all__ = ["Layout", "LayoutSearch", "RankedLayout", "Refused", "search_layouts"]

log = logging.getLogger(__name__)

#: The joint search's time limit for one layout unless the caller says otherwise.
DEFAULT_PER_LAYOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class RankedLayout:
    """One searched layout that fits, with its predicted figures (the problem's time unit)."""

    layout: Layout
    step_time: float
    iteration_time: float
    post_pipeline_time: float  # exposed all-reduce and optimizer
    busiest: float  # the busiest device's work over the iteration
    bubble_ratio: float
    stages: int
    peak_memory_bytes: tuple[float, ...]  # per device of one replica (one GPU of its group)
    sequences_per_s: float
    tokens_per_s: float | None  # None: no sequence length given
    bound: float  # the step bound it was ordered by
    search_seconds: float
    cut_short: bool  # the per-layout time limit stopped its search
    reason: str | None = None  # why it loses to the first; None for the first

    def payload(self) -> dict[str, Any]:
        lay = self.layout
        return {"gpus": lay.gpus, "data_parallel": lay.data_parallel, "pipeline": lay.pipeline,
                "tensor": lay.tensor, "microbatch_size": lay.microbatch_size,
                "microbatches": lay.microbatches, "step_time": self.step_time,
                "iteration_time": self.iteration_time, "post_pipeline_time": self.post_pipeline_time,
                "bubble_ratio": self.bubble_ratio, "stages": self.stages,
                "peak_memory_bytes": list(self.peak_memory_bytes),
                "sequences_per_s": self.sequences_per_s, "tokens_per_s": self.tokens_per_s,
                "step_bound": self.bound, "search_seconds": self.search_seconds,
                "cut_short": self.cut_short, "reason": self.reason}


@dataclass(frozen=True, slots=True)
class Refused:
    """A layout that does not fit in memory, and why; ``searched``: False when its memory
    floor refused it before any search."""

    layout: Layout
    reason: str
    searched: bool

    def payload(self) -> dict[str, Any]:
        lay = self.layout
        return {"gpus": lay.gpus, "data_parallel": lay.data_parallel, "pipeline": lay.pipeline,
                "tensor": lay.tensor, "microbatch_size": lay.microbatch_size,
                "microbatches": lay.microbatches, "searched": self.searched, "reason": self.reason}


@dataclass(frozen=True, slots=True)
class LayoutSearch:
    """The layouts of a GPU budget ranked by predicted step (fastest first), and the refused."""

    name: str | None
    time_unit: str
    gpus: int
    global_batch: int
    ranked: tuple[RankedLayout, ...]
    refused: tuple[Refused, ...]
    enumerated: int  # layouts in the space
    searched: int  # layouts the joint search ran on
    pruned: int  # layouts whose step bound could not enter the top ``keep``: not searched
    seconds: float

    @property
    def best(self) -> RankedLayout | None:
        return self.ranked[0] if self.ranked else None

    def payload(self) -> dict[str, Any]:
        return {"name": self.name, "time_unit": self.time_unit, "gpus": self.gpus,
                "global_batch": self.global_batch, "enumerated": self.enumerated,
                "searched": self.searched, "pruned": self.pruned, "search_seconds": self.seconds,
                "layouts": [r.payload() for r in self.ranked],
                "refused": [r.payload() for r in self.refused]}


def search_layouts(
    problem: Problem, *, gpus: int, global_batch: int, min_gpus: int | None = None,
    microbatch_sizes: tuple[int, ...] | None = None, tensor_widths: Mapping[str, int] | None = None,
    profiled_microbatch: int = 1, sequence_length: int | None = None, keep: int = 5,
    per_layout_s: float | None = DEFAULT_PER_LAYOUT_S, exhaustive: bool = False,
) -> LayoutSearch:
    """The layouts of ``gpus`` GPUs (``min_gpus`` up to it, if given) for ``global_batch``
    sequences a step, ranked by predicted step (module docstring). ``problem``: the model's
    layers profiled at ``profiled_microbatch`` sequences a microbatch and whole (tensor degree
    1), and one device kind (its ``count``, ``microbatches``, ``data_parallel`` and
    ``tensor_parallel`` are what this search chooses, so they are ignored). ``exhaustive``:
    search every layout that passes its memory floor (no bound pruning). A
    :class:`LayoutError` names a bad argument."""
    if keep < 1:
        raise LayoutError("keep", f"{keep}: keep at least one layout")
    if profiled_microbatch < 1:
        raise LayoutError("profiled_microbatch", f"{profiled_microbatch}: give a positive size")
    if sequence_length is not None and sequence_length < 1:
        raise LayoutError("sequence_length", f"{sequence_length}: give a positive token count")
    t0 = time.perf_counter()
    layouts = enumerate_layouts(problem, gpus=gpus, global_batch=global_batch, min_gpus=min_gpus,
                                microbatch_sizes=microbatch_sizes, tensor_widths=tensor_widths)
    marked = mark_by_kind(problem.expanded_layers())
    refused: list[Refused] = []
    queue: list[tuple[float, Layout, Problem]] = []
    for lay in layouts:
        prob = layout_problem(problem, lay, profiled_microbatch=profiled_microbatch, marked=marked)
        costs = Costs.from_problem(prob)
        _floor, why = memory_floor(costs)
        if why is not None:
            refused.append(Refused(lay, why, searched=False))
            continue
        queue.append((step_bound(costs), lay, prob))
    queue.sort(key=lambda q: (q[0], -q[1].gpus, q[1].pipeline, q[1].tensor, q[1].microbatch_size))
    found: list[RankedLayout] = []
    searched = pruned = 0
    unit_s = TIME_UNIT_SECONDS[problem.time_unit]
    for i, (bound, lay, prob) in enumerate(queue):
        if not exhaustive and len(found) >= keep and bound >= sorted(r.step_time for r in found)[keep - 1]:
            pruned = len(queue) - i  # sorted by bound: none after it can enter the top either
            break
        searched += 1
        started = time.perf_counter()
        outcome = plan_strategy(prob, "adaptis", time_limit_s=per_layout_s)
        seconds = time.perf_counter() - started
        sim, res = outcome.simulation, outcome.result
        if sim is None or not res.feasible:
            refused.append(Refused(lay, res.reason or "no plan fits in memory", searched=True))
            continue
        step = sim.step_time
        rate = global_batch / (step * unit_s) if step > 0 else math.inf
        found.append(RankedLayout(
            layout=lay, step_time=step, iteration_time=sim.iteration_time,
            post_pipeline_time=sim.post_pipeline_time, busiest=max(sim.busy),
            bubble_ratio=sim.bubble_ratio, stages=res.stages or 0,
            peak_memory_bytes=tuple(sim.peak_memory), sequences_per_s=rate,
            tokens_per_s=None if sequence_length is None else rate * sequence_length,
            bound=bound, search_seconds=seconds, cut_short=res.cut_short is not None,
        ))
        log.debug("layout %s: step %.4g (bound %.4g) in %.2f s", lay.label(), step, bound, seconds)
    found.sort(key=lambda r: (r.step_time, -r.layout.gpus, r.layout.pipeline, r.layout.tensor))
    ranked = tuple(found[:1] + [_with_reason(r, first=found[0], unit=problem.time_unit) for r in found[1:]])
    return LayoutSearch(name=problem.name, time_unit=problem.time_unit, gpus=gpus,
                        global_batch=global_batch, ranked=ranked, refused=tuple(refused),
                        enumerated=len(layouts), searched=searched, pruned=pruned,
                        seconds=time.perf_counter() - t0)


def _with_reason(r: RankedLayout, *, first: RankedLayout, unit: str) -> RankedLayout:
    """``r`` with why it loses to ``first``: how much slower, and the part of the step that
    grew most (the busiest GPU's work, the bubble, the exposed all-reduce and optimizer)."""
    slower = r.step_time / first.step_time - 1 if first.step_time > 0 else 0.0
    parts = {
        "more work on the busiest GPU": r.busiest - first.busiest,
        "larger bubble": (r.iteration_time - r.busiest) - (first.iteration_time - first.busiest),
        "more exposed all-reduce and optimizer": r.post_pipeline_time - first.post_pipeline_time,
    }
    cause, delta = max(parts.items(), key=lambda kv: kv[1])
    if slower <= 5e-4:
        why = "as fast as the first (within 0.05%)"
    else:
        why = f"{100 * slower:.1f}% slower: {cause} (+{delta:.4g} {unit})"
    return replace(r, reason=why)
