"""Test helpers for the Helm chart: locate helm and promtool, render charts/adaptis, read its parts.

Used by the chart tests beside this module and by tests/integration (test_helm_*, and
test_prometheus_*), which put this directory on ``sys.path``. Helm comes from
``hack/build-control-plane.sh`` (its bin dir, or ``ADAPTIS_K8S_BIN_DIR``), promtool and
prometheus from Debian's ``prometheus`` package; a missing tool fails the test with the command
that provides it, never a silent skip.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "adaptis"
FIXTURES = Path(__file__).resolve().parent / "fixtures"
FULL_VALUES = FIXTURES / "values-full.yaml"
RULES_FILE = REPO / "deploy" / "prometheus" / "adaptis-rules.yaml"
DASHBOARD_FILE = CHART / "files" / "dashboard.json"
CHART_CRD = CHART / "files" / "adaptis.io_adaptisjobs.yaml"
BUILD_SCRIPT = REPO / "hack" / "build-control-plane.sh"

T = TypeVar("T")

RELEASE = "adaptis"
NAMESPACE = "adaptis-system"

# Recording rules of files/rules.yaml: the dashboard may query these besides worker metrics.
RECORDED = frozenset({
    "adaptis:bubble_ratio:rate5m",
    "adaptis:job_bubble_ratio:rate5m",
    "adaptis:job_steps:rate5m",
    "adaptis:job_step_phase_seconds:rate5m",
    "adaptis:job_step_phase_share:rate5m",
    "adaptis:job_step_phase_seconds:mean5m",
    "adaptis:job_step_seconds:mean5m",
})

# The operator's own series the dashboard reads (adaptis/operator/control/metrics.py): the running
# plan's predicted compute per device and the re-plans. A worker never serves them, so the
# worker-only checks (tests/integration/test_prometheus_scrape.py) leave them out;
# tests/charts/test_charts_dashboard.py checks them against a real operator registry.
OPERATOR = frozenset({"adaptis_operator_predicted_busy_seconds", "adaptis_operator_replans_total"})


@cache
def tool_bin_dir() -> Path:
    """Where hack/build-control-plane.sh puts helm (and the control-plane binaries)."""
    override = os.environ.get("ADAPTIS_K8S_BIN_DIR")
    if override:
        return Path(override)
    out = subprocess.run(["bash", str(BUILD_SCRIPT), "--print-bin-dir"], capture_output=True,
                         text=True, check=True)
    return Path(out.stdout.strip().splitlines()[-1])


def helm_binary() -> Path:
    path = tool_bin_dir() / "helm"
    if not os.access(path, os.X_OK):
        pytest.fail(f"{path} is missing: build it with `bash hack/build-control-plane.sh`",
                    pytrace=False)
    return path


def debian_tool(name: str) -> Path:
    """prometheus or promtool from Debian's `prometheus` package."""
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is missing: `apt-get install prometheus` (hack/build-control-plane.sh "
                    "does it)", pytrace=False)
    return Path(found)


def helm_env(home: Path) -> dict[str, str]:
    """Private helm cache/config/data dirs: tests never touch the user's helm state."""
    env = dict(os.environ)
    for var, sub in (("HELM_CACHE_HOME", "cache"), ("HELM_CONFIG_HOME", "config"),
                     ("HELM_DATA_HOME", "data")):
        env[var] = str(home / sub)
    return env


def run_helm(args: Sequence[str], *, home: Path, check: bool = True,
             timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(helm_binary()), *args], capture_output=True, text=True,
                            env=helm_env(home), timeout=timeout, check=False)
    if check and result.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({result.returncode}):\n"
                             f"{result.stdout}\n{result.stderr}")
    return result


def template_args(*, values: Iterable[Path] = (), sets: Mapping[str, Any] | None = None,
                  release: str = RELEASE, namespace: str = NAMESPACE) -> list[str]:
    """Arguments of `helm template` (or install/upgrade after the verb) for the chart."""
    args = [release, str(CHART), "--namespace", namespace]
    for path in values:
        args += ["--values", str(path)]
    for key, value in (sets or {}).items():
        args += ["--set-json", f"{key}={json.dumps(value)}"]
    return args


def render_text(*, home: Path, values: Iterable[Path] = (),
                sets: Mapping[str, Any] | None = None, namespace: str = NAMESPACE) -> str:
    args = ["template", *template_args(values=values, sets=sets, namespace=namespace)]
    return run_helm(args, home=home).stdout


def render(*, home: Path, values: Iterable[Path] = (), sets: Mapping[str, Any] | None = None,
           namespace: str = NAMESPACE) -> list[dict[str, Any]]:
    """The chart's objects, as `helm template` renders them."""
    text = render_text(home=home, values=values, sets=sets, namespace=namespace)
    return [doc for doc in yaml.safe_load_all(text) if doc]


def by_kind(objects: Iterable[Mapping[str, Any]], kind: str) -> list[Mapping[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: Iterable[Mapping[str, Any]], kind: str, name: str | None = None
        ) -> Mapping[str, Any]:
    found = [o for o in by_kind(objects, kind) if name is None or o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def operator_container(objects: Iterable[Mapping[str, Any]]) -> Mapping[str, Any]:
    deployment = one(objects, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def env_of(container: Mapping[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


# A PromQL metric name is an identifier followed by `{`, `[`, `)`, whitespace or the end, and is
# not a function (followed by `(`), a keyword or a label inside braces or a `by (...)` list.
_PROMQL_KEYWORDS = frozenset({
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
    "unless", "offset", "le",
})


def promql_metric_names(expr: str) -> set[str]:
    """Metric (and recording-rule) names a PromQL expression reads."""
    stripped = re.sub(r"\{[^}]*\}", "{}", expr)           # label matchers
    stripped = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", " ", stripped)
    stripped = re.sub(r"\[[^\]]*\]", "[]", stripped)      # range selectors, $__rate_interval
    stripped = re.sub(r'"[^"]*"', '""', stripped)
    names = set()
    for match in re.finditer(r"(?<![\w:$])([a-zA-Z_:][\w:]*)\s*(\()?", stripped):
        name, call = match.group(1), match.group(2)
        if call or name in _PROMQL_KEYWORDS:
            continue
        names.add(name)
    return names


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD_FILE.read_text())


def dashboard_queries(board: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel target and query variable."""
    queries = []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            queries.append((panel["title"], target["expr"]))
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            inner = re.fullmatch(r"label_values\((.*),\s*\w+\)", query)
            queries.append((f"variable {var['name']}", inner.group(1) if inner else query))
    return queries


def poll_until(predicate: Callable[[], T | None], *, timeout: float, what: str,
               interval: float = 0.5) -> T:
    """Call ``predicate`` until it returns something truthy; its exceptions end the wait."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)
