"""The watch-fed caches: the informer's list/watch/relist cycle, the GPU hold book, the
inventory the passes read, and that a pass reads only them (never a list of the cluster)."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from adaptis.operator.control.reconcile import Reconciler
from adaptis.operator.core.labels import LABEL_JOB, LABEL_MANAGED_BY, MANAGED_BY, NODE_ANNOTATION
from adaptis.operator.core.settings import ReconcileSettings
from adaptis.operator.kube.cluster import ApiError
from adaptis.operator.kube.informer import Informer
from adaptis.operator.scheduling.capacity import GpuHold, GpuHolds, HoldBook
from adaptis.operator.scheduling.inventory import ListedInventory, WatchedInventory

PROFILE_NS = ReconcileSettings().profile_namespace


def _obj(name: str, rv: str, *, ns: str | None = None, **extra: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "resourceVersion": rv}
    if ns:
        meta["namespace"] = ns
    return {"metadata": meta, **extra}


def _event(kind: str, obj: Mapping[str, Any]) -> dict[str, Any]:
    return {"type": kind, "object": dict(obj)}


class Source:
    """A scripted WatchSource: lists and watch streams handed out in order."""

    def __init__(self, *, lists: list[tuple[list[dict[str, Any]], str]],
                 streams: list[list[dict[str, Any]] | Exception] | None = None,
                 stop: threading.Event | None = None) -> None:
        self.lists = lists
        self.streams = streams or []
        self.watched_from: list[str] = []
        self.stop = stop

    def list_collection(self, path: str, *, query: Mapping[str, str]
                        ) -> tuple[list[dict[str, Any]], str]:
        if not self.lists:
            raise AssertionError("listed more often than scripted")
        listed = self.lists.pop(0)
        if not self.lists and self.stop is not None and not self.streams:
            self.stop.set()  # the script is played: the run ends after this list
        return listed

    def watch_collection(self, path: str, *, query: Mapping[str, str], resource_version: str,
                         timeout_s: float) -> Iterator[dict[str, Any]]:
        self.watched_from.append(resource_version)
        stream = self.streams.pop(0) if self.streams else []
        if not self.streams and not self.lists and self.stop is not None:
            self.stop.set()
        if isinstance(stream, Exception):
            raise stream
        yield from stream


class Sink:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.held: dict[str, Mapping[str, Any]] = {}

    def __call__(self, key: str, obj: Mapping[str, Any] | None) -> None:
        self.calls.append((key, None if obj is None else obj["metadata"]["resourceVersion"]))
        if obj is None:
            self.held.pop(key, None)
        else:
            self.held[key] = obj


# --- the informer ---------------------------------------------------------------------------


def test_events_apply_in_order_after_the_list_and_the_watch_resumes_from_the_last_version(
) -> None:
    managed = {"managedFields": [{"manager": "kubelet"}]}
    a = _obj("a", "5")
    a["metadata"].update(managed)
    source = Source(lists=[([a, _obj("b", "6")], "10")], streams=[[
        _event("MODIFIED", _obj("a", "11")),
        _event("ADDED", _obj("c", "12")),
        _event("DELETED", _obj("b", "13")),
        _event("MODIFIED", _obj("a", "14")),
        _event("BOOKMARK", {"metadata": {"resourceVersion": "20"}}),
    ]])
    sink = Sink()
    informer = Informer(source, path="/api/v1/nodes", sink=sink)
    version = informer.relist()
    assert version == "10" and informer.wait_synced(0)
    assert "managedFields" not in sink.held["a"]["metadata"]  # dropped on the way in
    version = informer.follow(version, stop=threading.Event(), timeout_s=1)
    assert source.watched_from == ["10"]
    assert version == "20"  # the bookmark's: the next watch starts there
    assert sink.calls == [("a", "5"), ("b", "6"), ("a", "11"), ("c", "12"), ("b", None),
                          ("a", "14")]
    assert {k: o["metadata"]["resourceVersion"] for k, o in sink.held.items()} == {
        "a": "14", "c": "12"}


def test_a_relist_deletes_what_vanished_unseen_and_skips_what_did_not_change() -> None:
    source = Source(lists=[([_obj("a", "1", ns="x"), _obj("b", "2", ns="x")], "2"),
                           ([_obj("a", "1", ns="x"), _obj("c", "3", ns="x")], "3")])
    sink = Sink()
    informer = Informer(source, path="/api/v1/pods", sink=sink)
    informer.relist()
    sink.calls.clear()
    informer.relist()  # b was deleted while no watch ran (its DELETED event was lost)
    assert sink.calls == [("x/c", "3"), ("x/b", None)]  # a is unchanged: not handed again
    assert set(sink.held) == {"x/a", "x/c"}


def test_a_deleted_event_of_an_unknown_object_changes_nothing() -> None:
    source = Source(lists=[([], "1")], streams=[[_event("DELETED", _obj("ghost", "2"))]])
    sink = Sink()
    informer = Informer(source, path="/api/v1/nodes", sink=sink)
    informer.follow(informer.relist(), stop=threading.Event(), timeout_s=1)
    assert sink.calls == []


def test_run_lists_again_after_a_410_and_after_an_error_and_never_raises() -> None:
    stop = threading.Event()
    gone = {"type": "ERROR", "object": {"code": 410, "message": "too old resource version"}}
    source = Source(
        lists=[([_obj("a", "1")], "1"), ([_obj("a", "1"), _obj("b", "4")], "4"),
               ([_obj("b", "4")], "6")],
        streams=[[_event("ADDED", _obj("z", "2")), gone],
                 ApiError("watch: connection reset", status=0)],
        stop=stop)
    sink = Sink()
    informer = Informer(source, path="/api/v1/nodes", sink=sink, backoff_s=0.01)
    informer.run(stop)
    assert informer.relists == 3
    assert source.watched_from == ["1", "4"]
    assert set(sink.held) == {"b"}  # z and a went with the relists, b came with them


def test_a_watch_error_other_than_410_is_an_api_error() -> None:
    source = Source(lists=[([], "1")], streams=[[
        {"type": "ERROR", "object": {"code": 500, "message": "internal"}}]])
    informer = Informer(source, path="/api/v1/nodes", sink=Sink())
    with pytest.raises(ApiError, match="500 internal"):
        informer.follow(informer.relist(), stop=threading.Event(), timeout_s=1)


# --- the hold book ----------------------------------------------------------------------------


def test_the_hold_book_sums_per_node_and_job_and_moves_a_pod_when_it_changes() -> None:
    book = HoldBook()
    book.put(("t", "x"), GpuHold(node="n0", gpus=2, owner=None))
    book.put(("t", "y"), GpuHold(node="n0", gpus=1, owner=None))
    book.put(("ns", "a-0"), GpuHold(node="n1", gpus=4, owner=("ns", "a")))
    before = book.snapshot()
    book.put(("ns", "a-0"), GpuHold(node="n2", gpus=4, owner=("ns", "a")))  # re-pinned
    book.put(("t", "x"), None)  # ended
    book.put(("t", "never"), None)  # never held anything: no effect
    after = book.snapshot()
    assert after.unowned == {"n0": 1}
    assert after.owned == {("ns", "a"): {"n2": 4}}
    assert set(after.pods) == {("t", "y"), ("ns", "a-0")}
    # A snapshot is not changed by what came after it.
    assert before.unowned == {"n0": 3} and before.owned == {("ns", "a"): {"n1": 4}}
    book.put(("ns", "a-0"), None)
    assert book.snapshot().owned == {}


# --- the inventory ----------------------------------------------------------------------------


def _gpu_pod(name: str, *, ns: str = "other", node: str | None = "n0", gpus: int = 1,
             job: str | None = None, pinned: str | None = None, rv: str = "1"
             ) -> dict[str, Any]:
    labels = {LABEL_MANAGED_BY: MANAGED_BY, LABEL_JOB: job} if job else {}
    annotations = {NODE_ANNOTATION: pinned} if pinned else {}
    spec: dict[str, Any] = {"containers": [
        {"resources": {"limits": {"nvidia.com/gpu": str(gpus)}}} if gpus else {}]}
    if node:
        spec["nodeName"] = node
    return {"metadata": {"name": name, "namespace": ns, "resourceVersion": rv,
                         "labels": labels, "annotations": annotations}, "spec": spec}


class _NoWatch:
    """Collections by path, listed once; no watch."""

    def __init__(self, collections: Mapping[str, list[dict[str, Any]]]) -> None:
        self.collections = collections

    def list_collection(self, path: str, *, query: Mapping[str, str]
                        ) -> tuple[list[dict[str, Any]], str]:
        return list(self.collections.get(path, [])), "1"

    def watch_collection(self, path: str, *, query: Mapping[str, str], resource_version: str,
                         timeout_s: float) -> Iterator[dict[str, Any]]:
        return iter(())


def _informer(inventory: WatchedInventory, path: str) -> Informer:
    return next(i for i in inventory.informers if i.path == path)


def test_the_inventory_follows_pod_events_into_gpu_holds() -> None:
    stream = [
        _event("ADDED", _gpu_pod("x", gpus=2, rv="2")),
        _event("ADDED", _gpu_pod("cpu-only", gpus=0, rv="3")),  # holds no GPU: not kept
        _event("ADDED", _gpu_pod("w-0", ns="ns", job="a", node=None, pinned="n1", gpus=4,
                                 rv="4")),
        _event("MODIFIED", _gpu_pod("w-0", ns="ns", job="a", node="n1", gpus=4, rv="5")),
        _event("ADDED", _gpu_pod("done", node="n1", gpus=1, rv="6")),
        _event("DELETED", _gpu_pod("done", node="n1", gpus=1, rv="7")),  # left the selector
    ]
    source = Source(lists=[([_gpu_pod("old", node="n2", gpus=8)], "1")], streams=[stream])
    inventory = WatchedInventory(source, profile_namespace=PROFILE_NS)
    pods = _informer(inventory, "/api/v1/pods")
    pods.follow(pods.relist(), stop=threading.Event(), timeout_s=1)
    holds = inventory.gpu_holds()
    assert holds.unowned == {"n0": 2, "n2": 8}
    assert holds.owned == {("ns", "a"): {"n1": 4}}
    assert ("other", "cpu-only") not in holds.pods and ("other", "done") not in holds.pods


def test_the_inventory_holds_nodes_priorities_and_profiles_from_its_lists() -> None:
    node = {"metadata": {"name": "n0", "resourceVersion": "1",
                         "managedFields": [{"manager": "kubelet"}]}}
    source = _NoWatch({
        "/api/v1/nodes": [node],
        "/apis/scheduling.k8s.io/v1/priorityclasses": [
            {"metadata": {"name": "high", "resourceVersion": "1"}, "value": 1000},
            {"metadata": {"name": "odd", "resourceVersion": "1"}, "value": "x"}],
    })
    inventory = WatchedInventory(source, profile_namespace=PROFILE_NS)
    for informer in inventory.informers:
        informer.relist()
    assert inventory.wait_synced(0)
    assert list(inventory.nodes()) == ["n0"]
    assert "managedFields" not in inventory.nodes()["n0"]["metadata"]
    assert inventory.priority("high") == 1000
    assert inventory.priority("odd") == 0 and inventory.priority("missing") == 0
    assert inventory.priority(None) == 0
    assert inventory.stored_profiles() == {}


def test_an_inventory_not_synced_says_so() -> None:
    inventory = WatchedInventory(_NoWatch({}), profile_namespace=PROFILE_NS)
    _informer(inventory, "/api/v1/nodes").relist()
    assert not inventory.wait_synced(0)  # pods, priorities and profiles never listed


def test_the_listed_inventory_reads_the_pods_again_only_once_its_ttl_has_passed(
    cluster: Any,
) -> None:
    now = [100.0]
    inventory = ListedInventory(cluster, profile_namespace=PROFILE_NS, snapshot_ttl_s=2.0,
                                clock=lambda: now[0])
    inventory.gpu_holds()
    now[0] = 101.9
    inventory.gpu_holds()
    assert cluster.calls.count("list_active_pods") == 1
    now[0] = 102.0
    inventory.gpu_holds()
    assert cluster.calls.count("list_active_pods") == 2


# --- a pass reads the caches, never a list of the cluster ------------------------------------


class _FakeSource:
    """The in-memory cluster's objects as collections (listed; no watch)."""

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster

    def list_collection(self, path: str, *, query: Mapping[str, str]
                        ) -> tuple[list[dict[str, Any]], str]:
        if path == "/api/v1/nodes":
            items = list(self.cluster.nodes.values())
        elif path == "/api/v1/pods":
            items = [o for (kind, _, _), o in self.cluster.objects.items() if kind == "Pod"]
        else:
            items = []
        return [{**i, "metadata": {**i["metadata"], "resourceVersion": "1"}} for i in items], "1"

    def watch_collection(self, path: str, *, query: Mapping[str, str], resource_version: str,
                         timeout_s: float) -> Iterator[dict[str, Any]]:
        return iter(())


