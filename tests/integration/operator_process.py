"""``adaptis operator`` as a subprocess against the test control plane, and the reads the
operator's integration tests make. Sits above controlplane.py; the test modules subclass it.

The operator runs as a user runs it (``python -m adaptis operator``) with the admin kubeconfig,
watching the one namespace its test module owns. :meth:`wait` fails the test with the
operator's log tail, so a failure shows what the operator was doing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest
from memcg import MemoryCgroup

REPO = Path(__file__).resolve().parents[2]
#: The operator's own namespace (profiles, plan records) when --profile-namespace is not given.
OPERATOR_NS = "adaptis-system"
CRD = REPO / "crds" / "adaptis.io_adaptisjobs.yaml"
T = TypeVar("T")


def install_crd(cp: Any) -> None:
    cp.kubectl("apply", "-f", str(CRD))
    cp.kubectl("wait", "--for=condition=Established", "crd/adaptisjobs.adaptis.io", "--timeout=60s")


def plan_record(cp: Any, *, job: str, namespace: str,
                operator_namespace: str = OPERATOR_NS) -> dict[str, Any] | None:
    """The plan record the operator keeps for ``namespace/job`` in its own namespace, as JSON."""
    items = cp.get_json("configmaps", "-n", operator_namespace,
                        "-l", "adaptis.io/role=plan-record")["items"]
    for cm in items:
        if (cm["metadata"].get("annotations") or {}).get("adaptis.io/job") == f"{namespace}/{job}":
            return dict(json.loads(cm["data"]["record.json"]))
    return None


def wait_for(what: str, predicate: Callable[[], T | None], *, timeout: float,
             alive: Sequence[tuple[str, subprocess.Popen[bytes] | None]],
             logs: Callable[[], str]) -> T:
    """Poll ``predicate`` until truthy; fail at once if a process of ``alive`` exits, and on
    timeout, either way with ``logs()``."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        for name, proc in alive:
            if proc is not None and proc.poll() is not None:
                pytest.fail(f"{name} exited ({proc.returncode}):\n{logs()}")
        try:
            value = predicate()
            if value:
                return value
        except Exception as err:  # noqa: BLE001 - "not yet"
            last = err
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what} (last error: {last!r})"
                f"\n{logs()}")


class OperatorProcess:
    """The operator subprocess watching ``namespace``, plus reads of jobs in it."""

    def __init__(self, cp: Any, log_path: Path, *, namespace: str) -> None:
        self.cp = cp
        self.log_path = log_path
        self.namespace = namespace
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, *, extra_args: Sequence[str] = (), cgroup: MemoryCgroup | None = None) -> None:
        """Start the operator (inside ``cgroup``, as a pod's memory limit would hold it)."""
        # Its own namespace, where it keeps plan records (and profiles), as the chart's release
        # namespace would be.
        args = list(extra_args)
        own = args[args.index("--profile-namespace") + 1] if "--profile-namespace" in args \
            else OPERATOR_NS
        if self.cp.kubectl("get", "namespace", own, check=False).returncode != 0:
            self.cp.kubectl("create", "namespace", own, check=False)
        log = self.log_path.open("ab")
        argv = [sys.executable, "-m", "adaptis", "-v", "operator", "--namespace", self.namespace,
                "--resync-seconds", "3", *extra_args]
        self.proc = subprocess.Popen(  # our own CLI
            argv if cgroup is None else cgroup.command(argv),
            cwd=REPO, env=self.cp.env(), stdout=log, stderr=subprocess.STDOUT)
        if cgroup is not None:  # the shell moves in before it execs the operator
            pid = self.proc.pid
            self.wait("the operator in its memory cgroup", lambda: pid in cgroup.pids(), timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def wait(self, what: str, predicate: Callable[[], T | None], timeout: float = 60) -> T:
        return wait_for(what, predicate, timeout=timeout, alive=[("the operator", self.proc)],
                        logs=lambda: f"operator log:\n{self.log_tail()}")

    def job(self, name: str) -> dict[str, Any]:
        return dict(self.cp.get_json("adaptisjob", name, "-n", self.namespace))

    def status(self, name: str) -> dict[str, Any]:
        return dict(self.job(name).get("status") or {})

    def condition(self, name: str, type_: str) -> dict[str, Any] | None:
        return next((c for c in self.status(name).get("conditions", [])
                     if c["type"] == type_), None)

    def phase_is(self, name: str, phase: str) -> Callable[[], bool]:
        return lambda: self.status(name).get("phase") == phase

    def pods(self, name: str) -> list[dict[str, Any]]:
        """The job's worker pods, by rank."""
        items = self.cp.get_json("pods", "-n", self.namespace, "-l",
                                 f"adaptis.io/job={name}")["items"]
        return sorted(items, key=lambda p: int(p["metadata"]["labels"]["adaptis.io/rank"]))

    def events(self, name: str) -> list[dict[str, Any]]:
        """The Events about the job."""
        return list(self.cp.get_json("events", "-n", self.namespace, "--field-selector",
                                     f"involvedObject.name={name}")["items"])
