"""The state of one reconcile pass, and what a pass is configured with and returns.

Sits beside :mod:`adaptis.operator.reconcile`: a :class:`PassState` collects the status being
built, the Events to post and the wake-up times while the reconciler walks a job through its
steps, so that the steps stay plain functions of (state, spec, cluster).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from adaptis.api.job import JobStatus
from adaptis.api.problem import Link
from adaptis.operator.manifests import JobRef, ManifestSettings
from adaptis.operator.planning import DEFAULT_INTER_NODE
from adaptis.operator.measurements import AdaptationSettings
from adaptis.operator.profiling import DEFAULT_TOPOLOGY_KEYS, NodeProfile
from adaptis.operator.status import now_rfc3339, set_condition

__all__ = ["PassState", "ReconcileSettings", "Result"]


@dataclass(frozen=True)
class ReconcileSettings:
    """Operator-wide choices, from the ``adaptis operator`` command line."""

    topology_keys: tuple[str, ...] = DEFAULT_TOPOLOGY_KEYS
    manifests: ManifestSettings = field(default_factory=ManifestSettings)
    inter_node: Link = DEFAULT_INTER_NODE
    # How long a profiler pod (spec.planner.profile: measure) may take, scheduling and image
    # pull included, before its node is planned from the label-based estimate instead.
    profile_timeout_s: float = 600.0
    # Where profiler pods run and measured profiles are stored: a namespace no tenant may
    # write (the chart's release namespace), since a profile changes every tenant's plans.
    profile_namespace: str = "adaptis-system"
    # The image of the profiler pods, chosen by the admin (None: manifests.image); never a
    # job's spec.worker.image, whose code could write any profile it liked.
    profiler_image: str | None = None
    # How long a rank may stay unschedulable on its planned node before the job is re-planned
    # on the capacity free then, without that node for a while (another scheduler's pod took
    # the GPUs, or a taint or quota the plan could not see).
    unschedulable_replan_s: float = 120.0
    # Where the workers' measurements are read, how often, and the restart cost assumed until
    # one is measured (spec.adaptation; adaptis.operator.adaptation).
    adaptation: AdaptationSettings = field(default_factory=AdaptationSettings)


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

    def condition(self, type_: str, status: str, *, reason: str, message: str = "",
                  event: str | None = None) -> None:
        """Set a condition; post an Event of type ``event`` if it really changed."""
        before = next((c for c in self.status.conditions if c.type == type_), None)
        changed = before is None or (before.status, before.reason, before.message) != (
            status, reason, message)
        self.update(conditions=set_condition(self.status.conditions, type_=type_, status=status,
                                             reason=reason, message=message, now=self.stamp))
        if changed and event:
            self.events.append((event, reason, message))
