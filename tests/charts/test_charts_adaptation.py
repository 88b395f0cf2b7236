"""The chart's adaptation values (operator.adaptation): the operator's --prometheus-url and
its companions, off by default, and what the schema refuses."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import chartkit
from chartkit import operator_container

from adaptis.cli import operator as operator_cli


def _parse(container: Any) -> argparse.Namespace:
    """The rendered args as `adaptis operator` parses them (the real parser)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--verbose", action="count", default=0)
    sub = parser.add_subparsers()
    operator_cli.register(sub)
    # The fixture's operator.extraArgs (["--dev"]) are the admin's, not the chart's.
    args, unknown = parser.parse_known_args(container["args"])
    assert unknown in ([], ["--dev"]), unknown
    return args


def test_adaptation_is_off_by_default(default_objects: list[dict[str, Any]]) -> None:
    args = _parse(operator_container(default_objects))
    assert args.prometheus_url is None


def test_the_prometheus_url_reaches_the_operator(full_objects: list[dict[str, Any]]) -> None:
    args = _parse(operator_container(full_objects))
    assert args.prometheus_url == "http://prometheus-operated.monitoring:9090"
    assert args.adaptation_poll_seconds == 15.0 and args.restart_cost_seconds == 300.0


def test_the_schema_refuses_a_url_without_a_scheme(helm_home: Path) -> None:
    result = chartkit.run_helm(["template", *chartkit.template_args(
        sets={"operator.adaptation.prometheusUrl": "prometheus:9090"})], home=helm_home,
        check=False)
    assert result.returncode != 0 and "prometheusUrl" in result.stderr
