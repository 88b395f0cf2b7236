"""The operator process: Kubernetes client, reconciler, work queue and kopf, wired together.

Sits at the top of the operator layer; ``adaptis operator`` (``adaptis.cli.operator``) parses the
command line into :class:`OperatorOptions` and calls :func:`run_operator`. kopf owns the event loop
and the watch streams; the reconciler runs in the work queue's threads, so a slow pass never blocks
a watch, and plans are made in processes of their own
(:mod:`adaptis.operator.scheduling.plan_runner`), which wake their job through the queue when done,
so a big plan never holds up another job's pass. The capacity ledger
(:mod:`adaptis.operator.scheduling.capacity`) is shared by every worker; a job that releases GPUs
wakes the waiting ones through the queue too. With a metrics port,
:mod:`adaptis.operator.control.metrics` serves the operator's own figures.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field

import kopf

from adaptis.operator.control.handlers import JobKey, build_registry
from adaptis.operator.control.metrics import OperatorMetrics
from adaptis.operator.control.reconcile import Reconciler, ReconcileSettings
from adaptis.operator.control.workqueue import WorkQueue
from adaptis.operator.core.errors import OperatorError
from adaptis.operator.core.settings import OPERATOR_DEFAULTS
from adaptis.operator.kube.client import KubeCluster
from adaptis.operator.scheduling.capacity import CapacityLedger
from adaptis.operator.scheduling.inventory import WatchedInventory
from adaptis.operator.scheduling.plan_runner import PlannerLimits, PlanRunner

__all__ = ["OperatorOptions", "run_operator"]

log = logging.getLogger(__name__)

_SYNC_TIMEOUT_S = 120.0  # the first lists of the inventory's informers


@dataclass(frozen=True)
class OperatorOptions:
    """What ``adaptis operator`` was asked to do."""

    namespaces: tuple[str, ...] = ()
    all_namespaces: bool = False
    liveness_endpoint: str | None = None
    metrics_port: int | None = None  # serve /metrics here (None: no metrics server)
    reconcile_workers: int = OPERATOR_DEFAULTS.reconcile_workers
    resync_seconds: float = OPERATOR_DEFAULTS.resync_seconds
    queue_strict_after_s: float = OPERATOR_DEFAULTS.queue_strict_after_seconds  # see capacity.CapacityLedger
    reconcile: ReconcileSettings = field(default_factory=ReconcileSettings)
    planner: PlannerLimits = field(default_factory=PlannerLimits)


def _kopf_settings() -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    # Nothing of kopf's own bookkeeping goes into status (the schema would prune it anyway).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix="operator.adaptis.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="operator.adaptis.io")
    # The reconciler posts its own Events; kopf's would duplicate them at INFO level.
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.scanning.disabled = True
    return settings


def run_operator(options: OperatorOptions, *, stop_flag: threading.Event | None = None) -> None:
    """Run until stopped (a signal, or ``stop_flag`` when embedded in another program)."""
    cluster = KubeCluster()

    def process(key: JobKey) -> float | None:
        with metrics.observe_pass(key) as done:
            result = reconciler.reconcile(*key)
            done(result)
        if result.phase is None:  # the job is gone (its last pass released what it held)
            queue.forget(key)
        return result.requeue_after

    # The queue comes first (its workers start below, once everything is built), so what wakes
    # jobs holds its bound methods: a node that comes just after the inventory's first lists,
    # before the reconciler exists, is queued instead of meeting a name not yet bound.
    queue: WorkQueue[JobKey] = WorkQueue(process, workers=options.reconcile_workers,
                                         resync_s=options.resync_seconds)
    # A job that releases GPUs wakes the jobs waiting for them, in queue order; a finished
    # plan wakes its job.
    ledger = CapacityLedger(strict_after_s=options.queue_strict_after_s, wake=queue.add)
    planner = PlanRunner(limits=options.planner, wake=queue.add)
    metrics = OperatorMetrics(queue_depth=queue.depth)
    # Nodes, pods' GPUs, priority classes and measured profiles, kept from watches: no pass
    # lists the cluster. The first pass waits for the first lists (an empty copy would admit
    # onto GPUs others hold).
    inventory = WatchedInventory(cluster, profile_namespace=options.reconcile.profile_namespace,
                                 on_nodes_changed=queue.add_all)
    inventory.start()
    if not inventory.wait_synced(_SYNC_TIMEOUT_S):
        inventory.stop()
        raise OperatorError(f"the nodes, pods and priority classes could not be listed within "
                            f"{_SYNC_TIMEOUT_S:.0f}s: is the API server reachable, and may the "
                            "operator's service account list and watch them (charts/adaptis "
                            "rbac.yaml)?")
    reconciler = Reconciler(cluster, settings=options.reconcile, ledger=ledger, planner=planner,
                            inventory=inventory, observer=metrics)
    registry = build_registry(queue)
    server = metrics.serve(port=options.metrics_port) if options.metrics_port else None
    swept = reconciler.sweep()
    if swept:
        log.info("deleted %d plan record(s) of jobs deleted while the operator was down", swept)
    queue.start()
    log.info("adaptis operator: %s", "all namespaces" if options.all_namespaces
             else f"namespaces {', '.join(options.namespaces) or 'default'}")
    try:
        coroutine = kopf.operator(
            registry=registry,
            settings=_kopf_settings(),
            standalone=True,
            clusterwide=options.all_namespaces,
            namespaces=() if options.all_namespaces else (options.namespaces or ("default",)),
            liveness_endpoint=options.liveness_endpoint,
            stop_flag=stop_flag,
        )
        asyncio.run(coroutine)
    finally:
        queue.stop()
        inventory.stop()
        planner.shutdown()
        if server is not None:
            server.shutdown()
