"""The operator's Deployment, ServiceAccounts and RBAC as `helm template` renders them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import chartkit
import pytest
from chartkit import by_kind, env_of, one, operator_container

# Every (apiGroup, resource, verb) the operator may use, and nothing else: what
# adaptis/operator/kube/client.py calls, what its kopf handlers watch (jobs, pods, nodes) and the
# Events kopf posts. kopf runs standalone with scanning off (adaptis/operator/control/app.py), so it
# needs neither peering objects nor CRD or namespace watches. Changing this set is a deliberate act;
# tests/integration/test_helm_install.py proves it is enough by running the operator with it.
JOB_RULES = {
    ("adaptis.io", "adaptisjobs", verb) for verb in ("get", "list", "watch", "delete")
} | {
    ("adaptis.io", "adaptisjobs/status", "patch"),
    ("adaptis.io", "adaptisjobs/finalizers", "update"),
    ("", "events", "create"),
    ("", "services", "create"),
} | {
    ("", "pods", verb) for verb in ("list", "watch", "create", "delete")
} | {
    ("", "configmaps", verb) for verb in ("get", "create", "patch")
}
# No patch on nodes: measured profiles are kept in the release namespace (a node patch would
# also let the operator relabel, taint or cordon any node).
# Nodes, plus what the allocation ledger reads: every pod's GPU requests, PriorityClass values.
# Cluster-wide: what the informers list and watch (nodes, the pods holding GPUs, priority
# classes) and the one GET a priority class the cache has not seen yet costs.
CLUSTER_RULES = {
    (group, resource, verb)
    for group, resource in (("", "nodes"), ("", "pods"), ("scheduling.k8s.io", "priorityclasses"))
    for verb in ("list", "watch")
} | {("scheduling.k8s.io", "priorityclasses", "get")}
# In the release namespace only: the profiler pods, the stored profiles and the plan records
# (deleted with their job). No tenant writes there, which is what makes them unforgeable.
PROFILE_RULES = {("", "pods", verb) for verb in ("list", "watch", "create", "delete")} | {
    ("", "configmaps", verb) for verb in ("get", "list", "watch", "create", "patch", "delete")
}


def _grants(role: Mapping[str, Any]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def _roles(objects: Iterable[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] in ("ClusterRole", "Role")}


def test_one_replica_recreated_never_two(default_objects: list[dict[str, Any]]) -> None:
    deployment = one(default_objects, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert deployment["metadata"]["namespace"] == chartkit.NAMESPACE


def test_restricted_security_context(default_objects: list[dict[str, Any]]) -> None:
    pod = one(default_objects, "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = operator_container(default_objects)["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["runAsNonRoot"] is True
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    # The read-only root needs a writable /tmp for Python's and the client's temporary files.
    mounts = {m["mountPath"] for m in operator_container(default_objects)["volumeMounts"]}
    assert "/tmp" in mounts


def test_resources_are_bounded(default_objects: list[dict[str, Any]]) -> None:
    resources = operator_container(default_objects)["resources"]
    assert resources["requests"]["cpu"] and resources["requests"]["memory"]
    assert resources["limits"]["memory"]


@pytest.mark.parametrize(("values", "port"), [([], 8080), ([chartkit.FULL_VALUES], 8081)],
                         ids=["default", "full"])
def test_liveness_probe_hits_kopfs_endpoint(helm_home: Path, values: list[Path],
                                            port: int) -> None:
    objects = chartkit.render(home=helm_home, values=values)
    container = operator_container(objects)
    args = container["args"]
    # kopf serves /healthz where --liveness says; the kubelet probes the same port and path.
    assert args[args.index("--liveness") + 1] == f"http://0.0.0.0:{port}/healthz"
    probe = container["livenessProbe"]["httpGet"]
    assert probe["path"] == "/healthz"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports[probe["port"]] == port


def test_all_namespaces_by_default(default_objects: list[dict[str, Any]]) -> None:
    container = operator_container(default_objects)
    assert container["command"] == ["adaptis"]
    assert container["args"][:2] == ["operator", "--all-namespaces"]
    assert "--namespace" not in container["args"]


def test_watched_namespaces_become_arguments(full_objects: list[dict[str, Any]]) -> None:
    args = operator_container(full_objects)["args"]
    assert args[:3] == ["--verbose", "--verbose", "operator"]
    assert "--all-namespaces" not in args
    pairs = [args[i + 1] for i, a in enumerate(args) if a == "--namespace"]
    assert pairs == ["team-a", "team-b"]
    assert args[-1] == "--dev"  # extraArgs come last


def test_images_and_worker_settings_reach_the_operator(full_objects: list[dict[str, Any]],
                                                       helm_home: Path) -> None:
    container = operator_container(full_objects)
    assert container["image"] == "registry.example.test/adaptis/operator:0.1.0-test"
    args = container["args"]
    assert args[args.index("--worker-image") + 1] == (
        "registry.example.test/adaptis/worker:0.1.0-test")
    assert env_of(container) == {"ADAPTIS_EXTRA": "1"}
    # Profiles: the admin's image (default: the worker image), stored in the release namespace.
    assert args[args.index("--profiler-image") + 1] == (
        "registry.example.test/adaptis/worker:0.1.0-test")
    assert args[args.index("--profile-namespace") + 1] == chartkit.NAMESPACE
    assert (args[args.index("--worker-run-as-user") + 1],
            args[args.index("--worker-run-as-group") + 1]) == ("10001", "10001")
    custom = operator_container(chartkit.render(home=helm_home, sets={
        "profiler.image": "admin/profiler:1", "worker.runAsUser": 65532}))["args"]
    assert custom[custom.index("--profiler-image") + 1] == "admin/profiler:1"
    assert custom[custom.index("--worker-run-as-user") + 1] == "65532"
    digest = "sha256:" + "ab" * 32
    pinned = chartkit.render(home=helm_home, sets={"image.digest": digest})
    assert operator_container(pinned)["image"] == f"adaptis/operator@{digest}"


def test_no_wildcard_anywhere(default_objects: list[dict[str, Any]],
                              full_objects: list[dict[str, Any]]) -> None:
    for objects in (default_objects, full_objects):
        for role in _roles(objects).values():
            for group, resource, verb in _grants(role):
                assert "*" not in (group, resource, verb), role["metadata"]["name"]


def test_rbac_is_exactly_what_the_operator_uses_all_namespaces(
    default_objects: list[dict[str, Any]],
) -> None:
    roles = _roles(default_objects)
    assert set(roles) == {"adaptis-cluster", "adaptis-jobs", "adaptis-profiles"}
    assert _grants(roles["adaptis-cluster"]) == CLUSTER_RULES
    assert _grants(roles["adaptis-jobs"]) == JOB_RULES
    assert roles["adaptis-profiles"]["kind"] == "Role"
    assert roles["adaptis-profiles"]["metadata"]["namespace"] == chartkit.NAMESPACE
    assert _grants(roles["adaptis-profiles"]) == PROFILE_RULES
    bindings = by_kind(default_objects, "ClusterRoleBinding")
    assert {b["roleRef"]["name"] for b in bindings} == {"adaptis-cluster", "adaptis-jobs"}
    (profiles,) = by_kind(default_objects, "RoleBinding")
    assert profiles["metadata"]["namespace"] == chartkit.NAMESPACE
    assert profiles["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                   "name": "adaptis-profiles"}
    sa = one(default_objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"]
    for binding in [*bindings, profiles]:
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": sa, "namespace": chartkit.NAMESPACE}
        ]


def test_rbac_is_namespaced_when_namespaces_are_listed(
    full_objects: list[dict[str, Any]],
) -> None:
    roles = _roles(full_objects)
    # Only Nodes and the ledger's reads stay cluster-wide.
    assert _grants(roles["adaptis-cluster"]) == CLUSTER_RULES
    assert [b["roleRef"]["name"] for b in by_kind(full_objects, "ClusterRoleBinding")] == [
        "adaptis-cluster"
    ]
    bindings = [b for b in by_kind(full_objects, "RoleBinding")
                if b["roleRef"]["name"] != "adaptis-profiles"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    for binding in bindings:
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io",
                                      "kind": "ClusterRole", "name": "adaptis-jobs"}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "adaptis-operator",
                                        "namespace": chartkit.NAMESPACE}]


def test_workers_get_no_token_and_no_role(full_objects: list[dict[str, Any]]) -> None:
    workers = [sa for sa in by_kind(full_objects, "ServiceAccount")
               if sa["metadata"]["name"] == "trainer"]
    assert sorted(sa["metadata"]["namespace"] for sa in workers) == [
        chartkit.NAMESPACE, "team-a", "team-b"]
    assert all(sa["automountServiceAccountToken"] is False for sa in workers)
    subjects = [s for b in by_kind(full_objects, "RoleBinding") + by_kind(
        full_objects, "ClusterRoleBinding") for s in b["subjects"]]
    assert all(s["name"] != "trainer" for s in subjects)


def test_rbac_and_service_account_can_be_brought_by_the_user(helm_home: Path) -> None:
    objects = chartkit.render(home=helm_home, sets={
        "rbac.create": False, "serviceAccount.create": False, "serviceAccount.name": "mine",
        "worker.serviceAccount.create": False})
    assert not [o for o in objects if o["kind"] in (
        "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "ServiceAccount")]
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "mine"
