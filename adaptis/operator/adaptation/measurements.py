"""The workers' measured compute, read back from Prometheus: one job's busy counters and steps.

Sits under :mod:`adaptis.operator.adaptation.loop`, which feeds what this returns into the planner's
:class:`~adaptis.planner.drift.DriftWindow`. The workers export ``adaptis_busy_seconds_total``
and ``adaptis_steps_total`` per rank (labels ``adaptis_job`` and ``rank``,
:mod:`adaptis.worker.run.metrics`); the chart's PodMonitor adds ``namespace``, ``pod`` and ``node``
from the scraped pod. The operator asks Prometheus's HTTP API (``/api/v1/query``, one instant
query per poll) with the standard library only: the operator image stays free of torch and of
any Prometheus client.

Trust: only series whose ``namespace`` is the job's own count; the PodMonitor takes that label
from the target pod, so a job in another namespace cannot feed this job's decision by naming
it in ``adaptis_job``.
"""

from __future__ import annotations

import json
import logging
import math
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from adaptis.api.conditions import Reason
from adaptis.operator.core.errors import OperatorError

__all__ = ["BUSY", "STEPS", "MeasurementError", "Sample", "parse_sample", "query_job"]

log = logging.getLogger(__name__)

BUSY = "adaptis_busy_seconds_total"
STEPS = "adaptis_steps_total"


class MeasurementError(OperatorError):
    """Prometheus could not be asked, or answered something that is not a vector."""

    reason = Reason.MEASUREMENT_UNAVAILABLE


@dataclass(frozen=True, slots=True)
class Sample:
    """One poll of a job: the fewest steps any rank has done, and each rank's busy counter."""

    step: int
    busy: dict[int, float]  # global rank -> cumulative busy seconds

    def counters(self, world: int) -> list[float] | None:
        """Busy counters of ranks 0 .. world-1, or None while some rank has none yet."""
        if any(r not in self.busy for r in range(world)):
            return None
        return [self.busy[r] for r in range(world)]


def _quote(value: str) -> str:
    # PromQL string literal: JSON's escaping is a valid subset (names here are DNS labels anyway).
    return json.dumps(value)


def job_selector(*, namespace: str, job: str) -> str:
    """The instant query of one job's two series."""
    return (f'{{__name__=~"{BUSY}|{STEPS}",namespace={_quote(namespace)},'
            f'adaptis_job={_quote(job)}}}')


def parse_sample(payload: Any, *, namespace: str, job: str) -> Sample | None:
    """The sample in a ``/api/v1/query`` answer; None when no rank reports steps yet.

    A rank with two series (an old pod's not yet stale beside its successor's) counts by its
    largest counter: the older series stops growing and the window restarts on a new gang."""
    if not isinstance(payload, dict) or payload.get("status") != "success":
        raise MeasurementError(f"Prometheus answered {str(payload)[:200]}")
    data = payload.get("data") or {}
    if data.get("resultType") != "vector":
        raise MeasurementError(f"expected a vector, got {data.get('resultType')!r}")
    busy: dict[int, float] = {}
    steps: dict[int, float] = {}
    for series in data.get("result") or []:
        labels = series.get("metric") or {}
        if labels.get("namespace") != namespace or labels.get("adaptis_job") != job:
            continue  # never another namespace's series, whatever its adaptis_job says
        try:
            rank = int(labels.get("rank", ""))
            value = float((series.get("value") or [0, "nan"])[1])
        except (TypeError, ValueError):
            continue
        if rank < 0 or not math.isfinite(value):
            continue
        into = busy if labels.get("__name__") == BUSY else steps if labels.get(
            "__name__") == STEPS else None
        if into is not None:
            into[rank] = max(into.get(rank, value), value)
    if not steps:
        return None
    return Sample(step=int(min(steps.values())), busy=busy)


def query_job(url: str, *, namespace: str, job: str, timeout_s: float = 5.0) -> Sample | None:
    """Ask Prometheus at ``url`` for one job's counters now."""
    query = urllib.parse.urlencode({"query": job_selector(namespace=namespace, job=job)})
    target = f"{url.rstrip('/')}/api/v1/query?{query}"
    try:
        with urllib.request.urlopen(target, timeout=timeout_s) as response:  # noqa: S310 - admin's URL
            payload = json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError) as err:
        raise MeasurementError(f"querying Prometheus at {url}: {err}") from err
    return parse_sample(payload, namespace=namespace, job=job)
