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

import heapq
import math
import time
from collections import deque
from dataclasses import dataclass

from adaptis.planner.costs import Costs
from adaptis.planner.errors import OutOfTime, PlannerError

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
    deadline: float | None = None,
) -> Schedule:
    """Schedule every microbatch's F/B/W for ``stages`` placed as ``owner[s]`` (a device).

    ``deadline`` (a :func:`time.monotonic` value): raise :class:`OutOfTime` once it passes;
    one schedule of a 64-device x 4096-microbatch problem alone can take minutes.
    """
    sc = costs.stage_costs(stages)
    m = costs.microbatches
    n_st = len(stages)
    n_dev = costs.devices
    speed = costs.speed
    over = costs.overhead
    fwd = [sc.forward[s] / speed[owner[s]] + over for s in range(n_st)]
    bwd = [sc.backward[s] / speed[owner[s]] + over for s in range(n_st)]
    wgt = [sc.weight[s] / speed[owner[s]] + over for s in range(n_st)]
    fused = [sc.fused[s] / speed[owner[s]] + over for s in range(n_st)]
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
        room = costs.memory[d] - params[d]
        if room < need[d] or room < 0:
            return Schedule((), math.inf, False, f"device {d}: parameters and one microbatch "
                            f"need {params[d] + need[d]:.4g} bytes, it has {costs.memory[d]:.4g}")
        cap_mb.append(m if need[d] <= 0 or room == math.inf else int(min(m, room // need[d])))
    if policy.max_inflight:
        cap_mb = [min(c, policy.max_inflight) for c in cap_mb]
    # count[d]: admitted microbatches whose activations device d has not released yet;
    # rel[d*m + mb]: stages of d that still owe a W (or BW) for mb. A microbatch is admitted
    # only if every device can hold one more: the future of everything admitted always fits.
    count = [0] * n_dev
    rel = [len(dev_stages[d]) for d in range(n_dev) for _ in range(m)]
    mem_dev = [d for d in range(n_dev) if dev_stages[d]]
    tight = [False] * n_dev  # the device that blocks admission: it runs W before F
    f_end = [-1.0] * (n_st * m)
    b_end = [-1.0] * (n_st * m)
    next_f = [0] * n_st
    next_b = [0] * n_st
    wq: list[deque[int]] = [deque() for _ in range(n_st)]
    free = [0.0] * n_dev
    left = [len(dev_stages[d]) * m * (3 if policy.split_backward else 2) for d in range(n_dev)]
    out: list[list[tuple[str, int, int]]] = [[] for _ in range(n_dev)]
    split = policy.split_backward
    fill_w = policy.fill_with_w
    head_dev = owner[0]
    # Discrete events (time, device): "look at this device then". A device looks when it
    # becomes free and when an input of one of its stages arrives; nothing else can make
    # new work ready, so no other instant needs a look.
    events: list[tuple[float, int]] = [(0.0, d) for d in range(n_dev) if left[d]]
    heapq.heapify(events)
    remaining = sum(left)
    push = heapq.heappush
    pop = heapq.heappop

    steps = 0
    while remaining:
        steps += 1
        # Every 4096 steps: the clock costs next to nothing at that rate.
        if deadline is not None and not steps & 4095 and time.monotonic() >= deadline:
            raise OutOfTime("the time limit ran out during a list schedule")
        if not events:
            raise PlannerError("list scheduler made no progress (internal error)")
        t, d = pop(events)
        if free[d] > t or not left[d]:
            continue  # busy (it will look again when free) or done
        best_kind = ""
        best_key = (9, 0)
        best_s = best_mb = -1
        soonest = math.inf
        w_mb = m
        w_s = -1
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
                        if (0, mb) < best_key:
                            best_key, best_kind, best_s, best_mb = (0, mb), "B" if split else "BW", s, mb
                    elif r < soonest:
                        soonest = r
            mb = next_f[s]
            if mb < m:
                if s == 0:
                    r = 0.0
                    for e in mem_dev:
                        if count[e] >= cap_mb[e]:
                            tight[e] = True
                            r = -1.0
                else:
                    r = f_end[s * m + mb - m]
                    if r >= 0:
                        r += hop[s]
                if r >= 0:
                    if r <= t:
                        if (1, mb) < best_key:
                            best_key, best_kind, best_s, best_mb = (1, mb), "F", s, mb
                    elif r < soonest:
                        soonest = r
            q = wq[s]
            if q and q[0] < w_mb:
                w_mb, w_s = q[0], s
        if w_s >= 0 and tight[d] and best_key[0] >= 1:
            best_kind, best_s, best_mb = "W", w_s, w_mb  # free memory before more forwards
        elif not best_kind and w_s >= 0:
            # W fills the gap: always, or only where it ends before the next known arrival.
            if fill_w or soonest == math.inf or t + wgt[w_s] <= soonest:
                best_kind, best_s, best_mb = "W", w_s, w_mb
        if not best_kind:
            if soonest < math.inf:
                push(events, (soonest, d))
            continue  # an arrival or a release will push a new look
        s, mb = best_s, best_mb
        i = s * m + mb
        if best_kind == "F":
            end = t + fwd[s]
            f_end[i] = end
            next_f[s] += 1
            if s == 0:
                for e in mem_dev:
                    count[e] += 1
            if s + 1 < n_st:
                push(events, (end + hop[s + 1], owner[s + 1]))
            else:
                push(events, (end, d))
        elif best_kind == "W":
            end = t + wgt[s]
            wq[s].popleft()
        else:
            end = t + (bwd[s] if split else fused[s])
            b_end[i] = end
            next_b[s] += 1
            if split:
                wq[s].append(mb)
            if s > 0:
                push(events, (end + hop[s], owner[s - 1]))
        if best_kind == "W" or best_kind == "BW":
            k = d * m + mb
            rel[k] -= 1
            if rel[k] == 0:
                count[d] -= 1
                tight[d] = False
                push(events, (end, head_dev))  # memory freed: stage 0 may admit a microbatch
        free[d] = end
        out[d].append((best_kind, s, mb))
        left[d] -= 1
        remaining -= 1
        push(events, (end, d))
    iteration = max(free)
    return Schedule(tuple(tuple(a) for a in out), iteration, True, None)
