"""Metrics: a running 2-rank job is scraped over HTTP; values match what the ranks printed,
labels are exactly (adaptis_job, rank), and ``promtool check metrics`` accepts the exposition."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from worker_harness import small_config

from adaptis.api.events import WorkerEvent
from adaptis.worker.run.launcher import LocalLauncher
from adaptis.worker.run.metrics import METRIC_NAMES, WorkerMetrics

STEPS = 3


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is not on PATH: run `bash hack/build-control-plane.sh` (it installs "
                    "Debian's prometheus package, which provides promtool)")
    return path


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[WorkerEvent], dict[int, str]]:
    """Run 3 steps on 2 ranks that keep serving metrics afterwards; scrape both ranks."""
    workdir = tmp_path_factory.mktemp("metrics")
    config = small_config(steps=STEPS, metrics_port=0, job="metrics-test")
    # A plan that predicts the whole step, as a planner that models the post-pipeline part
    # writes it: 1 time unit after the pipeline.
    predicted = {**config.plan["predicted"], "post_pipeline_time": 1.0, "step_time":
                 config.plan["predicted"]["iteration_time"] + 1.0}
    config = config.model_copy(update={"plan": {**config.plan, "predicted": predicted}})
    launcher = LocalLauncher(config, world_size=2, workdir=workdir, linger_s=120, metrics_base=0)
    events: list[WorkerEvent] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            launcher.run(events.append)
        except BaseException as err:  # noqa: BLE001 - stopped on purpose below
            errors.append(err)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    deadline = time.monotonic() + 150
    try:
        while sum(e.event == "done" for e in events) < 2:
            if not thread.is_alive() or time.monotonic() > deadline:
                logs = {p.name: p.read_text()[-2000:] for p in Path(workdir).glob("rank-*.log")}
                pytest.fail(f"the ranks did not finish: {errors} {logs}")
            time.sleep(0.2)
        texts = {}
        for e in events:
            if e.event == "start":
                url = f"http://127.0.0.1:{e.metrics_port}/metrics"
                texts[e.rank] = urllib.request.urlopen(url, timeout=10).read().decode()
    finally:
        launcher.stop()
        thread.join(timeout=20)
    return events, texts


def _samples(text: str) -> dict[str, tuple[dict[str, str], float]]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("adaptis_") and not s.name.endswith(("_created", "_bucket")):
                out[s.name] = (dict(s.labels), s.value)
    return out


@pytest.mark.parametrize("rank", [0, 1])
def test_scraped_values_match_what_the_rank_printed(rank: int, scraped) -> None:
    events, texts = scraped
    steps = [e for e in events if e.event == "step" and e.rank == rank]
    assert [e.step for e in steps] == list(range(1, STEPS + 1))
    got = _samples(texts[rank])
    for name, (labels, _value) in got.items():
        assert labels == {"adaptis_job": "metrics-test", "rank": str(rank)}, name
    last = steps[-1]
    value = {k: v for k, (_l, v) in got.items()}
    assert value["adaptis_steps_total"] == STEPS
    assert value["adaptis_loss"] == pytest.approx(last.loss, rel=1e-9)
    assert value["adaptis_tokens_total"] == last.tokens == STEPS * 4 * 16
    assert value["adaptis_samples_total"] == last.samples == STEPS * 4
    assert value["adaptis_busy_seconds_total"] == pytest.approx(sum(e.busy_seconds for e in steps), rel=1e-6)
    assert value["adaptis_idle_seconds_total"] == pytest.approx(sum(e.idle_seconds for e in steps), rel=1e-6)
    assert value["adaptis_bubble_ratio"] == pytest.approx(last.rank_bubble_ratio, rel=1e-6)
    assert 0.0 <= value["adaptis_bubble_ratio"] <= 1.0
    assert value["adaptis_predicted_bubble_ratio"] == pytest.approx(last.predicted_bubble_ratio)
    assert value["adaptis_predicted_iteration_seconds"] == pytest.approx(last.predicted_iteration_seconds)
    assert value["adaptis_predicted_step_seconds"] == pytest.approx(last.predicted_step_seconds)
    assert value["adaptis_predicted_post_pipeline_seconds"] == pytest.approx(last.predicted_post_pipeline_seconds)
    assert last.predicted_step_seconds == pytest.approx(
        last.predicted_iteration_seconds + last.predicted_post_pipeline_seconds)
    # The phases of the steps, as counters of seconds.
    for counter, key in (("adaptis_data_seconds_total", "data_seconds"),
                         ("adaptis_pipeline_seconds_total", "iteration_seconds"),
                         ("adaptis_post_pipeline_seconds_total", "post_pipeline_seconds")):
        assert value[counter] == pytest.approx(sum(getattr(e, key) for e in steps), rel=1e-6), counter
        assert value[counter] > 0, counter
    assert value["adaptis_sent_bytes_total"] == sum(e.sent_bytes for e in steps)
    assert value["adaptis_received_bytes_total"] == sum(e.received_bytes for e in steps)
    # 1F1B on 2 ranks: 4 microbatches of 1x16x16 float32 activations cross each way per step.
    assert value["adaptis_sent_bytes_total"] == STEPS * 4 * 16 * 16 * 4
    assert value["adaptis_peak_memory_bytes"] == last.peak_memory_bytes > 0
    assert value["adaptis_step_duration_seconds_count"] == STEPS
    assert value["adaptis_step_duration_seconds_sum"] == pytest.approx(sum(e.step_seconds for e in steps), rel=1e-6)


def test_every_contract_metric_is_exported(scraped) -> None:
    _events, texts = scraped
    sampled = {line.split("{", 1)[0] for line in texts[0].splitlines() if line and not line.startswith("#")}
    for name in METRIC_NAMES:
        present = f"{name}_count" if name.endswith("_duration_seconds") else name
        assert present in sampled, f"{name} missing from the exposition"


@pytest.mark.parametrize("rank", [0, 1])
def test_promtool_accepts_the_exposition(rank: int, scraped) -> None:
    _events, texts = scraped
    result = subprocess.run([_promtool(), "check", "metrics"], input=texts[rank], capture_output=True,
                            text=True, timeout=30, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_last_step_gauges_appear_with_the_first_step() -> None:
    # A loss, bubble ratio or peak memory of 0 before any step would be plotted as observed.
    metrics = WorkerMetrics(job="early", rank=0)
    before = {s.name for fam in metrics.registry.collect() for s in fam.samples}
    assert "adaptis_steps_total" in before and "adaptis_busy_seconds_total" in before
    assert not before & {"adaptis_loss", "adaptis_bubble_ratio", "adaptis_peak_memory_bytes"}
