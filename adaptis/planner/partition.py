"""Partitions: how the baselines cut the layer sequence into contiguous stages.

Sits in the planner layer under :mod:`adaptis.planner.baselines` (and is free for the joint
search to start from). Two rules, both from the strategy table of docs/problem.md:

- :func:`megatron_partition`: Megatron-LM's default, by layer *count*: the body layers (all but
  a leading run of ``embedding`` layers and a trailing run of ``head`` layers) split evenly,
  the embedding joins the first stage and the head the last;
- :func:`balanced_partition`: by profiled *cost*, minimising the slowest stage's F+B+W
  (divided by the speed of the device it lands on), as Mist's partition-only adaptation does.

A stage is ``(first_layer, end_layer)``, half-open, and never empty.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from itertools import accumulate

from adaptis.planner.costs import Costs
from adaptis.planner.errors import PlannerError

__all__ = ["balanced_partition", "body_span", "bottleneck", "even_split", "megatron_partition"]

Stages = list[tuple[int, int]]

# Bisection stops at this relative width: far below any cost a profiler can resolve.
_REL_TOL = 1e-12
# Largest layers^2 x stages the slack-spreading DP runs on (about a second of Python).
_SPREAD_LIMIT = 2_000_000


def even_split(count: int, *, parts: int) -> list[int]:
    """Sizes of ``parts`` runs covering ``count`` items as evenly as possible.

    Megatron-LM asserts that the layer count divides by the pipeline size and has no rule of
    its own for a remainder; we spread it as Megatron-DeepSpeed's ``partition_uniform`` and
    torchtitan's pipeline splitter do: the first ``count % parts`` runs take one item more.
    """
    if parts < 1 or count < parts:
        raise PlannerError(f"cannot split {count} layers into {parts} non-empty stages")
    base, extra = divmod(count, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def body_span(costs: Costs) -> tuple[int, int]:
    """``(lead, tail)``: the leading ``embedding`` and trailing ``head`` layers Megatron pins.

    Only a *leading* run of ``kind: embedding`` and a *trailing* run of ``kind: head`` count
    (stages are contiguous, so such a layer elsewhere is an ordinary layer).
    """
    n = costs.layers
    lead = 0
    while lead < n and costs.kinds[lead] == "embedding":
        lead += 1
    tail = 0
    while tail < n - lead and costs.kinds[n - 1 - tail] == "head":
        tail += 1
    return lead, tail


def megatron_partition(costs: Costs, *, stages_count: int) -> Stages:
    """Megatron's default partition of ``costs``' layers into ``stages_count`` stages.

    The body is everything but :func:`body_span`'s embedding and head. When it has fewer
    layers than stages, no count-even split can keep every stage non-empty with the
    embedding and head pinned, so all layers split evenly by count instead.
    """
    n = costs.layers
    if stages_count < 1 or stages_count > n:
        raise PlannerError(f"cannot split {n} layers into {stages_count} non-empty stages")
    lead, tail = body_span(costs)
    body = n - lead - tail
    if body >= stages_count:
        sizes = even_split(body, parts=stages_count)
        sizes[0] += lead
        sizes[-1] += tail
    else:
        sizes = even_split(n, parts=stages_count)
    bounds = [0, *accumulate(sizes)]
    return [(bounds[i], bounds[i + 1]) for i in range(stages_count)]


def bottleneck(costs: Costs, stages: Sequence[tuple[int, int]], *, speeds: Sequence[float] | None = None) -> float:
    """The slowest stage's F+B+W, each stage divided by ``speeds[stage]`` when given."""
    work = [0.0, *accumulate(costs.layer_work())]
    return max(
        (work[hi] - work[lo]) / (1.0 if speeds is None else speeds[i]) for i, (lo, hi) in enumerate(stages)
    )


