"""The state of one reconcile pass, and what a pass returns.

Sits under :mod:`adaptis.operator.control.reconcile` and every room it walks a job through
(placement, measuring, the plan store, adaptation, refused creates): a :class:`PassState`
collects the status being built, the Events to post and the wake-up times, so that the steps
stay plain functions of (state, spec, cluster). What a pass is configured with:
:mod:`adaptis.operator.core.settings`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from adaptis.api.conditions import ConditionType
from adaptis.api.job import JobStatus
from adaptis.operator.core.conditions import now_rfc3339, set_condition
from adaptis.operator.core.records import JobRef, NodeProfile

__all__ = ["PassState", "Result"]


@dataclass(frozen=True)
class Result:
    """What the pass asks of its caller: look again after this many seconds (None: no need),
    and the job's phase after the pass (None: the job is gone)."""

    requeue_after: float | None = None
    phase: str | None = None


@dataclass
class PassState:
    """The mutable state of one pass: the status being built and the events to post."""

    job: JobRef
    status: JobStatus
    now: datetime
    events: list[tuple[str, str, str]] = field(default_factory=list)
    requeue: list[float] = field(default_factory=list)
    written: dict[str, Any] = field(default_factory=dict)  # the status the API holds now
    live_nodes: frozenset[str] | None = None  # names of the nodes that exist, once listed
    node_profiles: dict[str, NodeProfile] = field(default_factory=dict)  # the nodes, once profiled
    created: str = ""  # the job's metadata.creationTimestamp: its place in the capacity queue

    @property
    def stamp(self) -> str:
        return now_rfc3339(self.now)

    def update(self, **changes: Any) -> None:
        self.status = self.status.model_copy(update=changes)

    def condition(self, type_: ConditionType, status: str, *, reason: str, message: str = "",
                  event: str | None = None) -> None:
        """Set a condition; post an Event of type ``event`` if it really changed."""
        before = next((c for c in self.status.conditions if c.type == type_), None)
        changed = before is None or (before.status, before.reason, before.message) != (
            status, reason, message)
        self.update(conditions=set_condition(self.status.conditions, type_=type_, status=status,
                                             reason=reason, message=message, now=self.stamp))
        if changed and event:
            self.events.append((event, reason, message))
