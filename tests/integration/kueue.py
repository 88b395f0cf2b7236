"""The real Kueue manager against the session control plane, on loopback.

This module sits beside ``operator_process.py``, above ``controlplane.py``: the Kueue tests
(``test_kueue_admission.py``) start a :class:`KueueManager` on the session's control plane.
``hack/build-control-plane.sh`` builds the ``kueue`` binary from the Go module
``sigs.k8s.io/kueue`` and copies that same module's ``config/components/crd/bases/*.yaml`` and
``config/components/webhook/manifests.yaml`` into ``<bin dir>/kueue-config/{crd,webhook}/``.

What :meth:`KueueManager.start` does, in order:

1. installs Kueue's CRDs (server-side apply: they are too large for the last-applied
   annotation); the CRDs that Kueue's own kustomization converts by webhook get
   ``conversion.strategy: Webhook`` pointing at this manager, as a real install has;
2. issues a serving certificate for 127.0.0.1 from a CA of its own (``certs.py``) and writes
   Kueue's ``Configuration``: only the ``pod`` integration, pods managed only in the given
   namespaces (``managedJobsNamespaceSelector``), internal certificate management off, webhook,
   health and (off) metrics on loopback, no leader election, the on-demand visibility API off
   (an aggregated API server that needs an APIService and is no part of admission);
3. runs ``kueue --config ...`` with the admin kubeconfig, logs in ``<work dir>/kueue.log``;
4. waits (deadlines, no fixed sleeps) until the CRDs are Established, ``/readyz`` answers and
   the webhook answers TLS with the certificate we issued;
5. registers Kueue's Mutating/ValidatingWebhookConfigurations, from the module's manifests:
   only the webhooks of pods and of Kueue's own kinds, each calling
   ``https://127.0.0.1:<port><path>`` with our CA, the pod webhooks limited to the managed
   namespaces (the control plane is shared with other tests, which must never meet a Kueue
   webhook);
6. waits until a server-side dry-run pod with a queue name comes back gated by
   ``kueue.x-k8s.io/admission``: the whole path API server -> webhook -> Kueue works.

:meth:`KueueManager.stop` removes the webhook configurations first (so no later pod create
can fail on a stopped webhook), then stops the process.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import socket
import ssl
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from certs import CertificateAuthority
from processes import HOST, ControlPlaneError, ManagedProcess, free_ports, wait_until

logger = logging.getLogger(__name__)

#: The scheduling gate Kueue's pod webhook puts on every pod it manages.
ADMISSION_GATE = "kueue.x-k8s.io/admission"
KUEUE_GROUP = "kueue.x-k8s.io"
#: CRDs whose versions Kueue converts by webhook (its config/components/crd/kustomization.yaml).
CONVERTED_CRDS = ("localqueues", "clusterqueues", "cohorts", "workloads", "multikueueclusters")
#: Kueue v0.17 reads its metrics serving certificate from this fixed path whenever internal
#: certificate management is off, even with metrics disabled (cmd/kueue/main.go), and exits
#: if it is missing. In a cluster it is a Secret mounted there; here we write one (root only).
METRICS_CERT_DIR = Path("/etc/kueue/metrics/certs")
#: Names of the webhook configurations this fixture registers (Kueue's own names are generic).
MUTATING_NAME = "kueue-test-mutating"
VALIDATING_NAME = "kueue-test-validating"


def _webhook_targets(webhook: Mapping[str, Any]) -> tuple[bool, bool]:
    """(is a pod webhook, is a webhook of Kueue's own kinds)."""
    rules = webhook.get("rules") or []
    pods = any("pods" in (r.get("resources") or []) for r in rules)
    own = any(KUEUE_GROUP in (r.get("apiGroups") or []) for r in rules)
    return pods, own


def webhook_configurations(
    manifests: Sequence[Mapping[str, Any]],
    *,
    url: str,
    ca_bundle: bytes,
    namespaces: Sequence[str],
) -> list[dict[str, Any]]:
    """Kueue's webhook configurations, re-pointed at ``url`` and cut down to what we run.

    Webhooks of other integrations (batch Jobs, Deployments, ...) are dropped: we enable only
    the ``pod`` integration, and a webhook for them would make other tests' objects go through
    a Kueue they never asked for.
    """

    out: list[dict[str, Any]] = []
    for doc in manifests:
        kind = doc.get("kind")
        if kind not in {"MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"}:
            continue
        kept: list[dict[str, Any]] = []
        for webhook in doc.get("webhooks") or []:
            pods, own = _webhook_targets(webhook)
            if not (pods or own):
                continue
            hook = json.loads(json.dumps(webhook))
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": f"{url}{path}",
                                    "caBundle": base64.b64encode(ca_bundle).decode()}
            if pods:
                hook["namespaceSelector"] = {"matchExpressions": [{
                    "key": "kubernetes.io/metadata.name", "operator": "In",
                    "values": list(namespaces)}]}
            kept.append(hook)
        name = MUTATING_NAME if kind.startswith("Mutating") else VALIDATING_NAME
        out.append({"apiVersion": "admissionregistration.k8s.io/v1", "kind": kind,
                    "metadata": {"name": name}, "webhooks": kept})
    return out


