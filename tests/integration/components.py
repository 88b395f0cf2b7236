"""Command lines of the integration-test control plane's components, in start order.

This module sits under ``controlplane.py``: for each binary that
``hack/build-control-plane.sh`` builds it says how to run it on loopback (arguments, private
directories, credentials from ``kubeconfig.py``) and which URL answers 200 once it is healthy.
:data:`STARTUP_ORDER` lists the builders in dependency order; ``controlplane.py`` launches each
command with ``processes.py`` and waits for its health URL before starting the next.

* etcd (``--unsafe-no-fsync``, data in the work directory),
* kube-apiserver (secure port only, RBAC, client-certificate authentication against the test
  CA, service-account issuer and signing keys),
* kube-controller-manager (garbage collector, namespace, service-account and token
  controllers, node lifecycle, ...),
* kube-scheduler (binds pods, so node affinities are really obeyed),
* kwok, which plays the kubelet for fake nodes (see ``fakenodes.py`` and ``kwok-stages.yaml``).
"""

from __future__ import annotations

import ipaddress
import json
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from certs import client_ssl_context
from fakenodes import KWOK_NODE_ANNOTATION
from kubeconfig import ClusterCredentials
from processes import HOST, insecure_ssl_context

#: Documentation blocks only (RFC 5737), never a private range: the real node's pods take
#: 198.51.100.0/25 (hack/realnode/node.sh) and Services the upper half.  203.0.113.0/24 is
#: left alone: this machine's package proxy lives there.
SERVICE_CLUSTER_IP_RANGE = "198.51.100.128/25"
POD_CIDR = "10.244.0.0/16"
FAKE_NODE_IP = "10.255.0.1"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"

#: Binaries the control plane runs, in start order.
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
#: Loopback ports the control plane listens on, by name.
PORT_NAMES = ("etcd", "etcd-peer", "apiserver", "controller-manager", "scheduler", "kwok")


def apiserver_ip_addresses(host: str = HOST) -> list[str]:
    """IP addresses the apiserver serving certificate must name: its own, loopback, the Service IP."""
    service_ip = str(next(ipaddress.ip_network(SERVICE_CLUSTER_IP_RANGE).hosts()))
    return list(dict.fromkeys([host, HOST, service_ip]))


@dataclass(frozen=True)
class ClusterLayout:
    """Where one cluster's components find their ports, files and credentials."""

    work_dir: Path
    ports: Mapping[str, int]
    credentials: ClusterCredentials
    stages_file: Path
    #: Where the apiserver listens: loopback, or the real node's IP (pods reach it there).
    apiserver_host: str = HOST
    #: A real kubelet joins: Node authorizer, the apiserver's kubelet client certificate, and
    #: the ``kubernetes`` Service's endpoints kept by the apiserver.
    real_node: bool = False

    @property
    def server(self) -> str:
        """URL of the kube-apiserver."""
        return f"https://{self.apiserver_host}:{self.ports['apiserver']}"


@dataclass(frozen=True)
class ComponentCommand:
    """How to run one component (arguments after the binary) and how to see it is healthy."""

    name: str
    args: tuple[str, ...]
    health_url: str
    health_ssl_context: ssl.SSLContext | None = None


def etcd(layout: ClusterLayout) -> ComponentCommand:
    """etcd on loopback, without fsync (the data is thrown away after the tests)."""
    client_url = f"http://{HOST}:{layout.ports['etcd']}"
    peer_url = f"http://{HOST}:{layout.ports['etcd-peer']}"
    args = (
        "--name=adaptis-test",
        f"--data-dir={layout.work_dir / 'etcd'}",
        f"--listen-client-urls={client_url}",
        f"--advertise-client-urls={client_url}",
        f"--listen-peer-urls={peer_url}",
        f"--initial-advertise-peer-urls={peer_url}",
        f"--initial-cluster=adaptis-test={peer_url}",
        "--initial-cluster-state=new",
        "--unsafe-no-fsync",
        "--log-level=warn",
        "--quota-backend-bytes=2147483648",
    )
    return ComponentCommand("etcd", args, f"{client_url}/health")


