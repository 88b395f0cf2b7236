"""The pipeline performance model: replay a plan's per-device action lists in simulated time.

Sits in the planner layer, above :mod:`adaptis.planner.costs`. Every strategy (baselines and
the joint search) is scored here, so the figures ``adaptis plan`` prints for one plan are the
same whoever produced it. The model, per method.md:

- an action starts when its device is free and its inputs have arrived: F(s, mb) needs
  F(s-1, mb) plus the transfer of stage s-1's output between the two devices; B(s, mb) needs
  F(s, mb) and B(s+1, mb) plus the gradient transfer back; W(s, mb) needs B(s, mb); a fused
  BW is B then W in one action, its input gradient leaves when it ends;
- transfers cost ``latency + bytes / bandwidth`` of the link (none on one device) and overlap
  with compute: sends are asynchronous, only the receiver waits;
- a device of speed ``v`` runs an action in ``time / v``, plus the problem's fixed
  ``action_overhead_s`` (runtime bookkeeping, measured by ``adaptis profile``);
- the first stage has no input gradient: its B time counts in its W (as torch runs it);
- after the pipeline, data-parallel gradient all-reduces and the optimizer step
  (:mod:`adaptis.planner.post_pipeline`) give ``step_time``; ``iteration_time`` stays the
  pipeline's end, which the search optimises;
- memory of a device = parameters of its stages + activations held from each F's start until
  the matching W (or BW) ends. torch's pipelining runtime keeps a microbatch's saved tensors
  until W even on its B/W split, so this rule is the executor's too;
- a stage the plan recomputes (``Plan.recompute``) pays its forward again in its backward and
  holds only its input per microbatch (:meth:`adaptis.planner.costs.Costs.stage_costs`).
"""

from __future__ import annotations

from dataclasses import dataclass

from adaptis.api.plan import Plan
from adaptis.planner.costs import Costs
from adaptis.planner.errors import DeadlockError, PlannerError
from adaptis.planner.post_pipeline import PostPipeline, post_pipeline
from adaptis.planner.reasons import blocked_devices, over_memory

__all__ = ["Simulation", "TimedAction", "simulate"]


@dataclass(frozen=True, slots=True)
class TimedAction:
    kind: str
    stage: int
    microbatch: int
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class Simulation:
    """The performance model's verdict on one plan (times in the problem's ``time_unit``)."""

    iteration_time: float
    bubble_ratio: float
    busy: tuple[float, ...]
    bubble: tuple[float, ...]
    warmup_bubble: tuple[float, ...]
    steady_bubble: tuple[float, ...]
    cooldown_bubble: tuple[float, ...]
    peak_memory: tuple[float, ...]
    feasible: bool
    reason: str | None
    timeline: tuple[tuple[TimedAction, ...], ...]
    post: PostPipeline | None = None  # the reductions and optimizer step after the pipeline

    @property
    def step_time(self) -> float:
        """The whole step: the pipeline, then what :attr:`post` adds."""
        return self.iteration_time if self.post is None else self.post.step_time

    @property
    def post_pipeline_time(self) -> float:
        return 0.0 if self.post is None else self.post.post_pipeline_time


