"""The memory-aware list scheduler: F/B/W order for a given partition and placement.

Sits under :mod:`adaptis.planner.search`, which chooses partitions and placements and asks
this module for the best schedule of each. It simulates time itself (the same model as
:mod:`adaptis.planner.simulator`), so the order it emits replays to the same iteration time.

The rule, after the AdaPtis paper: whenever a device is idle it picks among its ready work
with priority B (input gradients, oldest microbatch first: they unblock the devices upstream
and free memory soonest), then F (oldest microbatch first, deeper stage on ties: drives work
towards the loss), and W last, to fill the gaps that nothing else can. A new microbatch is
admitted into the pipeline (F of stage 0) only if every device can hold the activations of
every in-flight microbatch plus the new one, so the schedule can never run out of memory or
deadlock on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from adaptis.planner.costs import Costs
from adaptis.planner.errors import PlannerError

__all__ = ["Policy", "Schedule", "list_schedule"]


@dataclass(frozen=True, slots=True)
class Policy:
    """Knobs of the schedule phase that the search tunes."""

    split_backward: bool = True  # B/W split (zero-bubble style) or fused BW
    max_inflight: int | None = None  # cap on microbatches in flight (None: memory decides)
    fill_with_w: bool = True  # run a W whenever nothing else is ready (else only where it fits)


@dataclass(frozen=True, slots=True)
class Schedule:
    actions: tuple[tuple[tuple[str, int, int], ...], ...]
    iteration_time: float
    feasible: bool
    reason: str | None


def list_schedule(
    costs: Costs,
    *,
    stages: list[tuple[int, int]],
    owner: list[int],
    policy: Policy = Policy(),
    memory_fraction: float = 1.0,
) -> Schedule:
    """Schedule every microbatch's F/B/W for ``stages`` placed as ``owner[s]`` (a device)."""
    sc = costs.stage_costs(stages)
    m = costs.microbatches
    n_st = len(stages)
    n_dev = costs.devices
    speed = costs.speed
    fwd = [sc.forward[s] / speed[owner[s]] for s in range(n_st)]
    bwd = [sc.backward[s] / speed[owner[s]] for s in range(n_st)]
    wgt = [sc.weight[s] / speed[owner[s]] for s in range(n_st)]
    hop = [0.0] + [
        costs.transfer_time(owner[s - 1], owner[s], sc.output_bytes[s - 1]) for s in range(1, n_st)
    ]
    dev_stages: list[list[int]] = [[] for _ in range(n_dev)]
    for s in range(n_st):
        dev_stages[owner[s]].append(s)
    # Deeper stages first on ties: their work is closer to the loss.
    for lst in dev_stages:
        lst.sort(reverse=True)

    # Memory admission: params + (in-flight microbatches) x (activations of one microbatch).
    params = [0.0] * n_dev
    need = [0.0] * n_dev
    for s in range(n_st):
        params[owner[s]] += sc.param_bytes[s]
        need[owner[s]] += sc.activation_bytes[s]
    cap_mb = []
    for d in range(n_dev):
        room = costs.memory[d] * memory_fraction - params[d]
        if room < need[d] or room < 0:
            return Schedule((), math.inf, False, f"device {d}: parameters and one microbatch "
                            f"need {params[d] + need[d]:.4g} bytes, it has {costs.memory[d]:.4g}")
        cap_mb.append(m if need[d] <= 0 or room == math.inf else int(room // need[d]))
    limit = min([m, *cap_mb, policy.max_inflight or m])
    limit = max(limit, 1)
    inflight = 0
    # Remaining W/BW per microbatch before its activations are released everywhere.
    pending_release = [n_st] * m

    f_end = [-1.0] * (n_st * m)
    b_end = [-1.0] * (n_st * m)
    next_f = [0] * n_st
    next_b = [0] * n_st
    wq: list[list[int]] = [[] for _ in range(n_st)]
    free = [0.0] * n_dev
    left = [len(dev_stages[d]) * m * (3 if policy.split_backward else 2) for d in range(n_dev)]
    out: list[list[tuple[str, int, int]]] = [[] for _ in range(n_dev)]
    active = [d for d in range(n_dev) if left[d]]
    waiting: list[int] = []
    split = policy.split_backward
    fill_w = policy.fill_with_w
    stall = (math.inf, -1)  # earliest known arrival among devices parked at the same instant

    while active:
        d = min(active, key=free.__getitem__)
        t = free[d]
        best: tuple[tuple[int, int], str, int, int] | None = None
        soonest = math.inf
        w_pick: tuple[int, int] | None = None  # (microbatch, stage) of the oldest pending W
        for s in dev_stages[d]:
            mb = next_b[s]
            if mb < m:
                i = s * m + mb
                r = f_end[i]
                if r >= 0 and s + 1 < n_st:
                    rb = b_end[i + m]
                    r = -1.0 if rb < 0 else max(r, rb + hop[s + 1])
                if r >= 0:
                    if r <= t:
                        if best is None or (0, mb) < best[0]:
                            best = ((0, mb), "B" if split else "BW", s, mb)
                    elif r < soonest:
                        soonest = r
            mb = next_f[s]
            if mb < m:
                if s == 0:
                    r = 0.0 if inflight < limit else -1.0
                else:
                    r = f_end[s * m + mb - m]
                    if r >= 0:
                        r += hop[s]
                if r >= 0:
                    if r <= t:
                        if best is None or (1, mb) < best[0]:
                            best = ((1, mb), "F", s, mb)
                    elif r < soonest:
                        soonest = r
            if wq[s] and (w_pick is None or wq[s][0] < w_pick[0]):
                w_pick = (wq[s][0], s)
        if best is None and w_pick is not None:
            # W fills the gap: always, or only where it ends before the next known arrival.
            if fill_w or t + wgt[w_pick[1]] <= soonest or soonest == math.inf:
                best = ((2, w_pick[0]), "W", w_pick[1], w_pick[0])
        if best is None:
            others = [free[e] for e in active if e != d]
            later = [x for x in others if x > t]
            if len(later) < len(others):
                # Another device is idle at the same instant: let it look first.
                if soonest < stall[0]:
                    stall = (soonest, d)
                active.remove(d)
                waiting.append(d)
                continue
            nxt = min(soonest, min(later, default=math.inf))
            if nxt < math.inf:
                free[d] = nxt
            elif stall[0] < math.inf:
                # Every device idle at t was tried: wake the one whose input comes first.
                free[stall[1]] = max(free[stall[1]], stall[0])
            else:
                raise PlannerError("list scheduler made no progress (internal error)")
            stall = (math.inf, -1)
            active.extend(waiting)
            waiting.clear()
            continue
        _, kind, s, mb = best
        i = s * m + mb
        if kind == "F":
            end = t + fwd[s]
            f_end[i] = end
            next_f[s] += 1
            if s == 0:
                inflight += 1
        elif kind == "B":
            end = t + bwd[s]
            b_end[i] = end
            next_b[s] += 1
            wq[s].append(mb)
        elif kind == "BW":
            end = t + bwd[s] + wgt[s]
            b_end[i] = end
            next_b[s] += 1
        else:
            end = t + wgt[s]
            wq[s].pop(0)
        if kind in ("W", "BW"):
            pending_release[mb] -= 1
            if pending_release[mb] == 0:
                inflight -= 1
        free[d] = end
        out[d].append((kind, s, mb))
        left[d] -= 1
        if not left[d]:
            active.remove(d)
        if waiting:
            active.extend(waiting)
            waiting.clear()
        stall = (math.inf, -1)
    iteration = max(free)
    return Schedule(tuple(tuple(a) for a in out), iteration, True, None)
