"""Tenancy at admission on the real kube-apiserver: a job gets no pod power its creator lacks.

The chart is installed with helm (its ValidatingAdmissionPolicy and binding, SECURITY.md);
then the escalation of issue 12 is replayed. ``alice`` (a client-certificate user) may only
create and get AdaPtisJobs and get and list pods in her namespace; ``bob`` may also create pods.
Each pod-level power alice's manifest asked for is rejected on its own, with the field named;
the same manifests from bob are admitted (server-side dry run: admission runs, nothing is
stored); alice's plain job, and one using only what the admin allow-listed, are admitted, and
the plain one runs to the end with the operator serving her namespace. ``carol`` may patch
jobs but not create pods: she may relabel a job that uses powers, not change its spec.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

_CHARTS = Path(__file__).resolve().parents[1] / "charts"
if str(_CHARTS) not in sys.path:
    sys.path.insert(0, str(_CHARTS))

import chartkit  # noqa: E402
from controlplane import ControlPlane, wait_until  # noqa: E402
from operator_process import OperatorProcess, install_crd  # noqa: E402

RELEASE = "tenancy"
SYSTEM_NS = "it-tenancy-system"
NS = "it-tenant-a"
NODES = ("it-tenancy-node-a", "it-tenancy-node-b")
ADMIN_ALLOWED_SA = "trainer"
DENIED = "only users who may create pods in namespace"
DEFAULT_VOLUME_TYPES = ["emptyDir", "configMap", "downwardAPI", "persistentVolumeClaim"]

# Everything alice's manifest asked for, one power at a time: (worker overrides, field named).
POWERS: dict[str, tuple[dict[str, Any], str]] = {
    "serviceAccountName": ({"serviceAccountName": "powerful"}, "spec.worker.serviceAccountName"),
    "tolerations": ({"tolerations": [{"operator": "Exists"}]}, "spec.worker.tolerations[0]"),
    "nodeSelector": ({"nodeSelector": {"node-role.kubernetes.io/control-plane": ""}},
                     "spec.worker.nodeSelector.node-role.kubernetes.io/control-plane"),
    "hostPath": ({"volumes": [{"name": "host", "hostPath": {"path": "/"}}]},
                 "spec.worker.volumes[0].hostPath"),
    "secret": ({"volumes": [{"name": "scratch", "emptyDir": {}},
                            {"name": "db", "secret": {"secretName": "db-password"}}]},
               "spec.worker.volumes[1].secret"),
    "secretKeyRef": ({"env": [{"name": "PLAIN", "value": "x"}, {
        "name": "DB_PASSWORD",
        "valueFrom": {"secretKeyRef": {"name": "db-password", "key": "password"}}}]},
        "spec.worker.env[1].valueFrom.secretKeyRef"),
    # The admin allowed projected volumes (of configMaps): a token source is still a power.
    "serviceAccountToken": ({"volumes": [{"name": "token", "projected": {"sources": [
        {"configMap": {"name": "settings"}},
        {"serviceAccountToken": {"path": "token", "audience": "vault"}}]}}]},
        "spec.worker.volumes[0].projected.sources[1].serviceAccountToken"),
    "priorityClassName": ({"priorityClassName": "system-cluster-critical"},
                          "spec.worker.priorityClassName"),
    "labels": ({"labels": {"app": "db"}}, "spec.worker.labels.app"),
    "annotations": ({"annotations": {"sidecar.istio.io/inject": "true"}},
                    "spec.worker.annotations.sidecar.istio.io/inject"),
}


def _job(name: str, **worker: Any) -> dict[str, Any]:
    manifest = yaml.safe_load((chartkit.REPO / "examples" / "tiny-heterogeneous.yaml").read_text())
    manifest["metadata"] = {"name": name, "namespace": NS}
    spec = manifest["spec"]
    spec["planner"] = {**spec["planner"], "profile": "estimate"}
    spec["training"] = {**spec["training"], "steps": 4}
    spec["checkpoint"] = {"everySteps": 0}
    if worker:
        spec["worker"] = copy.deepcopy(worker)
    return manifest


def _escalation(name: str) -> dict[str, Any]:
    """Alice's manifest of issue 12: every power at once."""
    worker: dict[str, Any] = {"volumes": [], "env": []}
    for overrides, _field in POWERS.values():
        for key, value in overrides.items():
            if isinstance(value, list):
                worker.setdefault(key, []).extend(value)
            elif isinstance(value, dict):
                worker[key] = {**worker.get(key, {}), **value}
            else:
                worker[key] = value
    return _job(name, **worker)


