"""A real Prometheus scrapes real workers started from the pods the operator renders.

The operator's own functions plan the example job on a CPU node and render its ConfigMap and worker
pods (adaptis/operator/resources/manifests.py); each pod's command runs here as a local process with
the pod's environment and its mounted worker.json, where only what a pod network gives for free is
replaced: MASTER_ADDR is loopback, and each rank serves metrics on its own port
(ADAPTIS_METRICS_PORT) since the ranks share one host. Debian's Prometheus scrapes them every second
with the chart's rules loaded (deploy/prometheus/adaptis-rules.yaml) and the target labels the
chart's PodMonitor gives (namespace, pod, adaptis_job, rank; the target's labels win but a sample's
own rank is kept).

Checked: the bubble ratio, the step phases and the recording rules come back from PromQL and
agree with the workers' own counters; every dashboard query returns data; the dashboard reads
only metrics a worker really serves. With ADAPTIS_UPDATE_DOCS=1 the panels are plotted to docs/dashboard.png.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

_CHARTS = Path(__file__).resolve().parents[1] / "charts"
if str(_CHARTS) not in sys.path:
    sys.path.insert(0, str(_CHARTS))

import chartkit  # noqa: E402
import dashplot  # noqa: E402
import promkit  # noqa: E402

pytestmark = pytest.mark.integration  # about 30 s: a real training run and Prometheus

JOB = "tiny"
NAMESPACE = "ml"
EXAMPLE = chartkit.REPO / "examples" / "tiny-heterogeneous.yaml"
# The example job, lighter: a run of several seconds (several scrapes) on 2 busy cores. The
# picture for docs/ trains the example itself, longer: there compute outweighs the per-message
# costs the performance model leaves out, so the prediction beside the observation means much.
UPDATE_DOCS = bool(os.environ.get("ADAPTIS_UPDATE_DOCS"))
TRAINING = ({"steps": 100} if UPDATE_DOCS else
            {"steps": 16, "microbatches": 8, "microbatchSize": 1, "sequenceLength": 32})
MODEL = {} if UPDATE_DOCS else {"vocabSize": 4096}
# The ranks serve their final metrics until the fixture stops them (SIGTERM).
LINGER_S = 600.0


@dataclass(frozen=True)
class Rank:
    rank: int
    port: int
    process: subprocess.Popen[str]
    log_path: Path


@dataclass(frozen=True)
class Run:
    prom: promkit.PrometheusServer
    ranks: tuple[Rank, ...]
    steps: int
    predicted_bubble_ratio: float
    predicts_step: bool  # the plan predicts the whole step (Predicted.step_time)
    started: float
    at: float  # every rank finished and still scraped; every rule evaluated since
    final: dict[int, dict[str, float]]  # rank -> sample name -> value, from the worker itself


def _render_pods() -> tuple[list[dict[str, Any]], dict[str, Any], Any]:
    """The operator's rendering: pods and worker.json of the example job on one CPU node."""
    import yaml

    from adaptis.api.job import parse_job
    from adaptis.operator.core.records import JobRef
    from adaptis.operator.core.settings import DEFAULT_TOPOLOGY_KEYS, ManifestSettings
    from adaptis.operator.profiling.nodes import profile_node
    from adaptis.operator.resources.manifests import (
        render_config_map,
        render_pod,
    )
    from adaptis.operator.scheduling.planning import plan_job

    manifest = yaml.safe_load(EXAMPLE.read_text())
    manifest["metadata"] = {"name": JOB, "namespace": NAMESPACE}
    manifest["spec"]["model"].update(MODEL)
    manifest["spec"]["training"].update(TRAINING)
    manifest["spec"]["planner"]["profile"] = "estimate"
    spec = parse_job(manifest).spec
    node = {"metadata": {"name": "cpu-0", "labels": {"kubernetes.io/hostname": "cpu-0"}},
            "spec": {},
            "status": {"capacity": {"cpu": "8", "memory": "32Gi"},
                       "allocatable": {"cpu": "8", "memory": "32Gi"},
                       "conditions": [{"type": "Ready", "status": "True"}]}}
    record = plan_job(spec, [profile_node(node, topology_keys=DEFAULT_TOPOLOGY_KEYS)], name=JOB)
    if UPDATE_DOCS:
        record = _measured(record, spec=spec)
    ref = JobRef(name=JOB, namespace=NAMESPACE, uid="0000-test")
    config_map = render_config_map(ref, spec, record=record)
    pods = [render_pod(ref, spec, record=record, rank=r, attempt=0, settings=ManifestSettings())
            for r in range(len(record.nodes))]
    return pods, config_map, record


