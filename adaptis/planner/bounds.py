"""Lower bounds on the iteration time: what no plan of any strategy can beat.

Sits under :mod:`adaptis.planner.strategies` (whose ``lower_bound`` is the largest of these) and
uses only :mod:`adaptis.planner.costs`. Two families:

- :func:`pipeline_bound`: the pipeline terms (all work spread perfectly, the heaviest layer on
  the fastest device, one microbatch's critical path, and per layer the forward before it, its
  ``m`` microbatches and the backward after it); see ``strategies``' docstring;
- :func:`assignment_bound`: the *granularity* term. A layer is never split between devices, so
  each device runs whole layers, ``m`` times each: the iteration is at least the least possible
  largest ``sum(work of its layers) x m / speed`` over every layer -> device assignment, with
  any number of layers on a device and in any order (V-shape, looped and packed placements
  are not contiguous, so a contiguous-partition DP would *not* be a bound for them). That
  minimum is a scheduling problem on uniform machines (NP-hard), so we bound it from below:
  bisection on the time ``T`` with a test that every feasible ``T`` passes (a necessary
  condition), and report the largest ``T`` that failed.

The necessary condition at ``T`` (device ``d`` may take work ``C_d = T x speed_d``):
1. every layer fits on some device (``w_max <= max C_d``);
2. layers larger than the ``k`` smallest capacities must fit, even split fractionally, into the
   other devices (Hall's condition of the fractional relaxation; the eligible devices of a
   layer are nested, so these ``p`` inequalities are exact for it);
3. counting: for every size ``s``, the layers of size ``>= s`` need at most
   ``sum_d`` (most of them device ``d`` can hold: its smallest ones, greedily) places —
   the generalisation of "``p + 1`` layers on ``p`` devices put two on one device" that makes
   40 equal layers on 16 devices cost 3 layers, not 2.5;
4. on identical devices with few distinct layer sizes (the paper's models: embedding, blocks,
   MoE blocks, head), the exact test instead: a DP over the count vectors of layers that
   says whether ``p`` bins of capacity ``T`` can take them all.

Each device's busy time is at least its layers' ``F + min(B+W, fused)`` over its speed, ``m``
times (torch's extra graph walks and the per-action overhead only add to it), so a ``T`` below
the optimum of that assignment problem is below every plan's iteration time.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_right
from itertools import accumulate

from adaptis.planner.costs import Costs

__all__ = ["assignment_bound", "pipeline_bound"]

# Bisection stops at this relative width; the failing end is returned, so it stays a bound.
_REL_TOL = 1e-9
# Comparisons lean towards "fits" by this much: float rounding must never fail a feasible T.
_SLACK = 1e-12
# Size limits of the exact bin-packing DP (beyond them the relaxation alone decides).
_MAX_KINDS = 6
_MAX_STATES = 20_000
_MAX_CONFIGS = 400


def pipeline_bound(costs: Costs) -> float:
    """The pipeline terms of the lower bound (the bound before granularity was counted)."""
    m = costs.microbatches
    back = costs.least_backward()  # a plan may run any backward fused or split
    grad = [min(b, fu) for b, fu in zip(costs.backward, costs.fused, strict=True)]  # input gradient ready
    work = [f + bw for f, bw in zip(costs.forward, back, strict=True)]
    vmax = max(costs.speed)
    spread = sum(work) * m / sum(costs.speed)
    heaviest = max(work) * m / vmax
    tail = min([*costs.weight, *back])
    chain = (sum(costs.forward) + sum(grad) + tail) / vmax
    per_layer = 0.0
    f_before = b_before = 0.0
    for f, g, bw in zip(costs.forward, grad, back, strict=True):
        per_layer = max(per_layer, f_before + m * (f + g) + b_before, f_before + m * (f + bw))
        f_before += f
        b_before += g
    return max(spread, heaviest, chain, per_layer / vmax)


def assignment_bound(costs: Costs, *, deadline: float | None = None) -> float:
    """A lower bound on the least max per-device work over any layer -> device assignment.

    Past ``deadline`` (:func:`time.monotonic`) the bisection stops where it is: its lower end
    is a bound already, only a looser one (seconds are spent here on thousands of layers)."""
    m = costs.microbatches
    work = sorted(m * (f + bw) for f, bw in zip(costs.forward, costs.least_backward(), strict=True))
    speeds = sorted(costs.speed)
    if not work or work[-1] <= 0:
        return 0.0
    lo = max(sum(work) / sum(speeds), work[-1] / speeds[-1]) * (1 - 1e-6)
    if _may_fit(work, speeds, t=lo):
        return lo  # spread and heaviest are bounds in their own right
    hi = _greedy_makespan(work, speeds)  # a real assignment: passes every necessary test
    for _ in range(8):  # only float rounding can fail a real assignment's makespan
        if _may_fit(work, speeds, t=hi):
            return _bisect(work, speeds, lo=lo, hi=hi, deadline=deadline)
        hi = math.nextafter(hi, math.inf) * (1 + _REL_TOL)
    return lo  # still a bound: spread and heaviest


def _bisect(work: list[float], speeds: list[float], *, lo: float, hi: float,
            deadline: float | None = None) -> float:
    """The largest T found with ``_may_fit`` false (``lo`` fails, ``hi`` passes)."""
    while hi - lo > _REL_TOL * hi:
        if deadline is not None and time.monotonic() >= deadline:
            break
        mid = (lo + hi) / 2
        if _may_fit(work, speeds, t=mid):
            hi = mid
        else:
            lo = mid
    return lo


def _greedy_makespan(work: list[float], speeds: list[float]) -> float:
    """Largest layers first, each onto the device where it would finish earliest."""
    load = [0.0] * len(speeds)
    for w in reversed(work):
        d = min(range(len(speeds)), key=lambda i: (load[i] + w) / speeds[i])
        load[d] += w
    return max(x / v for x, v in zip(load, speeds, strict=True))


def _may_fit(work: list[float], speeds: list[float], *, t: float) -> bool:
    """Necessary condition for an assignment of ``work`` (ascending) with every device's
    work / speed at most ``t`` (``speeds`` ascending); see the module docstring."""
    caps = [t * v * (1 + _SLACK) for v in speeds]  # ascending, as speeds
    n, p = len(work), len(caps)
    if work[-1] > caps[-1]:
        return False
    if caps[0] == caps[-1]:
        exact = _bins_suffice(work, bins=p, cap=caps[0])
        if exact is not None:
            return exact
    pre = [0.0, *accumulate(work)]
    # 2. Layers above the k smallest capacities go to the p - k others.
    room = sum(caps)
    for k in range(p):
        first = bisect_right(work, caps[k - 1]) if k else 0
        if pre[n] - pre[first] > room:
            return False
        room -= caps[k]
    # 3. Counting from every distinct size down: the layers of size >= s and how many of
    # them each device can hold (its smallest ones first).
    i = n
    while i > 0:
        s = work[i - 1]
        first = i - 1
        while first > 0 and work[first - 1] == s:
            first -= 1
        need = n - first
        base = pre[first]
        places = 0
        for c in caps:
            # Most layers among work[first:]: the largest j with pre[first + j] - base <= c.
            places += bisect_right(pre, base + c, lo=first) - 1 - first
            if places >= need:
                break
        if places < need:
            return False
        i = first
    return True


def _bins_suffice(work: list[float], *, bins: int, cap: float) -> bool | None:
    """Exact: can ``bins`` devices of capacity ``cap`` take every layer? None when the
    layers have too many distinct sizes for the DP (then the relaxation above decides).

    Paper models have a handful of layer kinds (embedding, blocks, MoE blocks, head), so the
    multisets of layers are count vectors: ``need(v)`` bins for the vector ``v`` is one bin
    filled with a maximal set ``c`` plus ``need(max(v - c, 0))`` (packing fewer is allowed).
    """
    sizes: list[float] = []
    counts: list[int] = []
    for w in work:
        if sizes and sizes[-1] == w:
            counts[-1] += 1
        else:
            sizes.append(w)
            counts.append(1)
    states = 1
    for c in counts:
        states *= c + 1
    if len(sizes) > _MAX_KINDS or states > _MAX_STATES:
        return None
    configs = _maximal_sets(sizes, counts=counts, cap=cap)
    if configs is None:
        return None
    radix = [1] * len(counts)
    for k in range(1, len(counts)):
        radix[k] = radix[k - 1] * (counts[k - 1] + 1)
    need = [0] * states
    for idx in range(1, states):  # every state's truncations have smaller indices
        v = [(idx // radix[k]) % (counts[k] + 1) for k in range(len(counts))]
        best = bins + 1
        for conf in configs:
            rest = sum(max(0, v[k] - conf[k]) * radix[k] for k in range(len(v)))
            if rest != idx and need[rest] + 1 < best:
                best = need[rest] + 1
        need[idx] = best
    return need[states - 1] <= bins


def _maximal_sets(sizes: list[float], *, counts: list[int], cap: float) -> list[tuple[int, ...]] | None:
    """Count vectors fitting in ``cap`` to which no further layer can be added."""
    out: list[tuple[int, ...]] = []
    cur = [0] * len(sizes)

    def walk(k: int, room: float) -> bool:
        if len(out) > _MAX_CONFIGS:
            return False
        if k == len(sizes):
            if any(cur[j] < counts[j] and sizes[j] <= room for j in range(len(sizes))):
                return True  # not maximal: a layer still fits
            out.append(tuple(cur))
            return True
        most = counts[k] if sizes[k] <= 0 else min(counts[k], int(room // sizes[k]))
        for c in range(most, -1, -1):
            cur[k] = c
            if not walk(k + 1, room - c * sizes[k]):
                return False
        cur[k] = 0
        return True

    return out if walk(0, cap) else None
