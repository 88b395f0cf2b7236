"""Closed-loop adaptation on a cluster: re-plan a running job from its workers' measured compute.

Sits between the reconciler (which calls :meth:`Adapter.adapt` once a pass, after placement and
before the pods are reconciled) and the planner's :mod:`adaptis.planner.drift`. One pass of a
Running job with ``spec.adaptation.policy`` suggest or auto, at most every ``poll_s``:

read the job's busy counters and steps from Prometheus
(:mod:`adaptis.operator.adaptation.measurements`) -> feed a
:class:`~adaptis.planner.drift.DriftWindow` per gang (plan and attempt: a new gang starts an empty
window, so a re-plan never follows another before its window is full again) -> on sustained drift,
:func:`~adaptis.planner.drift.decide` against the restart's cost (measured per job: a gang's pod
creation to its first step seen; ``default_restart_s`` until then) -> suggest:
``status.adaptation.suggestion``, condition ReplanSuggested and an Event; auto: the new plan goes
into the job's ConfigMap (its record carries the corrected device speeds, so any later plan on the
same nodes keeps them), and the reconciler's usual path replaces the pods of the old plan (SIGTERM:
the workers checkpoint) with the new plan's; condition Replanned, an Event, ``status.replans`` and a
history record.

Why the decision runs in the pass rather than in a planner process (:mod:`~adaptis.operator.
plan_runner`): it runs at most once per full window per job (the window is emptied after every
decision), re-plans a problem the job was already planned on, and is capped at
``decide_time_limit_s`` (the planner returns its best plan by then); a process start and
handshake would cost more than the search for the jobs the operator plans inline.

What it keeps per job (windows, restart costs) is memory only: a restarted operator starts
the window again, which only delays a decision by one window.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

from adaptis.api.adaptation import AdaptationStatus, ReplanRecord
from adaptis.api.conditions import ConditionType, Reason
from adaptis.api.job import JobSpec
from adaptis.api.problem import Link
from adaptis.operator.adaptation.measurements import MeasurementError, Sample, query_job
from adaptis.operator.core.errors import OperatorError, PlanTooLarge, Unsatisfiable
from adaptis.operator.core.records import PlanRecord
from adaptis.operator.core.settings import DEFAULT_INTER_NODE, AdaptationSettings
from adaptis.operator.resources.manifests import plan_hash, render_config_map
from adaptis.operator.resources.status import plan_summary
from adaptis.operator.scheduling.plan_store import PlanStore
from adaptis.operator.scheduling.planning import build_problem, correct_speeds, node_slots
from adaptis.planner.drift import Decision, Drift, DriftWindow, decide, predicted_busy
from adaptis.planner.errors import PlannerError

if TYPE_CHECKING:
    from adaptis.api.problem import Problem
    from adaptis.operator.core.passes import PassState
    from adaptis.operator.kube.cluster import Cluster

__all__ = ["AdaptationObserver", "Adapter", "Fetch"]

log = logging.getLogger(__name__)

JobKey = tuple[str, str]
Fetch = Callable[..., Sample | None]  # query_job's signature


class AdaptationObserver(Protocol):
    """Who is told about re-plans and predictions (the operator's metrics)."""

    def replanned(self, key: JobKey, *, action: str) -> None: ...

    def predicted(self, key: JobKey, *, busy_seconds: list[float]) -> None: ...


@dataclass
class _Gang:
    """One gang's measurements: its window, when its pods were asked for, its first step."""

    gang: str
    started: datetime
    window: DriftWindow | None = None
    problem: Problem | None = None  # the running plan's problem, with its corrected speeds
    first_step_seen: bool = False
    last_poll: datetime | None = None
    last_step: int | None = None  # the step last fed to the window


@dataclass
class _JobState:
    gang: _Gang | None = None
    restart_s: float | None = None  # measured on this job: pod creation to first step


class Adapter:
    """The adaptation loop of every job; see the module docstring."""

    def __init__(self, cluster: Cluster, *, settings: AdaptationSettings,
                 publish: Callable[[PassState], None], fetch: Fetch = query_job,
                 plans: PlanStore, observer: AdaptationObserver | None = None,
                 inter_node: Link = DEFAULT_INTER_NODE) -> None:
        self._cluster = cluster
        self._plans = plans
        self._settings = settings
        self._publish = publish  # write the status before the pods of the old plan go
        self._fetch = fetch
        self._observer = observer
        self._inter_node = inter_node
        self._jobs: dict[JobKey, _JobState] = {}

    def forget(self, key: JobKey) -> None:
        self._jobs.pop(key, None)

    def restart_seconds(self, key: JobKey) -> float:
        """The restart cost the decision weighs: measured on this job, else the default."""
        state = self._jobs.get(key)
        measured = None if state is None else state.restart_s
        return self._settings.default_restart_s if measured is None else measured

    # --- the pass -------------------------------------------------------------------------
    def adapt(self, p: PassState, *, spec: JobSpec, record: PlanRecord) -> PlanRecord:
        """The record to run: ``record``, or the re-planned one (policy auto)."""
        key = (p.job.namespace, p.job.name)
        g = self._due(p, key, spec=spec, record=record)
        if g is None:
            return record
        seen = self._observe(p, g, key=key, spec=spec, record=record)
        if seen is None:
            return record
        drift, step, problem = seen
        try:
            decision = decide(problem, record.plan, drift=drift, strategy=spec.planner.strategy,
                              remaining_steps=max(0, spec.training.steps - step),
                              restart_seconds=self.restart_seconds(key),
                              min_gain=spec.adaptation.min_gain,
                              time_limit_s=min(float(spec.planner.time_limit_seconds),
                                               self._settings.decide_time_limit_s))
        except PlannerError as err:
            p.condition(ConditionType.REPLAN_SUGGESTED, "False", reason=Reason.REPLAN_FAILED,
                        message=str(err))
            return record
        if not decision.replan or decision.plan is None:
            p.condition(ConditionType.REPLAN_SUGGESTED, "False", reason=Reason.NOT_WORTH_IT,
                        message=decision.reason)
            return record
        factors = _factors(decision.problem, problem, before=record.device_speed)
        rec = ReplanRecord(
            time=p.stamp, step=step, action="suggested", reason=decision.reason,
            old_predicted_iteration_seconds=round(decision.old_iteration_seconds, 6),
            new_predicted_iteration_seconds=round(decision.new_iteration_seconds, 6),
            device_speed=[round(f, 4) for f in factors], stages=len(decision.plan.stages))
        # Applied re-plans are counted by their records (maxReplans is at most the MAX_HISTORY
        # status keeps): past that many, auto only suggests.
        applied = len(p.status.adaptation.history) if p.status.adaptation else 0
        policy = spec.adaptation.policy
        if policy == "suggest" or applied >= spec.adaptation.max_replans:
            return self._suggest(p, key, rec=rec, capped=policy == "auto", spec=spec, record=record)
        try:
            return self._apply(p, key, spec=spec, record=record, decision=decision,
                               rec=rec.model_copy(update={"action": "applied"}), factors=factors)
        except (PlanTooLarge, Unsatisfiable, OperatorError) as err:
            log.warning("%s/%s: the re-plan could not be stored: %s", *key, err)
            return self._suggest(p, key, rec=rec, capped=False, spec=spec, record=record)

    def _due(self, p: PassState, key: JobKey, *, spec: JobSpec, record: PlanRecord) -> _Gang | None:
        """The running gang when its measurements are due for a look (adaptation on, a
        measurement source, the job running, a poll interval since the last look), else None."""
        policy = spec.adaptation.policy
        if policy == "off":
            self._jobs.pop(key, None)
            return None
        if not self._settings.prometheus_url:
            p.condition(ConditionType.REPLAN_SUGGESTED, "False", reason=Reason.NO_MEASUREMENT_SOURCE,
                        message=f"spec.adaptation.policy is {policy}, but the operator reads no "
                        "measurements: start it with --prometheus-url (chart value "
                        "operator.adaptation.prometheusUrl); the job runs its plan unchanged")
            return None
        state = self._jobs.setdefault(key, _JobState())
        gang = f"{plan_hash(record)}/{p.status.restarts}"
        if state.gang is None or state.gang.gang != gang:
            state.gang = _Gang(gang=gang, started=p.now)
        if p.status.phase != "Running":
            return None
        g = state.gang
        poll = self._settings.poll_s
        if g.last_poll is not None and (waited := (p.now - g.last_poll).total_seconds()) < poll:
            p.requeue.append(poll - waited)
            return None
        g.last_poll = p.now
        p.requeue.append(poll)
        return g

    def _observe(self, p: PassState, g: _Gang, *, key: JobKey, spec: JobSpec,
                 record: PlanRecord) -> tuple[Drift, int, Problem] | None:
        """Feed the gang's window the newest step's busy times; the drift, that step and the
        problem the plan was made for once a full window shows one, else None. A failure to
        read or replay is a condition, never a failed pass."""
        try:
            window = self._window(p, g, spec=spec, record=record)
        except (PlannerError, Unsatisfiable, ValueError) as err:
            # The running plan cannot be replayed on its problem (a record this operator's
            # planner would not make):
            # say so once per poll, never fail the pass over it.
            p.condition(ConditionType.REPLAN_SUGGESTED, "False", reason=Reason.REPLAN_FAILED,
                        message=f"the running plan's prediction cannot be rebuilt: {err}")
            return None
        if window is None:
            return None
        try:
            sample = self._fetch(self._settings.prometheus_url, namespace=key[0], job=key[1],
                                 timeout_s=self._settings.query_timeout_s)
        except MeasurementError as err:
            p.condition(ConditionType.REPLAN_SUGGESTED, "False", reason=err.reason, message=str(err))
            return None
        if sample is None:
            return None
        if not g.first_step_seen and sample.step >= 1:
            g.first_step_seen = True
            state = self._jobs[key]
            state.restart_s = max(0.0, (p.now - g.started).total_seconds())
            log.info("%s/%s: gang %s took %.0f s from its pods to its first step", *key, g.gang,
                     state.restart_s)
        counters = sample.counters(record.mesh.world)
        # A poll that sees no new step (polls faster than steps or scrapes) adds nothing; fed
        # to the window, the repeated step would read as a restart and empty it.
        if counters is None or sample.step == g.last_step:
            return None
        g.last_step = sample.step
        window.observe(step=sample.step, busy_seconds_total=counters)
        ratios = window.ratios()
        if ratios is not None:
            self._set_adaptation(p, measured_ratio=[round(r, 4) for r in ratios])
        drift = window.drift(threshold=spec.adaptation.drift_threshold)
        if drift is None or g.problem is None:
            return None
        window.reset()  # every decision needs a full window of its own
        return drift, sample.step, g.problem

    # --- pieces ---------------------------------------------------------------------------
    def _window(self, p: PassState, g: _Gang, *, spec: JobSpec,
                record: PlanRecord) -> DriftWindow | None:
        """The gang's window, made on first use from the problem its plan was made for."""
        if g.window is not None:
            return g.window
        profiles: Mapping[str, Any] = p.node_profiles
        if any(n not in profiles for n in record.nodes):
            return None  # a planned node is gone: placement re-plans anyway
        slots = [node_slots(profiles[n], spec=spec)[0] for n in record.nodes]
        problem = build_problem(spec, slots, name=f"{p.job.namespace}/{p.job.name}", inter_node=self._inter_node)
        g.problem = correct_speeds(problem, record.device_speed)
        busy = predicted_busy(g.problem, record.plan)
        if self._observer is not None:
            self._observer.predicted((p.job.namespace, p.job.name), busy_seconds=busy)
        g.window = DriftWindow(predicted=busy, window_steps=spec.adaptation.window_steps,
                               replicas=record.data_parallel)
        return g.window

    def _suggest(self, p: PassState, key: JobKey, *, rec: ReplanRecord, capped: bool,
                 spec: JobSpec, record: PlanRecord) -> PlanRecord:
        note = (f"; not applied: {spec.adaptation.max_replans} re-plans done "
                "(spec.adaptation.maxReplans)" if capped else "")
        self._set_adaptation(p, suggestion=rec)
        p.condition(ConditionType.REPLAN_SUGGESTED, "True", reason=Reason.MAX_REPLANS_REACHED if capped
                    else Reason.BETTER_PLAN, message=rec.reason + note, event="Normal")
        if self._observer is not None:
            self._observer.replanned(key, action="suggested")
        log.info("%s/%s: suggested a re-plan: %s%s", *key, rec.reason, note)
        return record

    def _apply(self, p: PassState, key: JobKey, *, spec: JobSpec, record: PlanRecord,
               decision: Decision, rec: ReplanRecord, factors: list[float]) -> PlanRecord:
        assert decision.plan is not None and decision.simulation is not None
        sim = decision.simulation
        plan = decision.plan.model_copy(update={"precision": record.plan.precision,
                                                "strategy": decision.plan.strategy
                                                or record.strategy})
        step = (None if sim.post is None or record.predicted_step_seconds is None
                else decision.new_iteration_seconds + record.predicted_step_seconds
                - record.predicted_iteration_seconds)
        new = record.model_copy(update={
            "plan": plan, "device_speed": factors,
            "predicted_iteration_seconds": decision.new_iteration_seconds,
            "predicted_bubble_ratio": float(sim.bubble_ratio),
            "predicted_step_seconds": step,
            "predicted_speedup_over_i1f1b": None,  # not re-measured on the corrected problem
            "budget_reason": None, "budget_note": None})
        # The plan first: a crash after it restarts the gang on the new plan anyway.
        rendered = render_config_map(p.job, spec, record=new)
        self._cluster.replace_config_map(rendered)
        self._plans.write(p.job, record=new, worker_data=rendered["data"])
        history = [*(p.status.adaptation.history if p.status.adaptation else []), rec]
        self._set_adaptation(p, suggestion=None, history=history)
        p.update(replans=p.status.replans + 1, phase="Restarting", **plan_summary(new, job=p.job.name))
        p.condition(ConditionType.REPLANNED, "True", reason=Reason.DRIFT, message=rec.reason,
                    event="Normal")
        p.condition(ConditionType.REPLAN_SUGGESTED, "False", reason=Reason.APPLIED,
                    message="the better plan was applied (policy auto)")
        p.condition(ConditionType.RESTARTING, "True", reason=Reason.REPLANNED,
                    message="restarting the gang with the re-planned partition from its checkpoint")
        p.condition(ConditionType.RUNNING, "False", reason=Reason.RESTARTING)
        self._publish(p)
        # The restart is measured from now: the old pods' checkpoint and exit are part of it.
        self._jobs.setdefault(key, _JobState()).gang = _Gang(
            gang=f"{plan_hash(new)}/{p.status.restarts}", started=p.now)
        if self._observer is not None:
            self._observer.replanned(key, action="applied")
        log.info("%s/%s: re-planned: %s", *key, rec.reason)
        return new

    @staticmethod
    def _set_adaptation(p: PassState, **changes: Any) -> None:
        current = p.status.adaptation or AdaptationStatus()
        p.update(adaptation=current.model_copy(update=changes))


def _factors(corrected: Problem, base: Problem, *, before: list[float]) -> list[float]:
    """Each device's corrected speed relative to its profiled speed (``base`` already carries
    the factors ``before``). The three are one per pipeline device of the same plan: the
    correction keeps the devices, and ``before`` is the record's factors for them."""
    old = before or [1.0] * len(base.device_specs())
    return [c.speed / b.speed * f for c, b, f in zip(corrected.device_specs(),
                                                      base.device_specs(), old, strict=True)]