def _measured(record: Any, *, spec: Any) -> Any:
    """The same job planned from its layers timed on this machine (``adaptis profile``'s way),
    for the picture in docs/: the operator's FLOP estimate has no per-operation overheads,
    which dominate this tiny CPU model, so its prediction would sit far from the observation."""
    from adaptis.api.problem import TIME_UNIT_SECONDS
    from adaptis.planner.strategies import plan_strategy
    from adaptis.worker.profiling.hardware import configure_host
    from adaptis.worker.profiling.job_problem import measure_problem

    configure_host(threads=1)  # as each rank runs
    outcome = plan_strategy(measure_problem(spec, devices=len(record.nodes)), "adaptis")
    assert outcome.plan is not None and outcome.result.feasible, outcome.result.reason
    predicted = outcome.plan.predicted
    assert predicted is not None
    return record.model_copy(update={
        "plan": outcome.plan, "predicted_bubble_ratio": outcome.result.bubble_ratio,
        "predicted_iteration_seconds":
            predicted.iteration_time * TIME_UNIT_SECONDS[predicted.time_unit]})


def _start_rank(pod: dict[str, Any], config_map: dict[str, Any], *, workdir: Path,
                master_port: int, port: int) -> Rank:
    (container,) = pod["spec"]["containers"]
    rank = int(pod["metadata"]["labels"]["adaptis.io/rank"])
    # The pod's mounts, as files: the ConfigMap's worker.json and a checkpoint directory.
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    config_dir = workdir / f"rank-{rank}" / "etc"
    config_dir.mkdir(parents=True)
    worker_json = json.loads(config_map["data"]["worker.json"])
    worker_json["checkpointDir"] = str(workdir / f"rank-{rank}" / "checkpoints")
    (config_dir / "worker.json").write_text(json.dumps(worker_json))
    command = [str(config_dir) + arg[len(mounts["adaptis-config"]):]
               if arg.startswith(mounts["adaptis-config"]) else arg
               for arg in container["command"]]
    assert command[:2] == ["adaptis", "worker"], command
    command[0] = str(Path(sys.executable).with_name("adaptis"))  # the venv's entry point
    env = {e["name"]: e["value"] for e in container["env"]}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port),
               ADAPTIS_METRICS_PORT=str(port))
    # The writable home (an emptyDir: HOME and the torch caches point into it) as a directory.
    home = mounts["adaptis-home"]
    env.update({k: str(workdir / f"rank-{rank}" / "home") + v[len(home):]
                for k, v in env.items() if v == home or v.startswith(home + "/")})
    log_path = workdir / f"rank-{rank}.log"
    process = subprocess.Popen(  # our own CLI
        [*command, "--linger-seconds", str(LINGER_S)],
        env={**os.environ, **env}, stdout=log_path.open("w"), stderr=subprocess.STDOUT,
        text=True, cwd=workdir)
    return Rank(rank=rank, port=port, process=process, log_path=log_path)


def _all_scraped(prom: promkit.PrometheusServer, ranks: list[Rank], *,
                 steps: int) -> float | None:
    """Prometheus' time once every rank's final step count is stored, and an earlier sample
    taken while it trained; None before. A rank that exits ends the wait with its log."""
    for r in ranks:
        if r.process.poll() is not None:
            raise AssertionError(f"rank {r.rank} exited with {r.process.returncode} before the "
                                 f"test stopped it:\n{r.log_path.read_text()[-4000:]}")
    now = prom.server_time()
    series = f'adaptis_steps_total{{adaptis_job="{JOB}"}}'
    final = prom.query(f"{series} >= {steps}", at=now)
    # A sample from before the last step (the counters exist at 0 from the first scrape): the
    # 5 minute rates then span part of the training, not two copies of the final values.
    during = prom.query(f"min_over_time({series}[5m]) < {steps}", at=now)
    if len(final) == len(ranks) and len(during) < len(ranks):
        raise AssertionError(f"a rank finished its {steps} steps before Prometheus sampled it "
                             "while training: rate() sees no increase; raise TRAINING['steps']")
    return now if len(final) == len(during) == len(ranks) else None


# Every recorded series the tests read, and how many series each must have.
_RECORDED = {"adaptis:bubble_ratio:rate5m": "ranks", "adaptis:job_bubble_ratio:rate5m": 1,
             "adaptis:job_steps:rate5m": 1, "adaptis:job_step_phase_seconds:rate5m": 4,
             "adaptis:job_step_phase_share:rate5m": 4, "adaptis:job_step_phase_seconds:mean5m": 4,
             "adaptis:job_step_seconds:mean5m": 1}
_PHASES = {"pipeline_busy", "bubble", "post_pipeline", "data"}


