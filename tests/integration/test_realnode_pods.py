"""Pods in real containers on the real node: logs, exec, exit codes, signals, DNS, restricted.

Every test here would fail on kwok's fake nodes (no container ever runs there): the output,
the exit code and the DNS answers come from processes in containers that runc started on the
kubelet of ``realnode.py``.  The pods run the base image (Debian's Python 3.11, the
Dockerfile's PYTHON_IMAGE here) with small Python programs.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from typing import Any

import pytest
import yaml
from processes import ControlPlaneError, wait_until
from realnode import BASE_IMAGE, CLUSTER_DNS_IP, REPO_ROOT, RealCluster

from adaptis.api.job import JobSpec
from adaptis.operator.resources.manifests import SHM_MOUNT, SHM_VOLUME, shm_volume

# The first test's setup installs the packages and builds the base image when missing.
pytestmark = [pytest.mark.realnode, pytest.mark.slow, pytest.mark.timeout(1800)]

RESTRICTED_SECURITY = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "readOnlyRootFilesystem": True,
}
POD_SECURITY = {
    "runAsNonRoot": True,
    "runAsUser": 10001,
    "runAsGroup": 10001,
    "seccompProfile": {"type": "RuntimeDefault"},
}


def _pod(name: str, script: str, **spec: Any) -> dict[str, Any]:
    """A pod of the base image running ``python3 -c script``, restricted-compliant."""
    container: dict[str, Any] = {
        "name": "main",
        "image": BASE_IMAGE,
        "imagePullPolicy": "Never",
        "command": ["python3", "-u", "-c", script],
        "securityContext": RESTRICTED_SECURITY,
        **spec.pop("container", {}),
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": spec.pop("labels", {"app": name})},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 30,
            "automountServiceAccountToken": False,
            "securityContext": POD_SECURITY,
            "containers": [container],
            **spec,
        },
    }


@pytest.fixture
def namespace(real_cluster: RealCluster) -> Any:
    name = real_cluster.plane.create_namespace(f"rn-{uuid.uuid4().hex[:6]}")
    yield name
    real_cluster.plane.kubectl("delete", "namespace", name, "--wait=false", check=False)


def _pod_status(cluster: RealCluster, ns: str, name: str) -> dict[str, Any]:
    return dict(cluster.plane.get_json("pod", name, "-n", ns)["status"])


def _wait_phase(cluster: RealCluster, ns: str, name: str, phases: set[str], timeout: float = 120) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        status = _pod_status(cluster, ns, name)
        return status if status.get("phase") in phases else None

    try:
        return wait_until(done, timeout=timeout, interval=0.5, what=f"pod {ns}/{name} in {phases}")
    except ControlPlaneError:
        describe = cluster.plane.kubectl("describe", "pod", name, "-n", ns, check=False).stdout
        pytest.fail(f"pod {ns}/{name} never reached {phases}:\n{describe[-3000:]}", pytrace=False)


def _terminated(status: dict[str, Any]) -> dict[str, Any]:
    return dict(status["containerStatuses"][0]["state"]["terminated"])


def test_node_is_real(real_cluster: RealCluster) -> None:
    """The node was registered by a kubelet talking to containerd, not by kwok."""
    node = real_cluster.plane.get_json("node", real_cluster.node.name)
    info = node["status"]["nodeInfo"]
    assert info["containerRuntimeVersion"].startswith("containerd://")
    assert info["kubeletVersion"].startswith("v1.")
    assert "kwok.x-k8s.io/node" not in node["metadata"].get("annotations", {})


def test_logs_and_exit_code(real_cluster: RealCluster, namespace: str) -> None:
    """A container's stdout is its log; its exit status is the pod's exit code."""
    script = "import sys, platform; print('hello from', platform.python_version()); sys.exit(3)"
    real_cluster.plane.apply(_pod("exits", script), namespace=namespace)
    status = _wait_phase(real_cluster, namespace, "exits", {"Failed", "Succeeded"})
    assert status["phase"] == "Failed"
    assert _terminated(status)["exitCode"] == 3
    logs = real_cluster.plane.kubectl("logs", "exits", "-n", namespace).stdout
    assert logs.startswith("hello from 3.11"), logs


def test_exec_and_sigterm_on_delete(real_cluster: RealCluster, namespace: str) -> None:
    """`kubectl exec` runs in the container as its user; a graceful delete delivers SIGTERM."""
    script = (
        "import signal, sys, time\n"
        "def bye(signum, frame):\n"
        "    print('got SIGTERM', flush=True); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        "print('waiting', flush=True)\n"
        "while True: time.sleep(0.2)\n"
    )
    plane = real_cluster.plane
    plane.apply(_pod("sleeper", script), namespace=namespace)
    _wait_phase(real_cluster, namespace, "sleeper", {"Running"})
    ident = plane.kubectl("exec", "sleeper", "-n", namespace, "--", "python3", "-c",
                          "import os; print(os.getuid(), os.getgid())").stdout.split()
    assert ident == ["10001", "10001"]
    wait_until(lambda: "waiting" in plane.kubectl("logs", "sleeper", "-n", namespace).stdout,
               timeout=60, what="the sleeper's first line")
    follow = subprocess.Popen(  # our kubectl; streams until the container exits
        [str(plane.binary("kubectl")), "logs", "-f", "sleeper", "-n", namespace],
        env=plane.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        time.sleep(1.0)  # let the stream attach before the signal (the log keeps it anyway)
        started = time.monotonic()
        plane.kubectl("delete", "pod", "sleeper", "-n", namespace, "--grace-period=30",
                      timeout=90)
        elapsed = time.monotonic() - started
        out, _ = follow.communicate(timeout=30)
    finally:
        follow.kill()
    assert "got SIGTERM" in out, out
    assert elapsed < 25, f"the delete took {elapsed:.1f}s: SIGTERM was not acted on"


def test_memory_limit_is_enforced(real_cluster: RealCluster, namespace: str) -> None:
    """A container over its memory limit is OOMKilled by the kernel (exit code 137)."""
    script = "x = bytearray(256 * 1024 * 1024); print('allocated')"
    resources = {"limits": {"memory": "64Mi", "cpu": "500m"}, "requests": {"memory": "64Mi"}}
    real_cluster.plane.apply(_pod("hog", script, container={"resources": resources}),
                             namespace=namespace)
    status = _wait_phase(real_cluster, namespace, "hog", {"Failed", "Succeeded"})
    terminated = _terminated(status)
    assert (terminated["reason"], terminated["exitCode"]) == ("OOMKilled", 137), terminated


def test_worker_shm_is_memory_backed_and_sized_by_the_memory_limit(real_cluster: RealCluster,
                                                                  namespace: str) -> None:
    """The operator's /dev/shm volume (``shm_volume``, as worker pods carry it) gives a tmpfs of
    the container's memory limit, where the runtime's own /dev/shm is 64 MiB (too small for
    NCCL's shared-memory transport and DataLoader workers)."""
    manifest = yaml.safe_load((REPO_ROOT / "examples" / "tiny-heterogeneous.yaml").read_text())
    limits = {"memory": "256Mi", "cpu": "500m"}
    manifest["spec"].setdefault("worker", {})["resources"] = {"limits": limits}
    volume = shm_volume(JobSpec.model_validate(manifest["spec"]))
    script = ("import os\n"
              "st = os.statvfs('/dev/shm')\n"
              "kind = [l.split()[2] for l in open('/proc/mounts') if l.split()[1] == '/dev/shm']\n"
              "print(kind[-1], st.f_blocks * st.f_frsize // 2**20)\n")
    resources = {"limits": limits, "requests": {"memory": "256Mi"}}
    plane = real_cluster.plane
    plane.apply([
        _pod("shm-worker", script, volumes=[volume],
             container={"resources": resources, "volumeMounts": [{"name": SHM_VOLUME, "mountPath": SHM_MOUNT}]}),
        _pod("shm-default", script, container={"resources": resources}),
    ], namespace=namespace)
    sizes = {}
    for name in ("shm-worker", "shm-default"):
        status = _wait_phase(real_cluster, namespace, name, {"Failed", "Succeeded"})
        assert status["phase"] == "Succeeded", status
        kind, mib = plane.kubectl("logs", name, "-n", namespace).stdout.split()
        assert kind == "tmpfs", (name, kind)
        sizes[name] = int(mib)
    assert sizes == {"shm-worker": 256, "shm-default": 64}, sizes


def test_headless_and_cluster_ip_services(real_cluster: RealCluster, namespace: str) -> None:
    """Two pods talk over TCP by the headless Service's DNS name and through a ClusterIP."""
    plane = real_cluster.plane
    server = (
        "import socketserver\n"
        "class H(socketserver.StreamRequestHandler):\n"
        "    def handle(self):\n"
        "        self.wfile.write(b'pong ' + self.rfile.readline())\n"
        "socketserver.TCPServer.allow_reuse_address = True\n"
        "socketserver.ThreadingTCPServer(('0.0.0.0', 7000), H).serve_forever()\n"
    )
    plane.apply(_pod("echo-0", server, hostname="echo-0", subdomain="echo",
                     labels={"app": "echo"}), namespace=namespace)
    service = {"selector": {"app": "echo"}, "ports": [{"port": 7000, "targetPort": 7000}]}
    plane.apply([
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "echo"},
         "spec": {**service, "clusterIP": "None"}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "echo-vip"}, "spec": service},
    ], namespace=namespace)
    _wait_phase(real_cluster, namespace, "echo-0", {"Running"})
    targets = [f"echo-0.echo.{namespace}.svc.cluster.local", f"echo.{namespace}.svc.cluster.local",
               f"echo-vip.{namespace}"]
    client = (
        "import json, socket, sys, time\n"
        f"targets = {targets!r}\n"
        "out = {}\n"
        "for name in targets:\n"
        "    for attempt in range(60):\n"
        "        try:\n"
        "            addr = socket.gethostbyname(name)\n"
        "            with socket.create_connection((addr, 7000), timeout=5) as s:\n"
        "                s.sendall(b'ping\\n'); out[name] = [addr, s.makefile().readline().strip()]\n"
        "            break\n"
        "        except OSError as exc:\n"
        "            out[name] = [None, repr(exc)]; time.sleep(1)\n"
        "print(json.dumps(out))\n"
        "with open('/etc/resolv.conf') as f: print(json.dumps(f.read()))\n"
    )
    plane.apply(_pod("client", client), namespace=namespace)
    status = _wait_phase(real_cluster, namespace, "client", {"Succeeded", "Failed"}, timeout=180)
    logs = plane.kubectl("logs", "client", "-n", namespace).stdout.splitlines()
    assert status["phase"] == "Succeeded", logs
    answers = json.loads(logs[0])
    resolv = json.loads(logs[1])
    assert f"nameserver {CLUSTER_DNS_IP}" in resolv
    server_ip = _pod_status(real_cluster, namespace, "echo-0")["podIP"]
    vip = plane.get_json("service", "echo-vip", "-n", namespace)["spec"]["clusterIP"]
    assert answers[targets[0]] == [server_ip, "pong ping"], answers
    assert answers[targets[1]] == [server_ip, "pong ping"], answers
    assert answers[targets[2]] == [vip, "pong ping"], answers


