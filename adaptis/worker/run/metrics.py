"""Prometheus metrics of one worker rank, served over HTTP (prometheus-client).

Sits beside the run loop (:mod:`adaptis.worker.run.runner`), which calls
:meth:`WorkerMetrics.record` after every step. The names are a contract with the Helm chart and the
Grafana dashboard; do not rename them. Labels are exactly ``adaptis_job`` and ``rank``: no per-step
or per-microbatch labels. Base units, ``_total`` counters, ratios in 0-1.

``adaptis_bubble_ratio`` is this rank's idle share of the last iteration; since every rank
shares one iteration time, the job's bubble ratio is the mean over ranks, which is what the
plan's ``adaptis_predicted_bubble_ratio`` predicts.

The phases of a step, as counters of seconds (rates add up to about one second per second):
``adaptis_data_seconds_total`` (fetching the batch, then waiting at the common start for every
rank), ``adaptis_pipeline_seconds_total`` (the common start to the last rank's pipeline end;
this rank's busy + idle time) and ``adaptis_post_pipeline_seconds_total`` (the pipeline end to
this rank's step end: tied-gradient exchange, gradient reductions, clipping, optimizer, stats).
The plan's step and post-pipeline predictions, when it has them, sit beside them as gauges.

The HELP texts are the user's reference too: :func:`series_table` renders the families' names,
kinds and HELP texts as the "Series" table of docs/metrics.md (``adaptis docs`` writes it there,
the tests check the checked-in copy), so the docs and what Prometheus shows cannot drift.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from adaptis.worker.runtime.executor import StepStats

__all__ = ["METRIC_NAMES", "WorkerMetrics", "series_table"]

log = logging.getLogger(__name__)

LABELS = ("adaptis_job", "rank")

#: Every metric family this module exports (the contract with charts/ and Grafana).
METRIC_NAMES: tuple[str, ...] = (
    "adaptis_busy_seconds_total",
    "adaptis_idle_seconds_total",
    "adaptis_bubble_ratio",
    "adaptis_predicted_bubble_ratio",
    "adaptis_predicted_iteration_seconds",
    "adaptis_predicted_step_seconds",
    "adaptis_predicted_post_pipeline_seconds",
    "adaptis_data_seconds_total",
    "adaptis_pipeline_seconds_total",
    "adaptis_post_pipeline_seconds_total",
    "adaptis_step_duration_seconds",
    "adaptis_tokens_total",
    "adaptis_samples_total",
    "adaptis_steps_total",
    "adaptis_loss",
    "adaptis_peak_memory_bytes",
    "adaptis_learning_rate",
    "adaptis_sent_bytes_total",
    "adaptis_received_bytes_total",
)

_STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass(frozen=True, slots=True)
class _Families:
    busy: Counter
    idle: Counter
    bubble: Gauge
    predicted_bubble: Gauge
    predicted_iteration: Gauge
    predicted_step: Gauge
    predicted_post: Gauge
    data: Counter
    pipeline: Counter
    post: Counter
    step_duration: Histogram
    tokens: Counter
    samples: Counter
    steps: Counter
    loss: Gauge
    peak_memory: Gauge
    learning_rate: Gauge
    sent: Counter
    received: Counter


class WorkerMetrics:
    """This rank's metric families in their own registry (no process-global state)."""

    def __init__(self, *, job: str, rank: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # prometheus-client appends _total to counters itself: name them without it.
        f = _Families(
            busy=Counter("adaptis_busy_seconds", "Compute time of this rank (F, B, W actions).", LABELS, registry=r),
            idle=Counter("adaptis_idle_seconds",
                         "Idle time of this rank within the pipeline part of the steps (the bubble).",
                         LABELS, registry=r),
            bubble=Gauge("adaptis_bubble_ratio", "Idle share of this rank in the last step's pipeline part (0-1).",
                         LABELS, registry=r),
            predicted_bubble=Gauge("adaptis_predicted_bubble_ratio",
                                   "Bubble ratio of the pipeline part the planner predicts for the plan (0-1).",
                                   LABELS, registry=r),
            predicted_iteration=Gauge("adaptis_predicted_iteration_seconds",
                                      "Pipeline part of a step (iteration time) the planner predicts for the plan.",
                                      LABELS, registry=r),
            predicted_step=Gauge("adaptis_predicted_step_seconds",
                                 "Whole-step time the planner predicts (pipeline + post-pipeline part); "
                                 "absent when the plan does not model it.",
                                 LABELS, registry=r),
            predicted_post=Gauge("adaptis_predicted_post_pipeline_seconds",
                                 "Post-pipeline time the planner predicts (reductions, clipping, optimizer); "
                                 "absent when the plan does not model it.",
                                 LABELS, registry=r),
            data=Counter("adaptis_data_seconds", "Time before the steps' common start: fetching the batch "
                         "and waiting for every rank.", LABELS, registry=r),
            pipeline=Counter("adaptis_pipeline_seconds", "Pipeline part of the steps: common start to the "
                             "last rank's pipeline end (busy + idle).", LABELS, registry=r),
            post=Counter("adaptis_post_pipeline_seconds", "Post-pipeline part of the steps: pipeline end to "
                         "this rank's step end (gradient exchange and reductions, clipping, optimizer).",
                         LABELS, registry=r),
            step_duration=Histogram("adaptis_step_duration_seconds",
                                    "Wall time of a training step on this rank from its common start: "
                                    "pipeline + post-pipeline part (optimizer included, data phase not).",
                                    LABELS, registry=r, buckets=_STEP_BUCKETS),
            tokens=Counter("adaptis_tokens", "Tokens trained.", LABELS, registry=r),
            samples=Counter("adaptis_samples", "Sequences trained.", LABELS, registry=r),
            steps=Counter("adaptis_steps", "Training steps completed.", LABELS, registry=r),
            loss=Gauge("adaptis_loss", "Training loss of the last step (mean over its batch).", LABELS, registry=r),
            peak_memory=Gauge("adaptis_peak_memory_bytes",
                              "Peak memory of this rank (device allocator on GPU, RSS on CPU).", LABELS, registry=r),
            learning_rate=Gauge("adaptis_learning_rate",
                                "Learning rate of the last step's optimizer update.", LABELS,
                                registry=r),
            sent=Counter("adaptis_sent_bytes", "Bytes this rank sent to other ranks (pipeline traffic).", LABELS,
                         registry=r),
            received=Counter("adaptis_received_bytes", "Bytes this rank received from other ranks (pipeline traffic).",
                             LABELS, registry=r),
        )
        self._f = f
        self._labels = {"adaptis_job": job, "rank": str(rank)}
        # Totals start at zero before the first step (rate() needs that first sample); the
        # gauges of the last step (bubble ratio, loss, peak memory) appear with the first step,
        # since a 0 there would be a false observation on every dashboard.
        for fam in (f.busy, f.idle, f.data, f.pipeline, f.post, f.step_duration, f.tokens, f.samples,
                    f.steps, f.sent, f.received):
            fam.labels(**self._labels)
        self._server: WSGIServer | None = None

    def set_prediction(self, *, bubble_ratio: float | None, iteration_seconds: float | None,
                       step_seconds: float | None = None,
                       post_pipeline_seconds: float | None = None) -> None:
        """The plan's predictions; a prediction the plan lacks stays absent (not 0)."""
        f, lab = self._f, self._labels
        for gauge, value in ((f.predicted_bubble, bubble_ratio), (f.predicted_iteration, iteration_seconds),
                             (f.predicted_step, step_seconds), (f.predicted_post, post_pipeline_seconds)):
            if value is not None:
                gauge.labels(**lab).set(value)

    def record(self, stats: StepStats, *, tokens: int, samples: int, data_seconds: float = 0.0) -> None:
        f, lab = self._f, self._labels
        f.busy.labels(**lab).inc(stats.busy_seconds[stats.rank])
        f.idle.labels(**lab).inc(stats.idle_seconds)
        f.data.labels(**lab).inc(data_seconds)
        f.pipeline.labels(**lab).inc(stats.iteration_seconds)
        f.post.labels(**lab).inc(stats.post_pipeline_seconds)
        f.bubble.labels(**lab).set(stats.rank_bubble_ratio)
        f.step_duration.labels(**lab).observe(stats.step_seconds)
        f.tokens.labels(**lab).inc(tokens)
        f.samples.labels(**lab).inc(samples)
        f.steps.labels(**lab).inc()
        f.loss.labels(**lab).set(stats.loss)
        f.peak_memory.labels(**lab).set(stats.peak_memory_bytes)
        f.learning_rate.labels(**lab).set(stats.learning_rate)
        f.sent.labels(**lab).inc(stats.sent_bytes)
        f.received.labels(**lab).inc(stats.received_bytes)

    def restore(self, *, steps: int, tokens: int, samples: int) -> None:
        """After a resume, counters continue from the checkpoint's totals (not from zero)."""
        f, lab = self._f, self._labels
        f.steps.labels(**lab).inc(steps)
        f.tokens.labels(**lab).inc(tokens)
        f.samples.labels(**lab).inc(samples)

    def serve(self, *, port: int, addr: str = "0.0.0.0") -> int:  # noqa: S104 - scraped on the pod's IP
        """Serve ``/metrics`` on ``port`` (0: any free port); returns the bound port."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        self._server = server
        bound = int(server.server_address[1])
        log.info("metrics on http://%s:%d/metrics", addr, bound)
        return bound

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def series_table(registry: CollectorRegistry) -> str:
    """The families of ``registry`` as a Markdown table: exported name, kind and HELP text.

    A counter is listed by the name a query uses (``_total`` appended, as in the exposition).
    """
    rows = ["| metric | type | meaning |", "|---|---|---|"]
    for family in registry.collect():
        name = f"{family.name}_total" if family.type == "counter" else family.name
        # A '|' would end the cell early; Markdown reads the escaped one as text.
        meaning = family.documentation.replace("|", "\\|")
        rows.append(f"| `{name}` | {family.type} | {meaning} |")
    return "\n".join(rows) + "\n"
