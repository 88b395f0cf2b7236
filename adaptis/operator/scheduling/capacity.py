"""The allocation ledger: which GPUs are free, who holds which, and who waits for them.

Sits beside :mod:`adaptis.operator.scheduling.planning`, under the reconciler. The operator plans
first and pins every rank to a node (see docs/shared-cluster.md for why), so it must know before
planning which GPUs nobody else holds. A node's free GPUs are its allocatable ``nvidia.com/gpu``
minus

- the requests of every non-terminated pod on it, in any namespace, ours or not (read from one
  cluster-wide pod list, served from the API server's watch cache, at most every
  ``snapshot_ttl_s``), and
- what this operator has *reserved* for jobs it admitted: a reservation covers a job from the
  moment its slots are chosen, through planning and pod creation, until it ends, is suspended
  or deleted. Pods of a job that holds a reservation are counted through the reservation only,
  so a pod that is created but not yet bound is never missed or counted twice.

Admission is one critical section (:meth:`CapacityLedger.admission`): read the free GPUs,
choose slots, reserve. Two reconcile workers can therefore never give the same GPU to two
jobs, and two half-placed gangs can never wait on each other.

Jobs that fit the cluster but not its free GPUs wait in a queue ordered by priority (their
PriorityClass value), then creation time. Best effort: a job that does not fit does not hold
back smaller ones behind it, until it has waited ``strict_after_s``; from then on nothing behind
it is admitted before it, so a large job is never starved by a stream of small ones. A release
wakes the waiting jobs in queue order (``wake``).

Memory only: after an operator restart the ledger is empty, the pods of running jobs are
counted as anyone's pods until each job's first pass re-reserves them, and waiting jobs
re-queue on their next pass.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from adaptis.operator.core.labels import GPU_RESOURCE, LABEL_JOB, LABEL_MANAGED_BY, MANAGED_BY, NODE_ANNOTATION
from adaptis.operator.profiling.nodes import parse_quantity

__all__ = [
    "CapacityLedger",
    "JobKey",
    "QueueOrder",
    "pod_gpus",
    "unschedulable_since",
]

log = logging.getLogger(__name__)

JobKey = tuple[str, str]  # (namespace, name)


@dataclass(frozen=True, order=True, slots=True)
class QueueOrder:
    """Sort key of a waiting job: higher priority first, then older first."""

    neg_priority: int
    created: str  # RFC 3339, which sorts as text
    namespace: str
    name: str

    @classmethod
    def of(cls, key: JobKey, *, priority: int, created: str) -> QueueOrder:
        return cls(neg_priority=-priority, created=created, namespace=key[0], name=key[1])


@dataclass(frozen=True, slots=True)
class _Waiting:
    order: QueueOrder
    gpus: int
    since: float


def pod_gpus(pod: Mapping[str, Any]) -> int:
    """GPUs a pod requests (an extended resource: its request equals its limit)."""
    total = 0
    for c in (pod.get("spec") or {}).get("containers") or []:
        res = c.get("resources") or {}
        value = (res.get("requests") or {}).get(GPU_RESOURCE) or (res.get("limits") or {}).get(
            GPU_RESOURCE)
        if value is not None:
            try:
                total += int(parse_quantity(value))
            except ValueError:
                continue
    return total


def _pod_node(pod: Mapping[str, Any]) -> str | None:
    node = (pod.get("spec") or {}).get("nodeName")
    if node:
        return str(node)
    if (pod.get("spec") or {}).get("schedulingGates"):
        return None  # held back by admission (Kueue's quota): it holds no GPU until released
    # Our own pods hold their pinned node from creation on, bound or not.
    meta = pod.get("metadata") or {}
    if (meta.get("labels") or {}).get(LABEL_MANAGED_BY) == MANAGED_BY:
        pinned = (meta.get("annotations") or {}).get(NODE_ANNOTATION)
        return str(pinned) if pinned else None
    return None


def _pod_job(pod: Mapping[str, Any]) -> JobKey | None:
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    if labels.get(LABEL_MANAGED_BY) != MANAGED_BY or not labels.get(LABEL_JOB):
        return None
    # The pod's own namespace, never a label: a tenant can only make pods pass for its own
    # jobs. (Profiler pods, in the operator's namespace, so count as anyone's: they hold GPUs.)
    return str(meta.get("namespace", "")), str(labels[LABEL_JOB])


def unschedulable_since(pods: Iterable[Mapping[str, Any]]) -> tuple[datetime | None, set[str]]:
    """Since when the longest-waiting unschedulable pod waits, and the nodes such pods pin."""
    oldest: datetime | None = None
    nodes: set[str] = set()
    for pod in pods:
        for cond in (pod.get("status") or {}).get("conditions") or []:
            if (cond.get("type") == "PodScheduled" and cond.get("status") == "False"
                    and cond.get("reason") == "Unschedulable"):
                node = _pod_node(pod)
                if node:
                    nodes.add(node)
                try:
                    at = datetime.fromisoformat(str(cond.get("lastTransitionTime")).replace(
                        "Z", "+00:00"))
                except ValueError:
                    continue
                oldest = at if oldest is None or at < oldest else oldest
    return oldest, nodes


class CapacityLedger:
    """Reservations and the waiting queue; shared by every reconcile worker of one operator."""

    def __init__(
        self,
        *,
        strict_after_s: float = 120.0,
        snapshot_ttl_s: float = 2.0,
        wake: Callable[[JobKey], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._strict_after_s = strict_after_s
        self._snapshot_ttl_s = snapshot_ttl_s
        self._wake = wake
        self._clock = clock
        self._lock = threading.RLock()
        self._reserved: dict[JobKey, dict[str, int]] = {}
        self._waiting: dict[JobKey, _Waiting] = {}
        self._snapshot: tuple[float, list[dict[str, Any]]] | None = None

    @contextmanager
    def admission(self) -> Iterator[None]:
        """Hold while reading free GPUs, choosing slots and reserving them."""
        with self._lock:
            yield

    # --- what is free -------------------------------------------------------------------------
    def active_pods(self, fetch: Callable[[], list[dict[str, Any]]]) -> list[dict[str, Any]]:
        """Every non-terminated pod of the cluster, re-read at most every ``snapshot_ttl_s``."""
        with self._lock:
            now = self._clock()
            if self._snapshot is None or now - self._snapshot[0] >= self._snapshot_ttl_s:
                self._snapshot = (now, fetch())
            return self._snapshot[1]

    def free_gpus(self, *, allocatable: Mapping[str, int], pods: Iterable[Mapping[str, Any]],
                  job: JobKey, ignore: frozenset[tuple[str, str]] = frozenset()
                  ) -> dict[str, int]:
        """Per node, the GPUs neither another pod nor another job's reservation holds.
        ``ignore``: (namespace, name) of pods that are the job's own but not labelled as its
        workers (its profiler pods, deleted once it is planned)."""
        used: dict[str, int] = defaultdict(int)
        with self._lock:
            for pod in pods:
                meta = pod.get("metadata") or {}
                if (meta.get("namespace"), meta.get("name")) in ignore:
                    continue
                owner = _pod_job(pod)
                if owner is not None and (owner == job or owner in self._reserved):
                    continue  # counted through its reservation (or it is the asker's own)
                node = _pod_node(pod)
                if node is not None:
                    used[node] += pod_gpus(pod)
            for key, nodes in self._reserved.items():
                if key != job:
                    for node, gpus in nodes.items():
                        used[node] += gpus
        return {node: max(0, total - used[node]) for node, total in allocatable.items()}

    # --- holding ------------------------------------------------------------------------------
    def reserve(self, job: JobKey, nodes: Mapping[str, int]) -> None:
        with self._lock:
            self._reserved[job] = {n: g for n, g in nodes.items() if g > 0}
            self._waiting.pop(job, None)

    def reservation(self, job: JobKey) -> dict[str, int] | None:
        with self._lock:
            held = self._reserved.get(job)
            return None if held is None else dict(held)

    def release(self, job: JobKey) -> None:
        """Drop a job's reservation and place in the queue; wake the waiting jobs if it held
        GPUs."""
        with self._lock:
            held = self._reserved.pop(job, None)
            self._waiting.pop(job, None)
            waiting = self.waiting()
        if held and self._wake is not None:
            log.debug("%s/%s released %s; waking %d waiting job(s)", *job, held, len(waiting))
            for key in waiting:
                self._wake(key)

    # --- waiting ------------------------------------------------------------------------------
    def enqueue(self, job: JobKey, *, order: QueueOrder, gpus: int) -> None:
        """Record that a job waits for ``gpus`` free GPUs (its first wait time is kept)."""
        with self._lock:
            before = self._waiting.get(job)
            since = before.since if before is not None else self._clock()
            self._waiting[job] = _Waiting(order=order, gpus=gpus, since=since)

    def waiting(self) -> list[JobKey]:
        """The waiting jobs, in queue order."""
        with self._lock:
            return [k for k, _ in sorted(self._waiting.items(), key=lambda kv: kv[1].order)]

    def position(self, job: JobKey, *, order: QueueOrder) -> tuple[int, int]:
        """(1-based place of ``job`` among the waiting jobs, how many wait), counting it."""
        with self._lock:
            ahead = sum(1 for k, w in self._waiting.items() if k != job and w.order < order)
            total = len(self._waiting) + (job not in self._waiting)
            return ahead + 1, total

    def blocker(self, job: JobKey, *, order: QueueOrder) -> tuple[JobKey, int, float] | None:
        """The first job ahead of ``job`` that has waited past ``strict_after_s``, with the GPUs
        it needs and how long it has waited: nothing behind it may be admitted first."""
        now = self._clock()
        with self._lock:
            for key, w in sorted(self._waiting.items(), key=lambda kv: kv[1].order):
                if w.order >= order:
                    return None
                if key != job and now - w.since >= self._strict_after_s:
                    return key, w.gpus, now - w.since
        return None
