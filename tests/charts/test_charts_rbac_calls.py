"""The chart's RBAC against the calls the operator makes, derived from the operator's code.

Every (API group, resource, verb) the chart grants must be one the operator uses, and every one
it uses must be granted, with the scope it is used at: cluster-scoped resources in the
``-cluster`` role, namespaced ones in the ``-jobs`` role. The calls are not a table kept by hand:

* the reconciler's client (adaptis/operator/kube/client.py): every method of the ``Cluster``
  protocol is called on a :class:`KubeCluster` whose transport records the HTTP method and path
  instead of sending them; ``create`` is tried with every core kind its router accepts;
* kopf's watches: every selector in the registry the operator runs (list and watch; handlers
  that change objects would add patch), and the Events kopf posts when posting is on;
* what admission asks besides the call itself: a child whose owner reference blocks its owner's
  deletion needs ``update`` on the owner's ``finalizers`` (OwnerReferencesPermissionEnforcement).

So a grant added to charts/adaptis/templates/rbac.yaml that the operator never uses fails here,
as does a call added to the operator without its grant. tests/integration/test_helm_install.py
runs the operator with these grants against a real API server.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from importlib.metadata import version
from pathlib import Path
from typing import Any

import chartkit
import pytest
from chartkit import by_kind

from adaptis.api.job import GROUP, PLURAL
from adaptis.operator.control.app import _kopf_settings
from adaptis.operator.control.handlers import build_registry
from adaptis.operator.control.workqueue import WorkQueue
from adaptis.operator.core.errors import OperatorError
from adaptis.operator.core.records import JobRef
from adaptis.operator.kube import client as kube
from adaptis.operator.kube.client import KubeCluster
from adaptis.operator.kube.cluster import Cluster
from adaptis.operator.scheduling.inventory import WatchedInventory

Grant = tuple[str, str, str]  # (apiGroup, resource[/subresource], verb)

_JOB = JobRef(name="job", namespace="ns", uid="uid-1")
# Kinds of core/v1 the client could be asked to create; the router decides which it serves.
_CORE_KINDS = ("Pod", "Service", "ConfigMap", "Event", "Secret", "ServiceAccount",
               "PersistentVolumeClaim", "Endpoints", "LimitRange", "ResourceQuota",
               "ReplicationController", "PodTemplate", "Binding")

# One call of each Cluster method (arguments do not matter, the route does).
_SAMPLES: dict[str, Callable[[KubeCluster], object]] = {
    "get_job": lambda c: c.get_job("ns", "job"),
    "patch_job_status": lambda c: c.patch_job_status("ns", "job", status={"phase": "Running"}),
    "delete_job": lambda c: c.delete_job("ns", "job"),
    "list_nodes": lambda c: c.list_nodes(),
    "list_pods": lambda c: c.list_pods("ns", "job"),
    "list_active_pods": lambda c: c.list_active_pods(),
    "priority_of": lambda c: c.priority_of("high"),
    "get_config_map": lambda c: c.get_config_map("ns", "job"),
    "list_config_maps": lambda c: c.list_config_maps("ns", selector={"a": "b"}),
    "create": lambda c: [c.create({"kind": kind, "metadata": {"namespace": "ns", "name": "x"}})
                         for kind in _routable_kinds()],
    "dry_run_create": lambda c: c.dry_run_create(
        {"kind": "Pod", "metadata": {"namespace": "ns", "name": "x"}}),
    "replace_config_map": lambda c: c.replace_config_map(
        {"kind": "ConfigMap", "metadata": {"namespace": "ns", "name": "x"}, "data": {}}),
    "delete_pod": lambda c: c.delete_pod("ns", "pod", force=True),
    "delete_config_map": lambda c: c.delete_config_map("ns", "x"),
    "event": lambda c: c.event(_JOB, type_="Normal", reason="Planned", message="m"),
}

_PATH = re.compile(r"^/(?:api/v1|apis/(?P<group>[^/]+)/[^/]+)"
                   r"(?P<ns>/namespaces/[^/]+)?/(?P<resource>[^/]+)(?:/(?P<name>[^/]+))?"
                   r"(?:/(?P<sub>[^/]+))?$")


def _routable_kinds() -> list[str]:
    kinds = []
    for kind in _CORE_KINDS:
        try:
            kube._collection({"kind": kind, "metadata": {"namespace": "ns"}})
        except OperatorError:
            continue
        kinds.append(kind)
    return kinds


def _protocol_methods() -> list[str]:
    return sorted(name for name, value in vars(Cluster).items()
                  if callable(value) and not name.startswith("_"))


def _verb(method: str, *, named: bool, query: Mapping[str, str] | None) -> str:
    if method == "GET":
        if named:
            return "get"
        return "watch" if (query or {}).get("watch") in ("1", "true") else "list"
    if method == "DELETE":
        return "delete" if named else "deletecollection"
    return {"POST": "create", "PATCH": "patch", "PUT": "update"}[method]


def client_calls() -> dict[tuple[str, str, str], bool]:
    """(group, resource, verb) -> namespaced, of every call the reconciler's client makes."""
    calls: dict[tuple[str, str, str], bool] = {}

    def record(method: str, path: str, *, body: Any = None,
               query: Mapping[str, str] | None = None, **_: Any) -> tuple[int, dict[str, Any]]:
        match = _PATH.match(path)
        assert match, f"unrecognised API path {path}"
        resource = match["resource"] + (f"/{match['sub']}" if match["sub"] else "")
        verb = _verb(method, named=match["name"] is not None, query=query)
        calls[(match["group"] or "", resource, verb)] = match["ns"] is not None
        if isinstance(body, Mapping):
            for ref in (body.get("metadata") or {}).get("ownerReferences") or []:
                if ref.get("blockOwnerDeletion"):
                    group = ref["apiVersion"].rpartition("/")[0]
                    calls[(group, _plural(ref["kind"]) + "/finalizers", "update")] = True
        return 200, {"items": []}

    client = KubeCluster.__new__(KubeCluster)  # no credentials: the transport is replaced
    client.request = record  # type: ignore[method-assign]
    missing = [name for name in _protocol_methods() if name not in _SAMPLES]
    assert not missing, f"add a sample call of Cluster.{missing} to _SAMPLES"
    for name in _protocol_methods():
        _SAMPLES[name](client)

    def watch(path: str, *, query: Mapping[str, str], **_: Any) -> Iterator[dict[str, Any]]:
        record("GET", path, query={**query, "watch": "true"})
        return iter(())

    client.watch_collection = watch  # type: ignore[method-assign]
    # The operator's inventory: each informer lists, then watches, its collection.
    for informer in WatchedInventory(client, profile_namespace="release").informers:
        informer.relist()
        informer.follow("1", stop=threading.Event(), timeout_s=1.0)
    # The children carry the job's owner reference (manifests._meta), which blocks deletion.
    record("POST", "/api/v1/namespaces/ns/pods", body={"metadata": {
        "ownerReferences": [_JOB.owner_reference()]}})
    return calls


