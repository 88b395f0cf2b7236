"""Status arithmetic: pod census, plan summary, the status payload. Pure functions of plain data.

Sits under :mod:`adaptis.operator.control.reconcile`, which decides *what* happened; this module
only says how it reads in ``status`` (the conditions themselves:
:mod:`adaptis.operator.core.conditions`): the pod census counts ready, running, finished and failed
workers and collects why pending pods cannot be scheduled or why the kubelet cannot start their
containers (:data:`STUCK_REASONS`: a missing Secret or ConfigMap, an image that cannot be pulled),
and the workers' termination messages give the observed bubble ratio.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from adaptis.api.job import JobStatus, RankAssignment
from adaptis.api.rules import pod_name
from adaptis.operator.core.records import PlanRecord

__all__ = [
    "STUCK_REASONS",
    "PodCensus",
    "StuckContainer",
    "census",
    "parse_status",
    "plan_summary",
    "summarize",
]


def parse_status(raw: Mapping[str, Any] | None) -> JobStatus:
    """The job's current status; anything unreadable (edited by hand, say) starts afresh."""
    try:
        return JobStatus.model_validate(dict(raw or {}))
    except ValueError:
        return JobStatus()


#: The kubelet's ``state.waiting.reason`` of a container it cannot start until something is
#: fixed outside the pod: a Secret or ConfigMap key (CreateContainerConfigError), the image
#: (ErrImagePull, ImagePullBackOff, ErrImageNeverPull, InvalidImageName), the runtime's
#: refusal (CreateContainerError). ContainerCreating and PodInitializing are the normal way.
STUCK_REASONS = frozenset({
    "CreateContainerConfigError", "CreateContainerError", "ErrImagePull", "ImagePullBackOff",
    "ErrImageNeverPull", "InvalidImageName",
})
#: The longest kubelet message kept per container: it quotes the tenant's names and images.
MAX_WAITING_MESSAGE = 160


@dataclass(frozen=True)
class StuckContainer:
    """A container of a worker pod that the kubelet keeps waiting (reason in STUCK_REASONS)."""

    pod: str
    container: str
    reason: str
    message: str = ""

    def __str__(self) -> str:
        return f"{self.pod}: {self.container}: {self.reason}: {self.message or 'no message'}"


def _clip(text: str, limit: int = MAX_WAITING_MESSAGE) -> str:
    """One line of at most ``limit`` characters (control characters become spaces)."""
    line = " ".join("".join(ch if ch.isprintable() else " " for ch in text).split())
    return line if len(line) <= limit else line[:limit - 3].rstrip() + "..."


def _stuck_containers(name: str, status: Mapping[str, Any]) -> list[StuckContainer]:
    out: list[StuckContainer] = []
    for key in ("initContainerStatuses", "containerStatuses"):
        for cs in status.get(key) or []:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            reason = str(waiting.get("reason") or "")
            if reason in STUCK_REASONS:
                out.append(StuckContainer(pod=name, container=_clip(str(cs.get("name", "?")), 63),
                                          reason=reason,
                                          message=_clip(str(waiting.get("message") or ""))))
    return out


@dataclass(frozen=True)
class PodCensus:
    """What the worker pods of the current attempt are doing."""

    ready: int = 0
    running: int = 0
    succeeded: int = 0
    failed: int = 0
    pending: int = 0
    terminating: int = 0
    unschedulable: tuple[str, ...] = ()
    gated: tuple[str, ...] = ()  # held by a scheduling gate, e.g. Kueue's admission
    failures: tuple[str, ...] = ()
    # Containers of pending or running pods the kubelet cannot start (STUCK_REASONS).
    stuck: tuple[StuckContainer, ...] = ()
    bubble_ratios: tuple[float, ...] = field(default=())

    @property
    def observed_bubble_ratio(self) -> float | None:
        if not self.bubble_ratios:
            return None
        return round(sum(self.bubble_ratios) / len(self.bubble_ratios), 4)


def _termination_messages(pod: Mapping[str, Any]) -> list[str]:
    out: list[str] = []
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        terminated = (cs.get("state") or {}).get("terminated") or {}
        if terminated.get("message"):
            out.append(str(terminated["message"]))
    return out


