"""Pytest wiring for the integration tests: the ``integration`` marker and the control plane.

The session-scoped ``control_plane`` fixture builds the control-plane binaries with
``hack/build-control-plane.sh`` (about a second when they are cached; a cold build takes much
longer, see hack/README.md) and starts a :class:`controlplane.ControlPlane` on 127.0.0.1.  If
the build or the start fails, every test that uses the fixture ERRORs with the reason and the
tail of the relevant log: these tests never skip silently.

With ``--realnode`` (tests/conftest.py) the build script also builds the kubelet, kube-proxy
and CoreDNS (``--real-node``), and the session fixture ``real_cluster`` runs a second control
plane, listening on the real node's IP, with one real node joined (``realnode.py``).

Environment:
    ADAPTIS_K8S_BIN_DIR: use binaries from this directory and do not run the build script.

The work dir (certificates, kubeconfigs, etcd data, ``logs/<component>.log``) is made by
pytest's ``tmp_path_factory`` and kept after the run like any other pytest temp dir.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:  # works with --import-mode=importlib too
    sys.path.insert(0, str(_HERE))

from controlplane import ControlPlane, ControlPlaneError  # noqa: E402
from realnode import (  # noqa: E402
    NODE_IP,
    REALNODE_HOME,
    NodeLock,
    RealCluster,
    RealNode,
    prepare_host,
    stop_host,
)

logger = logging.getLogger(__name__)

REPO_ROOT = _HERE.parents[1]
BUILD_SCRIPT = REPO_ROOT / "hack" / "build-control-plane.sh"
KUBERNETES_GO_MOD = REPO_ROOT / "hack" / "controlplane" / "kubernetes" / "go.mod"


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``integration`` marker."""
    config.addinivalue_line(
        "markers",
        "integration: needs the real Kubernetes control plane (etcd, kube-apiserver, "
        "controller-manager, scheduler, kwok) built by hack/build-control-plane.sh",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test collected under tests/integration as ``integration``."""
    for item in items:
        if _HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.integration)


def expected_k8s_version() -> str:
    """The k8s.io/kubernetes version pinned in hack/controlplane/kubernetes/go.mod."""
    match = re.search(
        r"^\s*(?:require\s+)?k8s\.io/kubernetes\s+(v\S+)", KUBERNETES_GO_MOD.read_text(), re.M
    )
    if not match:
        raise RuntimeError(f"no k8s.io/kubernetes requirement in {KUBERNETES_GO_MOD}")
    return match.group(1)


def _tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.splitlines()[-lines:])


@pytest.fixture(scope="session")
def k8s_version() -> str:
    """The Kubernetes version the control plane is built from (e.g. ``v1.37.2``)."""
    return expected_k8s_version()


@pytest.fixture(scope="session")
def control_plane_bin_dir(request: pytest.FixtureRequest) -> Path:
    """Build (or reuse) the control-plane binaries and return their directory.

    With ``--realnode`` the kubelet, kube-proxy and CoreDNS are built too (same cache).
    """
    override = os.environ.get("ADAPTIS_K8S_BIN_DIR")
    if override:
        logger.info("using prebuilt control-plane binaries from %s", override)
        return Path(override)
    args = ["--real-node"] if request.config.getoption("--realnode") else []
    logger.info("running %s %s", BUILD_SCRIPT, " ".join(args))
    started = time.monotonic()
    try:
        result = subprocess.run(  # our own script
            ["bash", str(BUILD_SCRIPT), *args], capture_output=True, text=True, check=False
        )
    except OSError as exc:
        pytest.fail(f"cannot run {BUILD_SCRIPT}: {exc}", pytrace=False)
    output = result.stdout + result.stderr
    if result.returncode != 0:
        pytest.fail(
            f"{BUILD_SCRIPT} failed with exit code {result.returncode}:\n{_tail(output)}",
            pytrace=False,
        )
    for line in result.stdout.splitlines():
        logger.info("build: %s", line)
    bin_dir = Path(result.stdout.strip().splitlines()[-1])
    if not bin_dir.is_dir():
        pytest.fail(f"{BUILD_SCRIPT} did not print its bin dir:\n{_tail(output)}", pytrace=False)
    logger.info("control-plane binaries ready in %.1fs", time.monotonic() - started)
    return bin_dir


@pytest.fixture(scope="session")
def control_plane(
    control_plane_bin_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ControlPlane]:
    """A running control plane shared by the whole test session."""
    work_dir = tmp_path_factory.mktemp("control-plane")
    plane = ControlPlane(control_plane_bin_dir, work_dir)
    try:
        plane.start()
        error: ControlPlaneError | None = None
    except ControlPlaneError as exc:
        error = exc
    if error is not None:  # fail outside the except block: no chained traceback noise
        pytest.fail(
            f"the control plane failed to start (logs in {work_dir / 'logs'}):\n{error}",
            pytrace=False,
        )
    logger.info("control-plane work dir: %s", work_dir)
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def real_cluster(
    control_plane_bin_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RealCluster]:
    """One real node (containerd, kubelet, kube-proxy, CoreDNS) on its own control plane.

    Fails (never skips) when the node cannot run: not root, packages missing, a build failed.
    Everything is undone at the end (and at the start, for a crashed run's leftovers).
    """
    work_dir = tmp_path_factory.mktemp("real-node")
    lock = NodeLock(REALNODE_HOME / "node.lock", timeout=1800)
    plane: ControlPlane | None = None
    error: ControlPlaneError | None = None
    try:
        lock.acquire()
        prepare_host(bin_dir=control_plane_bin_dir)
        plane = ControlPlane(
            control_plane_bin_dir, work_dir / "control-plane", apiserver_host=NODE_IP, real_node=True
        )
        plane.start()
        node = RealNode(plane, bin_dir=control_plane_bin_dir, work_dir=work_dir)
        node.start()
    except ControlPlaneError as exc:
        error = exc
    try:
        if error is not None:  # fail outside the except block: no chained traceback noise
            pytest.fail(f"the real node failed to start (logs in {work_dir}):\n{error}", pytrace=False)
        assert plane is not None
        yield RealCluster(plane, node, bin_dir=control_plane_bin_dir)
    finally:
        try:
            stop_host(bin_dir=control_plane_bin_dir, log_dir=work_dir / "node-logs")
        finally:
            if plane is not None:
                plane.stop()
            lock.release()
