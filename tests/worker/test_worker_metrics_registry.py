"""WorkerMetrics in process (adaptis.worker.run.metrics): each step's figures land in the family
the contract names, with the right kind and labels, and ``serve`` exposes them over HTTP.

test_worker_metrics.py scrapes real ranks (the values a user sees); its ranks run in their own
processes, so these tests pin the same contract where a broken :class:`WorkerMetrics` is caught
without starting a job, with known answers from hand-made steps.
"""

from __future__ import annotations

import logging
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from adaptis.worker.run.metrics import METRIC_NAMES, WorkerMetrics, series_table
from adaptis.worker.runtime.executor import StepStats

LABELS = {"adaptis_job": "demo", "rank": "1"}
DOCS = Path(__file__).resolve().parents[2] / "docs"


def _step(**overrides: object) -> StepStats:
    fields: dict[str, object] = {
        "rank": 1, "loss": 2.5, "iteration_seconds": 4.0, "step_seconds": 5.5, "busy_seconds": (3.5, 3.0),
        "busy_by_kind": {"F": 1.0, "B": 2.0}, "grad_norm": 0.7, "sent_bytes": 1000, "received_bytes": 300,
        "peak_memory_bytes": 123456, "learning_rate": 0.01,
    }
    fields.update(overrides)
    return StepStats(**fields)  # type: ignore[arg-type]


def _values(metrics: WorkerMetrics) -> dict[str, float]:
    """Every sample of the registry (histogram buckets keyed by their bound), labels checked."""
    out: dict[str, float] = {}
    for family in metrics.registry.collect():
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            labels = dict(s.labels)
            le = labels.pop("le", None)
            assert labels == LABELS, (s.name, s.labels)
            out[s.name if le is None else f"{s.name}{{le={le}}}"] = s.value
    return out


def _kinds(metrics: WorkerMetrics) -> dict[str, str]:
    """Family name (a counter's without ``_total``, as the exposition's TYPE line) -> kind."""
    text = generate_latest(metrics.registry).decode()
    return {f.name: f.type for f in text_string_to_metric_families(text) if not f.name.endswith("_created")}


def test_a_step_lands_in_each_family() -> None:
    metrics = WorkerMetrics(job="demo", rank=1)
    metrics.record(_step(), tokens=512, samples=4, data_seconds=0.25)
    v = _values(metrics)
    assert v["adaptis_busy_seconds_total"] == 3.0  # this rank's (rank 1's), not rank 0's
    assert v["adaptis_idle_seconds_total"] == 1.0  # 4.0 - 3.0
    assert v["adaptis_bubble_ratio"] == 0.25
    assert v["adaptis_data_seconds_total"] == 0.25
    assert v["adaptis_pipeline_seconds_total"] == 4.0
    assert v["adaptis_post_pipeline_seconds_total"] == 1.5  # 5.5 - 4.0
    assert v["adaptis_step_duration_seconds_count"] == 1.0
    assert v["adaptis_step_duration_seconds_sum"] == 5.5
    assert v["adaptis_step_duration_seconds_bucket{le=5.0}"] == 0.0
    assert v["adaptis_step_duration_seconds_bucket{le=10.0}"] == 1.0
    assert v["adaptis_tokens_total"] == 512
    assert v["adaptis_samples_total"] == 4
    assert v["adaptis_steps_total"] == 1
    assert v["adaptis_loss"] == 2.5
    assert v["adaptis_peak_memory_bytes"] == 123456
    assert v["adaptis_learning_rate"] == 0.01
    assert v["adaptis_sent_bytes_total"] == 1000
    assert v["adaptis_received_bytes_total"] == 300


def test_counters_add_up_over_steps_and_gauges_keep_the_last() -> None:
    metrics = WorkerMetrics(job="demo", rank=1)
    metrics.record(_step(), tokens=512, samples=4, data_seconds=0.25)
    metrics.record(_step(loss=1.5, busy_seconds=(3.0, 2.0), peak_memory_bytes=99, learning_rate=0.02,
                         step_seconds=0.3, iteration_seconds=0.2), tokens=512, samples=4)
    v = _values(metrics)
    assert v["adaptis_busy_seconds_total"] == 5.0
    assert v["adaptis_idle_seconds_total"] == 1.0  # the second step: busy 2.0 > iteration 0.2 -> 0
    assert v["adaptis_data_seconds_total"] == 0.25  # no data_seconds: 0 by default
    assert v["adaptis_pipeline_seconds_total"] == pytest.approx(4.2)
    assert v["adaptis_post_pipeline_seconds_total"] == pytest.approx(1.6)
    assert v["adaptis_steps_total"] == 2 and v["adaptis_tokens_total"] == 1024 and v["adaptis_samples_total"] == 8
    assert (v["adaptis_loss"], v["adaptis_peak_memory_bytes"], v["adaptis_learning_rate"]) == (1.5, 99, 0.02)
    assert v["adaptis_bubble_ratio"] == 0.0
    assert v["adaptis_step_duration_seconds_bucket{le=0.25}"] == 0.0
    assert v["adaptis_step_duration_seconds_bucket{le=0.5}"] == 1.0
    assert v["adaptis_sent_bytes_total"] == 2000 and v["adaptis_received_bytes_total"] == 600