def test_restricted_namespace(real_cluster: RealCluster) -> None:
    """Pod Security `restricted` admits the compliant pod (and it runs) and refuses a root one."""
    plane = real_cluster.plane
    ns = plane.create_namespace(f"rn-restricted-{uuid.uuid4().hex[:6]}")
    try:
        plane.kubectl("label", "namespace", ns, "pod-security.kubernetes.io/enforce=restricted")
        script = ("import os\n"
                  "try:\n    open('/probe', 'w')\nexcept OSError as e:\n    print('ro', e.errno)\n"
                  "print('uid', os.getuid())\n"
                  "print('capeff', [l.split()[1] for l in open('/proc/self/status') "
                  "if l.startswith('CapEff')][0])\n")
        plane.apply(_pod("compliant", script), namespace=ns)
        status = _wait_phase(real_cluster, ns, "compliant", {"Succeeded", "Failed"})
        logs = plane.kubectl("logs", "compliant", "-n", ns).stdout
        assert status["phase"] == "Succeeded", logs
        assert "ro 30" in logs and "uid 10001" in logs and "capeff 0000000000000000" in logs, logs
        rogue = _pod("rogue", "print(1)")
        rogue["spec"]["securityContext"] = {}
        rogue["spec"]["containers"][0]["securityContext"] = {}
        result = plane.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(rogue), check=False)
        assert result.returncode != 0 and "violates PodSecurity" in result.stderr, result.stderr
    finally:
        plane.kubectl("delete", "namespace", ns, "--wait=false", check=False)
