"""A real Kubernetes control plane on loopback for the AdaPtis integration tests.

:class:`ControlPlane` runs the binaries that ``hack/build-control-plane.sh`` builds from Go
modules (no container engine is needed) on 127.0.0.1 with free ports and a private work
directory:

* etcd (``--unsafe-no-fsync``, data in the work directory),
* kube-apiserver (secure port only, RBAC, client-certificate authentication against a CA made
  here, service-account issuer and signing keys),
* kube-controller-manager (garbage collector, namespace, service-account and token
  controllers, node lifecycle, ...),
* kube-scheduler (binds pods, so node affinities are really obeyed),
* kwok, which plays the kubelet for fake nodes annotated ``kwok.x-k8s.io/node: fake`` following
  the Stages in ``kwok-stages.yaml`` (pods become Running; pods labelled
  ``app.kubernetes.io/managed-by: adaptis`` complete after ``adaptis.io/fake-run-seconds``
  seconds, or fail when annotated ``adaptis.io/fake-fail: "true"``).

The CA, serving and client certificates and the service-account keys are made with the
``cryptography`` package.  Each process logs to ``<work_dir>/logs/<name>.log``; a process that
fails to start raises :class:`ControlPlaneError` with the tail of its log.  :meth:`stop` tears
the processes down in reverse start order.

Typical use::

    with ControlPlane(bin_dir, work_dir) as cp:
        cp.add_fake_gpu_node("gpu-0", product="NVIDIA-H100-80GB-HBM3", gpu_count=8,
                             gpu_memory_mib=81559, zone="zone-a", rack="rack-1")
        cp.kubectl("get", "nodes")
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import ipaddress
import json
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any, TypeVar

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

logger = logging.getLogger(__name__)

T = TypeVar("T")

HOST = "127.0.0.1"
SERVICE_CLUSTER_IP_RANGE = "10.0.0.0/24"
POD_CIDR = "10.244.0.0/16"
FAKE_NODE_IP = "10.255.0.1"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"

#: Annotation that puts a node under kwok's control.
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
#: Topology label for the rack (or block) of a fake node.
RACK_LABEL = "topology.adaptis.io/rack"
#: Label that selects pods for kwok's AdaPtis completion / failure stages.
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY_VALUE = "adaptis"
#: Annotation: seconds a managed pod runs before kwok completes it (default 3).
FAKE_RUN_SECONDS_ANNOTATION = "adaptis.io/fake-run-seconds"
#: Annotation: ``"true"`` makes kwok fail a managed pod instead of completing it.
FAKE_FAIL_ANNOTATION = "adaptis.io/fake-fail"
#: Annotation: exit code of the failed containers (default 1).
FAKE_EXIT_CODE_ANNOTATION = "adaptis.io/fake-exit-code"

DEFAULT_STAGES_FILE = Path(__file__).resolve().parent / "kwok-stages.yaml"

# NVIDIA GPU Feature Discovery reports the architecture family of a product.
_GPU_FAMILIES: tuple[tuple[str, str], ...] = (
    ("GB200", "blackwell"),
    ("B200", "blackwell"),
    ("B100", "blackwell"),
    ("H200", "hopper"),
    ("H100", "hopper"),
    ("H800", "hopper"),
    ("GH200", "hopper"),
    ("L40", "ada-lovelace"),
    ("L4", "ada-lovelace"),
    ("RTX-4090", "ada-lovelace"),
    ("A100", "ampere"),
    ("A800", "ampere"),
    ("A10", "ampere"),
    ("A30", "ampere"),
    ("A40", "ampere"),
    ("T4", "turing"),
    ("V100", "volta"),
    ("P100", "pascal"),
)


class ControlPlaneError(RuntimeError):
    """A control-plane process could not be started, or a wait timed out."""


class KubectlError(subprocess.CalledProcessError):
    """A kubectl (or helm) call exited non-zero; the message includes its stderr."""

    def __str__(self) -> str:
        return f"{super().__str__()}\nstdout:\n{self.stdout}\nstderr:\n{self.stderr}"


def gpu_family(product: str) -> str:
    """Return the GPU Feature Discovery family (``hopper``, ``ampere``...) of a product name."""
    upper = product.upper()
    for marker, family in _GPU_FAMILIES:
        if marker in upper:
            return family
    return "unknown"


def free_ports(count: int, host: str = HOST) -> list[int]:
    """Return ``count`` distinct TCP ports that are free on ``host`` right now."""
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def wait_until(
    predicate: Callable[[], T | None],
    *,
    timeout: float,
    interval: float = 0.5,
    what: str = "condition",
) -> T:
    """Call ``predicate`` until it returns a truthy value and return it.

    Exceptions raised by ``predicate`` count as "not yet", except :class:`ControlPlaneError`,
    which is fatal (e.g. the process being waited for has exited) and propagates at once.
    Raises :class:`ControlPlaneError` naming ``what`` (and the last exception) after ``timeout``
    seconds.
    """
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            result = predicate()
            if result:
                return result
        except ControlPlaneError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure means "not yet"
            last_error = exc
        if time.monotonic() >= deadline:
            detail = f": last error: {last_error!r}" if last_error else ""
            raise ControlPlaneError(f"timed out after {timeout:.0f}s waiting for {what}{detail}")
        time.sleep(interval)


def tail(path: Path, lines: int = 40) -> str:
    """Return the last ``lines`` lines of a text file ('' if it does not exist)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


