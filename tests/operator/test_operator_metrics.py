"""The operator's own metrics: passes counted and timed, jobs by phase, served over HTTP."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from prometheus_client import generate_latest

from adaptis.operator.control.metrics import PHASES, OperatorMetrics
from adaptis.operator.core.passes import Result


def _samples(metrics: OperatorMetrics) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in generate_latest(metrics.registry).decode().splitlines()
            if line and not line.startswith("#")}


def _jobs(metrics: OperatorMetrics) -> dict[str, float]:
    s = _samples(metrics)
    return {p: s[f'adaptis_operator_jobs{{phase="{p}"}}'] for p in PHASES}


def test_a_job_is_counted_once_in_its_latest_phase_and_dropped_when_gone() -> None:
    metrics = OperatorMetrics()
    assert set(_jobs(metrics).values()) == {0.0}  # every phase present from the start
    for key, phase in ((("ns", "a"), "Running"), (("ns", "b"), "Running"), (("ns", "a"), "Succeeded"),
                       (("ns", "a"), "Succeeded")):
        with metrics.observe_pass(key) as done:
            done(Result(phase=phase))
    jobs = _jobs(metrics)
    assert jobs["Running"] == 1 and jobs["Succeeded"] == 1 and sum(jobs.values()) == 2
    with metrics.observe_pass(("ns", "b")) as done:
        done(Result())  # deleted: no phase any more
    assert _jobs(metrics)["Running"] == 0
    s = _samples(metrics)
    assert s['adaptis_operator_reconciles_total{result="ok"}'] == 5
    assert s["adaptis_operator_reconcile_seconds_count"] == 5


def test_a_failing_pass_counts_as_an_error_and_keeps_the_phase() -> None:
    metrics = OperatorMetrics()
    with metrics.observe_pass(("ns", "a")) as done:
        done(Result(phase="Planned"))
    with pytest.raises(RuntimeError), metrics.observe_pass(("ns", "a")):
        raise RuntimeError("the API server went away")
    s = _samples(metrics)
    assert s['adaptis_operator_reconciles_total{result="error"}'] == 1
    assert s['adaptis_operator_reconciles_total{result="ok"}'] == 1
    assert s["adaptis_operator_reconcile_seconds_count"] == 2
    assert _jobs(metrics)["Planned"] == 1


def test_served_over_http_with_the_queue_depth() -> None:
    depth = [3]
    metrics = OperatorMetrics(queue_depth=lambda: depth[0])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = metrics.serve(port=port, addr="127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    finally:
        server.shutdown()
    assert "adaptis_operator_queue_depth 3.0" in text
    assert "adaptis_operator_reconciles_total" in text
