"""Structures for the joint search: placement patterns and the cuts that balance them.

Sits under :mod:`adaptis.planner.search` (which schedules and ranks what this module builds)
and uses only :mod:`adaptis.planner.costs`. A structure is an owner per stage (a device) and
contiguous stages; here are the device sequences the search tries and the layer cuts that
balance each device's load (work / speed), with the load measures the search ranks moves by.

Placement patterns (device sequences over the stages, in model order):
``looped`` (Megatron: s mod p), ``vshape`` (rounds alternate direction, as ZB-V), and
``isolated`` variants whose last stage (the head) has a device of its own, the fastest, while
the other devices loop over the rest (``isolated-head``) or go over it in V-shape rounds
(``isolated-vshape``) — what a model with a huge vocabulary head needs.
"""

from __future__ import annotations

from bisect import bisect_right
from functools import partial
from itertools import accumulate

from adaptis.planner.costs import Costs

__all__ = ["balanced_cuts", "evenness", "evenness_of", "loads", "max_load", "pack", "patterns",
           "prefix_work"]


def patterns(costs: Costs) -> list[tuple[str, list[int]]]:
    """Device sequences (owner of each stage) to try; each keeps stages <= layers."""
    p = costs.devices
    n = costs.layers
    order = list(range(p))
    fastest = max(order, key=lambda d: (costs.speed[d], d))
    rest = [d for d in order if d != fastest]
    out: list[tuple[str, list[int]]] = []
    for v in range(1, 7):
        if p * v <= n:
            out.append((f"looped-v{v}", [order[s % p] for s in range(p * v)]))
        if v >= 2 and p * v <= n:
            seq = [order[i] if r % 2 == 0 else order[p - 1 - i] for r in range(v) for i in range(p)]
            out.append((f"vshape-v{v}", seq))
        if p >= 2 and (p - 1) * v + 1 <= n:
            seq = [rest[s % (p - 1)] for s in range((p - 1) * v)] + [fastest]
            out.append((f"isolated-head-v{v}", seq))
        if p >= 3 and v >= 2 and (p - 1) * v + 1 <= n:
            # The head alone on the fastest device, the rest in V-shape rounds over the others.
            q = p - 1
            seq = [rest[i] if r % 2 == 0 else rest[q - 1 - i] for r in range(v) for i in range(q)]
            out.append((f"isolated-vshape-v{v}", [*seq, fastest]))
    # Drop repeats (isolated-head-v1 is looped-v1 when the fastest device is the last one).
    seen: set[tuple[int, ...]] = set()
    unique: list[tuple[str, list[int]]] = []
    for name, o in out:
        if tuple(o) not in seen:
            seen.add(tuple(o))
            unique.append((name, o))
    return unique


def balanced_cuts(costs: Costs, owner: list[int]) -> list[list[tuple[int, int]]]:
    """Contiguous stages whose per-device load (work / speed) is as even as we can make it:
    distinct candidates, the most even first, from a cut towards each device's share of the
    work and capped cuts (the least cap per device, by bisection, that a greedy walk fits;
    see :func:`_capped`), each polished by single-layer boundary moves that lower the max
    load.

    No exact method is known to us for several stages a device (the split of a device's
    capacity between its stages couples them), so the walks are heuristics. Evenness does
    not decide the simulated time alone (where the slack sits matters too), so the search
    schedules each candidate: keeping only the most even lost 1.2 % on nemotron-h-S-4k."""
    pre = prefix_work(costs)
    found = [_share_cuts(costs, owner=owner, pre=pre)]
    if len(set(owner)) < len(owner):
        for fair in (False, True):
            cuts = _least_capped(costs, owner=owner, pre=pre, fair=fair)
            if cuts is not None:
                found.append(cuts)
    out: list[list[tuple[int, int]]] = []
    for cuts in found:
        stages = _polish(costs, owner=owner, cuts=cuts, pre=pre)
        if stages not in out:
            out.append(stages)

    def key(stages: list[tuple[int, int]]) -> tuple[float, float]:
        return evenness(costs, owner=owner, pre=pre, cuts=[*(a for a, _ in stages), stages[-1][1]])

    return sorted(out, key=key)


