"""Drift: a running plan's measured compute per device against its prediction, and whether to
re-plan.

Sits in the planner (pure Python: no torch, no Kubernetes), used by both closed loops: the
local run (:mod:`adaptis.cli.run`) and the operator. Each feeds :class:`DriftWindow` the
workers' cumulative busy-time counters (``adaptis_busy_seconds_total``: F, B and W compute
only, so communication and bubbles do not blur it) and asks :func:`decide` once a window is
full.

Why device speeds: a GPU that throttles, a node replaced by another kind, a neighbour on a
shared host all scale *every* action of one device by the same factor; that is exactly a
device's ``speed`` in the :class:`~adaptis.api.problem.Problem`. So the corrected problem keeps
the profiled per-layer costs and sets each pipeline device's speed to
``speed × predicted busy / measured busy``. A uniform error of the model (every device 10 %
slower than predicted) scales every speed alike: the re-plan finds the same partition, the gain
is nil and nothing restarts. A per-layer cost error (a mis-profiled head) also shows up as its
device being slow; correcting the device instead of the layer is then approximate, which the
decision absorbs: it re-evaluates the *old* plan on the corrected problem and restarts only for
a real predicted gain.

"Sustained": a window of ``window_steps`` steps counts only if the drift is above the threshold
in both of its halves, so one slow step (a checkpoint, a page-in) never triggers a re-plan.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from adaptis.api.plan import Plan
from adaptis.api.problem import TIME_UNIT_SECONDS, DeviceList, Problem
from adaptis.planner.costs import Costs
from adaptis.planner.errors import PlannerError
from adaptis.planner.simulator import Simulation, simulate
from adaptis.planner.strategies import plan_strategy

__all__ = ["Decision", "Drift", "DriftWindow", "corrected_problem", "decide", "idle_devices", "predicted_busy",
           "scaled_speeds"]


def predicted_busy(problem: Problem, plan: Plan) -> list[float]:
    """Seconds of compute (F, B, W) the performance model gives each pipeline device a step."""
    sim = simulate(Costs.from_problem(problem), plan)
    unit = TIME_UNIT_SECONDS[problem.time_unit]
    return [b * unit for b in sim.busy]


@dataclass(frozen=True, slots=True)
class Drift:
    """Measured over predicted compute per pipeline device, over one window."""

    ratios: tuple[float, ...]  # measured / predicted busy seconds per step, per device
    deviation: tuple[float, ...]  # ratio / median ratio - 1: the part the model's overall error does not explain
    steps: int  # steps the window spans

    @property
    def worst(self) -> int:
        # With two devices the median is their mean and both deviate alike: name the slower one.
        return max(range(len(self.deviation)), key=lambda d: (round(abs(self.deviation[d]), 9), self.ratios[d]))

    def describe(self) -> str:
        d = self.worst
        return (f"device {d} measured {self.ratios[d]:.2f}x its predicted compute over {self.steps} "
                f"steps ({self.deviation[d]:+.0%} against the median device)")


class DriftWindow:
    """The last ``window_steps`` steps of cumulative busy counters, per pipeline device.

    ``observe`` takes the step number and the counters of every *global* rank; with data
    parallelism (``replicas`` > 1, rank = replica × devices + device) a pipeline device counts
    as its slowest replica's, since every replica waits for the slowest at the all-reduce.

    A device the plan idles (predicted busy 0) has no speed to measure: its ratio is the median
    of the busy devices' (no deviation of its own), so it never triggers a re-plan and a
    re-plan corrects it only by the model's overall error.
    """

    def __init__(self, *, predicted: Sequence[float], window_steps: int, replicas: int = 1) -> None:
        if window_steps < 2:
            raise PlannerError(f"window_steps must be at least 2, got {window_steps}")
        if any(p < 0 for p in predicted) or not any(p > 0 for p in predicted):
            raise PlannerError("predicted busy times must be non-negative, with at least one device busy")
        self.predicted = tuple(predicted)
        self.window_steps = window_steps
        self.replicas = replicas
        self._samples: deque[tuple[int, tuple[float, ...]]] = deque(maxlen=window_steps + 1)

    def observe(self, *, step: int, busy_seconds_total: Sequence[float]) -> None:
        devices = len(self.predicted)
        if len(busy_seconds_total) != devices * self.replicas:
            raise PlannerError(f"expected {devices * self.replicas} ranks' counters, got "
                               f"{len(busy_seconds_total)}")
        if self._samples and step <= self._samples[-1][0]:
            self._samples.clear()  # a restart reset the counters: start the window again
        self._samples.append((step, tuple(busy_seconds_total)))

    def reset(self) -> None:
        self._samples.clear()

    def _ratios(self, first: int, last: int) -> list[float]:
        (s0, b0), (s1, b1) = self._samples[first], self._samples[last]
        steps, devices = s1 - s0, len(self.predicted)
        per_rank = [(b1[r] - b0[r]) / steps for r in range(len(b0))]
        slowest = [max(per_rank[rep * devices + d] for rep in range(self.replicas))
                   for d in range(devices)]
        measured = {d: m / p for d, (m, p) in enumerate(zip(slowest, self.predicted, strict=True)) if p > 0}
        unknown = statistics.median(measured.values())  # an idle device: see the class docstring
        return [measured.get(d, unknown) for d in range(devices)]

    def ratios(self) -> list[float] | None:
        """Measured / predicted compute per device over the full window (None: not full yet),
        drifting or not: what a status shows."""
        if len(self._samples) <= self.window_steps:
            return None
        return self._ratios(0, -1)

    def drift(self, *, threshold: float) -> Drift | None:
        """The window's drift when full and above ``threshold`` in both halves, else None."""
        if len(self._samples) <= self.window_steps:
            return None
        mid = len(self._samples) // 2
        halves = [_deviation(self._ratios(0, mid)), _deviation(self._ratios(mid, -1))]
        if not all(max(abs(x) for x in h) > threshold for h in halves):
            return None
        ratios = self._ratios(0, -1)
        return Drift(ratios=tuple(ratios), deviation=tuple(_deviation(ratios)),
                     steps=self._samples[-1][0] - self._samples[0][0])


