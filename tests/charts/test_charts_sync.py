"""What the chart copies stays equal to its source: the CRD of `adaptis crd`, the rules file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import chartkit
import yaml
from chartkit import one

FIX = "run hack/sync-chart.sh"


def _generated_crd_text() -> str:
    out = subprocess.run([sys.executable, "-m", "adaptis", "crd"], capture_output=True,
                         text=True, check=True, cwd=chartkit.REPO)
    return out.stdout


def test_chart_crd_is_the_generated_crd() -> None:
    assert chartkit.CHART_CRD.read_text() == _generated_crd_text(), FIX


def test_rendered_crd_keeps_the_spec_and_is_kept_on_uninstall(
    default_objects: list[dict[str, Any]],
) -> None:
    generated = yaml.safe_load(_generated_crd_text())
    rendered = one(default_objects, "CustomResourceDefinition")
    # The spec is copied as text: equal after parsing, integers stay integers.
    assert rendered["spec"] == generated["spec"]
    assert rendered["metadata"]["name"] == generated["metadata"]["name"] == "adaptisjobs.adaptis.io"
    assert rendered["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


def test_crd_install_can_be_switched_off(helm_home: Path) -> None:
    objects = chartkit.render(home=helm_home, sets={"crds.install": False})
    assert not [o for o in objects if o["kind"] == "CustomResourceDefinition"]
    assert one(objects, "Deployment")


def test_plain_rules_file_is_the_chart_rendered_with_defaults(helm_home: Path) -> None:
    objects = chartkit.render(home=helm_home, sets={"monitoring.prometheusRule.enabled": True})
    spec = one(objects, "PrometheusRule")["spec"]
    assert yaml.safe_load(chartkit.RULES_FILE.read_text()) == spec, FIX