# --------------------------------------------------------------------------- certificates


@dataclass(frozen=True)
class KeyPair:
    """A PEM certificate and private key written to disk."""

    cert_path: Path
    key_path: Path

    @property
    def cert_pem(self) -> bytes:
        """The certificate, PEM encoded."""
        return self.cert_path.read_bytes()

    @property
    def key_pem(self) -> bytes:
        """The private key, PEM encoded."""
        return self.key_path.read_bytes()


def _write_private(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    path.chmod(0o600)


def _key_pem(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


class CertificateAuthority:
    """A self-signed CA that issues the serving and client certificates of the cluster."""

    def __init__(self, directory: Path, common_name: str = "adaptis-test-ca") -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()), critical=False
            )
            .sign(self._key, hashes.SHA256())
        )
        self.pair = KeyPair(directory / "ca.crt", directory / "ca.key")
        self.pair.cert_path.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))
        _write_private(self.pair.key_path, _key_pem(self._key))

    @property
    def cert_path(self) -> Path:
        """Path of the CA certificate (PEM)."""
        return self.pair.cert_path

    def issue(
        self,
        name: str,
        *,
        common_name: str,
        organizations: Sequence[str] = (),
        server: bool = False,
        client: bool = False,
        dns_names: Sequence[str] = (),
        ip_addresses: Sequence[str] = (),
    ) -> KeyPair:
        """Issue a certificate for ``common_name`` and write ``<name>.crt`` / ``<name>.key``."""
        key = ec.generate_private_key(ec.SECP256R1())
        attributes = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
        attributes += [x509.NameAttribute(NameOID.ORGANIZATION_NAME, org) for org in organizations]
        usages = []
        if server:
            usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
        if client:
            usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
        now = dt.datetime.now(dt.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name(attributes))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                critical=False,
            )
        )
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns_names]
        sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses]
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        pair = KeyPair(self.directory / f"{name}.crt", self.directory / f"{name}.key")
        pair.cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_private(pair.key_path, _key_pem(key))
        return pair