def _least_capped(costs: Costs, *, owner: list[int], pre: list[float],
                  fair: bool) -> list[int] | None:
    """Cuts of :func:`_capped` under the least cap found by bisection; None if none fits."""
    hi = pre[-1] / min(costs.speed[d] for d in owner)
    best = _capped(costs, owner=owner, pre=pre, limit=hi, fair=fair)
    if best is None:
        return None
    lo = 0.0
    for _ in range(40):  # 1e-12 of the range: far below any profiled cost
        mid = (lo + hi) / 2
        cuts = _capped(costs, owner=owner, pre=pre, limit=mid, fair=fair)
        if cuts is None:
            lo = mid
        else:
            hi, best = mid, cuts
    return best


def _capped(costs: Costs, *, owner: list[int], pre: list[float], limit: float,
            fair: bool) -> list[int] | None:
    """Walk the stages in order, each taking as many layers as its device's remaining room
    (``limit`` x speed, less what its earlier stages took) allows, leaving a layer for each
    later stage; ``fair``: a stage takes at most its equal part of that room (the device's
    later stages keep theirs). None if a stage cannot take its layers."""
    n, n_st = len(pre) - 1, len(owner)
    room = [limit * v for v in costs.speed]
    left = [0] * costs.devices  # stages of each device still to cut
    for d in owner:
        left[d] += 1
    cuts = [0]
    for s, d in enumerate(owner):
        lo = cuts[-1]
        cap = room[d] / left[d] if fair else room[d]
        hi = n if s == n_st - 1 else min(bisect_right(pre, pre[lo] + cap) - 1, n - (n_st - 1 - s))
        if hi <= lo or pre[hi] - pre[lo] > room[d]:
            return None
        room[d] -= pre[hi] - pre[lo]
        left[d] -= 1
        cuts.append(hi)
    return cuts


def _share_cuts(costs: Costs, *, owner: list[int], pre: list[float]) -> list[int]:
    """Each boundary nearest the cumulative share of the work of the stages before it."""
    n = costs.layers
    n_st = len(owner)
    share = [0.0] * costs.devices
    count = [0] * costs.devices
    for d in owner:
        count[d] += 1
    total_speed = sum(costs.speed[d] for d in set(owner))
    for d in set(owner):
        share[d] = pre[-1] * costs.speed[d] / total_speed
    cuts = [0]
    target = 0.0
    for s in range(n_st - 1):
        target += share[owner[s]] / count[owner[s]]
        lo = cuts[-1] + 1
        hi = n - (n_st - 1 - s)
        # The boundary whose prefix work is nearest the cumulative target.
        k = max(lo, min(hi, _nearest(pre, target, lo=lo, hi=hi)))
        cuts.append(k)
        target = pre[k] + (target - pre[k]) * 0.5  # absorb half the rounding error
    cuts.append(n)
    return cuts


def prefix_work(costs: Costs) -> list[float]:
    """``pre[i]``: F+B+W of layers ``[0, i)``; a range's work is a difference of two."""
    return [0.0, *accumulate(costs.layer_work())]


def _nearest(pre: list[float], target: float, *, lo: int, hi: int) -> int:
    a, b = lo, hi
    while a < b:
        mid = (a + b) // 2
        if pre[mid] < target:
            a = mid + 1
        else:
            b = mid
    if a > lo and abs(pre[a - 1] - target) <= abs(pre[a] - target):
        return a - 1
    return a


def loads(costs: Costs, owner: list[int], *, cuts: list[int], pre: list[float]) -> list[float]:
    load = [0.0] * costs.devices
    for s, d in enumerate(owner):
        load[d] += (pre[cuts[s + 1]] - pre[cuts[s]]) / costs.speed[d]
    return load


