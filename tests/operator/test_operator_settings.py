"""``adaptis operator``'s flags come from OperatorSettings: names, defaults and help.

The command line is derived from :class:`adaptis.operator.core.settings.OperatorSettings`; the
settings the rooms read default to the same values (:data:`OPERATOR_DEFAULTS`).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import fields, replace

import pytest

from adaptis.cli import operator as cli_operator
from adaptis.operator.control.app import OperatorOptions
from adaptis.operator.core.settings import (
    DEFAULT_INTER_NODE,
    OPERATOR_DEFAULTS,
    PROFILE_NAMESPACE,
    WORKER_IMAGE,
    AdaptationSettings,
    ManifestSettings,
    OperatorSettings,
    ReconcileSettings,
)
from adaptis.operator.scheduling.plan_runner import PlannerLimits


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="adaptis")
    cli_operator.register(parser.add_subparsers())
    return parser


def _parse(*argv: str) -> OperatorSettings:
    return cli_operator._settings(_parser().parse_args(["operator", *argv]))


def test_no_flags_are_the_settings_defaults() -> None:
    assert _parse() == OPERATOR_DEFAULTS


def test_every_field_is_a_flag_of_its_name() -> None:
    given = _parse("-n", "a", "--namespace", "b", "--reconcile-workers", "5",
                   "--inter-node-bandwidth", "1e9", "--metrics-port", "9000",
                   "--planner-memory-mib", "0", "--prometheus-url", "http://p:9090")
    assert given == replace(OPERATOR_DEFAULTS, namespace=("a", "b"), reconcile_workers=5,
                            inter_node_bandwidth=1e9, metrics_port=9000, planner_memory_mib=0,
                            prometheus_url="http://p:9090")


def test_every_field_has_its_flag_and_no_other_flag_exists(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["operator", "--help"])
    shown = set(re.findall(r"(?<![\w-])--?[a-zA-Z][\w-]*", capsys.readouterr().out.split("options:")[1]))
    fields_ = {"--" + f.name.replace("_", "-") for f in fields(OperatorSettings)}
    assert shown == fields_ | {"-h", "--help", "-n", "-A"}


def test_namespaces_and_all_namespaces_exclude_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse("-A", "-n", "x")
    assert "not allowed with argument" in capsys.readouterr().err


def test_help_says_each_default_from_the_model(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["operator", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "jobs reconciled in parallel (default 2)" in text
    assert "look at every job at least this often (default 30)" in text
    assert "(default 1536; fits the chart's memory limit" in text
    assert f"(default: {WORKER_IMAGE})" in text
    assert f"else {PROFILE_NAMESPACE})" in text
    assert "(default: $KUBECONFIG)" in text


def test_the_rooms_settings_default_to_the_flags_defaults() -> None:
    d = OPERATOR_DEFAULTS
    assert (ManifestSettings().image, ManifestSettings().run_as_user, ManifestSettings().run_as_group) \
        == (WORKER_IMAGE, d.worker_run_as_user, d.worker_run_as_group)
    assert (AdaptationSettings().poll_s, AdaptationSettings().default_restart_s) \
        == (d.adaptation_poll_seconds, d.restart_cost_seconds)
    r = ReconcileSettings()
    assert (r.profile_timeout_s, r.unschedulable_replan_s, r.profile_namespace) \
        == (d.profile_timeout_seconds, d.unschedulable_replan_seconds, PROFILE_NAMESPACE)
    assert d.inter_node_bandwidth == DEFAULT_INTER_NODE.bandwidth_bytes_per_s
    p = PlannerLimits()
    assert (p.max_concurrent, p.memory_bytes, p.kill_grace_s) \
        == (d.max_concurrent_plans, d.planner_memory_mib << 20, d.planner_kill_grace_seconds)
    o = OperatorOptions()
    assert (o.reconcile_workers, o.resync_seconds, o.queue_strict_after_s) \
        == (d.reconcile_workers, d.resync_seconds, d.queue_strict_after_seconds)
