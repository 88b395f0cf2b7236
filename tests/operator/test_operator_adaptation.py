"""The operator's adaptation loop (spec.adaptation) on the in-memory API, with a fake
Prometheus: suggest, auto (re-plan, new pods, history), the caps, and what is never trusted.
The real scrape and control plane: tests/integration/test_operator_adaptation_e2e.py."""

from __future__ import annotations

import json
from typing import Any

import pytest
from plan_kit import stored_record

from adaptis.api.job import JobSpec
from adaptis.api.problem import Link
from adaptis.operator.adaptation.measurements import MeasurementError, Sample, parse_sample
from adaptis.operator.control.reconcile import Reconciler
from adaptis.operator.core.labels import LABEL_PLAN
from adaptis.operator.core.settings import DEFAULT_TOPOLOGY_KEYS, AdaptationSettings, ReconcileSettings
from adaptis.operator.profiling.nodes import profile_node
from adaptis.operator.scheduling.plan_store import RECORD_KEY, record_name
from adaptis.operator.scheduling.planning import plan_job


def _cond(job: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in job["status"].get("conditions", []) if c["type"] == type_), None)


def _run_all(cluster: Any) -> None:
    for pod in cluster.pods():
        if pod["metadata"].get("deletionTimestamp"):
            continue
        cluster.set_pod_phase(pod["metadata"]["name"], "Running")
        terms = pod["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        pod["spec"]["nodeName"] = terms[0]["matchExpressions"][0]["values"][0]


class Workers:
    """A Prometheus answering for workers that run the plan's predicted compute, rank r
    ``slow[r]`` times slower, one more step a poll; also the operator's observer, whose
    ``predicted`` call says what the plan predicts (and that a new gang started)."""

    def __init__(self, slow: dict[int, float]) -> None:
        self.slow = slow
        self.busy_pred: list[float] = []
        self.step = 0
        self.calls = 0
        self.fail = False
        self.stall = False  # the next poll sees no new step (none done, or not scraped yet)
        self.replans: list[str] = []

    def replanned(self, key: tuple[str, str], *, action: str) -> None:
        self.replans.append(action)

    def predicted(self, key: tuple[str, str], *, busy_seconds: list[float]) -> None:
        self.busy_pred = list(busy_seconds)
        self.step = 0  # a new gang's counters start again

    def fetch(self, url: str, *, namespace: str, job: str, timeout_s: float) -> Sample | None:
        self.calls += 1
        if self.fail:
            raise MeasurementError(f"querying Prometheus at {url}: connection refused")
        if not self.busy_pred:
            return None
        if not self.stall:
            self.step += 1
        self.stall = False
        devices = len(self.busy_pred)
        return Sample(step=self.step, busy={
            r: self.busy_pred[r % devices] * self.step * self.slow.get(r, 1.0)
            for r in range(devices)})


def _job(make_job: Any, *, policy: str, **adaptation: Any) -> dict[str, Any]:
    return make_job(spec={
        # Blocks outweigh the head: a slow device's blocks can move to the others.
        "model": {"vocabSize": 1024, "hidden": 512, "heads": 8,
                  "blocks": [{"kind": "attention", "count": 12}]},
        "training": {"steps": 10_000_000, "microbatches": 8, "sequenceLength": 128},
        "planner": {"strategy": "adaptis", "timeLimitSeconds": 5},
        "adaptation": {"policy": policy, "windowSteps": 2, "driftThreshold": 0.15,
                       "minGain": 0.02, **adaptation}})


def _reconciler(cluster: Any, clock: Any, workers: Workers, *, url: str | None = "http://prom"
                ) -> Reconciler:
    settings = ReconcileSettings(adaptation=AdaptationSettings(
        prometheus_url=url, poll_s=10.0, default_restart_s=0.0))
    return Reconciler(cluster, settings=settings, clock=clock, observer=workers,
                      fetch=workers.fetch)


def _start(cluster: Any, rec: Reconciler) -> None:
    rec.reconcile("ns", "demo")  # plan, pods
    _run_all(cluster)
    rec.reconcile("ns", "demo")  # Running


def _poll(rec: Reconciler, clock: Any, times: int) -> None:
    for _ in range(times):
        rec.reconcile("ns", "demo")
        clock.advance(10.0)


def test_suggest_reports_the_better_plan_and_leaves_the_pods(cluster: Any, make_job: Any,
                                                             clock: Any) -> None:
    cluster.add_job(_job(make_job, policy="suggest"))
    workers = Workers(slow={1: 2.0})
    rec = _reconciler(cluster, clock, workers)
    _start(cluster, rec)
    pods = {p["metadata"]["name"]: p["metadata"]["labels"][LABEL_PLAN] for p in cluster.pods()}
    _poll(rec, clock, 2)
    assert _cond(cluster.job(), "ReplanSuggested") is None  # the window is not full yet
    _poll(rec, clock, 1)
    job = cluster.job()
    adaptation = job["status"]["adaptation"]
    assert adaptation["measuredRatio"][1] == pytest.approx(2.0, rel=1e-3)
    suggestion = adaptation["suggestion"]
    assert suggestion["action"] == "suggested"
    assert suggestion["newPredictedIterationSeconds"] < suggestion["oldPredictedIterationSeconds"]
    assert suggestion["deviceSpeed"][1] == pytest.approx(0.5, rel=1e-3)
    cond = _cond(job, "ReplanSuggested")
    assert cond is not None and (cond["status"], cond["reason"]) == ("True", "BetterPlan")
    assert "device 1 measured 2.00x" in cond["message"]
    assert ("demo", "Normal", "BetterPlan") in [e[:3] for e in cluster.events]
    assert job["status"].get("replans", 0) == 0 and not adaptation.get("history")
    assert {p["metadata"]["name"]: p["metadata"]["labels"][LABEL_PLAN]
            for p in cluster.pods()} == pods  # nothing restarted
    assert not any(p["metadata"].get("deletionTimestamp") for p in cluster.pods())
    assert workers.replans == ["suggested"]
    _poll(rec, clock, 1)  # the drift goes on, but the next decision needs a full window again
    assert workers.replans == ["suggested"]


def test_the_drift_is_weighed_on_the_inter_node_link_the_operator_was_given(
        cluster: Any, make_job: Any, clock: Any) -> None:
    """The plan was made on the operator's --inter-node-* link; the adapter must predict the
    running plan on that same network: a device measured slower can only lengthen it, never
    make it faster than the placer predicted. (On a slow link the transfers dominate, so a
    prediction on the default or a free link would be several times faster.)"""
    cluster.add_job(_job(make_job, policy="suggest"))
    workers = Workers(slow={1: 2.0})
    slow_link = Link(bandwidth_bytes_per_s=2e8, latency_s=1e-4)
    settings = ReconcileSettings(inter_node=slow_link, adaptation=AdaptationSettings(
        prometheus_url="http://prom", poll_s=10.0, default_restart_s=0.0))
    rec = Reconciler(cluster, settings=settings, clock=clock, observer=workers, fetch=workers.fetch)
    _start(cluster, rec)
    record = stored_record(cluster)
    assert record is not None and len(set(record.nodes)) > 1  # the plan crosses nodes
    _poll(rec, clock, 3)
    suggestion = cluster.job()["status"]["adaptation"]["suggestion"]
    assert suggestion["oldPredictedIterationSeconds"] >= record.predicted_iteration_seconds


def test_a_measured_slow_restart_outweighs_the_gain(cluster: Any, make_job: Any,
                                                    clock: Any) -> None:
    cluster.add_job(_job(make_job, policy="auto"))
    workers = Workers(slow={1: 2.0})
    rec = _reconciler(cluster, clock, workers)  # assumes a free restart until one is measured
    rec.reconcile("ns", "demo")  # the pods are asked for now ...
    clock.advance(100_000.0)  # ... and take a day to their first step
    _run_all(cluster)
    rec.reconcile("ns", "demo")
    _poll(rec, clock, 3)
    job = cluster.job()
    cond = _cond(job, "ReplanSuggested")
    assert cond is not None and cond["reason"] == "NotWorthIt", cond
    assert "a restart's 100000 s" in cond["message"]
    assert job["status"].get("replans", 0) == 0
    # Deleted, then created again under the same name: a new job, whose restarts nobody has
    # measured yet; the day the old one took must not hold it back.
    cluster.delete_job("ns", "demo")
    for pod in cluster.pods():
        cluster.delete_pod("ns", pod["metadata"]["name"], force=True)
    rec.reconcile("ns", "demo")  # gone: the operator forgets it
    cluster.add_job(_job(make_job, policy="auto"))
    _start(cluster, rec)
    _poll(rec, clock, 3)
    assert cluster.job()["status"].get("replans", 0) == 1, _cond(cluster.job(), "ReplanSuggested")


def test_auto_replans_restarts_the_gang_and_waits_a_full_window(cluster: Any, make_job: Any,
                                                                clock: Any) -> None:
    cluster.add_job(_job(make_job, policy="auto", maxReplans=1))
    workers = Workers(slow={1: 2.0})
    rec = _reconciler(cluster, clock, workers)
    _start(cluster, rec)
    old_plan = stored_record(cluster)
    assert old_plan is not None
    _poll(rec, clock, 3)
    job = cluster.job()
    assert job["status"]["replans"] == 1
    assert job["status"]["phase"] == "Restarting"
    cond = _cond(job, "Replanned")
    assert cond is not None and (cond["status"], cond["reason"]) == ("True", "Drift")
    history = job["status"]["adaptation"]["history"]
    assert [h["action"] for h in history] == ["applied"]
    new_plan = stored_record(cluster)
    assert new_plan is not None and new_plan.plan != old_plan.plan
    assert new_plan.device_speed == pytest.approx(history[-1]["deviceSpeed"], rel=1e-3)
    assert new_plan.device_speed[1] == pytest.approx(0.5, rel=1e-3)
    # The slowed device got less work: fewer layers than before.
    def layers_of(plan: Any, device: int) -> int:
        return sum(plan.stages[s][1] - plan.stages[s][0] for s in plan.placement[device])

    assert layers_of(new_plan.plan, 1) < layers_of(old_plan.plan, 1)
    assert all(p["metadata"].get("deletionTimestamp") for p in cluster.pods())  # SIGTERM
    assert ("demo", "Normal", "Drift") in [e[:3] for e in cluster.events]
    assert workers.replans == ["applied"]

    cluster.finish_deletions()
    rec.reconcile("ns", "demo")  # the new plan's pods, from the stored (not a new) plan
    labels = {p["metadata"]["labels"][LABEL_PLAN] for p in cluster.pods()}
    assert len(cluster.pods()) == 4 and len(labels) == 1
    _run_all(cluster)
    rec.reconcile("ns", "demo")
    assert cluster.job()["status"]["phase"] == "Running"
    # The old window does not carry over: the new gang needs a full window of its own; then a
    # drift that persists (the device slowed further) meets maxReplans=1.
    workers.slow = {1: 2.0, 2: 2.0}  # device 1 as corrected; now device 2 slows down too
    _poll(rec, clock, 2)
    assert cluster.job()["status"]["replans"] == 1
    assert _cond(cluster.job(), "ReplanSuggested")["reason"] == "Applied"  # type: ignore[index]
    _poll(rec, clock, 1)
    job = cluster.job()
    assert job["status"]["replans"] == 1 and len(job["status"]["adaptation"]["history"]) == 1
    cond = _cond(job, "ReplanSuggested")
    assert cond is not None and cond["reason"] == "MaxReplansReached", cond
    assert job["status"]["adaptation"]["suggestion"]["deviceSpeed"][2] == pytest.approx(0.5, rel=1e-3)
    assert job["status"]["phase"] == "Running"


def test_without_prometheus_the_job_is_told_and_runs_on(cluster: Any, make_job: Any,
                                                        clock: Any) -> None:
    cluster.add_job(_job(make_job, policy="auto"))
    workers = Workers(slow={1: 2.0})
    rec = _reconciler(cluster, clock, workers, url=None)
    _start(cluster, rec)
    _poll(rec, clock, 4)
    job = cluster.job()
    cond = _cond(job, "ReplanSuggested")
    assert cond is not None and cond["reason"] == "NoMeasurementSource"
    assert "--prometheus-url" in cond["message"]
    assert job["status"]["phase"] == "Running" and workers.calls == 0


def test_policy_off_never_asks(cluster: Any, make_job: Any, clock: Any) -> None:
    cluster.add_job(_job(make_job, policy="off"))
    workers = Workers(slow={1: 2.0})
    rec = _reconciler(cluster, clock, workers)
    _start(cluster, rec)
    _poll(rec, clock, 4)
    assert workers.calls == 0 and _cond(cluster.job(), "ReplanSuggested") is None


def test_uniform_slowness_and_an_unreachable_prometheus_change_nothing(
        cluster: Any, make_job: Any, clock: Any) -> None:
    cluster.add_job(_job(make_job, policy="auto"))
    workers = Workers(slow=dict.fromkeys(range(4), 1.5))  # the model's error, not a device's
    rec = _reconciler(cluster, clock, workers)
    _start(cluster, rec)
    _poll(rec, clock, 6)
    job = cluster.job()
    assert job["status"].get("replans", 0) == 0 and _cond(job, "ReplanSuggested") is None
    assert job["status"]["adaptation"]["measuredRatio"] == pytest.approx([1.5] * 4, rel=1e-3)
    workers.fail = True
    _poll(rec, clock, 1)
    cond = _cond(cluster.job(), "ReplanSuggested")
    assert cond is not None and cond["reason"] == "MeasurementUnavailable"
    assert cluster.job()["status"]["phase"] == "Running"


def _series(name: str, ns: str, job: str, rank: str, value: str) -> dict[str, Any]:
    return {"metric": {"__name__": name, "namespace": ns, "adaptis_job": job, "rank": rank},
            "value": [0, value]}


def test_only_the_jobs_own_namespace_is_trusted() -> None:
    payload = {"status": "success", "data": {"resultType": "vector", "result": [
        _series("adaptis_steps_total", "ns", "demo", "0", "12"),
        _series("adaptis_steps_total", "ns", "demo", "1", "11"),
        _series("adaptis_busy_seconds_total", "ns", "demo", "0", "3.5"),
        _series("adaptis_busy_seconds_total", "ns", "demo", "1", "2.0"),
        # Another tenant naming this job: ignored, even with bigger counters.
        _series("adaptis_busy_seconds_total", "evil", "demo", "1", "999"),
        _series("adaptis_steps_total", "evil", "demo", "0", "1"),
    ]}}
    sample = parse_sample(json.loads(json.dumps(payload)), namespace="ns", job="demo")
    assert sample is not None
    assert sample.step == 11 and sample.busy == {0: 3.5, 1: 2.0}
    assert sample.counters(2) == [3.5, 2.0] and sample.counters(3) is None
    with pytest.raises(MeasurementError):
        parse_sample({"status": "error", "error": "bad query"}, namespace="ns", job="demo")


def test_corrected_speeds_hold_only_on_their_nodes(cluster: Any, make_job: Any) -> None:
    spec = JobSpec.model_validate(_job(make_job, policy="auto")["spec"])
    nodes = [profile_node(n, topology_keys=DEFAULT_TOPOLOGY_KEYS) for n in cluster.list_nodes()]
    first = plan_job(spec, nodes, name="ns/demo")
    same = plan_job(spec, nodes, name="ns/demo", speed_correction=(
        tuple(first.nodes), (1.0, 0.5, 1.0, 1.0)))
    assert same.device_speed == [1.0, 0.5, 1.0, 1.0] and same.plan != first.plan
    moved = plan_job(spec, nodes, name="ns/demo", speed_correction=(
        ("a100-0", "a100-0", "a100-1", "a100-1"), (1.0, 0.5, 1.0, 1.0)))
    assert moved.device_speed == [] and moved.plan == first.plan


def test_the_operator_counts_replans_and_shows_predictions() -> None:
    from adaptis.operator.control.metrics import OperatorMetrics

    metrics = OperatorMetrics()
    metrics.replanned(("ns", "demo"), action="applied")
    metrics.replanned(("ns", "demo"), action="suggested")
    metrics.replanned(("ns", "demo"), action="applied")
    metrics.predicted(("ns", "demo"), busy_seconds=[0.25, 0.5])
    value = metrics.registry.get_sample_value
    assert value("adaptis_operator_replans_total", {
        "job_namespace": "ns", "adaptis_job": "demo", "action": "applied"}) == 2
    assert value("adaptis_operator_replans_total", {
        "job_namespace": "ns", "adaptis_job": "demo", "action": "suggested"}) == 1
    assert value("adaptis_operator_predicted_busy_seconds", {
        "job_namespace": "ns", "adaptis_job": "demo", "device": "1"}) == 0.5


def test_changing_the_policy_never_restarts_the_job(cluster: Any, make_job: Any,
                                                    clock: Any) -> None:
    cluster.add_job(_job(make_job, policy="suggest"))
    workers = Workers(slow={})
    rec = _reconciler(cluster, clock, workers)
    _start(cluster, rec)
    before = {p["metadata"]["name"]: p["metadata"]["labels"][LABEL_PLAN] for p in cluster.pods()}
    cluster.job()["spec"]["adaptation"] = {"policy": "auto", "maxReplans": 5}
    cluster.job()["metadata"]["generation"] = 2
    rec.reconcile("ns", "demo")
    assert "replace ConfigMap" not in cluster.calls
    assert {p["metadata"]["name"]: p["metadata"]["labels"][LABEL_PLAN]
            for p in cluster.pods()} == before
    assert not any(p["metadata"].get("deletionTimestamp") for p in cluster.pods())


def test_a_poll_without_a_new_step_keeps_the_window(cluster: Any, make_job: Any,
                                                   clock: Any) -> None:
    cluster.add_job(_job(make_job, policy="suggest"))
    workers = Workers(slow={1: 2.0})
    rec = _reconciler(cluster, clock, workers)
    _start(cluster, rec)
    _poll(rec, clock, 2)
    workers.stall = True
    _poll(rec, clock, 1)  # the same step again: not a restart
    _poll(rec, clock, 1)
    assert workers.replans == ["suggested"]


def test_query_job_asks_the_prometheus_http_api() -> None:
    """query_job over real HTTP (a loopback server answering as Prometheus's /api/v1/query)."""
    import http.server
    import threading
    import urllib.parse

    from adaptis.operator.adaptation.measurements import query_job

    asked: list[dict[str, list[str]]] = []
    answer = {"status": "success", "data": {"resultType": "vector", "result": [
        _series("adaptis_steps_total", "ns", "demo", "0", "7"),
        _series("adaptis_busy_seconds_total", "ns", "demo", "0", "1.5")]}}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # the http.server API
            url = urllib.parse.urlparse(self.path)
            asked.append({"path": [url.path], **urllib.parse.parse_qs(url.query)})
            body = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        sample = query_job(url, namespace="ns", job="demo", timeout_s=5)
    finally:
        server.shutdown()
    assert sample == Sample(step=7, busy={0: 1.5})
    (request,) = asked
    assert request["path"] == ["/api/v1/query"]
    assert request["query"] == ['{__name__=~"adaptis_busy_seconds_total|adaptis_steps_total",'
                                'namespace="ns",adaptis_job="demo"}']
    with pytest.raises(MeasurementError, match=r"querying Prometheus at http://127.0.0.1:9/"):
        query_job("http://127.0.0.1:9/", namespace="ns", job="demo", timeout_s=2)


def test_a_record_that_cannot_be_replayed_is_a_condition_not_a_failed_pass(
        cluster: Any, make_job: Any, clock: Any) -> None:
    cluster.add_job(_job(make_job, policy="auto"))
    workers = Workers(slow={1: 2.0})
    rec = _reconciler(cluster, clock, workers)
    _start(cluster, rec)
    cm = cluster.objects[("ConfigMap", "adaptis-system", record_name(cluster.job()["metadata"]["uid"]))]
    doc = json.loads(cm["data"][RECORD_KEY])
    doc["device_speed"] = [0.5]  # one speed for four devices: an inconsistent record
    cm["data"][RECORD_KEY] = json.dumps(doc)
    cm["metadata"]["resourceVersion"] += "-edited"  # as the API server does on any write
    _poll(rec, clock, 2)
    job = cluster.job()
    cond = _cond(job, "ReplanSuggested")
    assert cond is not None and cond["reason"] == "ReplanFailed", cond
    assert job["status"]["phase"] == "Running" and workers.calls == 0


def test_prometheus_is_asked_once_a_poll_interval_however_often_the_job_is_reconciled(
        cluster: Any, make_job: Any, clock: Any) -> None:
    # Pod events reconcile a running job many times a second; each pass must not become a
    # Prometheus query. poll_s is 10 s here, passes come 3 s apart.
    cluster.add_job(_job(make_job, policy="suggest"))
    workers = Workers(slow={})
    rec = _reconciler(cluster, clock, workers)
    _start(cluster, rec)
    calls = [workers.calls]
    for _ in range(7):
        clock.advance(3.0)
        rec.reconcile("ns", "demo")
        calls.append(workers.calls)
    # The first look at +3 s; the next is due at +13 s and happens at the pass of +15 s.
    assert calls == [0, 1, 1, 1, 1, 2, 2, 2]