def _write_service_account_keys(directory: Path) -> tuple[Path, Path]:
    """Write an RSA key pair for signing service-account tokens; return (private, public)."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private = directory / "sa.key"
    public = directory / "sa.pub"
    _write_private(private, _key_pem(key))
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return private, public


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def write_kubeconfig(
    path: Path,
    *,
    server: str,
    ca_pem: bytes,
    user: str,
    client: KeyPair | None = None,
    token: str | None = None,
    namespace: str | None = None,
) -> Path:
    """Write a self-contained kubeconfig (JSON, certificates inlined) and return its path."""
    if (client is None) == (token is None):
        raise ValueError("give exactly one of client or token")
    credentials: dict[str, str]
    if client is not None:
        credentials = {
            "client-certificate-data": _b64(client.cert_pem),
            "client-key-data": _b64(client.key_pem),
        }
    else:
        credentials = {"token": str(token)}
    context: dict[str, str] = {"cluster": "adaptis-test", "user": user}
    if namespace:
        context["namespace"] = namespace
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "adaptis-test",
                "cluster": {"server": server, "certificate-authority-data": _b64(ca_pem)},
            }
        ],
        "users": [{"name": user, "user": credentials}],
        "contexts": [{"name": "adaptis-test", "context": context}],
        "current-context": "adaptis-test",
        "preferences": {},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_private(path, json.dumps(config, indent=2).encode())
    return path


# --------------------------------------------------------------------------- processes


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM the child when the test process dies (no orphans on a crash)."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


@dataclass
class ManagedProcess:
    """One control-plane process and its log file."""

    name: str
    args: list[str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = field(default=None, repr=False)

    def start(self, env: Mapping[str, str]) -> None:
        """Start the process with stdout and stderr going to its log file."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        self._log.write(f"$ {' '.join(self.args)}\n".encode())
        self._log.flush()
        logger.info("starting %s (log %s)", self.name, self.log_path)
        self.popen = subprocess.Popen(  # noqa: S603 - binaries we built, fixed arguments
            self.args,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=dict(env),
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )

    @property
    def running(self) -> bool:
        """True while the process is alive."""
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the process log."""
        return tail(self.log_path, lines)

    def check_alive(self) -> None:
        """Raise :class:`ControlPlaneError` with the log tail if the process has exited."""
        if self.popen is not None and self.popen.poll() is not None:
            raise ControlPlaneError(
                f"{self.name} exited with code {self.popen.returncode}; "
                f"last lines of {self.log_path}:\n{self.log_tail()}"
            )

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the process, SIGKILL it after ``grace`` seconds, and close its log."""
        if self.popen is not None and self.popen.poll() is None:
            logger.info("stopping %s (pid %d)", self.name, self.popen.pid)
            self.popen.terminate()
            try:
                self.popen.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop in %.0fs, killing it", self.name, grace)
                self.popen.kill()
                self.popen.wait(timeout=grace)
        if self._log is not None:
            self._log.close()
            self._log = None


# --------------------------------------------------------------------------- control plane