def _plural(kind: str) -> str:
    plurals = {"AdaPtisJob": PLURAL}
    assert kind in plurals, f"owner kind {kind}: add its plural"
    return plurals[kind]


# The parts of a kopf OperatorRegistry whose selectors kopf watches (kopf's reactor reads the
# same ones, kopf/_core/reactor/observation.py). kopf (1.45) has no public view of a registry's
# selectors, so these private names are read, and a kopf that renames them fails here by name.
_KOPF_READING = ("_watching", "_indexing")
_KOPF_WRITING = ("_changing", "_spawning")


def kopf_part(registry: object, name: str) -> Any:
    """A registry's part ``name``, or a failure that names the kopf version to adapt to."""
    part = getattr(registry, name, None)
    if not callable(getattr(part, "get_all_selectors", None)):
        pytest.fail(f"kopf {version('kopf')}: OperatorRegistry.{name}.get_all_selectors() is "
                    "gone; kopf has no public view of the watched selectors, so this test reads "
                    "its private parts: find where this kopf keeps them (its reactor's "
                    "observation.py) and update _KOPF_READING/_KOPF_WRITING")
    return part


def kopf_calls() -> set[tuple[str, str, str]]:
    """What kopf itself calls for the operator's handlers and settings."""
    registry = build_registry(WorkQueue(lambda _key: None))
    calls: set[tuple[str, str, str]] = set()
    reading = [kopf_part(registry, name) for name in _KOPF_READING]
    writing = [kopf_part(registry, name) for name in _KOPF_WRITING]
    for sub, verbs in [(r, ("list", "watch")) for r in reading] + [
            (r, ("list", "watch", "patch")) for r in writing]:
        for selector in sub.get_all_selectors():
            calls |= {(selector.group or "", selector.any_name, verb) for verb in verbs}
    if _kopf_settings().posting.enabled:
        calls.add(("", "events", "create"))
    return calls


