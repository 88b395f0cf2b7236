"""What the operator benchmarks share: a real control plane with many fake GPU nodes, the
operator as a subprocess, and the figures read from /proc.

Used by bench/operator_scale.py (one large job) and bench/operator_shared.py (many jobs on a
shared cluster). The control plane is the one of tests/integration (etcd, kube-apiserver,
scheduler, controller-manager, kwok), built or reused by hack/build-control-plane.sh.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration"))

from controlplane import ControlPlane, ControlPlaneError, wait_until  # noqa: E402

__all__ = ["ControlPlane", "ControlPlaneError", "Operator", "REPO", "bin_dir", "create_nodes", "epoch", "fake_job",
           "fake_node", "free_port", "install_crd", "rss_kib", "wait_until"]

KINDS = (("NVIDIA-H100-80GB-HBM3", 81559, "hopper"), ("NVIDIA-A100-SXM4-80GB", 81920, "ampere"))
_TICK = os.sysconf("SC_CLK_TCK")


def bin_dir() -> Path:
    out = subprocess.run(["bash", str(REPO / "hack" / "build-control-plane.sh")],
                         capture_output=True, text=True, check=True).stdout
    return Path(out.strip().splitlines()[-1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def epoch(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


def fake_node(i: int, *, gpus: int, prefix: str = "bench", kinds: int = 2) -> dict[str, Any]:
    """Node ``<prefix>-<i>``: kwok-managed, GFD-labelled, four zones, 32 racks."""
    product, memory, family = KINDS[i % min(kinds, len(KINDS))]
    name = f"{prefix}-{i:03d}"
    capacity = {"cpu": "96", "memory": "1Ti", "pods": "110", "nvidia.com/gpu": str(gpus)}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "type": "kwok",
                "topology.kubernetes.io/zone": f"zone-{i % 4}",
                "topology.adaptis.io/rack": f"rack-{i % 32}",
                "nvidia.com/gpu.product": product,
                "nvidia.com/gpu.count": str(gpus),
                "nvidia.com/gpu.memory": str(memory),
                "nvidia.com/gpu.family": family,
            },
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
        },
        "status": {"capacity": capacity, "allocatable": dict(capacity)},
    }


def fake_job(name: str, *, namespace: str, workers: int, gpus: int, run_s: int,
             **spec: Any) -> dict[str, Any]:
    """An AdaPtisJob of ``workers`` x ``gpus`` whose pods kwok runs for ``run_s`` seconds
    (``adaptis.io/fake-run-seconds``); ``spec``: more top-level spec fields (backoffLimit, ...)."""
    return {
        "apiVersion": "adaptis.io/v1alpha1", "kind": "AdaPtisJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": {"vocabSize": 32000, "hidden": 512, "heads": 8,
                      "blocks": [{"kind": "attention", "count": 2 * workers}]},
            "training": {"steps": 10, "microbatches": 2 * workers, "sequenceLength": 512},
            "parallelism": {"workers": workers, "gpusPerWorker": gpus},
            "worker": {"annotations": {"adaptis.io/fake-run-seconds": str(run_s)}},
            **spec,
        },
    }


def install_crd(cp: ControlPlane) -> None:
    cp.kubectl("apply", "-f", str(REPO / "crds" / "adaptis.io_adaptisjobs.yaml"))
    # `kubectl wait` fails outright on a CRD whose status has no conditions yet: ask again.
    wait_until(lambda: cp.kubectl("wait", "--for=condition=Established", "crd/adaptisjobs.adaptis.io",
                                  check=False).returncode == 0, timeout=60, interval=0.5,
               what="the AdaPtisJob CRD Established")


def create_nodes(cp: ControlPlane, nodes: Sequence[dict[str, Any]], *,
                 timeout: float = 600) -> float:
    """Create the nodes 64 at a time and wait until kwok has made them all Ready; seconds."""
    started = time.monotonic()
    for lo in range(0, len(nodes), 64):
        cp.kubectl("create", "-f", "-", input=json.dumps(
            {"apiVersion": "v1", "kind": "List", "items": list(nodes[lo:lo + 64])}))

    def all_ready() -> bool:
        items = cp.get_json("nodes", "-l", "type=kwok")["items"]
        ready = [n for n in items if any(c["type"] == "Ready" and c["status"] == "True"
                                         for c in n["status"].get("conditions", []))]
        return len(ready) >= len(nodes)

    wait_until(all_ready, timeout=timeout, interval=1.0, what="all fake nodes Ready")
    return time.monotonic() - started


def rss_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of one process, KiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text()
                  .splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def _stat(pid: int) -> list[str]:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2:].split()  # fields from the 3rd on (state, ppid, ...)


def process_tree(root: int) -> list[int]:
    """``root`` and its descendants now alive."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                children.setdefault(int(_stat(int(entry.name))[1]), []).append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


@dataclass
class Operator:
    """``adaptis operator`` as a subprocess watching one namespace, with its own figures."""

    cp: ControlPlane
    namespace: str
    log_path: Path
    extra_args: Sequence[str] = ()
    kubeconfig: Path | None = None  # None: the admin's (system:masters, exempt from APF)
    proc: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = None
    metrics_url: str = ""
    peak_tree_rss_kib: int = 0

    def start(self) -> None:
        liveness = f"http://127.0.0.1:{free_port()}/healthz"
        port = free_port()
        self.metrics_url = f"http://127.0.0.1:{port}/metrics"
        self._log = self.log_path.open("ab")  # a restarted operator appends
        self.proc = subprocess.Popen(  # our own CLI
            [sys.executable, "-m", "adaptis", "operator", "--namespace", self.namespace,
             "--liveness", liveness, "--metrics-port", str(port), *self.extra_args],
            cwd=REPO, env=self.cp.env(self.kubeconfig), stdout=self._log, stderr=subprocess.STDOUT)

        def alive() -> bool:
            with urllib.request.urlopen(liveness, timeout=2) as resp:
                return resp.status == 200

        wait_until(alive, timeout=120, interval=0.2, what="the operator's liveness probe")

    def sample(self) -> None:
        """Note the resident memory of the operator and its planning children now."""
        assert self.proc is not None
        total = 0
        for pid in process_tree(self.proc.pid):
            try:
                total += rss_kib(pid)[0]
            except (OSError, KeyError):
                continue
        self.peak_tree_rss_kib = max(self.peak_tree_rss_kib, total)

    def cpu_seconds(self) -> float:
        """User + system CPU of the operator, its live children and its reaped ones."""
        assert self.proc is not None
        total = 0.0
        for i, pid in enumerate(process_tree(self.proc.pid)):
            try:
                f = _stat(pid)
            except OSError:
                continue
            # utime, stime; cutime, cstime (reaped children) only for the operator itself.
            total += sum(int(x) for x in (f[11], f[12], *((f[13], f[14]) if i == 0 else ())))
        return total / _TICK

    def peak_rss_mib(self) -> float:
        assert self.proc is not None
        return rss_kib(self.proc.pid)[1] / 1024

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self._log is not None:
            self._log.close()
