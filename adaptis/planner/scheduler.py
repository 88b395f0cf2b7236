"""The memory-aware list scheduler: F/B/W order for a given partition and placement.

Sits under :mod:`adaptis.planner.search`, which chooses partitions and placements and asks
this module for the best schedule of each. It decides on its own clock and reports the time
its order replays to under the model of :mod:`adaptis.planner.simulator` (computed as it
goes, ``_Pipeline._replay``): ``simulate`` of the plan it emits gives the same iteration time
(tests/planner/test_planner_scheduler.py checks it on random problems).

The rule, after the AdaPtis paper: whenever a device is idle it picks among its ready work
with priority B (input gradients, oldest microbatch first: they unblock the devices upstream
and free memory soonest), then F (oldest microbatch first, deeper stage on ties: drives work
towards the loss), and W last, to fill the gaps that nothing else can. A new microbatch is
admitted into the pipeline (F of stage 0) only if every device can hold the activations of
every in-flight microbatch plus the new one, so the schedule can never run out of memory or
deadlock on it. With ``Policy.admit_per_device`` each device admits on its own instead: a
device runs the F of its first stage for a microbatch only while it can hold one more. That
cannot deadlock either: F runs in microbatch order on every stage, so wherever a newer
microbatch was admitted the oldest unfinished one was admitted before it, and what a full
device holds that is older is waiting only for its own W, which it runs first.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from heapq import heapify, heappop, heappush
from typing import Literal

from adaptis.api.plan import Action, ActionKind
from adaptis.planner.costs import Costs, StageCosts
from adaptis.planner.errors import OutOfTime, PlannerError
from adaptis.planner.post_pipeline import step_time

__all__ = ["Policy", "Schedule", "inflight_caps", "list_schedule"]


@dataclass(frozen=True, slots=True)
class Policy:
    """Knobs of the schedule phase that the search tunes."""

    split_backward: bool = True  # B/W split (zero-bubble style) or fused BW
    max_inflight: int | None = None  # cap on microbatches in flight (None: memory decides)
    fill_with_w: bool = True  # run a W whenever nothing else is ready (else only where it fits)
    # Admission per device: a device takes a new microbatch (the F of its first stage) while it
    # has room for it, instead of stage 0 waiting until *every* device has room. The global
    # rule reserves a microbatch's memory on devices it has not reached yet, so one device
    # with room for few (a huge head) throttles the whole pipeline to that many in flight.
    admit_per_device: bool = False
    # Stage 0 runs fused BW (not B then W) for microbatches from this one on (None: never).
    # Stage 0's B is empty (its whole backward is W) and W runs last, so device 0 can finish
    # the iteration with a run of deferred W's; fusing the last microbatches' does them at once.
    fuse_first_from: int | None = None
    # W of a stage whose backwards are all done first, the deepest such stage's W's all
    # before another's (else the oldest microbatch's, any stage): that stage's gradient is
    # final sooner, so its all-reduce across the replicas starts under the device's other
    # work. Tried only when the search scores the step.
    drain_w: bool = False


@dataclass(frozen=True, slots=True)
class Schedule:
    actions: tuple[tuple[Action, ...], ...]
    iteration_time: float
    feasible: bool
    reason: str | None
    # The whole step (post_pipeline.step_time of the replayed order); the iteration where the
    # problem has no all-reduce or optimizer.
    step_time: float = math.inf

    def score(self, *, by_step: bool) -> float:
        """What the search minimises (``Costs.by_step``); inf where it does not fit."""
        if not self.feasible:
            return math.inf
        return self.step_time if by_step else self.iteration_time


@dataclass(frozen=True, slots=True)
class _Durations:
    """Per stage: each action's time on the stage's device (overhead included), and ``hop[s]``,
    the transfer between stage ``s-1`` and stage ``s`` (the same both ways; 0 for stage 0)."""

    fwd: list[float]
    bwd: list[float]
    wgt: list[float]
    fused: list[float]
    hop: list[float]


def _durations(costs: Costs, *, sc: StageCosts, owner: list[int]) -> _Durations:
    speed = costs.speed
    over = costs.overhead
    n_st = len(owner)
    return _Durations(
        fwd=[sc.forward[s] / speed[owner[s]] + over for s in range(n_st)],
        bwd=[sc.backward[s] / speed[owner[s]] + over for s in range(n_st)],
        wgt=[sc.weight[s] / speed[owner[s]] + over for s in range(n_st)],
        fused=[sc.fused[s] / speed[owner[s]] + over for s in range(n_st)],
        hop=[0.0] + [
            costs.transfer_time(owner[s - 1], owner[s], nbytes=sc.output_bytes[s - 1]) for s in range(1, n_st)
        ],
    )


def inflight_caps(costs: Costs, *, sc: StageCosts, owner: list[int],
                  policy: Policy) -> list[int] | str:
    """How many admitted microbatches each device can hold at once: parameters plus that many
    microbatches' activations of its stages fit its memory. A reason (str) if not even one fits."""
    m = costs.microbatches
    params, need = sc.held_by(owner, devices=costs.devices)
    caps = []
    for d in range(costs.devices):
        room = costs.memory[d] - params[d]
        if room < need[d] or room < 0:
            return (f"device {d}: parameters and one microbatch need {params[d] + need[d]:.4g} "
                    f"bytes, it has {costs.memory[d]:.4g}")
        caps.append(m if need[d] <= 0 or room == math.inf else int(min(m, room // need[d])))
    if policy.max_inflight:
        caps = [min(c, policy.max_inflight) for c in caps]
    return caps


class _Pipeline:
    """The scheduler's state while it runs: what has run, what is queued, what memory holds.

    Readiness follows the simulator's rules (:func:`adaptis.planner.simulator.simulate`):
    ``f_end`` / ``b_end`` hold each (stage, microbatch)'s F / B end (-1: not run yet).
    """

    __slots__ = ("m", "n_st", "owner", "dur", "caps", "split", "fill_w", "stage0_dev",
                 "dev_stages", "held", "owed", "mem_devs", "tight", "f_end", "b_end", "next_f",
                 "next_b", "w_queue", "free", "replay_f", "replay_b", "replay_free", "left", "out",
                 "first", "fuse_from", "drain", "replay_w")

    def __init__(self, costs: Costs, *, owner: list[int], dur: _Durations, caps: list[int],
                 policy: Policy) -> None:
        n_st, n_dev, m = len(owner), costs.devices, costs.microbatches
        self.m, self.n_st, self.owner, self.dur, self.caps = m, n_st, owner, dur, caps
        self.split = policy.split_backward
        self.fill_w = policy.fill_with_w
        self.stage0_dev = owner[0]
        self.dev_stages: list[list[int]] = [[] for _ in range(n_dev)]
        for s in range(n_st):
            self.dev_stages[owner[s]].append(s)
        for lst in self.dev_stages:
            lst.sort(reverse=True)  # deeper stages first on ties: their work is closer to the loss
        # held[d]: admitted microbatches whose activations device d has not released yet;
        # owed[d*m + mb]: stages of d that still owe a W (or BW) for mb. A microbatch is admitted
        # only if every device can hold one more: the future of everything admitted always fits.
        self.held = [0] * n_dev
        # first[s]: stage s is its device's first (where that device admits, per device); -1
        # everywhere under the global rule, where only stage 0 admits, for every device.
        self.first = [-1] * n_st
        if policy.admit_per_device:
            for lst in self.dev_stages:
                if lst:
                    self.first[min(lst)] = owner[min(lst)]
        self.owed = [len(self.dev_stages[d]) for d in range(n_dev) for _ in range(m)]
        self.mem_devs = [d for d in range(n_dev) if self.dev_stages[d]]
        self.tight = [False] * n_dev  # a device that blocked admission: it runs W before F
        self.f_end = [-1.0] * (n_st * m)
        self.b_end = [-1.0] * (n_st * m)
        self.next_f = [0] * n_st
        self.next_b = [0] * n_st
        self.w_queue: list[deque[int]] = [deque() for _ in range(n_st)]
        self.free = [0.0] * n_dev
        # The same ends when the order is replayed (see _replay): what the schedule reports.
        self.replay_f = [-1.0] * (n_st * m)
        self.replay_b = [-1.0] * (n_st * m)
        self.replay_free = [0.0] * n_dev
        self.replay_w = [0.0] * n_st  # each stage's last W (or BW) end: its all-reduce's start
        self.drain = policy.drain_w
        per_mb = 3 if self.split else 2
        self.left = [len(self.dev_stages[d]) * m * per_mb for d in range(n_dev)]
        # Stage 0's microbatches from fuse_first_from on run one BW instead of B and W.
        self.fuse_from = m if policy.fuse_first_from is None or not self.split else policy.fuse_first_from
        self.left[owner[0]] -= m - self.fuse_from
        self.out: list[list[Action]] = [[] for _ in range(n_dev)]

    def admission_open(self) -> bool:
        """Whether stage 0 may take a new microbatch; marks every full device ``tight``."""
        open_ = True
        for e in self.mem_devs:
            if self.held[e] >= self.caps[e]:
                self.tight[e] = True
                open_ = False
        return open_

    def choose(self, d: int, t: float) -> tuple[ActionKind | Literal[""], int, int, float]:
        """What device ``d`` runs at ``t``: (kind, stage, microbatch, soonest), kind "" for
        nothing, then ``soonest`` is the next known arrival of an input (inf: none known).

        B first (oldest microbatch), then F (oldest, deeper stage on ties), W to fill a gap;
        a W before anything else on a device that blocks admission (it frees memory).
        Inputs are ready as the simulator says: F(s, mb) after F(s-1, mb) and its transfer;
        B(s, mb) after F(s, mb) and B(s+1, mb) with the gradient's transfer back. (The hot
        loop of the planner: locals instead of attribute reads and helper calls.)"""
        m, n_st, f_end, b_end, hop = self.m, self.n_st, self.f_end, self.b_end, self.dur.hop
        next_f, next_b, w_queue = self.next_f, self.next_b, self.w_queue
        admitted = True
        first = self.first
        if first[0] < 0 and d == self.stage0_dev and next_f[0] < m:
            admitted = self.admission_open()
        best_kind: ActionKind | Literal[""] = ""
        best_key, best_s, best_mb = (9, 0), -1, -1
        soonest = math.inf
        w_mb, w_s, w_key, drain = m, -1, m, self.drain
        for s in self.dev_stages[d]:
            mb = next_b[s]
            if mb < m:
                i = s * m + mb
                r = f_end[i]
                if r >= 0 and s + 1 < n_st:
                    rb = b_end[i + m]
                    r = -1.0 if rb < 0 else max(r, rb + hop[s + 1])
                if r >= 0:
                    if r > t:
                        soonest = min(soonest, r)
                    elif (0, mb) < best_key:
                        split = self.split and (s > 0 or mb < self.fuse_from)
                        best_key, best_kind, best_s, best_mb = (0, mb), "B" if split else "BW", s, mb
            mb = next_f[s]
            if mb < m:
                if s == 0:
                    r = 0.0 if admitted else -1.0
                else:
                    r = f_end[s * m + mb - m]
                    if r >= 0:
                        r += hop[s]
                if first[s] >= 0 and self.held[d] >= self.caps[d]:
                    self.tight[d] = True  # full: nothing new until a W frees a microbatch
                    r = -1.0
                if r >= 0:
                    if r > t:
                        soonest = min(soonest, r)
                    elif (1, mb) < best_key:
                        best_key, best_kind, best_s, best_mb = (1, mb), "F", s, mb
            q = w_queue[s]
            if q:
                # Oldest first, deeper stage on ties; draining, a stage with every B done goes
                # first, the deepest of those first (all its W's, so its gradient is final).
                key = -1 - s if drain and next_b[s] == m else q[0]
                if key < w_key:
                    w_key, w_mb, w_s = key, q[0], s
        if w_s >= 0 and self.tight[d] and best_key[0] >= 1:
            return "W", w_s, w_mb, soonest  # free memory before more forwards
        # W fills the gap: always, or only where it ends before the next known arrival.
        if not best_kind and w_s >= 0 and (
                self.fill_w or soonest == math.inf or t + self.dur.wgt[w_s] <= soonest):
            return "W", w_s, w_mb, soonest
        return best_kind, best_s, best_mb, soonest

    def _replay(self, d: int, *, kind: ActionKind, s: int, i: int, took: float) -> None:
        """Time an action as the executor and the simulator will run the emitted order: as soon
        as its device is free and its inputs are there (``i``: stage x m + microbatch).

        The scheduler's own clock (``f_end``, ``free``, ...) can run later: stage 0's device
        idles while admission waits for memory, and a W held back for an arrival can wait
        longer than it needs to; the executor waits for neither, it only keeps the order.
        So decisions follow the scheduler's clock, the reported time this one."""
        m, hop, rf, rb = self.m, self.dur.hop, self.replay_f, self.replay_b
        if kind == "F":
            ready = 0.0 if s == 0 else rf[i - m] + hop[s]
        elif kind == "W":
            ready = rb[i]
        elif s + 1 < self.n_st:
            ready = max(rf[i], rb[i + m] + hop[s + 1])
        else:
            ready = rf[i]
        free = self.replay_free[d]
        end = (ready if ready > free else free) + took
        self.replay_free[d] = end
        if kind == "F":
            rf[i] = end
        elif kind != "W":
            rb[i] = end
        if kind in ("W", "BW"):
            self.replay_w[s] = end

    def run(self, d: int, t: float, *, kind: ActionKind, s: int, mb: int, looks: list[tuple[float, int]]) -> None:
        """Record ``kind`` (s, mb) on device ``d`` from ``t``; push the looks it causes
        (time, device) onto the ``looks`` heap."""
        m, dur = self.m, self.dur
        i = s * m + mb
        took = dur.fwd[s] if kind == "F" else dur.wgt[s] if kind == "W" else dur.bwd[s] if kind == "B" else dur.fused[s]
        end = t + took
        self._replay(d, kind=kind, s=s, i=i, took=took)
        if kind == "F":
            self.f_end[i] = end
            self.next_f[s] += 1
            if self.first[s] >= 0:
                self.held[d] += 1
            elif s == 0:
                for e in self.mem_devs:
                    self.held[e] += 1
            # The next stage's device gets the activation; the last stage's own B is ready now.
            heappush(looks, (end + dur.hop[s + 1], self.owner[s + 1]) if s + 1 < self.n_st else (end, d))
        elif kind == "W":
            self.w_queue[s].popleft()
        else:
            self.b_end[i] = end
            self.next_b[s] += 1
            if kind == "B":
                self.w_queue[s].append(mb)
            if s > 0:
                heappush(looks, (end + dur.hop[s], self.owner[s - 1]))
        if kind in {"W", "BW"}:
            k = d * m + mb
            self.owed[k] -= 1
            if self.owed[k] == 0:
                self.held[d] -= 1
                self.tight[d] = False
                heappush(looks, (end, self.stage0_dev))  # memory freed: stage 0 may admit a microbatch
        self.free[d] = end
        self.out[d].append((kind, s, mb))
        self.left[d] -= 1
        heappush(looks, (end, d))


def list_schedule(
    costs: Costs,
    *,
    stages: list[tuple[int, int]],
    owner: list[int],
    policy: Policy = Policy(),
    deadline: float | None = None,
    recompute: tuple[bool, ...] | None = None,
) -> Schedule:
    """Schedule every microbatch's F/B/W for ``stages`` placed as ``owner[s]`` (a device).

    ``recompute[s]``: stage ``s`` recomputes its activations (``Plan.recompute``; costs as
    :meth:`Costs.stage_costs` charges them); only with fused backwards
    (``policy.split_backward`` false), as plans require.

    ``deadline`` (a :func:`time.monotonic` value): raise :class:`OutOfTime` once it passes;
    one schedule of a 64-device x 4096-microbatch problem alone can take minutes.
    """
    if recompute and any(recompute) and policy.split_backward:
        raise PlannerError("list_schedule: a recomputed stage runs fused backwards; pass a policy "
                           "with split_backward=False")
    sc = costs.stage_costs(stages, recompute=recompute)
    caps = inflight_caps(costs, sc=sc, owner=owner, policy=policy)
    if isinstance(caps, str):
        return Schedule((), math.inf, False, caps)
    pipe = _Pipeline(costs, owner=owner, dur=_durations(costs, sc=sc, owner=owner), caps=caps, policy=policy)
    # Discrete events (time, device): "look at this device then". A device looks when it
    # becomes free and when an input of one of its stages arrives; nothing else can make
    # new work ready, so no other instant needs a look.
    free, left, choose, run = pipe.free, pipe.left, pipe.choose, pipe.run  # used on every step
    events: list[tuple[float, int]] = [(0.0, d) for d in range(costs.devices) if left[d]]
    heapify(events)
    remaining = sum(left)
    steps = 0
    while remaining:
        steps += 1
        # Every 4096 steps: the clock costs next to nothing at that rate.
        if deadline is not None and not steps & 4095 and time.monotonic() >= deadline:
            raise OutOfTime("the time limit ran out during a list schedule")
        if not events:
            raise PlannerError("list scheduler made no progress (internal error)")
        t, d = heappop(events)
        if free[d] > t or not left[d]:
            continue  # busy (it will look again when free) or done
        kind, s, mb, soonest = choose(d, t)
        if not kind:
            if soonest < math.inf:
                heappush(events, (soonest, d))
            continue  # an arrival or a release will push a new look
        run(d, t, kind=kind, s=s, mb=mb, looks=events)
        remaining -= 1
    end = max(pipe.replay_free)
    placement = [[s for s, o in enumerate(owner) if o == d] for d in range(costs.devices)]
    step = step_time(costs, stages=stages, placement=placement, last_w=pipe.replay_w,
                     device_end=pipe.replay_free)
    return Schedule(tuple(tuple(a) for a in pipe.out), end, True, None, step)
