"""Kubeconfigs of the integration-test control plane: components, admin, users, ServiceAccounts.

This module sits under ``controlplane.py`` and over ``certs.py``: :func:`write_kubeconfig`
writes one self-contained kubeconfig (JSON, certificates inlined);
:func:`make_cluster_credentials` makes the CA, the apiserver serving certificate, the
ServiceAccount signing keys and the kubeconfigs of the admin and of each component at start-up;
:class:`UserKubeconfigs` writes numbered kubeconfigs for test users (a client certificate issued
by the cluster CA) or for bearer tokens such as ServiceAccount tokens.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from certs import CertificateAuthority, KeyPair, write_private, write_service_account_keys

#: The admin user; its group ``system:masters`` bypasses RBAC.
ADMIN_USER = "adaptis-admin"
_CLUSTER_NAME = "adaptis-test"
# Names the apiserver is reached by, in-cluster and from the tests.
_APISERVER_DNS_NAMES = (
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def safe_name(text: str) -> str:
    """``text`` reduced to characters that are safe in a file name (at most 60)."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)[:60]


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
    context: dict[str, str] = {"cluster": _CLUSTER_NAME, "user": user}
    if namespace:
        context["namespace"] = namespace
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": _CLUSTER_NAME,
                "cluster": {"server": server, "certificate-authority-data": _b64(ca_pem)},
            }
        ],
        "users": [{"name": user, "user": credentials}],
        "contexts": [{"name": _CLUSTER_NAME, "context": context}],
        "current-context": _CLUSTER_NAME,
        "preferences": {},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_private(path, json.dumps(config, indent=2).encode())
    return path


@dataclass(frozen=True)
class ClusterCredentials:
    """Everything the components authenticate with, made once when the cluster starts."""

    ca: CertificateAuthority
    #: The kube-apiserver serving certificate.
    serving: KeyPair
    #: The admin client certificate (group ``system:masters``).
    admin: KeyPair
    sa_private_key: Path
    sa_public_key: Path
    admin_kubeconfig: Path
    controller_manager_kubeconfig: Path
    scheduler_kubeconfig: Path
    kwok_kubeconfig: Path
    #: The apiserver's client certificate towards kubelets (logs, exec, port-forward).
    kubelet_client: KeyPair


def make_cluster_credentials(
    *, pki_dir: Path, work_dir: Path, server: str, apiserver_ips: Sequence[str]
) -> ClusterCredentials:
    """Make the CA, certificates, ServiceAccount keys and component kubeconfigs.

    Certificates and keys go to ``pki_dir``, kubeconfigs to ``work_dir``; ``apiserver_ips``
    are the IP subject alternative names of the serving certificate.
    """
    ca = CertificateAuthority(pki_dir)
    ca_pem = ca.pair.cert_pem

    def cert_kubeconfig(filename: str, pair: KeyPair, user: str) -> Path:
        return write_kubeconfig(
            work_dir / filename, server=server, ca_pem=ca_pem, user=user, client=pair
        )

    serving = ca.issue(
        "apiserver",
        common_name="kube-apiserver",
        server=True,
        dns_names=_APISERVER_DNS_NAMES,
        ip_addresses=apiserver_ips,
    )
    admin = ca.issue("admin", common_name=ADMIN_USER, organizations=["system:masters"], client=True)
    sa_private, sa_public = write_service_account_keys(pki_dir)
    admin_kubeconfig = cert_kubeconfig("admin.kubeconfig", admin, ADMIN_USER)
    # The built-in RBAC roles of the controller-manager and scheduler are bound to these users.
    cm = ca.issue("controller-manager", common_name="system:kube-controller-manager", client=True)
    cm_kubeconfig = cert_kubeconfig(
        "controller-manager.kubeconfig", cm, "system:kube-controller-manager"
    )
    sched = ca.issue("scheduler", common_name="system:kube-scheduler", client=True)
    sched_kubeconfig = cert_kubeconfig("scheduler.kubeconfig", sched, "system:kube-scheduler")
    kwok = ca.issue(
        "kwok", common_name="kwok-controller", organizations=["system:masters"], client=True
    )
    kwok_kubeconfig = cert_kubeconfig("kwok.kubeconfig", kwok, "kwok-controller")
    kubelet_client = ca.issue(
        "apiserver-kubelet-client",
        common_name="kube-apiserver-kubelet-client",
        organizations=["system:masters"],
        client=True,
    )
    return ClusterCredentials(
        ca=ca,
        serving=serving,
        admin=admin,
        sa_private_key=sa_private,
        sa_public_key=sa_public,
        admin_kubeconfig=admin_kubeconfig,
        controller_manager_kubeconfig=cm_kubeconfig,
        scheduler_kubeconfig=sched_kubeconfig,
        kwok_kubeconfig=kwok_kubeconfig,
        kubelet_client=kubelet_client,
    )


class UserKubeconfigs:
    """Writes numbered kubeconfigs for test users into ``<directory>/NNN-<user>.kubeconfig``.

    The number keeps two kubeconfigs of one user (say with different groups) apart.
    """

    def __init__(self, *, ca: CertificateAuthority, server: str, directory: Path) -> None:
        self._ca = ca
        self._server = server
        self._directory = directory
        self._count = 0

    def write(
        self,
        user: str,
        *,
        groups: Sequence[str] = (),
        token: str | None = None,
        namespace: str | None = None,
        path: Path | str | None = None,
    ) -> Path:
        """Write a kubeconfig for ``user`` and return its path.

        With ``token`` the kubeconfig carries that bearer token; otherwise a client certificate
        with CN ``user`` and organizations ``groups`` is issued by the cluster CA.
        """
        self._count += 1
        stem = f"{self._count:03d}-{safe_name(user)}"
        target = Path(path) if path else self._directory / f"{stem}.kubeconfig"
        client = None
        if token is None:
            client = self._ca.issue(
                f"user-{stem}", common_name=user, organizations=groups, client=True
            )
        return write_kubeconfig(
            target,
            server=self._server,
            ca_pem=self._ca.pair.cert_pem,
            user=user,
            client=client,
            token=token,
            namespace=namespace,
        )
