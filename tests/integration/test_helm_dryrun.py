"""Every object the chart renders is valid for the real API server (server-side dry-run).

`kubectl apply --dry-run=server` runs admission and schema validation (strict field validation:
an unknown field is an error) without storing anything. The Prometheus Operator's CRDs cannot be
downloaded here, so tests/charts/fixtures/monitoring-crds.yaml stands in for them with the
fields the chart uses, typed as upstream types them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

_CHARTS = Path(__file__).resolve().parents[1] / "charts"
if str(_CHARTS) not in sys.path:
    sys.path.insert(0, str(_CHARTS))

import chartkit  # noqa: E402
from controlplane import ControlPlane  # noqa: E402

pytestmark = pytest.mark.integration

MONITORING_CRDS = chartkit.FIXTURES / "monitoring-crds.yaml"
# Namespaces that fixtures/values-full.yaml names.
NAMESPACES = (chartkit.NAMESPACE, "team-a", "team-b", "monitoring")


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane) -> ControlPlane:
    control_plane.kubectl("apply", "-f", str(MONITORING_CRDS))
    for doc in yaml.safe_load_all(MONITORING_CRDS.read_text()):
        control_plane.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                              f"crd/{doc['metadata']['name']}")
    for name in NAMESPACES:
        if control_plane.kubectl("get", "namespace", name, check=False).returncode != 0:
            control_plane.create_namespace(name, wait_for_default_service_account=False)
    return control_plane


def _dry_run(plane: ControlPlane, manifest: str) -> tuple[int, str]:
    result = plane.kubectl("apply", "--dry-run=server", "--validate=strict", "-f", "-",
                           input=manifest, check=False)
    return result.returncode, result.stdout + result.stderr


@pytest.mark.parametrize("values", [[], [chartkit.FULL_VALUES]], ids=["default", "full"])
def test_rendered_chart_passes_server_side_dry_run(cluster: ControlPlane, values: list[Path],
                                                   tmp_path: Path) -> None:
    manifest = chartkit.render_text(home=tmp_path, values=values)
    count = sum(1 for doc in yaml.safe_load_all(manifest) if doc)
    code, output = _dry_run(cluster, manifest)
    assert code == 0, output
    # One line per object, each accepted by the server, none merely printed by the client.
    accepted = [line for line in output.splitlines() if line.endswith("(server dry run)")]
    assert len(accepted) == count, output


def test_the_stand_in_crds_do_reject_a_wrong_field(cluster: ControlPlane, tmp_path: Path) -> None:
    """The dry-run above proves something: a mistyped monitor is refused."""
    objects = chartkit.render(home=tmp_path, values=[chartkit.FULL_VALUES])
    monitor = chartkit.one(objects, "PodMonitor")
    broken = yaml.safe_load(yaml.safe_dump(monitor))
    broken["spec"]["podMetricsEndpoints"][0]["intervall"] = "10s"
    code, output = _dry_run(cluster, yaml.safe_dump(broken))
    assert code != 0 and "intervall" in output, output
    broken = yaml.safe_load(yaml.safe_dump(monitor))
    broken["spec"]["podMetricsEndpoints"][0]["interval"] = "10 seconds"
    code, output = _dry_run(cluster, yaml.safe_dump(broken))
    assert code != 0 and "interval" in output, output
