"""The kopf handlers: watch AdaPtisJobs and their pods, and queue jobs to reconcile.

Sits between kopf (which owns the watch streams) and :mod:`adaptis.operator.control.workqueue`. The
handlers decide nothing: each event only says which job may need a look, and the reconciler,
which re-reads everything, decides what to do. That makes create, resume (operator restart),
update and every pod transition the same code path, and makes a lost or repeated event
harmless.

No handler here makes kopf write to the job (no ``on.create``/``on.update`` progress
annotations, no finalizers, no timers): deleting a job never waits for the operator, and
the status subresource stays the reconciler's alone.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import kopf

from adaptis.api.job import GROUP, PLURAL, VERSION
from adaptis.operator.control.workqueue import WorkQueue
from adaptis.operator.core.labels import LABEL_JOB, LABEL_MANAGED_BY, MANAGED_BY
from adaptis.operator.profiling.profiler_pods import LABEL_JOB_NAMESPACE

__all__ = ["JobKey", "build_registry", "wants_reconcile"]

log = logging.getLogger(__name__)

JobKey = tuple[str, str]  # (namespace, name)


def wants_reconcile(event_type: str | None, body: Mapping[str, Any]) -> bool:
    """Whether a job event needs a pass: not for the echo of the operator's own status write."""
    if event_type != "MODIFIED":
        return True
    meta = body.get("metadata") or {}
    status = body.get("status") or {}
    return bool(meta.get("deletionTimestamp")) or meta.get("generation") != status.get(
        "observedGeneration")


def build_registry(queue: WorkQueue[JobKey]) -> kopf.OperatorRegistry:
    """A registry with the operator's handlers, all feeding ``queue``."""
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        return kopf.login_via_client(**kwargs)

    # kopf passes a handler's arguments by name: the handlers take them keyword-only.
    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    def job_event(*, type: str | None, body: kopf.Body, namespace: str, name: str,
                  **_: Any) -> None:
        key = (namespace, name)
        if wants_reconcile(type, body):  # a deletion too: its pass frees the job's GPUs
            queue.add(key)

    @kopf.on.event("v1", "pods", labels={LABEL_MANAGED_BY: MANAGED_BY}, registry=registry)
    def pod_event(*, labels: kopf.Labels, namespace: str, **_: Any) -> None:
        job = labels.get(LABEL_JOB)
        if job:
            # Profiler pods run in the operator's namespace and name their job's namespace.
            queue.add((labels.get(LABEL_JOB_NAMESPACE) or namespace, job))

    # Nodes are not watched here: the inventory's node informer (scheduling.inventory) already
    # follows them, and wakes every job when one comes or goes (control.app).
    return registry