def operator_calls() -> tuple[set[Grant], set[Grant]]:
    """(cluster-scoped, namespaced) grants the operator needs."""
    client = client_calls()
    # A resource the client uses in a namespace is watched by kopf per namespace too.
    scope: dict[tuple[str, str], bool] = {}
    for (group, resource, _verb), namespaced_call in client.items():
        key = (group, resource.partition("/")[0])
        scope[key] = scope.get(key, False) or namespaced_call
    cluster: set[Grant] = {call for call, ns in client.items() if not ns}
    namespaced: set[Grant] = {call for call, ns in client.items() if ns}
    for call in kopf_calls():
        key = (call[0], call[1].partition("/")[0])
        assert key in scope, f"{key}: kopf watches it but the client never says its scope"
        (namespaced if scope[key] else cluster).add(call)
    return cluster, namespaced


def grants(role: Mapping[str, Any]) -> set[Grant]:
    return {(group, resource, verb)
            for rule in role["rules"] for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}


def _roles(objects: Iterable[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] in ("ClusterRole", "Role")}


def test_a_kopf_that_moved_its_registry_parts_fails_naming_its_version() -> None:
    assert kopf_part(build_registry(WorkQueue(lambda _key: None)), "_watching") is not None
    with pytest.raises(pytest.fail.Exception, match=rf"^kopf {re.escape(version('kopf'))}: "
                       r"OperatorRegistry\._watching\.get_all_selectors\(\) is gone"):
        kopf_part(object(), "_watching")  # what a kopf without the attribute looks like


def test_the_derivation_sees_the_operators_calls() -> None:
    cluster, namespaced = operator_calls()
    # Anchors, so that a broken derivation cannot make both sides empty and equal.
    assert ("", "nodes", "list") in cluster
    assert {("", "pods", "create"), (GROUP, f"{PLURAL}/status", "patch"),
            (GROUP, f"{PLURAL}/finalizers", "update"), ("", "pods", "watch")} <= namespaced
    assert not any(resource == "secrets" for _g, resource, _v in cluster | namespaced)


def test_chart_grants_exactly_the_calls_the_operator_makes(
    default_objects: list[dict[str, Any]],
) -> None:
    cluster, namespaced = operator_calls()
    roles = _roles(default_objects)
    # No role grants anything the operator never calls ...
    for name, role in roles.items():
        unused = grants(role) - cluster - namespaced
        assert not unused, f"{name} grants what the operator never calls: {sorted(unused)}"
    # ... and every call is granted: cluster-scoped ones by a ClusterRoleBinding, namespaced
    # ones by some role (the job namespaces' and the release namespace's roles split them; the
    # integration test runs the operator with them and fails on any 403).
    wide = set().union(*(grants(roles[b["roleRef"]["name"]])
                         for b in by_kind(default_objects, "ClusterRoleBinding")))
    assert not cluster - wide, f"not granted cluster-wide: {sorted(cluster - wide)}"
    everywhere = set().union(*(grants(role) for role in roles.values()))
    assert not namespaced - everywhere, f"not granted: {sorted(namespaced - everywhere)}"


@pytest.mark.parametrize("listed", [["team-a"], ["team-a", "team-b"]])
def test_namespaced_install_has_no_cluster_wide_rights_on_namespaced_resources(
    helm_home: Path, listed: list[str],
) -> None:
    objects = chartkit.render(home=helm_home, sets={"operator.watchNamespaces": listed})
    _cluster, namespaced = operator_calls()
    namespaced_resources = {(g, r.partition("/")[0]) for g, r, _v in namespaced}
    roles = _roles(objects)
    # The one exception, read-only: listing and watching every pod is how the allocation ledger
    # sees which GPUs other teams' pods hold (docs/shared-cluster.md).
    ledger_read = {("", "pods", "list"), ("", "pods", "watch")}
    for binding in by_kind(objects, "ClusterRoleBinding"):
        role = roles[binding["roleRef"]["name"]]
        wide = {(g, r, v) for g, r, v in grants(role)
                if (g, r.partition("/")[0]) in namespaced_resources} - ledger_read
        assert not wide, f"{binding['metadata']['name']} grants {sorted(wide)} in every namespace"
        assert {r for _g, r, _v in grants(role)} == {"nodes", "pods", "priorityclasses"}
    # Each watched namespace gets the same job rights, through its RoleBinding, and nothing the
    # operator never calls.
    per_namespace = [set().union(*(grants(roles[b["roleRef"]["name"]])
                                   for b in by_kind(objects, "RoleBinding")
                                   if b["metadata"]["namespace"] == namespace))
                     for namespace in listed]
    unused = per_namespace[0] - namespaced
    assert not unused, f"watched namespaces get what the operator never calls: {sorted(unused)}"
    assert all(granted == per_namespace[0] for granted in per_namespace)
    assert {("", "pods", "create"), (GROUP, PLURAL, "watch")} <= per_namespace[0]
