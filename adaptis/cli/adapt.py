"""The closed loop of ``adaptis run``: launch the ranks, watch their compute drift, re-plan.

Sits between :mod:`adaptis.cli.run` (which plans, then calls :func:`train`) and the local
launcher. The ranks' step events carry each rank's cumulative busy seconds; every step that all
ranks reported feeds the planner's :class:`~adaptis.planner.drift.DriftWindow` (from the second
step of each launch: the first pays one-off costs). When the window shows a sustained drift and
``spec.adaptation.policy`` is not ``off``, :func:`~adaptis.planner.drift.decide` re-plans the
corrected problem and weighs the gain over the remaining steps against a restart, as measured
on this run: the launch to its first step plus the largest data phase seen (which holds the
periodic checkpoint's save). ``auto`` (up to ``maxReplans``) then stops the ranks with SIGTERM,
and relaunches them with the new plan from the checkpoint; ``suggest`` only reports the plan.
Each decision is printed and kept as a :class:`~adaptis.api.adaptation.ReplanRecord`.
docs/adaptation.md, "Local runs".
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from adaptis.api.adaptation import AdaptationSpec, ReplanRecord
from adaptis.api.events import DoneEvent, PreemptedEvent, StartEvent, StepEvent
from adaptis.api.job import WorkerConfig
from adaptis.api.plan import Plan, predicted_seconds
from adaptis.api.problem import Problem
from adaptis.planner.drift import Decision, Drift, DriftWindow, decide, predicted_busy
from adaptis.planner.errors import PlannerError

__all__ = ["Adapter", "Segment", "Trained", "check_slowdown", "layers_per_device", "train"]

log = logging.getLogger(__name__)

_DECISIONS = 20  # decisions kept for the summary, newest last

Say = Callable[[str], None]


def layers_per_device(plan: Plan) -> list[int]:
    return [sum(plan.stages[s][1] - plan.stages[s][0] for s in stages) for stages in plan.placement]


@dataclass
class Segment:
    """One launch of the ranks under one plan."""

    plan: Plan
    launched_at: float
    first_step_at: float | None = None
    stop_requested_at: float | None = None
    stopped_at: float | None = None  # every rank checkpointed and exited
    resumed_step: int = 0
    steps: list[StepEvent] = field(default_factory=list)  # rank 0's step events
    max_data_seconds: float = 0.0  # the largest data phase of those steps (kept as they come)
    rank_stages: dict[int, list[int]] = field(default_factory=dict)  # what each rank said it runs

    def report(self) -> dict[str, Any]:
        steady = self.steps[1:] or self.steps
        return {"from_step": self.resumed_step, "to_step": self.steps[-1].step if self.steps else None,
                "stages": len(self.plan.stages), "placement": self.plan.placement,
                "layers_per_device": layers_per_device(self.plan),
                "rank_stages": [self.rank_stages.get(r) for r in sorted(self.rank_stages)],
                "predicted_iteration_seconds": predicted_seconds(self.plan.predicted)["iteration_seconds"],
                "measured_iteration_seconds": statistics.mean(s.iteration_seconds for s in steady)
                if steady else None,
                "launch_to_first_step_seconds": None if self.first_step_at is None
                else self.first_step_at - self.launched_at,
                "stop_seconds": self.stop_seconds}

    @property
    def stop_seconds(self) -> float | None:
        """SIGTERM to every rank gone: the step in flight, the checkpoint, the exit."""
        if self.stop_requested_at is None or self.stopped_at is None:
            return None
        return self.stopped_at - self.stop_requested_at


@dataclass
class Trained:
    """What :func:`train` hands back for the summary."""

    plan: Plan  # the last plan run
    problem: Problem  # what it was planned for (after a re-plan: the speeds corrected by measurement)
    steps: list[StepEvent]  # rank 0's step events, each step once (a resume drops the re-run ones)
    starts: dict[int, StartEvent]  # each rank's first start event
    reduce: list[tuple[float, float]]
    segments: list[Segment]
    adaptation: dict[str, Any]


class Adapter:
    """The decision half of the loop: step events in, "stop now for this plan" out."""

    def __init__(self, *, problem: Problem, plan: Plan, spec: AdaptationSpec, strategy: str, total_steps: int,
                 replicas: int, ranks: int, time_limit_s: float | None, say: Say) -> None:
        self.spec, self.strategy, self.total_steps = spec, strategy, total_steps
        self.replicas, self.ranks, self.time_limit_s, self.say = replicas, ranks, time_limit_s, say
        self.profiled = [d.speed for d in problem.device_specs()]
        self.history: list[ReplanRecord] = []
        self.suggestion: ReplanRecord | None = None
        self.measured_ratio: list[float] = []
        self.pending: Decision | None = None  # the re-plan the ranks are being stopped for
        self.decisions: list[dict[str, Any]] = []  # the latest, so a user sees why nothing restarted
        self._said: set[str] = set()
        self._suggested_s: float | None = None  # the new iteration of the last suggestion said
        self.start(problem=problem, plan=plan)

    def start(self, *, problem: Problem, plan: Plan) -> None:
        """A launch under ``plan``, planned for ``problem``: a fresh window of its predictions."""
        self.problem, self.plan, self.pending = problem, plan, None
        predicted = predicted_busy(problem, plan)
        self.window: DriftWindow | None = None
        if self.spec.policy != "off" and max(predicted) > 0:
            # A device the plan idles has no speed to measure: the window gives it the others'
            # median ratio (DriftWindow), so the busy devices are still watched.
            self.window = DriftWindow(predicted=predicted, window_steps=self.spec.window_steps,
                                      replicas=self.replicas)
        self._busy: dict[int, dict[int, float]] = {}
        self._first_step: int | None = None

    def observe(self, event: StepEvent, *, segment: Segment, restart_seconds: float) -> bool:
        """A rank's step event; True when the ranks must stop for :attr:`pending`."""
        if self.window is None or self.pending is not None:
            return False
        step = event.step
        if self._first_step is None:
            self._first_step = step
        if step == self._first_step:  # the launch's first step pays one-off costs
            return False
        got = self._busy.setdefault(step, {})
        got[event.rank] = event.busy_seconds_total
        if len(got) < self.ranks:
            return False
        del self._busy[step]
        # One counter per device of each replica: under tensor parallelism a device is T
        # consecutive ranks (tensor innermost), paced by its slowest shard.
        tensor = self.ranks // (self.replicas * len(self.window.predicted))
        counters = [max(got[g * tensor + t] for t in range(tensor)) for g in range(self.ranks // tensor)]
        self.window.observe(step=step, busy_seconds_total=counters)
        drift = self.window.drift(threshold=self.spec.drift_threshold)
        if drift is None:
            return False
        self.measured_ratio = list(drift.ratios)
        try:
            decision = self._decide(drift, step=step, restart_seconds=restart_seconds)
        except PlannerError as err:
            self._once(f"adaptation: drift seen at step {step} ({drift.describe()}) but no re-plan: {err}")
            self.window.reset()
            return False
        window = [s.iteration_seconds for s in segment.steps if s.step > step - drift.steps]
        record = self._record(decision, step=step, measured=statistics.mean(window) if window else None)
        self.decisions = [*self.decisions[-(_DECISIONS - 1):],
                          {"step": step, "replan": decision.replan, "reason": decision.reason}]
        if not decision.replan:
            self._once(f"adaptation: drift at step {step}: {drift.describe()}; keeping the plan: {decision.reason}")
            self.window.reset()  # look again over a fresh window
            return False
        if self.spec.policy == "auto" and len(self.history) < self.spec.max_replans:
            self.history.append(record.model_copy(update={"action": "applied"}))
            self.pending = decision
            self._announce(decision, record=record, verb="re-planning")
            return True
        past = "" if self.spec.policy == "suggest" else f" (maxReplans {self.spec.max_replans} reached)"
        # Said again only when it is better by minGain than the last said: the search may find
        # an equivalent plan each window, and a line every window would drown the progress.
        best = self._suggested_s
        if best is None or decision.new_iteration_seconds < best * (1 - self.spec.min_gain):
            self._suggested_s = decision.new_iteration_seconds
            self._announce(decision, record=record, verb=f"suggestion{past}")
        self.suggestion = record
        self.window.reset()
        return False

    def _decide(self, drift: Drift, *, step: int, restart_seconds: float) -> Decision:
        return decide(self.problem, self.plan, drift=drift, strategy=self.strategy,
                      remaining_steps=self.total_steps - step, restart_seconds=restart_seconds,
                      min_gain=self.spec.min_gain, time_limit_s=self.time_limit_s)

    def _record(self, d: Decision, *, step: int, measured: float | None) -> ReplanRecord:
        speeds = [s.speed / p for s, p in zip(d.problem.device_specs(), self.profiled, strict=False)]
        return ReplanRecord(time=datetime.now(UTC).isoformat(timespec="seconds"), step=step,
                            action="suggested", reason=d.reason,
                            old_predicted_iteration_seconds=d.old_iteration_seconds,
                            new_predicted_iteration_seconds=d.new_iteration_seconds,
                            measured_iteration_seconds=measured, device_speed=[round(x, 4) for x in speeds],
                            stages=len(d.plan.stages) if d.plan else None)

    def _announce(self, d: Decision, *, record: ReplanRecord, verb: str) -> None:
        assert d.plan is not None
        self.say(f"adaptation {verb} at step {record.step}: device speeds "
                 f"{', '.join(f'{x:.2f}' for x in record.device_speed)} (1: as profiled); predicted "
                 f"iteration {d.old_iteration_seconds * 1e3:.1f} ms (running plan, corrected) -> "
                 f"{d.new_iteration_seconds * 1e3:.1f} ms; layers per device {layers_per_device(self.plan)} -> "
                 f"{layers_per_device(d.plan)}; {d.reason}")

    def _once(self, text: str) -> None:
        key = text.split(":", 2)[-1]
        if key not in self._said:
            self._said.add(key)
            self.say(text)

    def report(self) -> dict[str, Any]:
        return {"policy": self.spec.policy, "measured_ratio": self.measured_ratio,
                "suggestion": self.suggestion.model_dump(mode="json") if self.suggestion else None,
                "history": [r.model_dump(mode="json") for r in self.history], "decisions": self.decisions}


def train(*, config: WorkerConfig, problem: Problem, plan: Plan, spec: AdaptationSpec, strategy: str,
          ranks: int, replicas: int, time_limit_s: float | None, launcher: Callable[[WorkerConfig], Any],
          on_step: Callable[[StepEvent], None], say: Say) -> Trained:
    """Run the ranks to the last step, relaunching them under a new plan whenever the loop
    re-plans. ``launcher(config)`` makes a :class:`~adaptis.worker.run.launcher.LocalLauncher`;
    ``on_step`` shows rank 0's step events. Raises what the launcher raises, except the stop
    this loop asked for."""
    from adaptis.worker.errors import PreemptedError

    total = config.training.steps
    adapter = Adapter(problem=problem, plan=plan, spec=spec, strategy=strategy, total_steps=total,
                      replicas=replicas, ranks=ranks, time_limit_s=time_limit_s, say=say)
    steps: list[StepEvent] = []
    starts: dict[int, StartEvent] = {}
    reduce: list[tuple[float, float]] = []
    segments: list[Segment] = []
    while True:
        seg = Segment(plan=plan, launched_at=time.perf_counter())
        segments.append(seg)
        ranks_run = launcher(config)

        def on_event(event: StartEvent | StepEvent | DoneEvent | PreemptedEvent, *, seg: Segment = seg,
                     ranks_run: Any = ranks_run) -> None:
            if isinstance(event, StartEvent):
                starts.setdefault(event.rank, event)
                seg.rank_stages[event.rank] = list(event.stages)
                if event.rank == 0:
                    seg.resumed_step = event.resumed_step
                    # A relaunch repeats the steps after its checkpoint: keep each step once.
                    steps[:] = [s for s in steps if s.step <= seg.resumed_step]
                return
            if not isinstance(event, StepEvent):
                return
            if event.step > seg.resumed_step + 1:  # a launch's first step pays one-off costs
                reduce.append((event.reduce_wait_seconds, event.step_seconds))
            if event.rank == 0:
                if seg.first_step_at is None:
                    seg.first_step_at = time.perf_counter()
                seg.steps.append(event)
                seg.max_data_seconds = max(seg.max_data_seconds, event.data_seconds)
                steps.append(event)
                on_step(event)
            if adapter.observe(event, segment=seg, restart_seconds=_restart_seconds(segments)):
                # Graceful (adaptis.worker.run.preemption): the ranks agree on a step boundary,
                # checkpoint it and exit; the relaunch resumes there under the new plan.
                seg.stop_requested_at = time.perf_counter()
                ranks_run.request_stop()

        try:
            ranks_run.run(on_event)
        except PreemptedError:
            if adapter.pending is None:  # a SIGTERM this loop did not send: the user's
                raise
            seg.stopped_at = time.perf_counter()
        if adapter.pending is None:
            break
        decision = adapter.pending
        assert decision.plan is not None
        plan = decision.plan.model_copy(update={"precision": plan.precision})
        config = config.model_copy(update={"plan": plan.model_dump(mode="json", exclude_none=True)})
        adapter.start(problem=decision.problem, plan=plan)
        say(f"relaunching the ranks under the new plan ({len(plan.stages)} stages, placement {plan.placement}) "
            "from the last checkpoint")
    adaptation = adapter.report()
    adaptation["segments"] = [s.report() for s in segments]
    # Per step (rank 0's, each step once): the curve across re-plans, for a look or a benchmark.
    adaptation["losses"] = [s.loss for s in steps]
    adaptation["iteration_seconds"] = [s.iteration_seconds for s in steps]
    return Trained(plan=plan, problem=adapter.problem, steps=steps, starts=starts, reduce=reduce,
                   segments=segments, adaptation=adaptation)


def _restart_seconds(segments: list[Segment]) -> float:
    """A restart as this run measured it: the slowest launch to its first step (start, resume,
    the first step's one-off costs), plus the slowest graceful stop once one was seen, else
    the largest data phase (which holds a periodic checkpoint's save) as the stop's stand-in."""
    launch = max((s.first_step_at - s.launched_at for s in segments if s.first_step_at is not None), default=0.0)
    stops = [s.stop_seconds for s in segments if s.stop_seconds is not None]
    if stops:
        return launch + max(stops)
    return launch + max((s.max_data_seconds for s in segments), default=0.0)


def check_slowdown(text: str | None, *, ranks: int) -> None:
    """--slowdown, checked before anything starts (each rank would reject it on its own)."""
    from adaptis.cli import CLIError
    from adaptis.worker.runtime.slowdown import parse_slowdown

    if text is None:
        return
    try:
        parsed = parse_slowdown(text)
    except ValueError as err:
        raise CLIError(f"--slowdown: {err}") from None
    if not parsed or max(parsed) >= ranks:
        raise CLIError(f"--slowdown {text!r}: name a rank of this run (0 .. {ranks - 1})")
