"""The Grafana dashboard: datasource as a variable, and queries of exported metrics only.

The exported names come from a real worker metrics registry (adaptis.worker.run.metrics, rendered in
the Prometheus text format); tests/integration/test_prometheus_scrape.py also checks the
dashboard against a running worker's /metrics and runs every query against real data.
"""

from __future__ import annotations

from functools import cache

import chartkit
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families


@cache
def worker_samples() -> frozenset[str]:
    """Sample names a worker's /metrics serves (counters with _total, histogram series)."""
    from adaptis.worker.run.metrics import WorkerMetrics

    registry = WorkerMetrics(job="j", rank=0).registry
    text = generate_latest(registry).decode()
    served = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    # The last-step gauges get their sample with the first step; a gauge's sample is its name.
    gauges = {fam.name for fam in registry.collect() if fam.type == "gauge"}
    return frozenset(served | gauges)


@cache
def operator_samples() -> frozenset[str]:
    """Sample names the operator's /metrics serves once a job was planned and re-planned."""
    from adaptis.operator.control.metrics import OperatorMetrics

    metrics = OperatorMetrics()
    metrics.predicted(("ns", "j"), busy_seconds=[0.1, 0.2])
    metrics.replanned(("ns", "j"), action="applied")
    text = generate_latest(metrics.registry).decode()
    served = frozenset(s.name for fam in text_string_to_metric_families(text) for s in fam.samples)
    assert served >= chartkit.OPERATOR  # chartkit's list names what the operator really serves
    return served


def test_datasource_is_a_variable_used_by_every_panel() -> None:
    board = chartkit.dashboard()
    (ds,) = [v for v in board["templating"]["list"] if v["type"] == "datasource"]
    assert ds["query"] == "prometheus"
    ref = {"type": "prometheus", "uid": f"${{{ds['name']}}}"}
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert panels
    for panel in panels:
        assert panel["datasource"] == ref, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == ref, panel["title"]


def test_queries_read_only_exported_or_recorded_metrics() -> None:
    queries = chartkit.dashboard_queries(chartkit.dashboard())
    used: set[str] = set()
    for title, expr in queries:
        names = chartkit.promql_metric_names(expr)
        assert names, f"{title}: no metric found in {expr!r}"
        unknown = names - worker_samples() - chartkit.RECORDED - operator_samples()
        assert not unknown, f"{title}: {sorted(unknown)} is neither exported nor recorded"
        used |= names
    # The panels the issue asks for: bubble ratio observed (recorded) vs predicted, tokens/s,
    # step time, memory; per job and per rank.
    assert {"adaptis:job_bubble_ratio:rate5m", "adaptis:bubble_ratio:rate5m",
            "adaptis_predicted_bubble_ratio", "adaptis_tokens_total",
            "adaptis_step_duration_seconds_bucket", "adaptis_peak_memory_bytes"} <= used
    # Issue 14: the whole step split into its phases, per job and per rank.
    assert {"adaptis:job_step_phase_seconds:mean5m", "adaptis:job_step_phase_share:rate5m",
            "adaptis_predicted_step_seconds", "adaptis_data_seconds_total",
            "adaptis_pipeline_seconds_total", "adaptis_post_pipeline_seconds_total"} <= used


def test_step_split_stacks_the_observed_phases_beside_the_predicted_step() -> None:
    (panel,) = [p for p in chartkit.dashboard()["panels"] if p["type"] != "row" and any(
        "adaptis:job_step_phase_seconds:mean5m" in t["expr"] for t in p["targets"])]
    assert panel["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    predicted = {t["refId"] for t in panel["targets"] if "adaptis_predicted_step_seconds" in t["expr"]}
    observed = {t["refId"] for t in panel["targets"] if "adaptis:job_step_seconds:mean5m" in t["expr"]}
    assert predicted and observed, "the predicted step belongs beside the observed one (like with like)"
    # The observed and predicted steps are lines over the stack, not stacked on it.
    unstacked = {o["matcher"]["options"] for o in panel["fieldConfig"]["overrides"]
                 if {"id": "custom.stacking", "value": {"mode": "none", "group": "A"}} in o["properties"]}
    assert predicted | observed <= unstacked


def test_panels_filter_by_job_and_rank() -> None:
    board = chartkit.dashboard()
    names = {v["name"] for v in board["templating"]["list"]}
    assert {"datasource", "namespace", "job", "rank"} <= names
    for title, expr in chartkit.dashboard_queries(board):
        if not title.startswith("variable"):
            assert 'adaptis_job=~"$job"' in expr, title
    per_rank = [p for p in board["panels"] if p["type"] != "row"
                and all('rank=~"$rank"' in t["expr"] for t in p["targets"])]
    assert len(per_rank) >= 4


def test_metric_name_parser() -> None:
    expr = ('histogram_quantile(0.9, sum by (namespace, adaptis_job, le) '
            '(rate(adaptis_step_duration_seconds_bucket{adaptis_job=~"$job"}[$__rate_interval])))'
            ' / on (adaptis_job) adaptis:job_bubble_ratio:rate5m')
    assert chartkit.promql_metric_names(expr) == {"adaptis_step_duration_seconds_bucket",
                                                  "adaptis:job_bubble_ratio:rate5m"}


def test_measured_vs_predicted_per_rank_with_replans_annotated() -> None:
    """Issue 17: each rank's measured compute per step beside its device's prediction, and
    the operator's re-plans as annotations."""
    board = chartkit.dashboard()
    (panel,) = [p for p in board["panels"] if p["type"] != "row" and any(
        "adaptis_operator_predicted_busy_seconds" in t["expr"] for t in p["targets"])]
    measured = [t for t in panel["targets"] if {"adaptis_busy_seconds_total", "adaptis_steps_total"}
                <= chartkit.promql_metric_names(t["expr"])]
    assert measured and 'rank=~"$rank"' in measured[0]["expr"]
    (replans,) = [a for a in board["annotations"]["list"]
                  if "adaptis_operator_replans_total" in a["expr"]]
    assert replans["enable"] and replans["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    assert chartkit.promql_metric_names(replans["expr"]) <= operator_samples()
    assert 'adaptis_job=~"$job"' in replans["expr"]