def _deviation(ratios: Sequence[float]) -> list[float]:
    median = statistics.median(ratios)
    return [r / median - 1 for r in ratios]


def scaled_speeds(problem: Problem, *, factors: Sequence[float]) -> Problem:
    """``problem`` with device d's speed times ``factors[d]``: the one way a measured correction
    reaches a problem (:func:`corrected_problem`, and the operator's persisted corrections)."""
    specs = problem.device_specs()
    if len(factors) != len(specs):
        raise PlannerError(f"{len(factors)} ratios for {len(specs)} devices")
    devices = [s.model_copy(update={"speed": s.speed * f}) for s, f in zip(specs, factors, strict=True)]
    return problem.model_copy(update={"devices": DeviceList(list=devices)})


def corrected_problem(problem: Problem, *, ratios: Sequence[float]) -> Problem:
    """``problem`` with each device's speed divided by its measured / predicted ratio."""
    if not all(math.isfinite(r) and r > 0 for r in ratios):
        raise PlannerError(f"ratios must be positive and finite, got {list(ratios)}")
    return scaled_speeds(problem, factors=[1 / r for r in ratios])


@dataclass(frozen=True, slots=True)
class Decision:
    """What a re-plan would give, and whether it is worth a restart."""

    replan: bool
    reason: str
    old_iteration_seconds: float  # the running plan, on the corrected problem
    new_iteration_seconds: float
    plan: Plan | None  # the better plan (None when the search found nothing better)
    problem: Problem  # the corrected problem the new plan was made for
    simulation: Simulation | None = None  # the new plan's, on that problem

    @property
    def gain(self) -> float:
        """Fraction of the iteration the new plan saves."""
        return 1 - self.new_iteration_seconds / self.old_iteration_seconds


def idle_devices(plan: Plan) -> list[int]:
    """Devices ``plan`` gives no action (a device slow enough is worth idling, to the planner).
    The workers run such plans: an idle rank stays out of torch's pipelining and only joins the
    step's collectives. For reporting."""
    return [d for d, actions in enumerate(plan.actions) if not actions]


def decide(problem: Problem, plan: Plan, *, drift: Drift, strategy: str, remaining_steps: int,
           restart_seconds: float, min_gain: float, time_limit_s: float | None = None) -> Decision:
    """Re-plan ``problem`` corrected by ``drift`` and weigh the gain against a restart.

    Worth it when the new plan saves at least ``min_gain`` of the iteration *and* the time it
    saves over ``remaining_steps`` exceeds ``restart_seconds`` (checkpoint, restart, warm-up:
    measured by the caller). A new plan that idles a device is taken as any other (the
    workers run it; the reason names the idle devices)."""
    fixed = corrected_problem(problem, ratios=drift.ratios)
    unit = TIME_UNIT_SECONDS[problem.time_unit]
    old = simulate(Costs.from_problem(fixed), plan)
    if not old.feasible:  # the old plan cannot be judged on the corrected problem: never worse
        raise PlannerError(f"the running plan does not replay on the corrected problem: {old.reason}")
    old_s = old.iteration_time * unit
    outcome = plan_strategy(fixed, strategy, time_limit_s=time_limit_s)
    if outcome.plan is None or outcome.simulation is None:
        return Decision(replan=False, reason=f"no runnable plan for the corrected problem: {outcome.result.reason}",
                        old_iteration_seconds=old_s, new_iteration_seconds=old_s, plan=None,
                        problem=fixed)
    new_s = outcome.simulation.iteration_time * unit
    saved = (old_s - new_s) * remaining_steps
    gain = 1 - new_s / old_s
    if gain < min_gain:
        why = f"the new plan saves {gain:.1%} of the iteration, under minGain {min_gain:.0%}"
    elif saved <= restart_seconds:
        why = (f"the new plan saves {saved:.0f} s over the {remaining_steps} remaining steps, "
               f"not more than a restart's {restart_seconds:.0f} s")
    else:
        why = (f"{drift.describe()}: re-planned {old_s * 1e3:.1f} -> {new_s * 1e3:.1f} ms per "
               f"iteration, saving {saved:.0f} s over {remaining_steps} steps against a "
               f"{restart_seconds:.0f} s restart")
    idle = idle_devices(outcome.plan)
    note = f" (the new plan idles device(s) {idle})" if idle else ""
    return Decision(replan=gain >= min_gain and saved > restart_seconds, reason=why + note,
                    old_iteration_seconds=old_s, new_iteration_seconds=new_s,
                    plan=outcome.plan, problem=fixed, simulation=outcome.simulation)
