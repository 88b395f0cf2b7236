"""A lower bound on the iteration time that knows memory: the work, plus the recomputation
that the cluster's memory forces on it.

Sits beside :mod:`adaptis.planner.bounds` (the compute-only bounds) under
:mod:`adaptis.planner.strategies`, whose ``lower_bound`` is the largest of them all (issue 32
item 2). It uses only :mod:`adaptis.planner.costs` and the simulator's memory rule
(:mod:`adaptis.planner.simulator`): a device holds its stages' parameters all iteration and a
stage's activations from each forward's start until the matching W (or fused BW) ends; a
recomputed stage holds only its input, and pays its forward again in its backward.

Two necessary conditions on any plan that fits, at iteration time ``T`` (``m`` microbatches):

- *work*: every device is busy at most ``T``, so ``T x sum(speed) >= m x (W + R)``, ``W`` the
  least work of one microbatch (``F + min(B + W, BW)`` per layer) and ``R`` the forwards it
  recomputes;
- *memory-time*: layer ``j``'s activations, where its stage keeps them, are held at least
  ``lat_j``: its own forward, every later layer's forward and input gradient, then its own
  backward, all at the fastest device's speed (transfers, overhead and waiting only add), so
  ``sum_j m x a_j x lat_j`` over the layers not recomputed is at most the memory left beside
  every layer's parameters, ``sum(memory) - sum(params)``, times ``T``.

The plan chooses what to recompute (whole stages, binary); letting each layer choose any
fraction only lowers the least ``T`` meeting both, so that ``T`` is still a bound. For a given
recomputation budget ``R`` the most memory-time it saves is a fractional knapsack: layers by
``a_j x lat_j / f_j``, highest first. ``T`` is found by bisection and the failing end returned.

On a problem where memory does not bind it is the work term of
:func:`adaptis.planner.bounds.pipeline_bound`; it counts memory over the whole cluster, so it
is tight where memory is short in total, not where one device is short and others have room
(a placement question, which the search answers).
"""

from __future__ import annotations

import math

from adaptis.planner.costs import Costs

__all__ = ["memory_bound"]

# Bisection stops at this relative width; the failing end is returned, so it stays a bound.
_REL_TOL = 1e-9
# The simulator's memory check lets a device exceed its capacity by this fraction
# (adaptis.planner.reasons); the bound grants the same, so it never fails a plan that fits.
_MEMORY_SLACK = 1e-9


def memory_bound(costs: Costs) -> float:
    """The least ``T`` meeting the work and memory-time conditions (module docstring)."""
    m = costs.microbatches
    back = costs.least_backward()
    grad = [min(b, fu) for b, fu in zip(costs.backward, costs.fused, strict=True)]
    speeds = sum(costs.speed)
    vmax = max(costs.speed)
    work = sum(costs.forward) + sum(back)
    room = sum(costs.memory) * (1 + _MEMORY_SLACK) - sum(costs.param_bytes)
    if room <= 0:
        return work * m / speeds  # no plan fits at all: any value bounds none of them
    # lat_j: layer j's residence at least, from its forward's start to its backward's end.
    lat = []
    after_f = after_g = 0.0  # forwards from j on, input gradients after j
    for j in reversed(range(costs.layers)):
        after_f += costs.forward[j]
        lat.append((after_f + after_g + back[j]) / vmax)
        after_g += grad[j]
    lat.reverse()
    held = [a * t for a, t in zip(costs.activation_bytes, lat, strict=True)]  # memory-time per microbatch
    # Recomputation's best buys first: memory-time saved per unit of forward recomputed.
    free = sum(h for h, f in zip(held, costs.forward, strict=True) if f <= 0)
    paid = sorted(((h / f, h, f) for h, f in zip(held, costs.forward, strict=True) if f > 0 and h > 0),
                  reverse=True)
    total = sum(held)

    def fits(t: float) -> bool:
        budget = t * speeds / m - work  # forwards one microbatch may recompute
        if budget < 0:
            return False
        saved = free
        for _ratio, h, f in paid:
            if budget >= f:
                saved, budget = saved + h, budget - f
            else:
                saved += h * budget / f
                break
        return m * (total - saved) <= room * t

    lo = work * m / speeds  # the work term: no plan is faster
    if fits(lo):
        return lo
    hi = lo * 2
    while not fits(hi):
        hi *= 2
        if hi > lo * 2**40:  # unreachable: recomputing everything holds nothing
            return lo
    while hi - lo > _REL_TOL * hi:
        mid = (lo + hi) / 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return lo if math.isfinite(lo) else 0.0
