"""A real Kubernetes control plane on loopback for the AdaPtis integration tests.

:class:`ControlPlane` runs the binaries that ``hack/build-control-plane.sh`` builds from Go
modules (no container engine is needed) on 127.0.0.1 with free ports and a private work
directory: etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok, which plays
the kubelet for fake nodes annotated ``kwok.x-k8s.io/node: fake`` following the Stages in
``kwok-stages.yaml`` (pods become Running; pods labelled ``app.kubernetes.io/managed-by:
adaptis`` complete after ``adaptis.io/fake-run-seconds`` seconds, or fail when annotated
``adaptis.io/fake-fail: "true"``).

This module sits at the top of the test control plane and composes the modules beside it:

* ``processes.py`` - free ports, running and stopping one binary with its log, waiting;
* ``certs.py`` - the CA, serving and client certificates and ServiceAccount keys
  (``cryptography``);
* ``kubeconfig.py`` - the component, admin, user and ServiceAccount kubeconfigs;
* ``components.py`` - each component's command line and health URL, in start order;
* ``kubeclient.py`` - kubectl and helm against the cluster (:class:`ClusterClient`);
* ``fakenodes.py`` - kwok-managed fake GPU nodes (:class:`FakeNodeClient`).

Every public name of those modules that the tests use is importable from here.  Each process
logs to ``<work_dir>/logs/<name>.log``; a process that fails to start raises
:class:`ControlPlaneError` with the tail of its log.  :meth:`ControlPlane.stop` tears the
processes down in reverse start order.

Typical use::

    with ControlPlane(bin_dir, work_dir) as cp:
        cp.add_fake_gpu_node("gpu-0", product="NVIDIA-H100-80GB-HBM3", gpu_count=8,
                             gpu_memory_mib=81559, zone="zone-a", rack="rack-1")
        cp.kubectl("get", "nodes")
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from certs import CertificateAuthority, KeyPair
from components import (
    COMPONENTS,
    FAKE_NODE_IP,
    POD_CIDR,
    PORT_NAMES,
    SERVICE_ACCOUNT_ISSUER,
    SERVICE_CLUSTER_IP_RANGE,
    STARTUP_ORDER,
    ClusterLayout,
    ComponentCommand,
    apiserver_ip_addresses,
)
from fakenodes import (
    FAKE_EXIT_CODE_ANNOTATION,
    FAKE_FAIL_ANNOTATION,
    FAKE_RUN_SECONDS_ANNOTATION,
    KWOK_NODE_ANNOTATION,
    MANAGED_BY_LABEL,
    MANAGED_BY_VALUE,
    RACK_LABEL,
    FakeNodeClient,
    gpu_family,
)
from kubeclient import ClusterClient, KubectlError
from kubeconfig import (
    ClusterCredentials,
    UserKubeconfigs,
    make_cluster_credentials,
    write_kubeconfig,
)
from processes import (
    HOST,
    ControlPlaneError,
    ManagedProcess,
    free_ports,
    tail,
    wait_healthy,
    wait_until,
)

__all__ = [
    "DEFAULT_STAGES_FILE",
    "FAKE_EXIT_CODE_ANNOTATION",
    "FAKE_FAIL_ANNOTATION",
    "FAKE_NODE_IP",
    "FAKE_RUN_SECONDS_ANNOTATION",
    "HOST",
    "KWOK_NODE_ANNOTATION",
    "MANAGED_BY_LABEL",
    "MANAGED_BY_VALUE",
    "POD_CIDR",
    "RACK_LABEL",
    "SERVICE_ACCOUNT_ISSUER",
    "SERVICE_CLUSTER_IP_RANGE",
    "CertificateAuthority",
    "ClusterClient",
    "ControlPlane",
    "ControlPlaneError",
    "FakeNodeClient",
    "KeyPair",
    "KubectlError",
    "ManagedProcess",
    "free_ports",
    "gpu_family",
    "tail",
    "wait_until",
    "write_kubeconfig",
]

logger = logging.getLogger(__name__)

DEFAULT_STAGES_FILE = Path(__file__).resolve().parent / "kwok-stages.yaml"


class ControlPlane(FakeNodeClient):
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler + kwok on loopback.

    Args:
        bin_dir: directory holding ``etcd``, ``kube-apiserver``, ``kube-controller-manager``,
            ``kube-scheduler``, ``kubectl``, ``kwok`` (and ``helm``), as built by
            ``hack/build-control-plane.sh``.
        work_dir: where certificates, kubeconfigs, etcd data and logs go; a fresh temporary
            directory (removed by :meth:`stop`) when omitted.
        stages_file: kwok Stage definitions; ``kwok-stages.yaml`` beside this module by default.
        startup_timeout: seconds each component may take to become healthy.
        apiserver_host: the address the apiserver listens on and advertises (loopback; the
            real node's IP when a kubelet joins, see ``realnode.py``).
        real_node: configure the apiserver for a real kubelet (Node authorizer, its kubelet
            client certificate, the ``kubernetes`` Service's endpoints).
    """

    def __init__(
        self,
        bin_dir: Path | str,
        work_dir: Path | str | None = None,
        *,
        stages_file: Path | str | None = None,
        startup_timeout: float = 180.0,
        apiserver_host: str = HOST,
        real_node: bool = False,
    ) -> None:
        self.apiserver_host = apiserver_host
        self.real_node = real_node
        self._owns_work_dir = work_dir is None
        super().__init__(
            bin_dir=Path(bin_dir).resolve(),
            work_dir=Path(work_dir or tempfile.mkdtemp(prefix="adaptis-k8s-")).resolve(),
            startup_timeout=startup_timeout,
        )
        self.stages_file = Path(stages_file or DEFAULT_STAGES_FILE).resolve()
        self.log_dir = self.work_dir / "logs"
        self.pki_dir = self.work_dir / "pki"
        self._processes: list[ManagedProcess] = []
        self._commands: dict[str, ComponentCommand] = {}
        self._ports: dict[str, int] = {}
        self._credentials: ClusterCredentials | None = None
        self._user_kubeconfigs: UserKubeconfigs | None = None

    # ------------------------------------------------------------------ properties

    @property
    def server(self) -> str:
        """URL of the kube-apiserver, ``https://127.0.0.1:<port>``."""
        if "apiserver" not in self._ports:
            raise ControlPlaneError("the control plane has not been started")
        return f"https://{self.apiserver_host}:{self._ports['apiserver']}"

    @property
    def ca_cert_path(self) -> Path:
        """Path of the cluster CA certificate (PEM)."""
        return self._started_credentials().ca.cert_path

    @property
    def certificate_authority(self) -> CertificateAuthority:
        """The cluster CA, to issue certificates for more clients (a real node's kubelet)."""
        return self._started_credentials().ca

    @property
    def ports(self) -> dict[str, int]:
        """Loopback ports by component (etcd, apiserver, controller-manager, scheduler, kwok)."""
        return dict(self._ports)

    @property
    def log_files(self) -> dict[str, Path]:
        """Log file of each started process, by name."""
        return {p.name: p.log_path for p in self._processes}

    def _started_credentials(self) -> ClusterCredentials:
        if self._credentials is None:
            raise ControlPlaneError("the control plane has not been started")
        return self._credentials

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> ControlPlane:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        """Start every component in dependency order and wait until each is healthy.

        On failure everything already started is stopped again and
        :class:`ControlPlaneError` (with the tail of the failing component's log) is raised.
        """
        for name in COMPONENTS:
            self.binary(name)
        if not self.stages_file.is_file():
            raise ControlPlaneError(f"kwok stages file {self.stages_file} is missing")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        try:
            layout = self._make_layout()
            for build in STARTUP_ORDER:
                command = build(layout)
                self._commands[command.name] = command
                process = self._launch(command.name, list(command.args))
                wait_healthy(
                    process,
                    command.health_url,
                    timeout=self.startup_timeout,
                    context=command.health_ssl_context,
                )
            self._wait_for_default_service_account("default")
        except BaseException:
            self.stop()
            raise
        logger.info(
            "control plane up at %s in %.1fs (work dir %s)",
            self.server,
            time.monotonic() - started,
            self.work_dir,
        )

    def stop(self) -> None:
        """Stop all processes in reverse start order; remove the work dir if it was temporary."""
        for process in reversed(self._processes):
            try:
                process.stop()
            except Exception:  # keep tearing down the others
                logger.exception("failed to stop %s", process.name)
        if self._owns_work_dir and self.work_dir.exists():
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def restart(self, name: str, *, kill: bool = False) -> float:
        """Stop one component (SIGKILL when ``kill``, else SIGTERM) and start it again with the
        same command line, ports and data; return the seconds until it was healthy again. The
        soak's fault of a restarted apiserver or etcd (bench/soak.py)."""
        command = self._commands.get(name)
        old = next((p for p in self._processes if p.name == name and p.running), None)
        if command is None or old is None:
            raise ControlPlaneError(f"{name} is not a running component of this control plane")
        if kill and old.popen is not None:
            old.popen.kill()
            old.popen.wait(timeout=30)
        old.stop()
        self._processes.remove(old)
        started = time.monotonic()
        process = self._launch(name, list(command.args))
        wait_healthy(process, command.health_url, timeout=self.startup_timeout,
                     context=command.health_ssl_context)
        return time.monotonic() - started

    def check_alive(self) -> None:
        """Raise :class:`ControlPlaneError` if any component has exited."""
        for process in self._processes:
            process.check_alive()

    def _make_layout(self) -> ClusterLayout:
        """Pick the ports and make the credentials and kubeconfigs of every component."""
        self._ports = dict(zip(PORT_NAMES, free_ports(len(PORT_NAMES)), strict=True))
        credentials = make_cluster_credentials(
            pki_dir=self.pki_dir,
            work_dir=self.work_dir,
            server=self.server,
            apiserver_ips=apiserver_ip_addresses(self.apiserver_host),
        )
        self._credentials = credentials
        self._kubeconfig = credentials.admin_kubeconfig
        self._user_kubeconfigs = UserKubeconfigs(
            ca=credentials.ca, server=self.server, directory=self.work_dir / "kubeconfigs"
        )
        return ClusterLayout(
            work_dir=self.work_dir,
            ports=dict(self._ports),
            credentials=credentials,
            stages_file=self.stages_file,
            apiserver_host=self.apiserver_host,
            real_node=self.real_node,
        )

    def _launch(self, name: str, args: list[str]) -> ManagedProcess:
        process = ManagedProcess(
            name, [str(self.binary(name)), *args], self.log_dir / f"{name}.log"
        )
        self._processes.append(process)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ETCD_", "KUBECONFIG"))}
        env["HOME"] = str(self.work_dir / "home")  # kwok reads ~/.kwok; keep it private
        Path(env["HOME"]).mkdir(exist_ok=True)
        process.start(env)
        return process

    # ------------------------------------------------------------------ credentials

    def make_user_kubeconfig(
        self,
        user: str,
        *,
        groups: Sequence[str] = (),
        token: str | None = None,
        namespace: str | None = None,
        path: Path | str | None = None,
    ) -> Path:
        """Write a kubeconfig for ``user`` and return its path.

        With ``token`` the kubeconfig carries that bearer token (e.g. a ServiceAccount token);
        otherwise a client certificate with CN ``user`` and organizations ``groups`` is issued
        by the cluster CA.  RBAC applies to the user as to any other.
        """
        if self._user_kubeconfigs is None:
            raise ControlPlaneError("the control plane has not been started")
        return self._user_kubeconfigs.write(
            user, groups=groups, token=token, namespace=namespace, path=path
        )

    def service_account_kubeconfig(
        self,
        namespace: str,
        name: str,
        *,
        duration_seconds: int = 7200,
        path: Path | str | None = None,
    ) -> Path:
        """A kubeconfig that authenticates as ServiceAccount ``namespace/name`` with a token."""
        token = self.service_account_token(namespace, name, duration_seconds=duration_seconds)
        return self.make_user_kubeconfig(
            f"system:serviceaccount:{namespace}:{name}",
            token=token,
            namespace=namespace,
            path=path,
        )
