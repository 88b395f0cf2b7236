"""Worker-like metrics for the operator's adaptation test: a process serving the counters a
real gang of workers serves (``adaptis_busy_seconds_total`` and ``adaptis_steps_total`` per rank,
labels ``adaptis_job`` and ``rank``, the names of :mod:`adaptis.worker.run.metrics`), for pods that
kwok only pretends to run.

Each rank does, per step, the compute the running plan predicts for its device (read from the
operator's own ``adaptis_operator_predicted_busy_seconds``) times its slowness
(``--slow RANK=FACTOR``): the slow device a real GPU that throttles would be. When the
prediction changes (the operator re-planned: a new gang), the counters start again from zero,
as new worker processes' do. Run as ``python fakeworkers.py --port ... --job ... --operator
URL``; stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import threading
import urllib.request
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily
from prometheus_client.parser import text_string_to_metric_families

# adaptis.worker.run.metrics's names (importing it would import torch: 20 s on a busy machine);
# tests/charts/test_charts_dashboard.py holds the dashboard, which reads both, to that registry.
BUSY, STEPS = "adaptis_busy_seconds_total", "adaptis_steps_total"


class Gang:
    """The counters of one gang, advanced one step at a time."""

    def __init__(self, *, job: str, slow: dict[int, float], claim_namespace: str | None = None) -> None:
        self.job = job
        self.slow = slow
        # A worker that labels its own samples with another namespace (a tenant's spoof): the
        # PodMonitor's target labels must win over it.
        self.claim = {"namespace": claim_namespace} if claim_namespace else {}
        self.lock = threading.Lock()
        self.predicted: tuple[float, ...] = ()
        self.steps = 0
        self.busy: list[float] = []

    def predict(self, predicted: tuple[float, ...]) -> None:
        with self.lock:
            if predicted != self.predicted:  # a new plan: new processes, counters from zero
                self.predicted, self.steps, self.busy = predicted, 0, [0.0] * len(predicted)

    def step(self) -> None:
        with self.lock:
            if not self.predicted:
                return
            self.steps += 1
            for r, seconds in enumerate(self.predicted):
                self.busy[r] += seconds * self.slow.get(r, 1.0)

    def collect(self) -> Iterator[CounterMetricFamily]:
        with self.lock:
            if not self.predicted:
                return
            names = ["adaptis_job", "rank", *self.claim]
            busy = CounterMetricFamily(BUSY[:-6], "Compute time of this rank (F, B, W actions).",
                                       labels=names)
            steps = CounterMetricFamily(STEPS[:-6], "Training steps completed.", labels=names)
            for r, seconds in enumerate(self.busy):
                busy.add_metric([self.job, str(r), *self.claim.values()], seconds)
                steps.add_metric([self.job, str(r), *self.claim.values()], float(self.steps))
        yield busy
        yield steps


def predicted_busy(operator_metrics: str, *, job: str) -> tuple[float, ...]:
    """The operator's prediction per device for ``job``, device order; () when none yet."""
    with urllib.request.urlopen(operator_metrics, timeout=5) as response:  # loopback
        text = response.read().decode()
    found: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (sample.name == "adaptis_operator_predicted_busy_seconds"
                    and sample.labels.get("adaptis_job") == job):
                found[int(sample.labels["device"])] = sample.value
    return tuple(found[d] for d in sorted(found)) if found and sorted(found) == list(
        range(len(found))) else ()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--operator", required=True, help="the operator's /metrics URL")
    parser.add_argument("--slow", action="append", default=[], metavar="RANK=FACTOR")
    parser.add_argument("--step-seconds", type=float, default=0.25)
    parser.add_argument("--claim-namespace", help="label the samples with this namespace")
    args = parser.parse_args()
    slow = {int(k): float(v) for k, v in (s.split("=") for s in args.slow)}
    gang = Gang(job=args.job, slow=slow, claim_namespace=args.claim_namespace)
    registry = CollectorRegistry()
    registry.register(gang)  # type: ignore[arg-type]
    server, _ = start_http_server(args.port, addr="127.0.0.1", registry=registry)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.is_set():
        with contextlib.suppress(OSError):  # the operator is not up yet
            gang.predict(predicted_busy(args.operator, job=args.job))
        gang.step()
        stop.wait(args.step_seconds)
    server.shutdown()


if __name__ == "__main__":
    main()