def kueue_configuration(
    *, namespaces: Sequence[str], webhook_port: int, health_port: int, cert_dir: Path
) -> dict[str, Any]:
    """Kueue's ``Configuration`` (config.kueue.x-k8s.io/v1beta2) for the tests."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": "kueue-system",
        "health": {"healthProbeBindAddress": f"{HOST}:{health_port}"},
        "metrics": {"bindAddress": "0"},  # off: nothing scrapes it here
        "webhook": {"host": HOST, "port": webhook_port, "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "manageJobsWithoutQueueName": False,
        "managedJobsNamespaceSelector": {"matchExpressions": [{
            "key": "kubernetes.io/metadata.name", "operator": "In",
            "values": list(namespaces)}]},
        "integrations": {"frameworks": ["pod"]},
        "featureGates": {"VisibilityOnDemand": False},
    }


class KueueManager:
    """The Kueue manager process, its CRDs and its webhooks on the control plane ``cp``.

    Args:
        cp: a started :class:`controlplane.ControlPlane`.
        work_dir: certificates, the configuration and ``kueue.log`` go here.
        namespaces: the only namespaces whose pods Kueue manages.
        timeout: seconds each wait of :meth:`start` may take.
    """

    def __init__(self, cp: Any, work_dir: Path, *, namespaces: Sequence[str],
                 timeout: float = 120.0) -> None:
        self.cp = cp
        self.work_dir = work_dir
        self.namespaces = tuple(namespaces)
        self.timeout = timeout
        self.config_dir = Path(cp.bin_dir) / "kueue-config"
        self.process: ManagedProcess | None = None
        self.webhook_port = 0
        self.health_port = 0
        self._ca: CertificateAuthority | None = None

    @property
    def log_path(self) -> Path:
        return self.work_dir / "kueue.log"

    def log_tail(self, lines: int = 60) -> str:
        return self.process.log_tail(lines) if self.process else ""

    # ------------------------------------------------------------------ start / stop

    def start(self) -> None:
        binary = self.cp.binary("kueue")
        crd_files = sorted((self.config_dir / "crd").glob("*.yaml"))
        webhook_file = self.config_dir / "webhook" / "manifests.yaml"
        if not crd_files or not webhook_file.is_file():
            raise ControlPlaneError(f"{self.config_dir} lacks crd/*.yaml or webhook/manifests.yaml;"
                                    " run hack/build-control-plane.sh")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.webhook_port, self.health_port = free_ports(2)
        self._ca = CertificateAuthority(self.work_dir / "pki", common_name="kueue-webhook-ca")
        cert_dir = self.work_dir / "webhook-certs"
        cert_dir.mkdir(exist_ok=True)
        pair = self._ca.issue("webhook", common_name="kueue-webhook", server=True,
                              dns_names=["localhost"], ip_addresses=[HOST])
        # controller-runtime's webhook server reads tls.crt and tls.key from certDir.
        (cert_dir / "tls.crt").write_bytes(pair.cert_pem)
        (cert_dir / "tls.key").write_bytes(pair.key_pem)
        (cert_dir / "tls.key").chmod(0o600)

        self._ensure_metrics_cert()
        self._install_crds(crd_files)
        if self.cp.kubectl("get", "namespace", "kueue-system", check=False).returncode != 0:
            self.cp.kubectl("create", "namespace", "kueue-system")
        config = self.work_dir / "kueue-config.yaml"
        config.write_text(yaml.safe_dump(kueue_configuration(
            namespaces=self.namespaces, webhook_port=self.webhook_port,
            health_port=self.health_port, cert_dir=cert_dir)))
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBECONFIG")}
        env["KUBECONFIG"] = str(self.cp.kubeconfig)
        self.process = ManagedProcess("kueue", [str(binary), f"--config={config}",
                                                "--zap-log-level=2"], self.log_path)
        self.process.start(env)
        try:
            self._wait_ready()
            self.cp.apply(webhook_configurations(
                list(yaml.safe_load_all(webhook_file.read_text())),
                url=f"https://{HOST}:{self.webhook_port}", ca_bundle=self._ca.pair.cert_pem,
                namespaces=self.namespaces))
            self._wait_pods_gated()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for kind, name in (("mutatingwebhookconfiguration", MUTATING_NAME),
                           ("validatingwebhookconfiguration", VALIDATING_NAME)):
            try:
                self.cp.kubectl("delete", kind, name, "--ignore-not-found")
            except Exception:  # keep tearing down
                logger.exception("cannot delete %s %s", kind, name)
        if self.process is not None:
            self.process.stop()

    # ------------------------------------------------------------------ steps

    def _ensure_metrics_cert(self) -> None:
        """Make sure a valid pair is at :data:`METRICS_CERT_DIR` (any pair: metrics are off)."""
        crt, key = METRICS_CERT_DIR / "tls.crt", METRICS_CERT_DIR / "tls.key"
        if crt.is_file() and key.is_file():
            return  # another session (or an admin) put one there; it only has to parse
        assert self._ca is not None
        pair = self._ca.issue("metrics", common_name="kueue-metrics", server=True,
                              ip_addresses=[HOST])
        try:
            METRICS_CERT_DIR.mkdir(parents=True, exist_ok=True)
            # Atomic renames: a concurrent test session never reads half a file.
            for target, data in ((key, pair.key_pem), (crt, pair.cert_pem)):
                tmp = target.with_name(f".{target.name}.{os.getpid()}")
                tmp.write_bytes(data)
                tmp.chmod(0o600)
                os.replace(tmp, target)
        except OSError as err:
            raise ControlPlaneError(
                f"Kueue needs a certificate in {METRICS_CERT_DIR} and we cannot write it "
                f"({err}); run the tests as root, or put any tls.crt/tls.key pair there"
            ) from err

    def _install_crds(self, files: Sequence[Path]) -> None:
        assert self._ca is not None

        ca = base64.b64encode(self._ca.pair.cert_pem).decode()
        docs: list[dict[str, Any]] = []
        for path in files:
            crd = yaml.safe_load(path.read_text())
            if crd["spec"]["names"]["plural"] in CONVERTED_CRDS:
                crd["spec"]["conversion"] = {"strategy": "Webhook", "webhook": {
                    "clientConfig": {"url": f"https://{HOST}:{self.webhook_port}/convert",
                                     "caBundle": ca},
                    "conversionReviewVersions": ["v1"]}}
            docs.append(crd)
        self.cp.kubectl("apply", "--server-side", "--force-conflicts",
                        "--field-manager=kueue-test", "-f", "-",
                        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
        names = [f"crd/{d['metadata']['name']}" for d in docs]
        self.cp.kubectl("wait", "--for=condition=Established", *names,
                        f"--timeout={int(self.timeout)}s", timeout=self.timeout + 30)

    def _wait_ready(self) -> None:
        assert self.process is not None and self._ca is not None
        process = self.process
        health = f"http://{HOST}:{self.health_port}/readyz"

        def ready() -> bool:
            process.check_alive()
            try:
                with urllib.request.urlopen(health, timeout=5) as resp:  # loopback
                    return bool(resp.status == 200)
            except (urllib.error.URLError, OSError):
                return False

        context = ssl.create_default_context(cafile=str(self._ca.cert_path))

        def webhook_answers() -> bool:
            process.check_alive()
            with socket.create_connection((HOST, self.webhook_port), timeout=5) as raw, \
                    context.wrap_socket(raw, server_hostname=HOST):
                return True  # the handshake verified our certificate

        self._wait(ready, what="Kueue's /readyz")
        self._wait(webhook_answers, what=f"Kueue's webhook TLS on {HOST}:{self.webhook_port}")

    def _wait(self, predicate: Any, *, what: str) -> None:
        """:func:`wait_until` with the deadline of this manager; the log tail on a timeout."""
        try:
            wait_until(predicate, timeout=self.timeout, what=what)
        except ControlPlaneError as err:
            if self.process is not None and not self.process.running:
                raise  # check_alive's message already carries the log tail
            raise ControlPlaneError(f"{err}\nlast lines of {self.log_path}:\n"
                                    f"{self.log_tail()}") from None

    def _wait_pods_gated(self) -> None:
        """A dry-run pod with a queue name comes back with Kueue's scheduling gate."""
        namespace = self.namespaces[0]
        probe = {"apiVersion": "v1", "kind": "Pod",
                 "metadata": {"name": "kueue-probe", "namespace": namespace,
                              "labels": {"kueue.x-k8s.io/queue-name": "probe"}},
                 "spec": {"containers": [{"name": "c", "image": "probe"}]}}

        def gated() -> bool:
            self.process.check_alive()  # type: ignore[union-attr]
            out = self.cp.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-",
                                  input=json.dumps(probe), check=False)
            if out.returncode != 0:
                return False
            gates = json.loads(out.stdout)["spec"].get("schedulingGates") or []
            return any(g.get("name") == ADMISSION_GATE for g in gates)

        self._wait(gated, what=f"Kueue's webhook to gate a dry-run pod in {namespace}")
