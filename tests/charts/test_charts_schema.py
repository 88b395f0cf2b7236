"""values.schema.json: the chart refuses unknown keys and wrong types before rendering anything."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import chartkit
import pytest
import yaml


def _walk(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found = [(path or "/", schema)]
    for name, sub in schema.get("properties", {}).items():
        found += _walk(sub, f"{path}/{name}")
    return found


def test_every_object_in_the_schema_is_closed() -> None:
    schema = json.loads((chartkit.CHART / "values.schema.json").read_text())
    # Objects that describe chart settings list their keys; Kubernetes passthroughs (maps of
    # labels, resources, affinity, `global`) say what their values are instead.
    open_ok = {"/global", "/operator/affinity"}
    for path, node in _walk(schema):
        if node.get("type") == "object" and path not in open_ok:
            assert "additionalProperties" in node, f"{path} accepts unknown keys"
            if "properties" in node:
                assert node["additionalProperties"] is False, path


def test_the_defaults_satisfy_the_schema_and_cover_it() -> None:
    """Every key of values.yaml is in the schema and vice versa (no undocumented knobs)."""
    schema = json.loads((chartkit.CHART / "values.schema.json").read_text())
    values = yaml.safe_load((chartkit.CHART / "values.yaml").read_text())

    def keys(node: dict[str, Any], tree: dict[str, Any], prefix: str = "") -> None:
        props = node.get("properties")
        if props is None or not isinstance(tree, dict):
            return
        assert set(tree) <= set(props), f"{prefix}: {set(tree) - set(props)} not in the schema"
        missing = set(props) - set(tree) - {"global"}
        assert not missing, f"{prefix}: {missing} in the schema but not in values.yaml"
        for name, sub in tree.items():
            keys(props[name], sub, f"{prefix}.{name}")

    keys(schema, values)


@pytest.mark.parametrize(("sets", "message"), [
    ({"replicas": 2}, "replicas"),
    ({"operator.replicas": 2}, "replicas"),
    ({"monitoring.podMonitor.labels": {"release": "x"}}, "labels"),
    ({"crds.install": "yes"}, "/crds/install"),
    ({"operator.watchNamespaces": ["Team_A"]}, "/operator/watchNamespaces/0"),
    ({"monitoring.prometheusRule.bubbleRatioThreshold": 1.5}, "bubbleRatioThreshold"),
    ({"monitoring.prometheusRule.bubbleRatioFor": "15 minutes"}, "bubbleRatioFor"),
    ({"operator.metrics.port": 80}, "/operator/metrics/port"),
    ({"image.pullPolicy": "Sometimes"}, "pullPolicy"),
    ({"image.digest": "latest"}, "digest"),
    ({"worker.runAsUser": 0}, "/worker/runAsUser"),  # root: the pods would not start
    ({"profiler.imagee": "x"}, "imagee"),
], ids=lambda v: next(iter(v)) if isinstance(v, dict) else None)
def test_bad_values_are_rejected(helm_home: Path, sets: dict[str, Any], message: str) -> None:
    args = ["template", *chartkit.template_args(sets=sets)]
    result = chartkit.run_helm(args, home=helm_home, check=False)
    assert result.returncode != 0, f"{sets} was accepted"
    assert "schema" in result.stderr.lower() or "at '/" in result.stderr
    assert message in result.stderr, result.stderr