def _rules_evaluated_after(prom: promkit.PrometheusServer, t: float) -> float | None:
    """Prometheus' time once every recording rule has been evaluated after ``t`` (so over the
    final samples) for all its series; None before. Rule evaluations lag scrapes, more so on a
    busy machine: this is the condition the recorded values are compared under."""
    now = prom.server_time()
    ranks = len(prom.query(f'adaptis_steps_total{{adaptis_job="{JOB}"}}', at=now))
    for record, want in _RECORDED.items():
        fresh = prom.query(f'timestamp({record}{{adaptis_job="{JOB}"}}) > {t}', at=now)
        if len(fresh) != (ranks if want == "ranks" else want):
            return None
    return now


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    # Sample names as served (counters with _total, histogram _bucket/_sum/_count); a
    # histogram's value here is its last bucket's, unused.
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    workdir = tmp_path_factory.mktemp("prometheus-run")
    pods, config_map, record = _render_pods()
    steps = TRAINING["steps"]
    master_port = promkit.free_port()
    ports = [promkit.free_port() for _ in pods]
    targets = [promkit.Target(port=port, labels={
        "namespace": NAMESPACE, "pod": pod["metadata"]["name"], "adaptis_job": JOB,
        "rank": pod["metadata"]["labels"]["adaptis.io/rank"]}) for pod, port in zip(pods, ports, strict=True)]
    config = promkit.write_config(workdir / "prometheus.yml", targets=targets,
                                  rule_files=[chartkit.RULES_FILE])
    ranks: list[Rank] = []
    started = time.time()
    # Prometheus first, already scraping the ranks' (still closed) ports: a short run is then
    # sampled while it trains, which rate() needs (two samples that differ), on any machine.
    with promkit.PrometheusServer(config, workdir=workdir) as prom:
        chartkit.poll_until(lambda: len(prom.query(f'up{{adaptis_job="{JOB}"}}')) == len(pods),
                            timeout=60, what="prometheus to try every rank's port once")
        try:
            for pod, port in zip(pods, ports, strict=True):
                ranks.append(_start_rank(pod, config_map, workdir=workdir,
                                         master_port=master_port, port=port))
            done_at = chartkit.poll_until(lambda: _all_scraped(prom, ranks, steps=steps),
                                          timeout=240, what="every rank's last step to be "
                                          "scraped, after a sample taken while it trained")
            at = chartkit.poll_until(lambda: _rules_evaluated_after(prom, done_at), timeout=120,
                                     what="the recording rules to be evaluated after the last "
                                          "step was scraped")
            final = {r.rank: _scrape(r.port) for r in ranks}
            yield Run(prom=prom, ranks=tuple(ranks), steps=steps,
                      predicted_bubble_ratio=record.predicted_bubble_ratio,
                      predicts_step=bool(record.plan.predicted and record.plan.predicted.step_time is not None),
                      started=started, at=at, final=final)
            # The ranks linger (still scraped: `up` holds at `at`) until told to stop; a stop
            # while lingering is a clean exit, the training being complete.
            for r in ranks:
                r.process.terminate()
            for r in ranks:
                assert r.process.wait(timeout=60) == 0, r.log_path.read_text()[-3000:]
        finally:
            for r in ranks:
                if r.process.poll() is None:
                    r.process.kill()
                    r.process.wait(timeout=15)


def _by_rank(result: list[dict[str, Any]]) -> dict[int, float]:
    return {int(s["metric"]["rank"]): float(s["value"][1]) for s in result}


def test_targets_are_up_with_the_podmonitor_labels(run: Run) -> None:
    up = run.prom.query(f'up{{adaptis_job="{JOB}"}}', at=run.at)
    assert sorted((s["metric"]["rank"], s["value"][1]) for s in up) == [
        (str(r.rank), "1") for r in run.ranks]
    assert {s["metric"]["namespace"] for s in up} == {NAMESPACE}


def test_bubble_ratio_gauge_is_queryable(run: Run) -> None:
    gauge = _by_rank(run.prom.query(f'adaptis_bubble_ratio{{adaptis_job="{JOB}"}}', at=run.at))
    assert set(gauge) == {r.rank for r in run.ranks}
    assert all(0.0 <= v < 1.0 for v in gauge.values()), gauge
    for rank, value in gauge.items():
        assert value == pytest.approx(run.final[rank]["adaptis_bubble_ratio"])


def test_recording_rule_matches_the_workers_counters(run: Run) -> None:
    recorded = _by_rank(run.prom.query(
        f'adaptis:bubble_ratio:rate5m{{adaptis_job="{JOB}"}}', at=run.at))
    assert set(recorded) == {r.rank for r in run.ranks}
    for rank, value in recorded.items():
        counters = run.final[rank]
        busy, idle = counters["adaptis_busy_seconds_total"], counters["adaptis_idle_seconds_total"]
        assert busy > 0
        # The run is shorter than the 5 minute window: the rate covers it (from the first
        # scrape), so the ratio of rates is the ratio of the totals up to the first interval.
        assert value == pytest.approx(idle / (busy + idle), abs=0.05), (rank, counters)
    (job,) = run.prom.query(f'adaptis:job_bubble_ratio:rate5m{{adaptis_job="{JOB}"}}',
                            at=run.at)
    assert job["metric"]["namespace"] == NAMESPACE
    assert min(recorded.values()) - 1e-9 <= float(job["value"][1]) <= max(recorded.values()) + 1e-9


