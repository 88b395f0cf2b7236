"""Closed-loop adaptation of a running job (``spec.adaptation``, ``status.adaptation``).

Part of :mod:`adaptis.api`. The policy says what a loop (the operator's, or ``adaptis run``'s)
may do when the workers' measured compute drifts from the plan's prediction
(:mod:`adaptis.planner.drift`): nothing, report the better plan, or checkpoint and restart
the gang with it. Status keeps the latest suggestion and every re-plan, newest last, so a user
sees why a week-long job changed its partition and what it bought. docs/adaptation.md.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from adaptis.api.model import Spec

__all__ = ["AdaptationSpec", "AdaptationStatus", "ReplanRecord", "MAX_HISTORY"]

MAX_HISTORY = 20  # re-plan records kept in status: bounded, as a status must be small


class AdaptationSpec(Spec):
    """When and how far a running job may re-plan itself from its own measurements."""

    policy: Literal["off", "suggest", "auto"] = Field(
        default="suggest",
        description="off: do not compare; suggest: report a better plan in status (and an "
        "Event) without touching the pods; auto: checkpoint, then restart the gang with it.")
    drift_threshold: float = Field(
        default=0.15, gt=0, le=10,
        description="A device drifts when its measured compute per step differs from the "
        "prediction by more than this fraction, relative to the median device.")
    window_steps: int = Field(
        default=20, ge=2, le=100_000,
        description="Steps the drift must last (in both halves of the window) before a re-plan is "
        "considered.")
    min_gain: float = Field(
        default=0.05, ge=0, lt=1,
        description="Least fraction of the iteration time the new plan must save; it must also save "
        "more over the remaining steps than a restart costs (measured).")
    max_replans: int = Field(
        default=3, ge=0, le=MAX_HISTORY,
        description=f"Most automatic re-plans in the job's life (at most {MAX_HISTORY}: status "
        "keeps a record of each, and counts them by their records).")


class ReplanRecord(Spec):
    """One re-plan, applied (auto) or only suggested."""

    time: str = Field(description="RFC 3339 time of the decision.")
    step: int | None = Field(default=None, ge=0, description="Training step the drift was seen at.")
    action: Literal["suggested", "applied"] = Field(description="suggested or applied.")
    reason: str = Field(description="The drift seen and what the new plan buys.")
    old_predicted_iteration_seconds: float = Field(
        ge=0, description="The running plan's iteration on the corrected problem.")
    new_predicted_iteration_seconds: float = Field(ge=0, description="The new plan's iteration.")
    measured_iteration_seconds: float | None = Field(
        default=None, ge=0, description="The iteration the workers measured over the window.")
    device_speed: list[float] = Field(
        default_factory=list,
        description="Corrected relative speed of each pipeline device (1: as profiled).")
    stages: int | None = Field(default=None, ge=1, description="Stages of the new plan.")


class AdaptationStatus(Spec):
    """What the adaptation loop last saw and did."""

    measured_ratio: list[float] = Field(
        default_factory=list,
        description="Measured / predicted compute per pipeline device over the last full window.")
    suggestion: ReplanRecord | None = Field(
        default=None, description="The better plan found and not applied (policy suggest, or "
        "auto past maxReplans).")
    history: list[ReplanRecord] = Field(
        default_factory=list, max_length=MAX_HISTORY,
        description=f"Applied re-plans, newest last (at most {MAX_HISTORY}).")
