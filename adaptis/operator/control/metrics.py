"""The operator's own Prometheus metrics: reconcile passes, their time, the jobs by phase.

Sits beside the work queue in :mod:`adaptis.operator.control.app`, which wraps each reconcile pass
with :meth:`OperatorMetrics.observe_pass` and serves the registry when ``adaptis operator
--metrics-port`` is given (the chart's ``operator.metrics``; its Service and ServiceMonitor scrape
it). The workers' training metrics (``adaptis_*``, bubble ratio and the rest) are
:mod:`adaptis.worker.run.metrics`; these say whether the operator keeps up:

- ``adaptis_operator_reconciles_total{result}``: passes, ``ok`` or ``error`` (an exception:
  the pass is retried with backoff);
- ``adaptis_operator_reconcile_seconds``: how long a pass took (planning included);
- ``adaptis_operator_jobs{phase}``: AdaPtisJobs by the phase their last pass left them in;
- ``adaptis_operator_queue_depth``: jobs waiting for a pass.
- ``adaptis_operator_replans_total{job_namespace, adaptis_job, action}``: re-plans from the
  workers' measured drift (:mod:`adaptis.operator.adaptation.loop`), ``applied`` (policy auto) or
  ``suggested``; the dashboard annotates them;
- ``adaptis_operator_predicted_busy_seconds{job_namespace, adaptis_job, device}``: compute per
  step the running plan predicts for each pipeline device, beside the workers' measured
  ``adaptis_busy_seconds_total`` per step on the dashboard.

``job_namespace``, not ``namespace``: a scrape sets ``namespace`` to the operator's own.

The registry is the instance's own, never prometheus_client's global one: two operators in one
process (tests) do not share counters.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import Any, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from adaptis.api.job import Phase
from adaptis.operator.core.passes import Result

__all__ = ["OperatorMetrics"]

#: Every phase a job can be in, so a scrape shows zeros rather than gaps.
PHASES: tuple[str, ...] = get_args(Phase)
_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class OperatorMetrics:
    """Counters of reconcile passes and the jobs' phases, in an own registry."""

    def __init__(self, *, queue_depth: Callable[[], int] | None = None) -> None:
        self.registry = CollectorRegistry()
        self._passes = Counter("adaptis_operator_reconciles", "Reconcile passes by result (ok, error).",
                               ["result"], registry=self.registry)
        self._seconds = Histogram("adaptis_operator_reconcile_seconds", "Seconds of one reconcile pass.",
                                  buckets=_BUCKETS, registry=self.registry)
        self._jobs = Gauge("adaptis_operator_jobs", "AdaPtisJobs by phase after their last pass.",
                           ["phase"], registry=self.registry)
        for result in ("ok", "error"):
            self._passes.labels(result=result)
        for phase in PHASES:
            self._jobs.labels(phase=phase).set(0)
        if queue_depth is not None:
            depth = Gauge("adaptis_operator_queue_depth", "Jobs waiting for a reconcile pass.",
                          registry=self.registry)
            depth.set_function(lambda: float(queue_depth()))
        self._replans = Counter("adaptis_operator_replans", "Re-plans from measured drift, applied "
                                "(policy auto) or suggested.", ["job_namespace", "adaptis_job", "action"],
                                registry=self.registry)
        self._predicted_busy = Gauge("adaptis_operator_predicted_busy_seconds",
                                     "Compute per step the running plan predicts for each pipeline device.",
                                     ["job_namespace", "adaptis_job", "device"], registry=self.registry)
        self._lock = threading.Lock()
        self._phase_of: dict[Hashable, str] = {}

    @contextmanager
    def observe_pass(self, key: Hashable) -> Iterator[Callable[[Result], None]]:
        """Time one pass of ``key``; call the yielded function with its result. A pass that
        raises counts as an error and leaves the job's phase as it was."""
        start = time.perf_counter()
        outcome: list[Result] = []
        try:
            yield outcome.append
        except BaseException:
            self._passes.labels(result="error").inc()
            raise
        finally:
            self._seconds.observe(time.perf_counter() - start)
        self._passes.labels(result="ok").inc()
        if outcome:
            self._set_phase(key, outcome[-1].phase)

    def _set_phase(self, key: Hashable, phase: str | None) -> None:
        with self._lock:
            before = self._phase_of.pop(key, None)
            if phase is not None:
                self._phase_of[key] = phase
            if before == phase:
                return
            if before is not None:
                self._jobs.labels(phase=before).dec()
            if phase is not None:
                self._jobs.labels(phase=phase).inc()

    # --- adaptis.operator.adaptation.loop.AdaptationObserver ------------------------------
    def replanned(self, key: tuple[str, str], *, action: str) -> None:
        self._replans.labels(job_namespace=key[0], adaptis_job=key[1], action=action).inc()

    def predicted(self, key: tuple[str, str], *, busy_seconds: list[float]) -> None:
        for device, seconds in enumerate(busy_seconds):
            self._predicted_busy.labels(job_namespace=key[0], adaptis_job=key[1],
                                        device=str(device)).set(seconds)

    def serve(self, *, port: int, addr: str = "0.0.0.0") -> Any:  # noqa: S104 - a pod's metrics port
        """Serve /metrics on ``port`` from a daemon thread; returns the server (``shutdown()``)."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return server