def test_the_families_have_the_contract_names_kinds_and_buckets() -> None:
    metrics = WorkerMetrics(job="demo", rank=1)
    metrics.set_prediction(bubble_ratio=0.1, iteration_seconds=2.0, step_seconds=2.5, post_pipeline_seconds=0.5)
    metrics.record(_step(), tokens=1, samples=1)
    kinds = _kinds(metrics)
    exported = {name if kind != "counter" else f"{name}_total" for name, kind in kinds.items()}
    assert exported == set(METRIC_NAMES)
    assert len(METRIC_NAMES) == 19
    counters = {n for n in METRIC_NAMES if n.endswith("_total")}
    assert {n for n, k in kinds.items() if k == "counter"} == {n.removesuffix("_total") for n in counters}
    assert {n for n, k in kinds.items() if k == "histogram"} == {"adaptis_step_duration_seconds"}
    bounds = sorted(float(k.split("le=")[1].rstrip("}")) for k in _values(metrics) if "_bucket{" in k)
    assert bounds == [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
                      float("inf")]


def test_the_docs_list_every_family_with_its_kind_and_help_text() -> None:
    """docs/metrics.md's series table is the registry's: the names a query uses, the kinds and
    the HELP texts Prometheus shows (what a user reads in either place is the same text)."""
    text = (DOCS / "metrics.md").read_text()
    begin = "<!-- BEGIN generated by `adaptis docs` from adaptis/worker/run/metrics.py. Do not edit. -->\n"
    documented = text[text.index(begin) + len(begin):text.index("<!-- END generated -->")]
    assert documented == series_table(WorkerMetrics(job="demo", rank=1).registry), (
        "docs/metrics.md's series drifted from adaptis/worker/run/metrics.py: run `adaptis docs`")
    rows = documented.splitlines()[2:]
    assert [r.split("`")[1] for r in rows] == list(METRIC_NAMES)
    # Read by hand: a counter under its _total name, the kind, the HELP text as written.
    assert "| `adaptis_busy_seconds_total` | counter | Compute time of this rank (F, B, W actions). |" in rows
    assert ("| `adaptis_step_duration_seconds` | histogram | Wall time of a training step on this rank from "
            "its common start: pipeline + post-pipeline part (optimizer included, data phase not). |") in rows
    for row in rows:
        assert row.count(" | ") == 2 and row.endswith(". |"), row  # three cells, a sentence each


def test_a_pipe_in_a_help_text_stays_inside_its_cell() -> None:
    from prometheus_client import CollectorRegistry, Gauge

    registry = CollectorRegistry()
    Gauge("adaptis_demo", "Either | or.", registry=registry)
    assert series_table(registry).splitlines()[2] == "| `adaptis_demo` | gauge | Either \\| or. |"


def test_totals_start_at_zero_and_resume_from_a_checkpoint() -> None:
    metrics = WorkerMetrics(job="demo", rank=1)
    v = _values(metrics)
    for name in ("adaptis_busy_seconds_total", "adaptis_idle_seconds_total", "adaptis_data_seconds_total",
                 "adaptis_pipeline_seconds_total", "adaptis_post_pipeline_seconds_total", "adaptis_tokens_total",
                 "adaptis_samples_total", "adaptis_steps_total", "adaptis_sent_bytes_total",
                 "adaptis_received_bytes_total", "adaptis_step_duration_seconds_count"):
        assert v[name] == 0.0, name
    metrics.restore(steps=7, tokens=3584, samples=28)
    metrics.record(_step(), tokens=512, samples=4)
    v = _values(metrics)
    assert (v["adaptis_steps_total"], v["adaptis_tokens_total"], v["adaptis_samples_total"]) == (8, 4096, 32)


def test_a_prediction_the_plan_lacks_stays_absent() -> None:
    metrics = WorkerMetrics(job="demo", rank=1)
    metrics.set_prediction(bubble_ratio=0.2, iteration_seconds=3.0)
    v = _values(metrics)
    assert v["adaptis_predicted_bubble_ratio"] == 0.2
    assert v["adaptis_predicted_iteration_seconds"] == 3.0
    assert "adaptis_predicted_step_seconds" not in v and "adaptis_predicted_post_pipeline_seconds" not in v
    metrics.set_prediction(bubble_ratio=None, iteration_seconds=None, step_seconds=3.5, post_pipeline_seconds=0.5)
    v = _values(metrics)
    assert (v["adaptis_predicted_step_seconds"], v["adaptis_predicted_post_pipeline_seconds"]) == (3.5, 0.5)
    assert v["adaptis_predicted_bubble_ratio"] == 0.2  # None leaves the earlier value


def test_serve_exposes_the_registry_on_a_free_port_until_closed(caplog: pytest.LogCaptureFixture) -> None:
    metrics = WorkerMetrics(job="demo", rank=1)
    metrics.record(_step(), tokens=512, samples=4)
    with caplog.at_level(logging.INFO, logger="adaptis.worker.run.metrics"):
        port = metrics.serve(port=0, addr="127.0.0.1")
    assert port > 0
    # The rank's log says where to scrape, and it listens on the address asked for only.
    assert f"metrics on http://127.0.0.1:{port}/metrics" in caplog.messages
    assert metrics._server is not None and metrics._server.server_address[0] == "127.0.0.1"
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert 'adaptis_tokens_total{adaptis_job="demo",rank="1"} 512.0' in text
    finally:
        metrics.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
    metrics.close()  # a second close is harmless
    WorkerMetrics(job="demo", rank=0).close()  # so is closing metrics never served (a rank that failed early)


def test_by_default_serve_listens_on_every_interface() -> None:
    """A rank is served without an address (runner.py): Prometheus scrapes the pod's IP, not
    its loopback, so the default is every interface."""
    metrics = WorkerMetrics(job="demo", rank=1)
    port = metrics.serve(port=0)
    try:
        assert metrics._server is not None and metrics._server.server_address[0] == "0.0.0.0"
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert 'adaptis_steps_total{adaptis_job="demo",rank="1"} 0.0' in text
    finally:
        metrics.close()
