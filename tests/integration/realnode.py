"""A real Kubernetes node for the integration tests: containerd, runc, a kubelet, kube-proxy.

This module sits beside ``controlplane.py`` (whose :class:`ControlPlane` it joins) and drives
the scripts of ``hack/realnode/``: ``install-packages.sh`` (Debian's containerd, runc, CNI
plugins, buildah, debootstrap), ``node.sh`` (the node's processes and every host change, undone
at the end and also at the start, for a crashed run's leftovers) and ``build-images.sh`` (the
pause and base images, and the Dockerfile's targets, imported into the node's containerd).
Pods really run here, unlike on kwok's fake nodes: their logs, exit codes, signals, DNS names
and volumes are real.

Only one real node runs per machine (its cgroups, iptables chains, bridge and sysctls are
machine-wide): :class:`NodeLock` makes a second test session wait for the first.  The node's
addresses are documentation blocks only (node 198.51.100.1 on its own bridge, pods
198.51.100.0/25, Services 198.51.100.128/25) and nothing is routed off the machine.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import IO, Any

from controlplane import ControlPlane, ControlPlaneError, wait_until, write_kubeconfig

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
HACK = REPO_ROOT / "hack" / "realnode"
#: Persistent state: containerd's root with the imported images, the sysctl baseline, image
#: stamps; the run's state is ``<home>/run`` (its logs are copied into the test's work dir).
REALNODE_HOME = Path(
    os.environ.get("ADAPTIS_REALNODE_HOME", Path.home() / ".cache" / "adaptis-k8s" / "realnode")
)

NODE_NAME = "realnode-0"
NODE_IP = "198.51.100.1"
POD_CIDR = "198.51.100.0/25"
CLUSTER_DNS_IP = "198.51.100.138"
DNS_PORT = 30053
#: The images every real-node session has (``build-images.sh pause base``).
PAUSE_IMAGE = "registry.k8s.io/pause:3.10"
BASE_IMAGE = "adaptis.local/python:3.11-bookworm"


class RealNodeError(ControlPlaneError):
    """The real node could not be prepared, started or stopped."""


def run_script(args: list[str], *, timeout: float, what: str, env: dict[str, str] | None = None) -> str:
    """Run one of our scripts; return its stdout, or raise with the tail of its output."""
    started = time.monotonic()
    try:
        result = subprocess.run(  # our own scripts
            ["bash", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env={**os.environ, **(env or {})},
        )
    except subprocess.TimeoutExpired as exc:
        raise RealNodeError(f"{what} took more than {timeout:.0f}s: {exc}") from exc
    for line in result.stderr.splitlines():
        logger.info("%s: %s", what, line)
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).splitlines()[-40:])
        raise RealNodeError(f"{what} failed with exit code {result.returncode}:\n{tail}")
    logger.info("%s: done in %.1fs", what, time.monotonic() - started)
    return result.stdout


class NodeLock:
    """An exclusive lock on the machine's one real node, waited for with a deadline."""

    def __init__(self, path: Path, *, timeout: float) -> None:
        self.path = path
        self.timeout = timeout
        self._file: IO[str] | None = None

    def acquire(self) -> None:
        """Take the lock; raise :class:`RealNodeError` if another session holds it too long."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = self.path.open("w")
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    handle.close()
                    raise RealNodeError(
                        f"another test session holds {self.path} (the machine's one real node) "
                        f"for more than {self.timeout:.0f}s"
                    ) from None
                time.sleep(1.0)
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        self._file = handle

    def release(self) -> None:
        """Release the lock (idempotent)."""
        if self._file is not None:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None


def prepare_host(*, bin_dir: Path, images: tuple[str, ...] = ("pause", "base")) -> None:
    """Packages, leftovers cleaned, bridge and containerd up, ``images`` built and imported."""
    if os.geteuid() != 0:
        raise RealNodeError("a real node needs root (cgroups, network namespaces, iptables)")
    env = {"RN_BIN_DIR": str(bin_dir)}
    run_script([str(HACK / "install-packages.sh")], timeout=900, what="install-packages.sh")
    run_script([str(HACK / "node.sh"), "prepare"], timeout=300, what="node.sh prepare", env=env)
    build_images(images, bin_dir=bin_dir)


def build_images(images: tuple[str, ...], *, bin_dir: Path) -> None:
    """``build-images.sh IMAGES...``: cached by their inputs, so a rerun costs seconds."""
    run_script(
        [str(HACK / "build-images.sh"), *images],
        timeout=3600,
        what=f"build-images.sh {' '.join(images)}",
        env={"RN_BIN_DIR": str(bin_dir)},
    )


def stop_host(*, bin_dir: Path, log_dir: Path | None = None) -> None:
    """``node.sh stop`` (idempotent); the run's logs are copied to ``log_dir`` first."""
    if log_dir is not None and (REALNODE_HOME / "run" / "logs").is_dir():
        shutil.copytree(REALNODE_HOME / "run" / "logs", log_dir, dirs_exist_ok=True)
    run_script(
        [str(HACK / "node.sh"), "stop"], timeout=300, what="node.sh stop",
        env={"RN_BIN_DIR": str(bin_dir)},
    )


