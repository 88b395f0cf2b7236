"""The chart's monitoring objects: PodMonitor, ServiceMonitor, PrometheusRule, dashboard ConfigMap."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import chartkit
import pytest
from chartkit import by_kind, one, operator_container

MONITORING_KINDS = ("PodMonitor", "ServiceMonitor", "PrometheusRule")


def test_monitoring_objects_are_off_by_default_and_the_operator_metrics_on(
    default_objects: list[dict[str, Any]],
) -> None:
    kinds = {o["kind"] for o in default_objects}
    # The Prometheus Operator's kinds need its CRDs, and the dashboard a Grafana: asked for.
    assert not kinds & {*MONITORING_KINDS, "ConfigMap"}
    # The operator's own metrics need nothing: served, behind a Service, by default.
    assert [p["name"] for p in operator_container(default_objects)["ports"]] == ["health", "metrics"]
    assert [o["metadata"]["name"] for o in by_kind(default_objects, "Service")] == ["adaptis-metrics"]


def test_every_monitor_carries_the_additional_labels(full_objects: list[dict[str, Any]]) -> None:
    for kind in MONITORING_KINDS:
        labels = one(full_objects, kind)["metadata"]["labels"]
        assert labels["release"] == "kube-prometheus-stack", kind


def test_pod_monitor_scrapes_the_workers_metrics_port(full_objects: list[dict[str, Any]],
                                                      helm_home: Path) -> None:
    spec = one(full_objects, "PodMonitor")["spec"]
    # The operator labels its worker pods so (adaptis/operator/resources/manifests.py).
    assert spec["selector"]["matchLabels"] == {"app.kubernetes.io/managed-by": "adaptis"}
    assert spec["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    (endpoint,) = spec["podMetricsEndpoints"]
    assert (endpoint["path"], endpoint["interval"]) == ("/metrics", "10s")
    # Every rank of a pod: the ports named metrics and metrics-<LOCAL_RANK> (manifests.py).
    assert "port" not in endpoint
    keep = endpoint["relabelings"][0]
    assert (keep["sourceLabels"], keep["regex"], keep["action"]) == (
        ["__meta_kubernetes_pod_container_port_name"], "metrics(-[0-9]+)?", "keep")
    # A worker's samples cannot override the target's namespace or job (tenancy); its rank
    # (one process of a multi-GPU pod) comes back from exported_rank.
    assert endpoint["honorLabels"] is False
    assert endpoint["metricRelabelings"] == [
        {"sourceLabels": ["exported_rank"], "regex": "(.+)", "targetLabel": "rank"},
        {"regex": "exported_.*", "action": "labeldrop"}]
    targets = {r.get("targetLabel") for r in endpoint["relabelings"]}
    assert {"adaptis_job", "rank", "local_rank"} <= targets
    everywhere = chartkit.render(home=helm_home, sets={"monitoring.podMonitor.enabled": True})
    assert one(everywhere, "PodMonitor")["spec"]["namespaceSelector"] == {"any": True}


def test_service_monitor_finds_the_operator_service(full_objects: list[dict[str, Any]]) -> None:
    service = one(full_objects, "Service")
    monitor = one(full_objects, "ServiceMonitor")
    pod_labels = one(full_objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"][
        "labels"].items()
    (port,) = service["spec"]["ports"]
    assert (port["name"], port["port"], port["targetPort"]) == ("metrics", 8000, "metrics")
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    container_ports = {p["name"]: p["containerPort"] for p in
                       operator_container(full_objects)["ports"]}
    assert container_ports["metrics"] == 8000
    args = operator_container(full_objects)["args"]
    assert args[args.index("--metrics-port") + 1] == "8000"  # the operator serves what is scraped


def test_service_monitor_without_metrics_is_refused(helm_home: Path) -> None:
    args = ["template", *chartkit.template_args(sets={"monitoring.serviceMonitor.enabled": True,
                                                      "operator.metrics.enabled": False})]
    result = chartkit.run_helm(args, home=helm_home, check=False)
    assert result.returncode != 0
    assert "operator.metrics.enabled" in result.stderr


def test_prometheus_rule_has_alerts_and_the_recording_rule(
    full_objects: list[dict[str, Any]],
) -> None:
    groups = one(full_objects, "PrometheusRule")["spec"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    records = {r["record"]: r for r in rules if "record" in r}
    alerts = {r["alert"]: r for r in rules if "alert" in r}
    assert set(alerts) == {"AdaptisHighBubbleRatio", "AdaptisJobNoProgress", "AdaptisWorkerDown"}
    assert "adaptis_idle_seconds_total" in records["adaptis:bubble_ratio:rate5m"]["expr"]
    assert "adaptis_busy_seconds_total" in records["adaptis:bubble_ratio:rate5m"]["expr"]
    # The values of fixtures/values-full.yaml reach the alerts.
    high = alerts["AdaptisHighBubbleRatio"]
    assert high["expr"].endswith("> 0.25") and high["for"] == "20m"
    assert alerts["AdaptisJobNoProgress"]["for"] == "15m"
    assert alerts["AdaptisWorkerDown"]["for"] == "3m"
    assert {a["labels"]["severity"] for a in alerts.values()} == {"critical"}
    # Prometheus's own templates survive Helm's.
    assert "{{ $labels.adaptis_job }}" in high["annotations"]["summary"]


def test_dashboard_config_map(full_objects: list[dict[str, Any]]) -> None:
    (cm,) = [o for o in by_kind(full_objects, "ConfigMap")
             if o["metadata"]["name"] == "adaptis-dashboard"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "AdaPtis"}
    assert json.loads(cm["data"]["adaptis.json"]) == chartkit.dashboard()


@pytest.mark.parametrize("kind", MONITORING_KINDS)
def test_each_monitor_switches_on_alone(helm_home: Path, kind: str) -> None:
    key = {"PodMonitor": "podMonitor", "ServiceMonitor": "serviceMonitor",
           "PrometheusRule": "prometheusRule"}[kind]
    sets: dict[str, Any] = {f"monitoring.{key}.enabled": True}
    if kind == "ServiceMonitor":
        sets["operator.metrics.enabled"] = True
    objects = chartkit.render(home=helm_home, sets=sets)
    assert [o["kind"] for o in objects if o["kind"] in MONITORING_KINDS] == [kind]