def test_a_pass_on_a_watched_inventory_lists_neither_nodes_nor_pods(
    cluster: Any, make_job: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    inventory = WatchedInventory(_FakeSource(cluster), profile_namespace=PROFILE_NS)
    for informer in inventory.informers:
        informer.relist()

    def no_list() -> list[dict[str, Any]]:
        raise AssertionError("a pass listed the nodes")

    monkeypatch.setattr(cluster, "list_nodes", no_list)
    monkeypatch.setattr(cluster, "priority_of", lambda _name: pytest.fail("GET priorityclass"))
    body = make_job("a", spec={"parallelism": {"workers": 4, "gpusPerWorker": 1},
                               "worker": {"priorityClassName": "high"}})
    cluster.add_job(body)
    rec = Reconciler(cluster, inventory=inventory)
    rec.reconcile("ns", "a")
    assert cluster.job("a")["status"]["phase"] == "Planned"
    assert "list_active_pods" not in cluster.calls
    # What another team's pod holds reaches the next admission through the cache only.
    taken = {r["node"] for r in cluster.job("a")["status"]["placement"]}
    other = sorted(set(cluster.nodes) - taken)[0]
    pod = _gpu_pod("x", node=other, gpus=2)
    _informer(inventory, "/api/v1/pods")._sink("other/x", pod)
    cluster.add_job(make_job("b", spec={"parallelism": {"workers": 4, "gpusPerWorker": 1}}))
    rec.reconcile("ns", "b")
    status = cluster.job("b")["status"]
    assert status["phase"] == "Queued", status
    assert "2 free" in status["message"]  # 8 GPUs: 4 reserved for a, 2 held by x


def test_gpu_holds_of_pods_matches_the_book() -> None:
    pods = [_gpu_pod("x", gpus=2), _gpu_pod("y", gpus=1), _gpu_pod("z", node=None)]
    holds = GpuHolds.of_pods(pods)
    assert holds.unowned == {"n0": 3} and set(holds.pods) == {("other", "x"), ("other", "y")}


def test_a_node_that_comes_or_goes_after_the_first_list_wakes_the_jobs() -> None:
    woken: list[int] = []
    source = Source(lists=[([_obj("n0", "1"), _obj("n1", "1")], "1")], streams=[[
        _event("MODIFIED", _obj("n0", "2")),  # a heartbeat: no wake-up
        _event("ADDED", _obj("n2", "3")),
        _event("DELETED", _obj("n1", "4")),
    ]])
    inventory = WatchedInventory(source, profile_namespace=PROFILE_NS,
                                 on_nodes_changed=lambda: woken.append(1))
    nodes = _informer(inventory, "/api/v1/nodes")
    version = nodes.relist()
    assert woken == []  # the first list: no job waits on it yet
    nodes.follow(version, stop=threading.Event(), timeout_s=1)
    assert len(woken) == 2 and sorted(inventory.nodes()) == ["n0", "n2"]


def test_a_snapshot_copies_only_the_pods_asked_for_and_every_sum() -> None:
    book = HoldBook()
    book.put(("ops", "profiler"), GpuHold(node="n0", gpus=1, owner=("ops", "a")))
    book.put(("t", "x"), GpuHold(node="n0", gpus=2, owner=None))
    holds = book.snapshot(pods=[("ops", "profiler"), ("ops", "gone")])
    assert set(holds.pods) == {("ops", "profiler")}
    assert holds.unowned == {"n0": 2} and holds.owned == {("ops", "a"): {"n0": 1}}
    assert set(book.snapshot().pods) == {("ops", "profiler"), ("t", "x")}