def _dns_manifests() -> list[dict[str, Any]]:
    """The kube-dns Service (the kubelet's clusterDNS) in front of CoreDNS on the node IP."""
    ports = [("dns", "UDP"), ("dns-tcp", "TCP")]
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": "adaptis-realnode:coredns"},
            "rules": [
                {"apiGroups": [""], "resources": ["endpoints", "services", "pods", "namespaces"],
                 "verbs": ["list", "watch"]},
                {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                 "verbs": ["list", "watch"]},
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "adaptis-realnode:coredns"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": "adaptis-realnode:coredns"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                          "name": "system:coredns"}],
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "kube-dns", "namespace": "kube-system",
                         "labels": {"k8s-app": "kube-dns"}},
            "spec": {
                "clusterIP": CLUSTER_DNS_IP,
                "ports": [{"name": n, "port": 53, "protocol": p, "targetPort": DNS_PORT}
                          for n, p in ports],
            },
        },
        {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {"name": "kube-dns-node", "namespace": "kube-system",
                         "labels": {"kubernetes.io/service-name": "kube-dns"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [NODE_IP], "conditions": {"ready": True}}],
            "ports": [{"name": n, "port": DNS_PORT, "protocol": p} for n, p in ports],
        },
    ]


class RealNode:
    """The kubelet, kube-proxy and CoreDNS of one node joined to ``plane``.

    ``plane`` must have been started with ``apiserver_host=NODE_IP, real_node=True`` after
    :func:`prepare_host` (the apiserver listens on the bridge's address).
    """

    def __init__(self, plane: ControlPlane, *, bin_dir: Path, work_dir: Path) -> None:
        self.plane = plane
        self.bin_dir = bin_dir
        self.config_dir = work_dir / "node-config"
        self.name = NODE_NAME

    def _write_config(self) -> None:
        """The node's credentials, issued by the cluster CA (the files node.sh expects)."""
        ca = self.plane.certificate_authority
        cfg = self.config_dir
        cfg.mkdir(parents=True, exist_ok=True)
        shutil.copy(ca.cert_path, cfg / "ca.crt")
        (cfg / "node-name").write_text(self.name + "\n")
        serving = ca.issue(
            "kubelet-serving", common_name=self.name, server=True,
            dns_names=[self.name], ip_addresses=[NODE_IP],
        )
        shutil.copy(serving.cert_path, cfg / "kubelet-serving.crt")
        shutil.copy(serving.key_path, cfg / "kubelet-serving.key")
        clients = {
            "kubelet": (f"system:node:{self.name}", ["system:nodes"]),
            "kube-proxy": ("system:kube-proxy", []),
            "coredns": ("system:coredns", []),
        }
        for file, (user, groups) in clients.items():
            pair = ca.issue(f"{file}-client", common_name=user, organizations=groups, client=True)
            write_kubeconfig(
                cfg / f"{file}.kubeconfig", server=self.plane.server,
                ca_pem=ca.pair.cert_pem, user=user, client=pair,
            )

    def start(self, *, timeout: float = 180.0) -> None:
        """Start the node's processes and wait until the Node is Ready and DNS answers."""
        started = time.monotonic()
        self._write_config()
        self.plane.apply(_dns_manifests())
        run_script(
            [str(HACK / "node.sh"), "start", str(self.config_dir)], timeout=timeout,
            what="node.sh start", env={"RN_BIN_DIR": str(self.bin_dir)},
        )
        wait_until(self._ready, timeout=timeout, interval=1.0, what=f"node {self.name} Ready")
        logger.info("real node %s Ready in %.1fs", self.name, time.monotonic() - started)

    def _ready(self) -> bool:
        result = self.plane.kubectl("get", "node", self.name, "-o", "json", check=False)
        if result.returncode != 0:  # not registered yet
            return False
        conditions = json.loads(result.stdout)["status"].get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


class RealCluster:
    """A control plane on the real node's IP and the node joined to it (``real_cluster``)."""

    def __init__(self, plane: ControlPlane, node: RealNode, *, bin_dir: Path) -> None:
        self.plane = plane
        self.node = node
        self.bin_dir = bin_dir
