"""Worker and profiler pods pass the Pod Security Standard ``restricted`` as rendered.

:func:`restricted_violations` is the standard's checks (Kubernetes' pod-security-admission,
level restricted, written out from its documentation) on a pod dict, so a field dropped from
the rendering fails here; tests/integration/test_restricted_workers.py has the real API
server's admission judge the same pods.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from adaptis.api.job import JobSpec
from adaptis.operator.control.reconcile import Reconciler
from adaptis.operator.core.records import JobRef
from adaptis.operator.core.settings import DEFAULT_TOPOLOGY_KEYS, ManifestSettings
from adaptis.operator.kube.cluster import ApiError
from adaptis.operator.profiling.nodes import profile_node
from adaptis.operator.profiling.profiler_pods import render_profiler_pod
from adaptis.operator.resources.manifests import render_pod
from adaptis.operator.resources.pod_security import HOME_DIR, TMP_DIR
from adaptis.operator.scheduling.planning import plan_job

JOB = JobRef(name="demo", namespace="ns", uid="uid-1")
_ALLOWED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                    "persistentVolumeClaim", "projected", "secret"}


def restricted_violations(pod: Mapping[str, Any]) -> list[str]:
    """What keeps ``pod`` out of a namespace that enforces ``restricted`` (empty: nothing)."""
    spec = pod["spec"]
    psc = spec.get("securityContext") or {}
    bad: list[str] = []
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            bad.append(key)
    for vol in spec.get("volumes") or []:
        kinds = set(vol) - {"name"}
        if not kinds <= _ALLOWED_VOLUMES:
            bad.append(f"volume {vol['name']}: {sorted(kinds)}")
    if psc.get("runAsUser") == 0:
        bad.append("pod runAsUser 0")
    for c in [*spec.get("initContainers", []), *spec["containers"]]:
        sc = c.get("securityContext") or {}
        name = c["name"]
        if sc.get("privileged"):
            bad.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{name}: allowPrivilegeEscalation must be false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            bad.append(f"{name}: capabilities.drop must hold ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            bad.append(f"{name}: capabilities.add {caps['add']}")
        if sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True:
            bad.append(f"{name}: runAsNonRoot must be true")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            bad.append(f"{name}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        if seccomp not in {"RuntimeDefault", "Localhost"}:
            bad.append(f"{name}: seccompProfile {seccomp}")
        for port in c.get("ports") or []:
            if port.get("hostPort"):
                bad.append(f"{name}: hostPort")
    return bad


@pytest.fixture
def worker_pod(make_node: Any, make_job: Any) -> dict[str, Any]:
    spec = JobSpec.model_validate(make_job()["spec"])
    nodes = [profile_node(make_node(n, gpus=2), topology_keys=DEFAULT_TOPOLOGY_KEYS)
             for n in ("gpu-a", "gpu-b")]
    record = plan_job(spec, nodes, name="ns/demo")
    return render_pod(JOB, spec, record=record, rank=0, attempt=0,
                      settings=ManifestSettings(run_as_user=4242, run_as_group=4343))


@pytest.fixture
def profiler_pod(make_node: Any) -> dict[str, Any]:
    node = profile_node(make_node("gpu-a", gpus=2), topology_keys=DEFAULT_TOPOLOGY_KEYS)
    return render_profiler_pod(JOB, node, namespace="ops", image="img",
                               image_pull_policy="IfNotPresent", tolerations=[], timeout_s=60,
                               run_as_user=4242, run_as_group=4343)


@pytest.mark.parametrize("which", ["worker_pod", "profiler_pod"])
def test_operator_pods_pass_the_restricted_standard(which: str,
                                                    request: pytest.FixtureRequest) -> None:
    pod = request.getfixturevalue(which)
    assert restricted_violations(pod) == []
    psc = pod["spec"]["securityContext"]
    # The image's numeric user, as configured (the check of runAsNonRoot needs a number).
    assert (psc["runAsUser"], psc["runAsGroup"], psc["fsGroup"]) == (4242, 4343, 4343)
    (container,) = pod["spec"]["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    # What torch and Python write goes to emptyDirs, the root filesystem being read-only.
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    for path in (TMP_DIR, HOME_DIR):
        assert "emptyDir" in volumes[mounts[path]], path
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["HOME"] == HOME_DIR
    for key in ("XDG_CACHE_HOME", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        assert env[key].startswith(HOME_DIR + "/"), key
    assert pod["spec"]["automountServiceAccountToken"] is False


def test_the_checker_sees_what_restricted_refuses(worker_pod: dict[str, Any]) -> None:
    # The checker itself could fail: each relaxation is one violation.
    container = worker_pod["spec"]["containers"][0]
    container["securityContext"]["allowPrivilegeEscalation"] = True
    container["securityContext"]["capabilities"] = {"add": ["SYS_ADMIN"]}
    worker_pod["spec"]["securityContext"].pop("seccompProfile")
    container["securityContext"].pop("seccompProfile")
    worker_pod["spec"]["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
    assert len(restricted_violations(worker_pod)) == 5


@pytest.mark.parametrize(("flags", "needle"), [
    (["--worker-run-as-user", "0"], "--worker-run-as-user must be a non-root UID"),
    (["--worker-run-as-group", "-1"], "--worker-run-as-group >= 0"),
])
def test_the_operator_refuses_a_root_worker_user(flags: list[str], needle: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from adaptis.cli import main

    # Refused before any connection: no cluster is needed to see it.
    assert main(["operator", "--namespace", "x", *flags]) == 2
    assert needle in capsys.readouterr().err


class RefusingCluster:
    """The conftest's in-memory API, with Pod Security admission refusing every pod."""

    def __init__(self, inner: Any, *, status: int = 403) -> None:
        self._inner = inner
        self._status = status

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def create(self, obj: Any) -> bool:
        if obj["kind"] == "Pod":
            raise ApiError(f'POST pods: {self._status} pods "{obj["metadata"]["name"]}" is '
                           'forbidden: violates PodSecurity "restricted:latest": hostPath '
                           'volumes', status=self._status)
        return bool(self._inner.create(obj))


def _condition(job: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in job["status"]["conditions"] if c["type"] == type_)


def test_worker_pods_refused_by_admission_show_in_status(cluster: Any, make_job: Any) -> None:
    cluster.add_job(make_job())
    result = Reconciler(RefusingCluster(cluster)).reconcile("ns", "demo")
    job = cluster.job()
    running = _condition(job, "Running")
    assert running["status"] == "False" and running["reason"] == "PodsRejected"
    assert "violates PodSecurity" in running["message"]
    assert "violates PodSecurity" in job["status"]["message"]
    assert ("demo", "Warning", "PodsRejected") in [e[:3] for e in cluster.events]
    assert result.requeue_after is not None  # tried again: the admin may relax the policy


def test_a_failure_of_the_api_server_is_not_a_refusal(cluster: Any, make_job: Any) -> None:
    cluster.add_job(make_job())
    with pytest.raises(ApiError):  # the work queue retries it with backoff
        Reconciler(RefusingCluster(cluster, status=500)).reconcile("ns", "demo")


def test_a_refused_profiler_leaves_its_node_to_the_estimate(cluster: Any, make_job: Any) -> None:
    cluster.add_job(make_job(spec={"planner": {"strategy": "1f1b", "profile": "measure"}}))
    Reconciler(RefusingCluster(cluster)).reconcile("ns", "demo")
    job = cluster.job()
    assert _condition(job, "Planned")["status"] == "True"  # not stuck in Profiling
    message = _condition(job, "Profiling")["message"]
    assert "profiler pod refused by the API server" in message
    assert "using the label-based estimate" in message
