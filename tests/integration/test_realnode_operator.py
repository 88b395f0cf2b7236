"""The chart's operator in a pod on the real node, and the example job trained in containers.

The user's first path, executed: the images built from the Dockerfile (``build-images.sh
operator worker``: buildah runs the Dockerfile's targets), ``helm install`` of charts/adaptis
with them (the chart's RBAC, admission policy, liveness probe; the operator talks to the API
with its in-cluster ServiceAccount token through the ``kubernetes`` Service), then
``kubectl apply -f examples/tiny-heterogeneous.yaml``: profiler pods measure the node, the
plan is made from their figures, the worker pods rendezvous through the job's headless
Service and train to ``Succeeded``.  No operator process runs on the host here.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from processes import ControlPlaneError, wait_until
from realnode import RealCluster, build_images

_CHARTS = Path(__file__).resolve().parents[1] / "charts"
if str(_CHARTS) not in sys.path:
    sys.path.insert(0, str(_CHARTS))

import chartkit  # noqa: E402

# The first test's setup builds the images when their inputs changed: the worker image alone
# took 12.5 min cold here (hack/README.md), more than the suite's 900 s per test.
pytestmark = [pytest.mark.realnode, pytest.mark.slow, pytest.mark.timeout(3600)]

RELEASE = "adaptis"
SYSTEM_NS = "adaptis-system"
JOBS_NS = "rn-jobs"
EXAMPLE = chartkit.REPO / "examples" / "tiny-heterogeneous.yaml"


@pytest.fixture(scope="module")
def release(real_cluster: RealCluster) -> Iterator[dict[str, Any]]:
    """The chart installed with the built images; the operator pod is Ready."""
    build_images(("operator", "worker"), bin_dir=real_cluster.bin_dir)
    plane = real_cluster.plane
    for name in (SYSTEM_NS, JOBS_NS):
        if plane.kubectl("get", "namespace", name, check=False).returncode != 0:
            plane.create_namespace(name)
    started = time.monotonic()
    plane.helm(
        "install", *chartkit.template_args(release=RELEASE, namespace=SYSTEM_NS,
                                           sets={"image.pullPolicy": "Never"}),
        "--wait", "--timeout", "300s", timeout=400,
    )
    pods = plane.get_json("pods", "-n", SYSTEM_NS, "-l", "app.kubernetes.io/component=operator")
    assert len(pods["items"]) == 1
    print(f"helm install --wait: operator pod Ready in {time.monotonic() - started:.1f}s")
    yield pods["items"][0]
    plane.helm("uninstall", RELEASE, "--namespace", SYSTEM_NS, "--wait", check=False)


def _operator_log(cluster: RealCluster) -> str:
    return cluster.plane.kubectl(
        "logs", "-n", SYSTEM_NS, "-l", "app.kubernetes.io/component=operator", "--tail=-1",
        check=False,
    ).stdout


def test_operator_runs_in_a_pod(real_cluster: RealCluster, release: dict[str, Any]) -> None:
    """The chart's Deployment runs the operator image as 10001 with a liveness probe."""
    pod = release
    container = pod["spec"]["containers"][0]
    assert container["image"].startswith("adaptis/operator:")
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    status = real_cluster.plane.get_json("pod", pod["metadata"]["name"], "-n", SYSTEM_NS)
    state = status["status"]["containerStatuses"][0]
    assert state["ready"] and "running" in state["state"], state
    assert state["imageID"], "no image ID: the container did not really start"
    ident = real_cluster.plane.kubectl(
        "exec", "-n", SYSTEM_NS, pod["metadata"]["name"], "--", "python", "-c",
        "import os; print(os.getuid(), open('/var/run/secrets/kubernetes.io/serviceaccount/namespace').read())",
    ).stdout.split()
    assert ident == ["10001", SYSTEM_NS]


def _train_to_succeeded(cluster: RealCluster, namespace: str, manifest: dict[str, Any], *,
                        path: Path | None = None) -> None:
    """Apply ``manifest`` (from ``path`` when given, as a user does) in ``namespace`` and wait
    until the job and its workers succeed."""
    plane = cluster.plane
    name = manifest["metadata"]["name"]
    started = time.monotonic()
    if path is not None:
        plane.kubectl("apply", "-n", namespace, "-f", str(path))
    else:
        plane.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(manifest))

    def phase() -> str | None:
        job = plane.get_json("adaptisjob", name, "-n", namespace)
        value = (job.get("status") or {}).get("phase")
        if value == "Failed":
            raise AssertionError(f"job failed: {json.dumps(job.get('status'), indent=1)}")
        return value if value == "Succeeded" else None

    try:
        wait_until(phase, timeout=600, interval=2.0, what=f"{name} Succeeded")
    except (ControlPlaneError, AssertionError) as err:
        pods = plane.kubectl("get", "pods", "-A", "-o", "wide", check=False).stdout
        pytest.fail(f"{err}\npods:\n{pods}\noperator log:\n{_operator_log(cluster)[-6000:]}",
                    pytrace=False)
    elapsed = time.monotonic() - started
    print(f"{name}: apply -> Succeeded in {elapsed:.1f}s")
    status = plane.get_json("adaptisjob", name, "-n", namespace)["status"]
    assert status["stages"] >= 2 and 0 <= status["predictedBubbleRatio"] < 1
    workers = plane.get_json("pods", "-n", namespace, "-l", f"adaptis.io/job={name}")["items"]
    assert len(workers) == manifest["spec"]["parallelism"]["workers"]
    for pod in workers:
        assert pod["status"]["phase"] == "Succeeded"
        terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
        assert terminated["exitCode"] == 0 and terminated["containerID"].startswith("containerd://")
        assert pod["spec"]["containers"][0]["image"].startswith("adaptis/worker:")


def test_tiny_example_trains_to_succeeded(real_cluster: RealCluster,
                                          release: dict[str, Any]) -> None:
    """`kubectl apply -f examples/tiny-heterogeneous.yaml` trains in real containers."""
    _train_to_succeeded(real_cluster, JOBS_NS, yaml.safe_load(EXAMPLE.read_text()), path=EXAMPLE)


def test_job_runs_in_a_restricted_namespace(real_cluster: RealCluster,
                                            release: dict[str, Any]) -> None:
    """Pod Security `restricted` enforced on the job's namespace: the workers still run."""
    plane = real_cluster.plane
    namespace = "rn-restricted-jobs"
    if plane.kubectl("get", "namespace", namespace, check=False).returncode != 0:
        plane.create_namespace(namespace)
    plane.kubectl("label", "namespace", namespace, "--overwrite",
                  "pod-security.kubernetes.io/enforce=restricted",
                  "pod-security.kubernetes.io/enforce-version=latest")
    manifest = yaml.safe_load(EXAMPLE.read_text())
    manifest["metadata"]["name"] = "tiny-restricted"
    manifest["spec"]["training"]["steps"] = 10
    _train_to_succeeded(real_cluster, namespace, manifest)
