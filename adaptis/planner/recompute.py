"""Recomputation chosen by the planner: the stages of memory-tight devices keep only their inputs.

Sits beside :mod:`adaptis.planner.search` and :mod:`adaptis.planner.feasibility` under
:mod:`adaptis.planner.strategies`, which offers it the structure the search (or the memory
fallback) chose. Under tight memory a device can hold few microbatches' activations, so the
list scheduler admits few (or, with the global admission rule, throttles the whole pipeline
to that device's count) and the pipeline never fills. Recomputing a stage (``Plan.recompute``,
the paper's R: its forward again in its backward) costs ``+F`` per backward but holds only
the stage's input per microbatch in flight, so the device admits many more.

What is tried, for a structure ``(stages, owner)``:

- the *tight* devices are those that cannot hold as many microbatches as the pipeline has
  stages (or the microbatches, if fewer) with every activation kept; none: nothing is tried;
- their stages recompute (first variant), then every stage (second variant, when different:
  the cheap devices then throttle no more either);
- each variant is scheduled with fused backwards (a recomputed stage must run BW), under both
  admission rules.

The caller keeps a variant only where its simulated time beats the plan it already has: the
costs model of recomputation (:meth:`adaptis.planner.costs.Costs.stage_costs`) is what the
scheduler and the simulator both charge, so a returned plan replays at the time it claims.
"""

from __future__ import annotations

import logging
import math

from adaptis.planner.costs import Costs
from adaptis.planner.scheduler import Policy, Schedule, list_schedule

__all__ = ["Recomputed", "busiest_work", "recompute_variants", "tight_devices"]

log = logging.getLogger(__name__)

Stages = list[tuple[int, int]]
# (stages, owner, schedule, recompute flags per stage)
Recomputed = tuple[Stages, list[int], Schedule, tuple[bool, ...]]

_POLICIES = (Policy(split_backward=False), Policy(split_backward=False, admit_per_device=True))


def tight_devices(costs: Costs, *, stages: Stages, owner: list[int]) -> list[int]:
    """Devices that hold fewer microbatches (parameters plus every activation kept) than the
    pipeline needs in flight to fill: ``min(len(stages), microbatches)``; with an activation
    working set that does not fit even once counted as holding none."""
    want = min(len(stages), costs.microbatches)
    params, need = costs.stage_costs(stages).held_by(owner, devices=costs.devices)
    out = []
    for d in sorted(set(owner)):
        room = costs.memory[d] - params[d]
        if room == math.inf or need[d] <= 0:
            continue
        if room < 0 or room // need[d] < want:
            out.append(d)
    return out


def busiest_work(costs: Costs, *, stages: Stages, owner: list[int], recompute: tuple[bool, ...]) -> float:
    """The busiest device's F + fused BW over the iteration, recomputation included (overheads
    left out): no fused schedule of these stages is faster."""
    sc = costs.stage_costs(stages, recompute=recompute)
    work = [0.0] * costs.devices
    for s, d in enumerate(owner):
        work[d] += (sc.forward[s] + sc.fused[s]) / costs.speed[d]
    return max(work) * costs.microbatches


def recompute_variants(costs: Costs, *, stages: Stages, owner: list[int], beat: float = math.inf,
                       deadline: float | None = None) -> list[Recomputed]:
    """The feasible recomputing schedules of ``(stages, owner)`` (module docstring); empty
    where no device is tight. A variant whose busiest device alone cannot beat ``beat`` (the
    time to beat) is not scheduled: on roomy problems that is every variant, for the price of
    a few stage sums (issue 13's scale workload: 64 x 512 plans as fast as without)."""
    tight = set(tight_devices(costs, stages=stages, owner=owner))
    if not tight:
        return []
    variants = [tuple(d in tight for d in owner)]
    if not all(variants[0]):
        variants.append(tuple(True for _ in owner))
    variants = [f for f in variants if busiest_work(costs, stages=stages, owner=owner, recompute=f) < beat]
    out: list[Recomputed] = []
    for flags in variants:
        for policy in _POLICIES:
            sched = list_schedule(costs, stages=stages, owner=owner, policy=policy, deadline=deadline,
                                  recompute=flags)
            if sched.feasible:
                out.append((stages, owner, sched, flags))
    log.debug("recompute: tight devices %s, %d feasible variants", sorted(tight), len(out))
    return out