class Users:
    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane
        self.alice = plane.make_user_kubeconfig("alice", namespace=NS)
        self.bob = plane.make_user_kubeconfig("bob", namespace=NS)
        self.carol = plane.make_user_kubeconfig("carol", namespace=NS)  # may patch jobs only

    def create(self, manifest: dict[str, Any], *, as_: Path, dry_run: bool = False) -> Any:
        args = ["create", "-f", "-"] + (["--dry-run=server"] if dry_run else [])
        return self.plane.kubectl(*args, input=yaml.safe_dump(manifest), kubeconfig=as_,
                                  check=False)


def _role(name: str, rules: list[dict[str, Any]], user: str) -> list[dict[str, Any]]:
    return [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": name, "namespace": NS}, "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": name, "namespace": NS},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]},
    ]


@pytest.fixture(scope="module")
def users(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[Users]:
    plane = control_plane
    install_crd(plane)  # kept by the release (crds.install=false): other modules share it
    for name in (SYSTEM_NS, NS):
        if plane.kubectl("get", "namespace", name, check=False).returncode != 0:
            plane.create_namespace(name)
    jobs = {"apiGroups": ["adaptis.io"], "resources": ["adaptisjobs"], "verbs": ["create", "get"]}
    plane.apply(_role("alice", [jobs, {"apiGroups": [""], "resources": ["pods"],
                                       "verbs": ["get", "list"]}], "alice"), namespace=NS)
    plane.apply(_role("bob", [jobs, {"apiGroups": [""], "resources": ["pods"],
                                     "verbs": ["get", "list", "create"]}], "bob"), namespace=NS)
    plane.apply(_role("carol", [{"apiGroups": ["adaptis.io"], "resources": ["adaptisjobs"],
                                 "verbs": ["get", "patch"]}], "carol"), namespace=NS)
    # What the escalation reached for: a powerful account and a secret.
    plane.kubectl("create", "serviceaccount", "powerful", "-n", NS, check=False)
    plane.kubectl("create", "secret", "generic", "db-password", "-n", NS,
                  "--from-literal=password=hunter2", check=False)
    plane.helm("install", *chartkit.template_args(
        release=RELEASE, namespace=SYSTEM_NS,
        sets={"crds.install": False, "operator.watchNamespaces": [NS],
              "admission.allowedServiceAccounts": [ADMIN_ALLOWED_SA],
              "admission.allowedVolumeTypes": [*DEFAULT_VOLUME_TYPES, "projected"]}))
    found = Users(plane)
    for user, verb, allowed in (("alice", "create", "no"), ("bob", "create", "yes")):
        out = plane.kubectl("auth", "can-i", verb, "pods", "-n", NS, f"--as={user}", check=False)
        assert out.stdout.strip() == allowed, (user, out.stdout, out.stderr)
    # The policy takes effect once the API server has loaded it: wait for the first denial.
    probe = _job("probe", volumes=[{"name": "host", "hostPath": {"path": "/"}}])
    wait_until(lambda: DENIED in found.create(probe, as_=found.alice, dry_run=True).stderr,
               timeout=60, what="the tenancy policy to deny alice's hostPath job")
    try:
        yield found
    finally:
        plane.helm("uninstall", RELEASE, "--namespace", SYSTEM_NS, check=False)


@pytest.mark.parametrize("power", sorted(POWERS))
def test_alice_cannot_borrow_a_pod_power(users: Users, power: str) -> None:
    overrides, field = POWERS[power]
    result = users.create(_job(f"alice-{power.lower()}", **overrides), as_=users.alice)
    assert result.returncode != 0, f"alice's job with {power} was admitted"
    message = result.stderr
    assert f"{field}:" in message, message
    assert f"{DENIED} {NS} may ask for this (alice may not)" in message, message
    assert users.plane.kubectl("get", "adaptisjob", f"alice-{power.lower()}", "-n", NS,
                               check=False).returncode != 0


def test_alices_whole_escalation_is_rejected_naming_every_field(users: Users) -> None:
    result = users.create(_escalation("alice-escalation"), as_=users.alice)
    assert result.returncode != 0
    # The powers merged: volumes hostPath, emptyDir, secret, projected; env plain, secret.
    fields = ["spec.worker.serviceAccountName", "spec.worker.tolerations[0]",
              "spec.worker.nodeSelector.node-role.kubernetes.io/control-plane",
              "spec.worker.volumes[0].hostPath", "spec.worker.volumes[2].secret",
              "spec.worker.volumes[3].projected.sources[1].serviceAccountToken",
              "spec.worker.env[1].valueFrom.secretKeyRef",
              "spec.worker.priorityClassName", "spec.worker.labels.app",
              "spec.worker.annotations.sidecar.istio.io/inject"]
    for field in fields:
        assert f"{field}:" in result.stderr, (field, result.stderr)
    assert "volumes[1]" not in result.stderr  # the emptyDir is anyone's
    pods = users.plane.get_json("pods", "-n", NS, "-l", "adaptis.io/job=alice-escalation")
    assert pods["items"] == []


@pytest.mark.parametrize("power", sorted(POWERS))
def test_a_user_who_may_create_pods_may_ask_for_the_same(users: Users, power: str) -> None:
    overrides, _field = POWERS[power]
    result = users.create(_job(f"bob-{power.lower()}", **overrides), as_=users.bob,
                          dry_run=True)
    assert result.returncode == 0, result.stderr


def test_bob_may_submit_the_whole_escalation(users: Users) -> None:
    result = users.create(_escalation("bob-escalation"), as_=users.bob, dry_run=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("worker", [
    {"serviceAccountName": ADMIN_ALLOWED_SA},
    {"serviceAccountName": f"{RELEASE}-adaptis-worker"},
    {"serviceAccountName": "default"},
    {"volumes": [{"name": "scratch", "emptyDir": {}},
                 {"name": "config", "configMap": {"name": "settings"}},
                 {"name": "data", "persistentVolumeClaim": {"claimName": "data"}}]},
    {"volumes": [{"name": "both", "projected": {"sources": [
        {"configMap": {"name": "settings"}},
        {"downwardAPI": {"items": [{"path": "name", "fieldRef": {"fieldPath": "metadata.name"}}]}},
    ]}}]},
    {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
    {"env": [{"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]},
], ids=["admin-allowed-sa", "chart-worker-sa", "default-sa", "allowed-volumes",
        "allowed-projected-sources", "gpu-toleration", "field-ref-env"])
def test_alice_may_use_what_the_admin_allowed(users: Users, worker: dict[str, Any]) -> None:
    result = users.create(_job("alice-allowed", **worker), as_=users.alice, dry_run=True)
    assert result.returncode == 0, result.stderr


def _hf_job(name: str, config_map: str) -> dict[str, Any]:
    manifest = _job(name)
    manifest["spec"]["model"] = {"huggingface": {"configMap": {"name": config_map}}}
    return manifest


def test_a_hugging_face_config_map_needs_its_reader(users: Users) -> None:
    """The operator reads spec.model.huggingface.configMap to plan, and a bad config's error
    quotes it into status: alice (no pod creation) may name only a ConfigMap she may get."""
    plane = users.plane
    plane.apply(_role("alice-hf-config", [{"apiGroups": [""], "resources": ["configmaps"],
                                           "resourceNames": ["alice-model"], "verbs": ["get"]}],
                      "alice"), namespace=NS)
    wait_until(lambda: "yes" in plane.kubectl(
        "auth", "can-i", "get", "configmap/alice-model", "-n", NS, "--as=alice",
        check=False).stdout, timeout=30, what="alice's get on ConfigMap alice-model")
    theirs = users.create(_hf_job("alice-hf-theirs", "platform-secrets"), as_=users.alice,
                          dry_run=True)
    assert theirs.returncode != 0, "alice named a ConfigMap she may not read and was admitted"
    assert ("spec.model.huggingface.configMap: alice may not get ConfigMap platform-secrets "
            f"in namespace {NS}") in theirs.stderr, theirs.stderr
    own = users.create(_hf_job("alice-hf-own", "alice-model"), as_=users.alice, dry_run=True)
    assert own.returncode == 0, own.stderr
    bobs = users.create(_hf_job("bob-hf", "platform-secrets"), as_=users.bob, dry_run=True)
    assert bobs.returncode == 0, bobs.stderr  # bob could mount it in a pod of his own


def test_spec_changes_need_the_powers_the_job_uses(users: Users) -> None:
    """bob's job runs as `powerful`; carol may patch jobs but not create pods."""
    plane = users.plane
    result = users.create(_job("bob-powered", serviceAccountName="powerful"), as_=users.bob)
    assert result.returncode == 0, result.stderr
    try:
        def patch(body: str) -> Any:
            return plane.kubectl("patch", "adaptisjob", "bob-powered", "-n", NS, "--type=merge",
                                 "-p", body, kubeconfig=users.carol, check=False)

        # Metadata is not the spec: the garbage collector and the operator's peers pass.
        labelled = patch('{"metadata": {"labels": {"team": "a"}}}')
        assert labelled.returncode == 0, labelled.stderr
        # A spec change re-creates pods that run as `powerful`: carol would borrow it.
        edited = patch('{"spec": {"training": {"steps": 5}}}')
        assert edited.returncode != 0
        assert "spec.worker.serviceAccountName:" in edited.stderr, edited.stderr
        assert f"{DENIED} {NS} may ask for this (carol may not)" in edited.stderr
    finally:
        plane.kubectl("delete", "adaptisjob", "bob-powered", "-n", NS, "--ignore-not-found",
                      check=False)


def test_alices_plain_job_is_admitted_and_runs(control_plane: ControlPlane, users: Users,
                                               tmp_path_factory: pytest.TempPathFactory) -> None:
    for index, node in enumerate(NODES):
        if control_plane.kubectl("get", "node", node, check=False).returncode != 0:
            control_plane.add_fake_gpu_node(node, rack=f"rack-{index}")
    operator = OperatorProcess(control_plane, tmp_path_factory.mktemp("operator") / "op.log",
                               namespace=NS)
    operator.start()
    try:
        result = users.create(_job("alice-plain"), as_=users.alice)
        assert result.returncode == 0, result.stderr
        operator.wait("alice's plain job to succeed",
                      lambda: operator.status("alice-plain").get("phase") == "Succeeded",
                      timeout=150)
        # Alice may read what ran for her: the workers, as the namespace's default account.
        pods = control_plane.get_json("pods", "-n", NS, "-l", "adaptis.io/job=alice-plain",
                                      kubeconfig=users.alice)["items"]
        assert len(pods) == 2
        for pod in pods:
            assert pod["spec"].get("serviceAccountName", "default") == "default"
            assert pod["spec"]["automountServiceAccountToken"] is False
    finally:
        operator.stop()
        control_plane.kubectl("delete", "adaptisjob", "alice-plain", "-n", NS,
                              "--ignore-not-found", check=False)
        for node in NODES:
            control_plane.kubectl("delete", "node", node, "--ignore-not-found", "--wait=false",
                                  check=False)