def test_prediction_is_exported_beside_the_observation(run: Run) -> None:
    predicted = _by_rank(run.prom.query(
        f'adaptis_predicted_bubble_ratio{{adaptis_job="{JOB}"}}', at=run.at))
    assert set(predicted) == {r.rank for r in run.ranks}
    for value in predicted.values():
        assert value == pytest.approx(run.predicted_bubble_ratio, rel=1e-6)
    steps = run.prom.query(f'adaptis:job_steps:rate5m{{adaptis_job="{JOB}"}}', at=run.at)
    assert steps and float(steps[0]["value"][1]) > 0


def test_step_phases_come_back_and_add_up(run: Run) -> None:
    for counter in ("adaptis_data_seconds_total", "adaptis_pipeline_seconds_total",
                    "adaptis_post_pipeline_seconds_total"):
        stored = _by_rank(run.prom.query(f'{counter}{{adaptis_job="{JOB}"}}', at=run.at))
        assert stored == {r: pytest.approx(run.final[r][counter]) for r in stored}, counter
        assert set(stored) == {r.rank for r in run.ranks} and min(stored.values()) > 0, counter
    shares = {s["metric"]["phase"]: float(s["value"][1]) for s in run.prom.query(
        f'adaptis:job_step_phase_share:rate5m{{adaptis_job="{JOB}"}}', at=run.at)}
    assert set(shares) == _PHASES and sum(shares.values()) == pytest.approx(1.0), shares
    means = run.prom.query(f'adaptis:job_step_phase_seconds:mean5m{{adaptis_job="{JOB}"}}', at=run.at)
    (step,) = run.prom.query(f'adaptis:job_step_seconds:mean5m{{adaptis_job="{JOB}"}}', at=run.at)
    # The step is the pipeline and post-pipeline parts; the data phase precedes it.
    assert sum(float(m["value"][1]) for m in means if m["metric"]["phase"] != "data") == pytest.approx(
        float(step["value"][1]))
    # The recorded mean step against the workers' own totals (step parts over steps, mean over
    # the ranks): the 5 minute rates may miss the first step, which pays one-off costs.
    totals = [sum(f[c] for c in ("adaptis_pipeline_seconds_total", "adaptis_post_pipeline_seconds_total"))
              / f["adaptis_steps_total"] for f in run.final.values()]
    assert 0.5 * min(totals) <= float(step["value"][1]) <= 1.5 * max(totals), (step, totals)


# The whole-step predictions: a gauge with no sample (absent) when the plan does not model the
# post-pipeline part (Predicted.step_time None).
_STEP_PREDICTIONS = {"adaptis_predicted_step_seconds", "adaptis_predicted_post_pipeline_seconds"}


def test_dashboard_reads_only_what_a_worker_serves(run: Run) -> None:
    served = set().union(*(set(m) for m in run.final.values()))
    if not run.predicts_step:
        served |= _STEP_PREDICTIONS
    for title, expr in chartkit.dashboard_queries(chartkit.dashboard()):
        unknown = (chartkit.promql_metric_names(expr) - served - chartkit.RECORDED
                   - chartkit.OPERATOR)  # the operator's own: tests/charts checks them
        assert not unknown, f"{title}: {sorted(unknown)} not served by a worker"


def test_every_dashboard_query_returns_data(run: Run, tmp_path: Path) -> None:
    board = chartkit.dashboard()
    empty = []
    for title, expr in chartkit.dashboard_queries(board):
        result = run.prom.query(dashplot.concrete(expr, job=JOB), at=run.at)
        unpredicted = not run.predicts_step and chartkit.promql_metric_names(expr) <= _STEP_PREDICTIONS
        no_operator = chartkit.promql_metric_names(expr) <= chartkit.OPERATOR  # none runs here
        if not result and not unpredicted and not no_operator:
            empty.append(f"{title}: {expr}")
    assert not empty, "queries without data:\n" + "\n".join(empty)
    out = chartkit.REPO / "docs" / "dashboard.png" if UPDATE_DOCS else tmp_path / "dashboard.png"
    plotted = dashplot.plot(board, run.prom, start=run.started, end=run.at + 2, job=JOB,
                            out=out)
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert plotted == len(panels) and out.stat().st_size > 20_000
