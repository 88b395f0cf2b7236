"""Test helpers for Prometheus: a real server on loopback (Debian's package), and its HTTP API.

Used by tests/integration/test_prometheus_scrape.py. The server runs with its own data dir,
listens on 127.0.0.1 only and is always stopped by the caller (``with PrometheusServer(...)``);
nothing here retries a query: a failed one is a failed test.
"""

from __future__ import annotations

import json
import socket
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import chartkit
import yaml


@dataclass(frozen=True)
class Target:
    """One scrape target and the labels the PodMonitor's relabelings would give it."""

    port: int
    labels: Mapping[str, str]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_config(path: Path, *, targets: Sequence[Target], rule_files: Sequence[Path],
                 interval_s: int = 1) -> Path:
    """A prometheus.yml scraping ``targets`` the way the chart's PodMonitor does."""
    config = {
        "global": {"scrape_interval": f"{interval_s}s", "evaluation_interval": f"{interval_s}s",
                   "scrape_timeout": f"{interval_s}s"},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": [{
            "job_name": "adaptis-workers",
            "metrics_path": "/metrics",
            # As the PodMonitor: the target's labels win, but a sample's own rank is kept.
            "honor_labels": False,
            "metric_relabel_configs": [
                {"source_labels": ["exported_rank"], "regex": "(.+)", "target_label": "rank"},
                {"regex": "exported_.*", "action": "labeldrop"},
            ],
            "static_configs": [{"targets": [f"127.0.0.1:{t.port}"], "labels": dict(t.labels)}
                               for t in targets],
        }],
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


class PrometheusServer:
    """``prometheus`` on a free loopback port with a private TSDB under ``workdir``."""

    def __init__(self, config: Path, *, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "prometheus.log"
        self._args = [
            str(chartkit.debian_tool("prometheus")),
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--storage.tsdb.retention.time=1h",
            "--web.console.templates=/dev/null",
            "--web.console.libraries=/dev/null",
        ]
        self._process: subprocess.Popen[bytes] | None = None
        self._log = None

    def __enter__(self) -> PrometheusServer:
        self._log = self.log_path.open("wb")
        self._process = subprocess.Popen(self._args, stdout=self._log,
                                         stderr=subprocess.STDOUT)
        chartkit.poll_until(self._ready, timeout=60, what="prometheus to be ready")
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=5)
        if self._log is not None:
            self._log.close()

    def _ready(self) -> bool:
        if self._process is not None and self._process.poll() is not None:
            raise AssertionError(f"prometheus exited:\n{self.log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def api(self, path: str, **params: Any) -> Any:
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=30) as resp:
            body = json.loads(resp.read())
        if body.get("status") != "success":
            raise AssertionError(f"prometheus {path} {params}: {body}")
        return body["data"]

    def query(self, expr: str, *, at: float | None = None) -> list[dict[str, Any]]:
        """Instant vector: [{'metric': {...}, 'value': [t, 'v']}, ...]."""
        data = self.api("query", query=expr, time=at)
        assert data["resultType"] == "vector", data
        return list(data["result"])

    def query_range(self, expr: str, *, start: float, end: float,
                    step: float) -> list[dict[str, Any]]:
        data = self.api("query_range", query=expr, start=start, end=end, step=step)
        return list(data["result"])

    def targets(self) -> list[dict[str, Any]]:
        return list(self.api("targets")["activeTargets"])

    def server_time(self) -> float:
        """Now, as Prometheus sees it (the scalar `time()`)."""
        data = self.api("query", query="time()")
        assert data["resultType"] == "scalar", data
        return float(data["result"][1])
