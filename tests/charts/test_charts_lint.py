"""`helm lint --strict` of charts/adaptis, with the default values and with every option on."""

from __future__ import annotations

from pathlib import Path

import chartkit
import pytest


@pytest.mark.parametrize("values", [[], [chartkit.FULL_VALUES]], ids=["default", "full"])
def test_chart_lints_strictly(helm_home: Path, values: list[Path]) -> None:
    args = ["lint", "--strict", str(chartkit.CHART), "--namespace", chartkit.NAMESPACE]
    for path in values:
        args += ["--values", str(path)]
    result = chartkit.run_helm(args, home=helm_home, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout
    # --strict turns warnings into failures; make sure none was printed either.
    assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout


def test_chart_metadata_matches_the_package() -> None:
    import yaml

    import adaptis

    chart = yaml.safe_load((chartkit.CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert chart["appVersion"] == adaptis.__version__
    assert chart["version"] == adaptis.__version__