def apiserver(layout: ClusterLayout) -> ComponentCommand:
    """kube-apiserver with RBAC and client-certificate and ServiceAccount-token authentication."""
    creds = layout.credentials
    if layout.real_node:
        # Pods reach the API through the `kubernetes` Service, whose endpoint the lease
        # reconciler keeps at the node IP; logs, exec and port-forward go to the kubelet.
        node_args: tuple[str, ...] = (
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction",
            f"--kubelet-client-certificate={creds.kubelet_client.cert_path}",
            f"--kubelet-client-key={creds.kubelet_client.key_path}",
            "--kubelet-preferred-address-types=InternalIP",
        )
    else:
        # A loopback advertise address is refused by the lease endpoint reconciler, and
        # no in-cluster client needs the endpoints of the `kubernetes` Service here.
        node_args = ("--authorization-mode=RBAC", "--endpoint-reconciler-type=none")
    args = (
        f"--etcd-servers=http://{HOST}:{layout.ports['etcd']}",
        f"--bind-address={layout.apiserver_host}",
        f"--advertise-address={layout.apiserver_host}",
        *node_args,
        f"--secure-port={layout.ports['apiserver']}",
        f"--cert-dir={layout.work_dir / 'apiserver-certs'}",
        f"--tls-cert-file={creds.serving.cert_path}",
        f"--tls-private-key-file={creds.serving.key_path}",
        f"--client-ca-file={creds.ca.cert_path}",
        f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
        f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
        f"--service-account-key-file={creds.sa_public_key}",
        f"--service-account-signing-key-file={creds.sa_private_key}",
        "--allow-privileged=true",
        "--profiling=false",
        "--v=1",
    )
    # /readyz needs an authenticated client; the admin certificate is one.
    context = client_ssl_context(ca_cert=creds.ca.cert_path, client=creds.admin)
    return ComponentCommand("kube-apiserver", args, f"{layout.server}/readyz", context)


def controller_manager(layout: ClusterLayout) -> ComponentCommand:
    """kube-controller-manager with per-controller ServiceAccount credentials."""
    creds = layout.credentials
    kubeconfig = str(creds.controller_manager_kubeconfig)
    args = (
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--leader-elect=false",
        f"--bind-address={HOST}",
        f"--secure-port={layout.ports['controller-manager']}",
        f"--cert-dir={layout.work_dir / 'controller-manager-certs'}",
        f"--service-account-private-key-file={creds.sa_private_key}",
        f"--root-ca-file={creds.ca.cert_path}",
        f"--cluster-signing-cert-file={creds.ca.cert_path}",
        f"--cluster-signing-key-file={creds.ca.pair.key_path}",
        "--use-service-account-credentials=true",
        f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
        "--v=1",
    )
    url = f"https://{HOST}:{layout.ports['controller-manager']}/healthz"
    return ComponentCommand("kube-controller-manager", args, url, insecure_ssl_context())


def scheduler(layout: ClusterLayout) -> ComponentCommand:
    """kube-scheduler; writes its KubeSchedulerConfiguration into the work directory."""
    kubeconfig = str(layout.credentials.scheduler_kubeconfig)
    config = layout.work_dir / "kube-scheduler.yaml"
    config.write_text(
        json.dumps(
            {
                "apiVersion": "kubescheduler.config.k8s.io/v1",
                "kind": "KubeSchedulerConfiguration",
                "clientConnection": {"kubeconfig": kubeconfig},
                "leaderElection": {"leaderElect": False},
            },
            indent=2,
        )
    )
    args = (
        f"--config={config}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        f"--bind-address={HOST}",
        f"--secure-port={layout.ports['scheduler']}",
        f"--cert-dir={layout.work_dir / 'scheduler-certs'}",
        "--v=1",
    )
    url = f"https://{HOST}:{layout.ports['scheduler']}/healthz"
    return ComponentCommand("kube-scheduler", args, url, insecure_ssl_context())


def kwok(layout: ClusterLayout) -> ComponentCommand:
    """kwok, managing only the nodes annotated as fake, with the AdaPtis pod Stages."""
    args = (
        f"--kubeconfig={layout.credentials.kwok_kubeconfig}",
        "--manage-all-nodes=false",
        f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake",
        f"--config={layout.stages_file}",
        f"--server-address={HOST}:{layout.ports['kwok']}",
        f"--cidr={POD_CIDR}",
        f"--node-ip={FAKE_NODE_IP}",
    )
    return ComponentCommand("kwok", args, f"http://{HOST}:{layout.ports['kwok']}/healthz")


#: Builders of the component commands, in the order the components must start.
STARTUP_ORDER: tuple[Callable[[ClusterLayout], ComponentCommand], ...] = (
    etcd,
    apiserver,
    controller_manager,
    scheduler,
    kwok,
)