def _bubble_ratio(messages: Iterable[str]) -> float | None:
    # The worker writes one JSON object to its termination log; its bubble ratio is reported
    # under either spelling.
    for text in messages:
        try:
            data = json.loads(text)
        except ValueError:
            continue
        if isinstance(data, dict):
            for key in ("observedBubbleRatio", "bubble_ratio", "bubbleRatio"):
                value = data.get(key)
                if isinstance(value, (int, float)) and 0 <= value <= 1:
                    return float(value)
    return None


def census(pods: Iterable[Mapping[str, Any]]) -> PodCensus:
    """Count the pods by what they are doing (only those of the current attempt are passed)."""
    ready = running = succeeded = failed = pending = terminating = 0
    unschedulable: list[str] = []
    gated: list[str] = []
    failures: list[str] = []
    stuck: list[StuckContainer] = []
    ratios: list[float] = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        status = pod.get("status") or {}
        name = str(meta.get("name", "?"))
        if meta.get("deletionTimestamp"):
            terminating += 1
            continue
        phase = status.get("phase", "Pending")
        conditions = {c.get("type"): c for c in status.get("conditions") or []}
        if phase == "Succeeded":
            succeeded += 1
            ratio = _bubble_ratio(_termination_messages(pod))
            if ratio is not None:
                ratios.append(ratio)
        elif phase == "Failed":
            failed += 1
            detail = status.get("message") or status.get("reason") or "failed"
            failures.append(f"{name}: {detail}")
        elif phase == "Running":
            running += 1
            if (conditions.get("Ready") or {}).get("status") == "True":
                ready += 1
            stuck += _stuck_containers(name, status)  # a restarted container's new image
        else:
            pending += 1
            stuck += _stuck_containers(name, status)
            sched = conditions.get("PodScheduled") or {}
            if sched.get("status") == "False" and sched.get("reason") == "Unschedulable":
                unschedulable.append(f"{name}: {sched.get('message', 'unschedulable')}")
            elif (sched.get("reason") == "SchedulingGated"
                  or (pod.get("spec") or {}).get("schedulingGates")):
                gates = [g.get("name", "?") for g in (pod.get("spec") or {}).get(
                    "schedulingGates") or []]
                gated.append(f"{name}: gated by {', '.join(gates) or 'a scheduling gate'}")
    return PodCensus(
        ready=ready, running=running, succeeded=succeeded, failed=failed,
        pending=pending, terminating=terminating, unschedulable=tuple(unschedulable),
        gated=tuple(gated), failures=tuple(failures), stuck=tuple(stuck),
        bubble_ratios=tuple(ratios),
    )


def summarize(items: Sequence[object], *, limit: int = 3) -> str:
    """The first ``limit`` items, then how many more: a condition message stays bounded
    however many pods a gang has."""
    head = "; ".join(str(x) for x in items[:limit])
    rest = len(items) - limit
    return f"{head}; and {rest} more" if rest > 0 else head


def plan_summary(record: PlanRecord, *, job: str | None = None) -> dict[str, Any]:
    """The status fields that describe a plan (snake_case keys of :class:`JobStatus`):
    placement lists every rank of every replica, with its pod when ``job`` names the job."""
    placement = record.plan.placement
    mesh = record.mesh
    out: dict[str, Any] = {
        "stages": len(record.plan.stages),
        "strategy": record.strategy,
        "predicted_iteration_seconds": round(record.predicted_iteration_seconds, 6),
        "predicted_bubble_ratio": round(record.predicted_bubble_ratio, 4),
        "predicted_speedup_over_i1f1b": record.predicted_speedup_over_i1f1b,
        "placement": [
            RankAssignment(
                rank=r, node=record.nodes[mesh.pod(r)], gpu=record.gpus[mesh.pod(r)],
                stages=list(placement[p]) if (p := mesh.pipeline_rank(r)) < len(placement)
                else [],
                replica=mesh.replica(r), tensor_rank=mesh.tensor_rank(r),
                pod=None if job is None else pod_name(job, mesh.pod(r)))
            for r in range(mesh.world)
        ],
    }
    if record.predicted_step_seconds is not None:
        out["predicted_step_seconds"] = round(record.predicted_step_seconds, 6)
    return out


def status_payload(status: JobStatus) -> dict[str, Any]:
    """The status as the API stores it (camelCase, no nulls)."""
    return status.model_dump(mode="json", by_alias=True, exclude_none=True)
