"""`helm install` into the real control plane; the operator runs with the chart's credentials.

The path of a new user, step by step: install the chart, apply the example job with kubectl,
watch it reach Succeeded, upgrade the release, uninstall it. The operator process runs locally
(no container runtime here) with the arguments of the installed Deployment and a kubeconfig
holding a token of the chart's ServiceAccount, not the admin's: a rule missing from the chart's
RBAC fails these tests. kwok plays the kubelet (pods become Running, then Succeeded).

The release watches one namespace (RoleBindings): other tests share the control plane, and an
all-namespaces operator would reconcile their jobs too; the upgrade switches it to all
namespaces and checks that the ClusterRoleBinding then grants the same access everywhere.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

_CHARTS = Path(__file__).resolve().parents[1] / "charts"
if str(_CHARTS) not in sys.path:
    sys.path.insert(0, str(_CHARTS))

import chartkit  # noqa: E402
from controlplane import ControlPlane, KubectlError, free_ports, wait_until  # noqa: E402

pytestmark = pytest.mark.integration

RELEASE = "adaptis"
SYSTEM_NS = "it-helm-system"
JOBS_NS = "it-helm-jobs"
OPERATOR_SA = f"system:serviceaccount:{SYSTEM_NS}:{RELEASE}"
EXAMPLE = chartkit.REPO / "examples" / "tiny-heterogeneous.yaml"
CRD_NAME = "adaptisjobs.adaptis.io"
NODES = ("it-helm-node-a", "it-helm-node-b")


def _ensure_namespace(plane: ControlPlane, name: str) -> None:
    if plane.kubectl("get", "namespace", name, check=False).returncode != 0:
        plane.create_namespace(name)


def _adopt_existing_crd(plane: ControlPlane) -> None:
    """Let the release adopt a CRD that an earlier test applied with kubectl.

    Helm refuses to install over an object it does not own; these are the labels and
    annotations by which it adopts one (what a user upgrading from `kubectl apply` does).
    """
    if plane.kubectl("get", "crd", CRD_NAME, check=False).returncode != 0:
        return
    plane.kubectl("label", "crd", CRD_NAME, "--overwrite", "app.kubernetes.io/managed-by=Helm")
    plane.kubectl("annotate", "crd", CRD_NAME, "--overwrite",
                  f"meta.helm.sh/release-name={RELEASE}",
                  f"meta.helm.sh/release-namespace={SYSTEM_NS}")


class Operator:
    """`adaptis operator` as a local process, with the installed Deployment's arguments."""

    def __init__(self, *, args: list[str], kubeconfig: Path, log_path: Path) -> None:
        self.health_port, self.metrics_port = free_ports(2)
        # Same arguments, but kopf's liveness endpoint and the metrics on free ports.
        at = args.index("--liveness")
        args = [*args[:at + 1], f"http://127.0.0.1:{self.health_port}/healthz", *args[at + 2:]]
        at = args.index("--metrics-port")
        args = [*args[:at + 1], str(self.metrics_port), *args[at + 2:]]
        self.args = args
        self.kubeconfig = kubeconfig
        self.log_path = log_path
        env = dict(os.environ, KUBECONFIG=str(kubeconfig))
        env.pop("KUBERNETES_SERVICE_HOST", None)  # never the in-cluster credentials
        self._log = log_path.open("w")
        self.process = subprocess.Popen(  # our own CLI
            [sys.executable, "-m", "adaptis", *args], env=env, stdout=self._log,
            stderr=subprocess.STDOUT, cwd=chartkit.REPO)

    def log(self) -> str:
        return self.log_path.read_text()

    def healthy(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"the operator exited ({self.process.returncode}):\n"
                                 f"{self.log()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/healthz",
                                        timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        self._log.close()


@pytest.fixture(scope="module")
def helm_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("helm-home")


@pytest.fixture(scope="module")
def release(control_plane: ControlPlane, helm_home: Path) -> Iterator[subprocess.CompletedProcess[str]]:
    """The chart installed (with --wait: the Deployment became available on a kwok node)."""
    for name in (SYSTEM_NS, JOBS_NS):
        _ensure_namespace(control_plane, name)
    for index, node in enumerate(NODES):
        if control_plane.kubectl("get", "node", node, check=False).returncode != 0:
            control_plane.add_fake_gpu_node(node, rack=f"rack-{index}")
    _adopt_existing_crd(control_plane)
    result = control_plane.helm(
        "install", *chartkit.template_args(release=RELEASE, namespace=SYSTEM_NS,
                                           sets={"operator.watchNamespaces": [JOBS_NS]}),
        "--wait", "--timeout", "120s")
    yield result
    control_plane.helm("uninstall", RELEASE, "--namespace", SYSTEM_NS, check=False)
    for node in NODES:
        control_plane.kubectl("delete", "node", node, "--ignore-not-found", "--wait=false",
                              check=False)


@pytest.fixture(scope="module")
def operator(control_plane: ControlPlane, release: subprocess.CompletedProcess[str],
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    """The operator, running as the chart's ServiceAccount with the chart's arguments."""
    deployment = control_plane.get_json("deployment", RELEASE, "-n", SYSTEM_NS)
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["adaptis"]
    sa = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    kubeconfig = control_plane.service_account_kubeconfig(SYSTEM_NS, sa)
    workdir = tmp_path_factory.mktemp("operator")
    proc = Operator(args=list(container["args"]), kubeconfig=kubeconfig,
                    log_path=workdir / "operator.log")
    try:
        wait_until(proc.healthy, timeout=60, what="the operator's liveness endpoint")
        yield proc
    finally:
        proc.stop()


def test_install_notes_tell_how_to_start(release: subprocess.CompletedProcess[str]) -> None:
    notes = release.stdout
    assert "STATUS: deployed" in notes
    assert f"kubectl -n {SYSTEM_NS} get deployment {RELEASE}" in notes
    assert f"kubectl apply -n {JOBS_NS} -f examples/tiny-heterogeneous.yaml" in notes
    assert "adaptis:job_bubble_ratio:rate5m" in notes


def test_installed_objects(control_plane: ControlPlane,
                           release: subprocess.CompletedProcess[str]) -> None:
    deployment = control_plane.get_json("deployment", RELEASE, "-n", SYSTEM_NS)
    assert deployment["status"].get("availableReplicas") == 1
    crd = control_plane.get_json("crd", CRD_NAME)
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert any(c["type"] == "Established" and c["status"] == "True"
               for c in crd["status"]["conditions"])
    worker_sa = control_plane.get_json("serviceaccount", f"{RELEASE}-worker", "-n", JOBS_NS)
    assert worker_sa["automountServiceAccountToken"] is False


def test_operator_is_denied_what_the_chart_does_not_grant(control_plane: ControlPlane,
                                                          release: Any) -> None:
    def can(*args: str) -> bool:
        out = control_plane.kubectl("auth", "can-i", *args, f"--as={OPERATOR_SA}", check=False)
        return out.stdout.strip() == "yes"

    assert can("create", "pods", "-n", JOBS_NS)
    assert can("patch", "adaptisjobs", "--subresource=status", "-n", JOBS_NS)
    assert not can("patch", "adaptisjobs", "-n", JOBS_NS)  # the spec is the user's
    assert can("list", "nodes")
    # Namespaced mode: nothing outside the watched namespace, and never secrets.
    assert not can("create", "pods", "-n", "default")
    assert not can("list", "adaptisjobs", "--all-namespaces")
    # No cluster-wide rights on anything namespaced but the allocation ledger's read of every
    # pod, listed and watched (which GPUs other teams' pods hold: docs/shared-cluster.md).
    assert can("list", "pods", "--all-namespaces")
    assert can("watch", "pods", "--all-namespaces")
    for verb, resource in (("get", "pods"), ("delete", "pods"),
                           ("get", "configmaps"), ("create", "configmaps"),
                           ("create", "services"), ("create", "events")):
        assert not can(verb, resource, "--all-namespaces"), (verb, resource)
        assert not can(verb, resource, "-n", "default"), (verb, resource)
    assert not can("get", "secrets", "-n", JOBS_NS)
    assert not can("delete", "nodes")


def test_example_job_succeeds_with_the_charts_credentials(control_plane: ControlPlane,
                                                         operator: Operator) -> None:
    manifest = yaml.safe_load(EXAMPLE.read_text())
    name = manifest["metadata"]["name"]
    control_plane.kubectl("apply", "-n", JOBS_NS, "-f", str(EXAMPLE))

    def phase() -> str | None:
        job = control_plane.get_json("adaptisjob", name, "-n", JOBS_NS)
        value = (job.get("status") or {}).get("phase")
        if value == "Failed":
            raise AssertionError(f"job failed: {json.dumps(job.get('status'), indent=1)}\n"
                                 f"{operator.log()[-4000:]}")
        return value

    try:
        chartkit.poll_until(lambda: phase() == "Succeeded", timeout=150,
                            what=f"{name} to succeed")
    except AssertionError as err:
        raise AssertionError(f"{err}\noperator log:\n{operator.log()[-6000:]}") from err
    status = control_plane.get_json("adaptisjob", name, "-n", JOBS_NS)["status"]
    assert status["stages"] >= 2 and 0 <= status["predictedBubbleRatio"] < 1
    pods = control_plane.get_json("pods", "-n", JOBS_NS, "-l", f"adaptis.io/job={name}")["items"]
    assert len(pods) == manifest["spec"]["parallelism"]["workers"]
    for pod in pods:
        assert pod["spec"]["automountServiceAccountToken"] is False
        assert pod["status"]["phase"] == "Succeeded"
    events = control_plane.get_json("events", "-n", JOBS_NS,
                                    "--field-selector", f"involvedObject.name={name}")["items"]
    assert events, "the operator posted no Event"
    # A 403 status (not a port that happens to contain 403) or kopf's APIForbiddenError.
    denied = re.findall(r".*(?:(?<![\d:])403(?!\d)|[Ff]orbidden).*", operator.log())
    assert not denied, "the operator was denied something:\n" + "\n".join(denied[:10])


def test_upgrade_updates_the_crd_and_the_operator(control_plane: ControlPlane,
                                                  operator: Operator, helm_home: Path,
                                                  tmp_path: Path) -> None:
    # A newer chart whose CRD changed: a templated CRD is upgraded (a crds/ one would not be).
    chart = tmp_path / "adaptis"
    shutil.copytree(chartkit.CHART, chart)
    crd_file = chart / "files" / "adaptis.io_adaptisjobs.yaml"
    crd = crd_file.read_text()
    assert "description: Where the job is in its lifecycle." in crd
    crd_file.write_text(crd.replace("description: Where the job is in its lifecycle.",
                                    "description: Lifecycle phase (upgraded)."))
    chart_yaml = chart / "Chart.yaml"
    chart_yaml.write_text(chart_yaml.read_text().replace("version: 0.1.0", "version: 0.1.1", 1))
    control_plane.helm("upgrade", RELEASE, str(chart), "--namespace", SYSTEM_NS,
                       "--reuse-values", "--set-json", "operator.watchNamespaces=[]",
                       "--set", "operator.verbosity=1", "--wait", "--timeout", "120s")

    live = control_plane.get_json("crd", CRD_NAME)
    columns = live["spec"]["versions"][0]["additionalPrinterColumns"]
    assert any(c.get("description") == "Lifecycle phase (upgraded)." for c in columns)
    assert live["metadata"]["labels"]["helm.sh/chart"] == "adaptis-0.1.1"
    deployment = control_plane.get_json("deployment", RELEASE, "-n", SYSTEM_NS)
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:3] == ["--verbose", "operator", "--all-namespaces"]
    # All namespaces now: one ClusterRoleBinding instead of the RoleBinding.
    out = control_plane.kubectl("auth", "can-i", "list", "adaptisjobs", "--all-namespaces",
                                f"--as={OPERATOR_SA}", check=False)
    assert out.stdout.strip() == "yes"
    assert control_plane.kubectl("get", "rolebinding", f"{RELEASE}-jobs", "-n", JOBS_NS,
                                 check=False).returncode != 0
    history = control_plane.helm("history", RELEASE, "--namespace", SYSTEM_NS, "-o", "json")
    assert [h["revision"] for h in json.loads(history.stdout)] == [1, 2]


def test_uninstall_keeps_the_crd_and_the_jobs(control_plane: ControlPlane, operator: Operator,
                                              release: Any) -> None:
    name = yaml.safe_load(EXAMPLE.read_text())["metadata"]["name"]
    result = control_plane.helm("uninstall", RELEASE, "--namespace", SYSTEM_NS)
    assert f"[CustomResourceDefinition] {CRD_NAME}" in result.stdout + result.stderr
    assert control_plane.kubectl("get", "crd", CRD_NAME, check=False).returncode == 0
    # The user's job (and its status) outlives the release.
    job = control_plane.get_json("adaptisjob", name, "-n", JOBS_NS)
    assert job["status"]["phase"] == "Succeeded"

    def gone(*args: str) -> bool:
        return control_plane.kubectl("get", *args, check=False).returncode != 0

    wait_until(lambda: gone("deployment", RELEASE, "-n", SYSTEM_NS), timeout=60,
               what="the operator Deployment to go")
    for obj in (("clusterrole", f"{RELEASE}-jobs"), ("clusterrole", f"{RELEASE}-cluster"),
                ("clusterrolebinding", f"{RELEASE}-jobs"),
                ("serviceaccount", RELEASE, "-n", SYSTEM_NS)):
        assert gone(*obj), obj
    # The ServiceAccount is gone, and with it every token the operator held.
    def token_refused() -> bool:
        try:
            control_plane.kubectl("get", "adaptisjobs", "-n", JOBS_NS,
                                  kubeconfig=operator.kubeconfig, timeout=20)
        except KubectlError as err:
            return "Unauthorized" in err.stderr or "must be logged in" in err.stderr
        return False

    wait_until(token_refused, timeout=60, what="the operator's token to be refused")