def balanced_partition(
    costs: Costs, *, stages_count: int, speeds: Sequence[float] | None = None, spread: bool = False
) -> Stages:
    """The contiguous partition that minimises the slowest stage's time F+B+W.

    ``speeds[i]`` is the speed of the device stage ``i`` runs on (default: all equal). Exact up
    to a relative 1e-12: bisection on the bottleneck time, each probe a feasibility test
    (greedy with equal speeds, a reachability sweep with unequal ones; O(layers x stages)).
    Among the optimal partitions it returns the one that fills early stages first, or with
    ``spread`` the one that spreads the slack: least sum of squared stage times under the
    optimal bottleneck (a DP, O(layers^2 x stages), skipped on very large inputs), so no
    tail stage is left nearly idle while the others sit at the bottleneck.
    """
    n = costs.layers
    if stages_count < 1 or stages_count > n:
        raise PlannerError(f"cannot split {n} layers into {stages_count} non-empty stages")
    if speeds is not None and len(speeds) != stages_count:
        raise PlannerError(f"balanced_partition: {len(speeds)} speeds for {stages_count} stages")
    pre = [0.0, *accumulate(costs.layer_work())]
    uniform = speeds is None or all(v == speeds[0] for v in speeds)
    speed_of = [1.0] * stages_count if speeds is None else [float(v) for v in speeds]

    def probe(limit: float) -> Stages | None:
        if uniform:
            return _greedy(pre, parts=stages_count, cap=limit * speed_of[0])
        return _sweep(pre, caps=[limit * v for v in speed_of])

    lo = 0.0
    hi = pre[n] / min(speed_of)  # every partition is at most this slow
    best = probe(hi)
    if best is None:  # only float rounding can get here; one more ulp of room fixes it
        hi = math.nextafter(hi, math.inf) * (1 + _REL_TOL)
        best = probe(hi)
        if best is None:
            raise PlannerError("balanced_partition: no feasible partition (internal error)")
    while hi - lo > _REL_TOL * hi:
        mid = (lo + hi) / 2
        found = probe(mid)
        if found is None:
            lo = mid
        else:
            hi, best = mid, found
    if spread and n * n * stages_count <= _SPREAD_LIMIT:
        even = _spread(pre, caps=[hi * v for v in speed_of], speeds=speed_of)
        if even is not None:
            return even
    return best


def _spread(pre: list[float], *, caps: list[float], speeds: list[float]) -> Stages | None:
    """Among partitions with stage ``i``'s work at most ``caps[i]``, the least sum of squared
    stage times (work / speed); None if none fits (float rounding only)."""
    n = len(pre) - 1
    parts = len(caps)
    inf = math.inf
    cost = [0.0] + [inf] * n  # best sum over the stages so far ending at layer b
    parents: list[list[int]] = []
    for i, cap in enumerate(caps):
        nxt = [inf] * (n + 1)
        parent = [-1] * (n + 1)
        for b in range(i + 1, n - (parts - 1 - i) + 1):
            a = b - 1
            while a >= i and pre[b] - pre[a] <= cap * (1 + _REL_TOL):
                if cost[a] < inf:
                    t = (pre[b] - pre[a]) / speeds[i]
                    c = cost[a] + t * t
                    if c < nxt[b]:
                        nxt[b], parent[b] = c, a
                a -= 1
        cost = nxt
        parents.append(parent)
    if cost[n] == inf:
        return None
    return _backtrack(parents, end=n)


def _greedy(pre: list[float], *, parts: int, cap: float) -> Stages | None:
    """Each stage takes as many layers as fit in ``cap``, leaving one per later stage."""
    n = len(pre) - 1
    out: Stages = []
    lo = 0
    for i in range(parts):
        # The last stage takes the rest; another the largest hi with pre[hi] - pre[lo] <= cap,
        # capped to leave the later stages a layer.
        hi = n if i == parts - 1 else min(bisect_right(pre, pre[lo] + cap) - 1, n - (parts - 1 - i))
        if hi <= lo or pre[hi] - pre[lo] > cap:
            return None
        out.append((lo, hi))
        lo = hi
    return out


def _sweep(pre: list[float], *, caps: list[float]) -> Stages | None:
    """Exact feasibility with a capacity per stage: which layer counts can stages 0..i cover.

    For an end ``b`` of stage ``i`` the best start is the largest reachable end of stage
    ``i-1`` below ``b`` (the shortest stage); keeping it as a parent rebuilds the partition.
    """
    n = len(pre) - 1
    parts = len(caps)
    reach = [True] + [False] * n  # ends reachable by the stages so far
    parents: list[list[int]] = []
    for i, cap in enumerate(caps):
        nxt = [False] * (n + 1)
        parent = [-1] * (n + 1)
        last = -1  # largest reachable end below b
        for b in range(1, n - (parts - 1 - i) + 1):
            if reach[b - 1]:
                last = b - 1
            if last >= 0 and pre[b] - pre[last] <= cap:
                nxt[b] = True
                parent[b] = last
        reach = nxt
        parents.append(parent)
    if not reach[n]:
        return None
    return _backtrack(parents, end=n)


def _backtrack(parents: list[list[int]], *, end: int) -> Stages:
    """The stages a DP chose: from the last end back through each stage's parent start."""
    out: Stages = []
    b = end
    for parent in reversed(parents):
        a = parent[b]
        out.append((a, b))
        b = a
    out.reverse()
    return out