def simulate(costs: Costs, plan: Plan) -> Simulation:
    """Replay ``plan`` on ``costs``; raise :class:`DeadlockError` if the lists wait on each other."""
    plan.check(layers=costs.layers, microbatches=costs.microbatches, devices=costs.devices)
    sc = costs.stage_costs(plan.stages, recompute=plan.recompute)
    owner = plan.stage_device()
    m = costs.microbatches
    n_stages = len(plan.stages)
    speed = costs.speed
    # Transfer time into stage s from stage s-1 (forward) equals the one back (gradient).
    hop = [0.0] + [
        costs.transfer_time(owner[s - 1], owner[s], nbytes=sc.output_bytes[s - 1]) for s in range(1, n_stages)
    ]
    f_end = [-1.0] * (n_stages * m)
    b_end = [-1.0] * (n_stages * m)
    lists = plan.actions
    n_dev = len(lists)
    pos = [0] * n_dev
    free = [0.0] * n_dev
    done: list[list[TimedAction]] = [[] for _ in range(n_dev)]

    def ready_time(kind: str, s: int, *, mb: int) -> float | None:
        """When the inputs of an action are there; None if a producer has not run yet."""
        i = s * m + mb
        if kind == "F":
            if s == 0:
                return 0.0
            t = f_end[i - m]
            return None if t < 0 else t + hop[s]
        if kind in ("B", "BW"):
            t = f_end[i]
            if t < 0:
                return None
            if s + 1 < n_stages:
                tb = b_end[i + m]
                if tb < 0:
                    return None
                t = max(t, tb + hop[s + 1])
            return t
        t = b_end[i]  # W
        return None if t < 0 else t

    # Each device runs its list until an input is missing, then waits on the producer's key
    # (a stage's F or B end, i.e. the index into f_end or b_end); finishing it wakes the device.
    runnable = list(range(n_dev))
    waiters: dict[tuple[bool, int], list[int]] = {}
    while runnable:
        d = runnable.pop()
        acts = lists[d]
        while pos[d] < len(acts):
            kind, s, mb = acts[pos[d]]
            ready = ready_time(kind, s, mb=mb)
            if ready is None:
                waiters.setdefault(_producer(kind, s, mb=mb, m=m, f_end=f_end), []).append(d)
                break
            if kind == "F":
                dur = sc.forward[s]
            elif kind == "B":
                dur = sc.backward[s]
            elif kind == "W":
                dur = sc.weight[s]
            else:
                dur = sc.fused[s]
            start = max(free[d], ready)
            end = start + dur / speed[d] + costs.overhead
            free[d] = end
            i = s * m + mb
            if kind == "F":
                f_end[i] = end
                runnable.extend(waiters.pop((True, i), ()))
            elif kind != "W":
                b_end[i] = end
                runnable.extend(waiters.pop((False, i), ()))
            done[d].append(TimedAction(kind, s, mb, start, end))
            pos[d] += 1
    stuck = [d for d in range(n_dev) if pos[d] < len(lists[d])]
    if stuck:
        waiting = tuple(lists[d][pos[d]] if pos[d] < len(lists[d]) else None for d in range(n_dev))
        blocked = blocked_devices(stuck, [None if w is None else tuple(w) for w in waiting])
        raise DeadlockError(f"plan deadlocks: {blocked}", waiting=waiting)
    return _summarise(costs=costs, plan=plan, timeline=done, act=sc.activation_bytes, params=sc.param_bytes)


def _producer(kind: str, s: int, *, mb: int, m: int, f_end: list[float]) -> tuple[bool, int]:
    """The key (is-forward, index) of the first missing input of an action."""
    i = s * m + mb
    if kind == "F":
        return (True, i - m)
    if kind == "W":
        return (False, i)
    if f_end[i] < 0:
        return (True, i)
    return (False, i + m)


def _summarise(
    *,
    costs: Costs,
    plan: Plan,
    timeline: list[list[TimedAction]],
    act: tuple[float, ...],
    params: tuple[float, ...],
) -> Simulation:
    n_dev = len(timeline)
    end = max((t[-1].end for t in timeline if t), default=0.0)
    if end <= 0:
        raise PlannerError("plan has no work")
    busy, bubble, warm, steady, cool, peaks = [], [], [], [], [], []
    for d in range(n_dev):
        acts = timeline[d]
        b = sum(a.end - a.start for a in acts)
        first = acts[0].start if acts else end
        last = acts[-1].end if acts else end
        busy.append(b)
        bubble.append(end - b)
        warm.append(first)
        cool.append(end - last)
        steady.append(max(0.0, end - b - first - (end - last)))
        # Memory walks the device's own order: allocations and frees happen at its boundaries.
        base = sum(params[s] for s in plan.placement[d])
        cur = peak = 0.0
        for a in acts:
            if a.kind == "F":
                cur += act[a.stage]
                peak = max(peak, cur)
            elif a.kind in ("W", "BW"):
                cur -= act[a.stage]
        peaks.append(base + peak)
    # One clause for the worst device and the count, not one per device (issue 32 item 4).
    reason = over_memory(peaks, costs.memory[:n_dev])
    ratio = 1.0 - sum(busy) / (n_dev * end)
    return Simulation(
        iteration_time=end,
        bubble_ratio=max(0.0, ratio),
        busy=tuple(busy),
        bubble=tuple(bubble),
        warmup_bubble=tuple(warm),
        steady_bubble=tuple(steady),
        cooldown_bubble=tuple(cool),
        peak_memory=tuple(peaks),
        feasible=reason is None,
        reason=reason,
        timeline=tuple(tuple(t) for t in timeline),
        post=post_pipeline(costs=costs, plan=plan, timeline=timeline),
    )