class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler + kwok on loopback.

    Args:
        bin_dir: directory holding ``etcd``, ``kube-apiserver``, ``kube-controller-manager``,
            ``kube-scheduler``, ``kubectl``, ``kwok`` (and ``helm``), as built by
            ``hack/build-control-plane.sh``.
        work_dir: where certificates, kubeconfigs, etcd data and logs go; a fresh temporary
            directory (removed by :meth:`stop`) when omitted.
        stages_file: kwok Stage definitions; ``kwok-stages.yaml`` beside this module by default.
        startup_timeout: seconds each component may take to become healthy.
    """

    def __init__(
        self,
        bin_dir: Path | str,
        work_dir: Path | str | None = None,
        *,
        stages_file: Path | str | None = None,
        startup_timeout: float = 180.0,
    ) -> None:
        self.bin_dir = Path(bin_dir).resolve()
        self._owns_work_dir = work_dir is None
        self.work_dir = Path(work_dir or tempfile.mkdtemp(prefix="adaptis-k8s-")).resolve()
        self.stages_file = Path(stages_file or DEFAULT_STAGES_FILE).resolve()
        self.startup_timeout = startup_timeout
        self.log_dir = self.work_dir / "logs"
        self.pki_dir = self.work_dir / "pki"
        self._processes: list[ManagedProcess] = []
        self._ca: CertificateAuthority | None = None
        self._admin: KeyPair | None = None
        self._ports: dict[str, int] = {}
        self._kubeconfig: Path | None = None
        self._kubeconfig_count = 0

    # ------------------------------------------------------------------ properties

    @property
    def server(self) -> str:
        """URL of the kube-apiserver, ``https://127.0.0.1:<port>``."""
        if "apiserver" not in self._ports:
            raise ControlPlaneError("the control plane has not been started")
        return f"https://{HOST}:{self._ports['apiserver']}"

    @property
    def kubeconfig(self) -> Path:
        """Path of the admin kubeconfig (user in group ``system:masters``)."""
        if self._kubeconfig is None:
            raise ControlPlaneError("the control plane has not been started")
        return self._kubeconfig

    @property
    def ca_cert_path(self) -> Path:
        """Path of the cluster CA certificate (PEM)."""
        if self._ca is None:
            raise ControlPlaneError("the control plane has not been started")
        return self._ca.cert_path

    @property
    def ports(self) -> dict[str, int]:
        """Loopback ports by component (etcd, apiserver, controller-manager, scheduler, kwok)."""
        return dict(self._ports)

    @property
    def log_files(self) -> dict[str, Path]:
        """Log file of each started process, by name."""
        return {p.name: p.log_path for p in self._processes}

    def binary(self, name: str) -> Path:
        """Path of a built binary; raises :class:`ControlPlaneError` if it is missing."""
        path = self.bin_dir / name
        if not os.access(path, os.X_OK):
            raise ControlPlaneError(f"{path} is missing; run hack/build-control-plane.sh")
        return path

    def env(self, kubeconfig: Path | str | None = None) -> dict[str, str]:
        """Environment for clients: ``KUBECONFIG`` set and the bin dir first on ``PATH``."""
        env = dict(os.environ)
        env["KUBECONFIG"] = str(kubeconfig or self.kubeconfig)
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        return env

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
        for name in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok"):
            self.binary(name)
        if not self.stages_file.is_file():
            raise ControlPlaneError(f"kwok stages file {self.stages_file} is missing")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        try:
            self._make_credentials()
            self._start_etcd()
            self._start_apiserver()
            self._start_controller_manager()
            self._start_scheduler()
            self._start_kwok()
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
            except Exception:  # noqa: BLE001 - keep tearing down the others
                logger.exception("failed to stop %s", process.name)
        if self._owns_work_dir and self.work_dir.exists():
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def check_alive(self) -> None:
        """Raise :class:`ControlPlaneError` if any component has exited."""
        for process in self._processes:
            process.check_alive()

    # ------------------------------------------------------------------ startup steps

    def _make_credentials(self) -> None:
        names = ("etcd", "etcd-peer", "apiserver", "controller-manager", "scheduler", "kwok")
        self._ports = dict(zip(names, free_ports(len(names)), strict=True))
        self._ca = CertificateAuthority(self.pki_dir)
        self._serving = self._ca.issue(
            "apiserver",
            common_name="kube-apiserver",
            server=True,
            dns_names=[
                "localhost",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ],
            ip_addresses=[HOST, str(next(ipaddress.ip_network(SERVICE_CLUSTER_IP_RANGE).hosts()))],
        )
        self._admin = self._ca.issue(
            "admin", common_name="adaptis-admin", organizations=["system:masters"], client=True
        )
        self._sa_private, self._sa_public = _write_service_account_keys(self.pki_dir)
        self._kubeconfig = self._cert_kubeconfig("admin.kubeconfig", self._admin, "adaptis-admin")
        cm = self._ca.issue(
            "controller-manager", common_name="system:kube-controller-manager", client=True
        )
        self._cm_kubeconfig = self._cert_kubeconfig(
            "controller-manager.kubeconfig", cm, "system:kube-controller-manager"
        )
        sched = self._ca.issue("scheduler", common_name="system:kube-scheduler", client=True)
        self._scheduler_kubeconfig = self._cert_kubeconfig(
            "scheduler.kubeconfig", sched, "system:kube-scheduler"
        )
        kwok = self._ca.issue(
            "kwok", common_name="kwok-controller", organizations=["system:masters"], client=True
        )
        self._kwok_kubeconfig = self._cert_kubeconfig("kwok.kubeconfig", kwok, "kwok-controller")

    def _cert_kubeconfig(self, filename: str, pair: KeyPair, user: str) -> Path:
        assert self._ca is not None
        return write_kubeconfig(
            self.work_dir / filename,
            server=f"https://{HOST}:{self._ports['apiserver']}",
            ca_pem=self._ca.pair.cert_pem,
            user=user,
            client=pair,
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

    def _wait_healthy(
        self, process: ManagedProcess, url: str, context: ssl.SSLContext | None = None
    ) -> None:
        started = time.monotonic()

        def healthy() -> bool:
            process.check_alive()
            try:
                with urllib.request.urlopen(url, timeout=5, context=context) as response:  # noqa: S310
                    return bool(response.status == 200)
            except (urllib.error.URLError, OSError, ssl.SSLError):
                return False

        try:
            wait_until(
                healthy, timeout=self.startup_timeout, interval=0.3, what=f"{process.name} health"
            )
        except ControlPlaneError as exc:
            if not process.running:
                raise
            raise ControlPlaneError(
                f"{process.name} did not become healthy at {url} in {self.startup_timeout:.0f}s; "
                f"last lines of {process.log_path}:\n{process.log_tail()}"
            ) from exc
        logger.info("%s healthy after %.1fs", process.name, time.monotonic() - started)

    def _admin_ssl_context(self) -> ssl.SSLContext:
        assert self._ca is not None and self._admin is not None
        context = ssl.create_default_context(cafile=str(self._ca.cert_path))
        context.load_cert_chain(str(self._admin.cert_path), str(self._admin.key_path))
        return context

    @staticmethod
    def _insecure_ssl_context() -> ssl.SSLContext:
        # controller-manager and scheduler serve /healthz with a throw-away self-signed cert.
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context

    def _start_etcd(self) -> None:
        client_url = f"http://{HOST}:{self._ports['etcd']}"
        peer_url = f"http://{HOST}:{self._ports['etcd-peer']}"
        process = self._launch(
            "etcd",
            [
                "--name=adaptis-test",
                f"--data-dir={self.work_dir / 'etcd'}",
                f"--listen-client-urls={client_url}",
                f"--advertise-client-urls={client_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=adaptis-test={peer_url}",
                "--initial-cluster-state=new",
                "--unsafe-no-fsync",
                "--log-level=warn",
                "--quota-backend-bytes=2147483648",
            ],
        )
        self._wait_healthy(process, f"{client_url}/health")

    def _start_apiserver(self) -> None:
        assert self._ca is not None
        process = self._launch(
            "kube-apiserver",
            [
                f"--etcd-servers=http://{HOST}:{self._ports['etcd']}",
                f"--bind-address={HOST}",
                f"--advertise-address={HOST}",
                # A loopback advertise address is refused by the lease endpoint reconciler, and
                # no in-cluster client needs the endpoints of the `kubernetes` Service here.
                "--endpoint-reconciler-type=none",
                f"--secure-port={self._ports['apiserver']}",
                f"--cert-dir={self.work_dir / 'apiserver-certs'}",
                f"--tls-cert-file={self._serving.cert_path}",
                f"--tls-private-key-file={self._serving.key_path}",
                f"--client-ca-file={self._ca.cert_path}",
                f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
                "--authorization-mode=RBAC",
                f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
                f"--service-account-key-file={self._sa_public}",
                f"--service-account-signing-key-file={self._sa_private}",
                "--allow-privileged=true",
                "--profiling=false",
                "--v=1",
            ],
        )
        self._wait_healthy(process, f"{self.server}/readyz", self._admin_ssl_context())

    def _start_controller_manager(self) -> None:
        assert self._ca is not None
        kubeconfig = str(self._cm_kubeconfig)
        process = self._launch(
            "kube-controller-manager",
            [
                f"--kubeconfig={kubeconfig}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                "--leader-elect=false",
                f"--bind-address={HOST}",
                f"--secure-port={self._ports['controller-manager']}",
                f"--cert-dir={self.work_dir / 'controller-manager-certs'}",
                f"--service-account-private-key-file={self._sa_private}",
                f"--root-ca-file={self._ca.cert_path}",
                f"--cluster-signing-cert-file={self._ca.cert_path}",
                f"--cluster-signing-key-file={self._ca.pair.key_path}",
                "--use-service-account-credentials=true",
                f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
                "--v=1",
            ],
        )
        self._wait_healthy(
            process,
            f"https://{HOST}:{self._ports['controller-manager']}/healthz",
            self._insecure_ssl_context(),
        )

    def _start_scheduler(self) -> None:
        config = self.work_dir / "kube-scheduler.yaml"
        config.write_text(
            json.dumps(
                {
                    "apiVersion": "kubescheduler.config.k8s.io/v1",
                    "kind": "KubeSchedulerConfiguration",
                    "clientConnection": {"kubeconfig": str(self._scheduler_kubeconfig)},
                    "leaderElection": {"leaderElect": False},
                },
                indent=2,
            )
        )
        kubeconfig = str(self._scheduler_kubeconfig)
        process = self._launch(
            "kube-scheduler",
            [
                f"--config={config}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                f"--bind-address={HOST}",
                f"--secure-port={self._ports['scheduler']}",
                f"--cert-dir={self.work_dir / 'scheduler-certs'}",
                "--v=1",
            ],
        )
        self._wait_healthy(
            process,
            f"https://{HOST}:{self._ports['scheduler']}/healthz",
            self._insecure_ssl_context(),
        )

    def _start_kwok(self) -> None:
        process = self._launch(
            "kwok",
            [
                f"--kubeconfig={self._kwok_kubeconfig}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake",
                f"--config={self.stages_file}",
                f"--server-address={HOST}:{self._ports['kwok']}",
                f"--cidr={POD_CIDR}",
                f"--node-ip={FAKE_NODE_IP}",
            ],
        )
        self._wait_healthy(process, f"http://{HOST}:{self._ports['kwok']}/healthz")

    def _wait_for_default_service_account(self, namespace: str) -> None:
        wait_until(
            lambda: (
                self.kubectl(
                    "get", "serviceaccount", "default", "-n", namespace, check=False
                ).returncode
                == 0
            ),
            timeout=self.startup_timeout,
            what=f"the default ServiceAccount in namespace {namespace}",
        )

    # ------------------------------------------------------------------ clients

    def kubectl(
        self,
        *args: str,
        input: str | None = None,  # noqa: A002 - mirrors subprocess.run
        check: bool = True,
        kubeconfig: Path | str | None = None,
        timeout: float = 120.0,
    ) -> subprocess.CompletedProcess[str]:
        """Run the built kubectl against this cluster (admin kubeconfig unless given).

        Raises :class:`KubectlError` (with stdout and stderr) on a non-zero exit if ``check``.
        """
        return self._run_tool(
            "kubectl", args, input=input, check=check, kubeconfig=kubeconfig, timeout=timeout
        )

    def helm(
        self,
        *args: str,
        input: str | None = None,  # noqa: A002 - mirrors subprocess.run
        check: bool = True,
        kubeconfig: Path | str | None = None,
        timeout: float = 300.0,
    ) -> subprocess.CompletedProcess[str]:
        """Run the built helm against this cluster with private HELM_* cache/config/data dirs."""
        return self._run_tool(
            "helm", args, input=input, check=check, kubeconfig=kubeconfig, timeout=timeout
        )

    def _run_tool(
        self,
        tool: str,
        args: Iterable[str],
        *,
        input: str | None,  # noqa: A002
        check: bool,
        kubeconfig: Path | str | None,
        timeout: float,
    ) -> subprocess.CompletedProcess[str]:
        command = [str(self.binary(tool)), *args]
        env = self.env(kubeconfig)
        if tool == "helm":
            helm_home = self.work_dir / "helm"
            for var, sub in (
                ("HELM_CACHE_HOME", "cache"),
                ("HELM_CONFIG_HOME", "config"),
                ("HELM_DATA_HOME", "data"),
            ):
                env[var] = str(helm_home / sub)
        logger.debug("running %s", " ".join(command))
        result = subprocess.run(  # noqa: S603 - our own binaries
            command,
            input=input,
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
            check=False,
        )
        if check and result.returncode != 0:
            raise KubectlError(result.returncode, command, result.stdout, result.stderr)
        return result

    def get_json(self, *args: str, kubeconfig: Path | str | None = None) -> Any:
        """``kubectl get <args> -o json``, parsed."""
        result = self.kubectl("get", *args, "-o", "json", kubeconfig=kubeconfig)
        return json.loads(result.stdout)

    def apply(
        self,
        manifest: str | Mapping[str, Any] | Sequence[Mapping[str, Any]],
        *,
        namespace: str | None = None,
        kubeconfig: Path | str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """``kubectl apply`` a YAML/JSON string, one object, or a list of objects."""
        if isinstance(manifest, str):
            text = manifest
        elif isinstance(manifest, Mapping):
            text = json.dumps(manifest)
        else:
            text = json.dumps({"apiVersion": "v1", "kind": "List", "items": list(manifest)})
        args = ["apply", "-f", "-"] + (["-n", namespace] if namespace else [])
        return self.kubectl(*args, input=text, kubeconfig=kubeconfig)

    def create_namespace(self, name: str, *, wait_for_default_service_account: bool = True) -> str:
        """Create a namespace and (by default) wait until its ``default`` ServiceAccount exists.

        Pods cannot be created in a namespace before that ServiceAccount exists.
        """
        self.kubectl("create", "namespace", name)
        if wait_for_default_service_account:
            self._wait_for_default_service_account(name)
        return name

    def wait_for_jsonpath(
        self,
        resource: str,
        jsonpath: str,
        value: str,
        *,
        namespace: str | None = None,
        timeout: float = 60.0,
    ) -> None:
        """Wait until ``{jsonpath}`` of ``resource`` (e.g. ``pod/x``) equals ``value``."""
        args = [
            "wait",
            resource,
            f"--for=jsonpath={{{jsonpath}}}={value}",
            f"--timeout={int(timeout)}s",
        ]
        if namespace:
            args += ["-n", namespace]
        self.kubectl(*args, timeout=timeout + 30)

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
        assert self._ca is not None
        self._kubeconfig_count += 1
        target = (
            Path(path)
            if path
            else (
                self.work_dir
                / "kubeconfigs"
                / f"{self._kubeconfig_count:03d}-{_safe(user)}.kubeconfig"
            )
        )
        client = None
        if token is None:
            client = self._ca.issue(
                f"user-{self._kubeconfig_count:03d}-{_safe(user)}",
                common_name=user,
                organizations=groups,
                client=True,
            )
        return write_kubeconfig(
            target,
            server=self.server,
            ca_pem=self._ca.pair.cert_pem,
            user=user,
            client=client,
            token=token,
            namespace=namespace,
        )

    def service_account_token(
        self, namespace: str, name: str, *, duration_seconds: int = 7200
    ) -> str:
        """A bound token for ServiceAccount ``namespace/name`` (``kubectl create token``)."""
        result = self.kubectl(
            "create", "token", name, "-n", namespace, f"--duration={duration_seconds}s"
        )
        return result.stdout.strip()

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

    # ------------------------------------------------------------------ fake nodes

    def add_fake_gpu_node(
        self,
        name: str,
        product: str = "NVIDIA-H100-80GB-HBM3",
        gpu_count: int = 8,
        gpu_memory_mib: int = 81559,
        zone: str = "zone-a",
        rack: str = "rack-0",
        *,
        family: str | None = None,
        region: str | None = None,
        cpu: str = "96",
        memory: str = "1Ti",
        pods: int = 110,
        ephemeral_storage: str = "2Ti",
        labels: Mapping[str, str] | None = None,
        annotations: Mapping[str, str] | None = None,
        taints: Sequence[Mapping[str, str]] = (),
        wait_ready: bool = True,
        timeout: float = 60.0,
    ) -> dict[str, Any]:
        """Create a kwok-managed Node that looks like a GPU node and return it (as JSON).

        The node carries ``nvidia.com/gpu`` capacity, the NVIDIA GPU Feature Discovery labels
        (``nvidia.com/gpu.product``, ``.count``, ``.memory`` in MiB, ``.family``) and the
        topology labels ``kubernetes.io/hostname``, ``topology.kubernetes.io/zone`` (and
        ``region``) and ``topology.adaptis.io/rack``.  With ``wait_ready`` it returns once kwok
        has made it Ready and no not-ready taint is left.
        """
        node_labels = {
            "kubernetes.io/hostname": name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            "type": "kwok",
            "topology.kubernetes.io/zone": zone,
            RACK_LABEL: rack,
            "nvidia.com/gpu.present": "true",
            "nvidia.com/gpu.product": product,
            "nvidia.com/gpu.count": str(gpu_count),
            "nvidia.com/gpu.memory": str(gpu_memory_mib),
            "nvidia.com/gpu.family": family or gpu_family(product),
        }
        if region:
            node_labels["topology.kubernetes.io/region"] = region
        node_labels.update(labels or {})
        node_annotations = {KWOK_NODE_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"}
        node_annotations.update(annotations or {})
        resources = {
            "cpu": cpu,
            "memory": memory,
            "pods": str(pods),
            "ephemeral-storage": ephemeral_storage,
            "nvidia.com/gpu": str(gpu_count),
        }
        node: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "labels": node_labels, "annotations": node_annotations},
            "spec": {"taints": [dict(t) for t in taints]} if taints else {},
            "status": {"capacity": resources, "allocatable": dict(resources)},
        }
        self.kubectl("create", "-f", "-", input=json.dumps(node))
        if wait_ready:
            self.wait_node_ready(name, timeout=timeout)
        return dict(self.get_json("node", name))

    def wait_node_ready(self, name: str, *, timeout: float = 60.0) -> None:
        """Wait until node ``name`` is Ready and carries no not-ready/unreachable taint."""

        def ready() -> bool:
            node = self.get_json("node", name)
            conditions = node.get("status", {}).get("conditions", [])
            is_ready = any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
            blocking = [
                t
                for t in node.get("spec", {}).get("taints", [])
                if t["key"] in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
            ]
            return is_ready and not blocking

        wait_until(ready, timeout=timeout, what=f"node {name} to be Ready")

    def delete_node(self, name: str) -> None:
        """Delete a node (its pods are then garbage-collected by the controller-manager)."""
        self.kubectl("delete", "node", name, "--wait=true")


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)[:60]
