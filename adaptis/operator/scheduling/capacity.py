"""The allocation ledger: which GPUs are free, who holds which, and who waits for them.

Sits beside :mod:`adaptis.operator.scheduling.planning`, under the reconciler. The operator plans
first and pins every rank to a node (see docs/shared-cluster.md for why), so it must know before
planning which GPUs nobody else holds. A node's free GPUs are its allocatable ``nvidia.com/gpu``
minus

- the requests of every non-terminated pod on it, in any namespace, ours or not (a
  :class:`GpuHolds` snapshot of the pods that hold GPUs, kept from watch events by
  :mod:`adaptis.operator.scheduling.inventory`), and
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
    "GpuHold",
    "GpuHolds",
    "HoldBook",
    "JobKey",
    "PodKey",
    "QueueOrder",
    "hold_of",
    "pod_gpus",
    "unschedulable_since",
]

log = logging.getLogger(__name__)

JobKey = tuple[str, str]  # (namespace, name)
PodKey = tuple[str, str]  # (namespace, name)


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


@dataclass(frozen=True, slots=True)
class GpuHold:
    """The GPUs one pod holds: on which node, and for which job (None: anyone's pod)."""

    node: str
    gpus: int
    owner: JobKey | None


def hold_of(pod: Mapping[str, Any]) -> GpuHold | None:
    """What a non-terminated pod holds; None when it holds no GPU (none asked, or no node)."""
    node = _pod_node(pod)
    gpus = pod_gpus(pod)
    if node is None or gpus <= 0:
        return None
    return GpuHold(node=node, gpus=gpus, owner=_pod_job(pod))


@dataclass(frozen=True, slots=True)
class GpuHolds:
    """A snapshot of what pods hold: by pod (all of them, or those asked for), and summed per
    node for anyone's pods and per job for the operator's. Never changed once made (a
    :class:`HoldBook` makes new ones)."""

    pods: Mapping[PodKey, GpuHold]
    unowned: Mapping[str, int]  # node -> GPUs held by pods of no job
    owned: Mapping[JobKey, Mapping[str, int]]  # job -> node -> GPUs its pods hold

    @classmethod
    def of_pods(cls, pods: Iterable[Mapping[str, Any]]) -> GpuHolds:
        """From a list of non-terminated pods."""
        book = HoldBook()
        for pod in pods:
            meta = pod.get("metadata") or {}
            book.put((str(meta.get("namespace", "")), str(meta.get("name", ""))), hold_of(pod))
        return book.snapshot()


class HoldBook:
    """:class:`GpuHolds` kept up to date one pod at a time (from watch events); thread-safe.
    The per-job maps are replaced, never changed in place, so a snapshot copies only the
    outer maps."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pods: dict[PodKey, GpuHold] = {}
        self._unowned: dict[str, int] = {}
        self._owned: dict[JobKey, dict[str, int]] = {}

    def put(self, pod: PodKey, hold: GpuHold | None) -> None:
        """The pod now holds ``hold`` (None: nothing, or it is gone)."""
        with self._lock:
            before = self._pods.pop(pod, None)
            if before is not None:
                self._add(before, -before.gpus)
            if hold is not None:
                self._pods[pod] = hold
                self._add(hold, hold.gpus)

    def _add(self, hold: GpuHold, gpus: int) -> None:
        if hold.owner is None:
            total = self._unowned.get(hold.node, 0) + gpus
            if total > 0:
                self._unowned[hold.node] = total
            else:
                self._unowned.pop(hold.node, None)
            return
        nodes = dict(self._owned.get(hold.owner, {}))
        total = nodes.get(hold.node, 0) + gpus
        if total > 0:
            nodes[hold.node] = total
        else:
            nodes.pop(hold.node, None)
        if nodes:
            self._owned[hold.owner] = nodes
        else:
            self._owned.pop(hold.owner, None)

    def snapshot(self, *, pods: Iterable[PodKey] | None = None) -> GpuHolds:
        """The holds now; by pod only those of ``pods`` when given (copying every pod's would
        make each admission cost as much as the cluster's pods)."""
        with self._lock:
            by_pod = (dict(self._pods) if pods is None
                      else {k: self._pods[k] for k in pods if k in self._pods})
            return GpuHolds(pods=by_pod, unowned=dict(self._unowned), owned=dict(self._owned))


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
        wake: Callable[[JobKey], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._strict_after_s = strict_after_s
        self._wake = wake
        self._clock = clock
        self._lock = threading.RLock()
        self._reserved: dict[JobKey, dict[str, int]] = {}
        self._waiting: dict[JobKey, _Waiting] = {}

    @contextmanager
    def admission(self) -> Iterator[None]:
        """Hold while reading free GPUs, choosing slots and reserving them."""
        with self._lock:
            yield

    # --- what is free -------------------------------------------------------------------------
    def free_gpus(self, *, allocatable: Mapping[str, int], holds: GpuHolds, job: JobKey,
                  ignore: frozenset[PodKey] = frozenset()) -> dict[str, int]:
        """Per node, the GPUs neither another pod nor another job's reservation holds.
        ``ignore``: (namespace, name) of pods that are the job's own but not labelled as its
        workers (its profiler pods, deleted once it is planned)."""
        used: dict[str, int] = defaultdict(int)
        for node, gpus in holds.unowned.items():
            used[node] += gpus
        with self._lock:
            # A job's pods count through its reservation (or are the asker's own).
            counted = {owner: nodes for owner, nodes in holds.owned.items()
                       if owner != job and owner not in self._reserved}
            for nodes in counted.values():
                for node, gpus in nodes.items():
                    used[node] += gpus
            for pod in ignore:
                hold = holds.pods.get(pod)
                if hold is not None and (hold.owner is None or hold.owner in counted):
                    used[hold.node] -= hold.gpus
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