def evenness(costs: Costs, *, owner: list[int], cuts: list[int],
             pre: list[float]) -> tuple[float, float]:
    """How even the device loads of ``cuts`` are: (max load, sum of squared loads), lower first."""
    ld = loads(costs, owner, cuts=cuts, pre=pre)
    return (max(ld), sum(x * x for x in ld))


def evenness_of(costs: Costs, cuts: list[int], *, owner: list[int],
                pre: list[float]) -> tuple[float, float]:
    """:func:`evenness` with ``cuts`` positional: a sort key once the rest is bound."""
    return evenness(costs, owner=owner, cuts=cuts, pre=pre)


def max_load(costs: Costs, cuts: list[int], *, owner: list[int], pre: list[float]) -> float:
    """The busiest device's load under ``cuts``: a sort key once the rest is bound."""
    return max(loads(costs, owner, cuts=cuts, pre=pre))


def _polish(costs: Costs, *, owner: list[int], cuts: list[int],
            pre: list[float]) -> list[tuple[int, int]]:
    """Single-layer boundary moves while one lowers :func:`evenness` (first improvement, in
    boundary order). A move changes two stages, so a trial recomputes only their devices'
    loads, each summed over its stages in stage order as :func:`loads` does: the same floats,
    the same decisions as recomputing everything, at O(devices) a trial instead of O(stages)."""
    cuts = list(cuts)
    speed = costs.speed
    mine: list[list[int]] = [[] for _ in range(costs.devices)]
    for st, d in enumerate(owner):
        mine[d].append(st)

    def load_of(d: int) -> float:
        total = 0.0
        for st in mine[d]:
            total += (pre[cuts[st + 1]] - pre[cuts[st]]) / speed[d]
        return total

    ld = loads(costs, owner, cuts=cuts, pre=pre)
    best = (max(ld), sum(x * x for x in ld))
    for _ in range(4 * len(cuts)):
        improved = False
        for i in range(1, len(cuts) - 1):
            a, b = owner[i - 1], owner[i]  # the devices of the two stages boundary i separates
            for step in (-1, 1):
                k = cuts[i] + step
                if not cuts[i - 1] < k < cuts[i + 1]:
                    continue
                old = cuts[i]
                cuts[i] = k
                trial = list(ld)
                trial[a] = load_of(a)
                trial[b] = load_of(b)
                sc = (max(trial), sum(x * x for x in trial))
                if sc < best:
                    best, ld, improved = sc, trial, True
                else:
                    cuts[i] = old
        if not improved:
            break
    return [(cuts[s], cuts[s + 1]) for s in range(len(cuts) - 1)]


def pack(costs: Costs, *, stages: list[tuple[int, int]], pre: list[float]) -> list[int]:
    """LPT bin packing of stages onto devices by time; ties go to the device holding the
    previous stage (no transfer), so neighbours stay together when it costs nothing."""
    load = [0.0] * costs.devices
    owner = [-1] * len(stages)
    work = [pre[hi] - pre[lo] for lo, hi in stages]
    for s in sorted(range(len(stages)), key=lambda i: -work[i]):
        d = min(range(costs.devices),
                key=partial(_pack_cost, costs, s=s, work=work[s], load=load, owner=owner))
        owner[s] = d
        load[d] += work[s]
    return owner


def _pack_cost(costs: Costs, d: int, *, s: int, work: float, load: list[float],
               owner: list[int]) -> tuple[float, int]:
    """Device ``d``'s time with stage ``s`` added, then 0 if it holds a neighbour of ``s``."""
    near = (s > 0 and owner[s - 1] == d) or (s + 1 < len(owner) and owner[s + 1] == d)
    return ((load[d] + work) / costs.speed[d], 0 if near else 1)
