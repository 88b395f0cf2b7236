"""What a reconcile pass knows of the cluster beyond its own job: the :class:`Inventory`.

Sits under :mod:`adaptis.operator.scheduling.placement` and
:mod:`adaptis.operator.scheduling.admitting`, which read the nodes, the measured node profiles,
the GPUs pods hold and the value of priority classes through it, never by listing the cluster.
Two kinds:

- :class:`WatchedInventory`, the operator's: four informers
  (:mod:`adaptis.operator.kube.informer`) keep it in step with the API server from watch
  events, so that a pass costs the same at 10 nodes as at 10,000 (docs/shared-cluster.md,
  "At a thousand nodes", says why a watch of our own and how a stale copy is made safe);
- :class:`ListedInventory`, which reads the cluster when asked (the pods at most every
  ``snapshot_ttl_s``): what the unit tests use, whose in-memory cluster has no watch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from adaptis.operator.kube.cluster import Cluster
from adaptis.operator.kube.informer import Informer, WatchSource
from adaptis.operator.profiling.profile_store import (
    StoredProfiles,
    profile_selector,
    read_stored_profiles,
)
from adaptis.operator.scheduling.capacity import GpuHolds, HoldBook, PodKey, hold_of

__all__ = ["ACTIVE_PODS", "Inventory", "ListedInventory", "WatchedInventory"]

log = logging.getLogger(__name__)

# Pods that may hold GPUs: not terminated. A pod that ends leaves the selector, and the watch
# then sends it as DELETED.
ACTIVE_PODS = "status.phase!=Succeeded,status.phase!=Failed"


class Inventory(Protocol):
    """The cluster as a pass may read it (each call a consistent copy, safe to keep)."""

    def nodes(self) -> dict[str, Mapping[str, Any]]:
        """Every node, by name."""
        ...

    def stored_profiles(self) -> StoredProfiles:
        """The measured node profiles (profile_store), by node."""
        ...

    def gpu_holds(self, *, pods: frozenset[PodKey] = frozenset()) -> GpuHolds:
        """What the non-terminated pods of every namespace hold (by pod: at least ``pods``)."""
        ...

    def priority(self, priority_class: str | None) -> int:
        """The value of a PriorityClass (0 for none or an unknown name, as for pods)."""
        ...


class ListedInventory:
    """:class:`Inventory` read from the cluster at each call (pods: at most every
    ``snapshot_ttl_s``)."""

    def __init__(self, cluster: Cluster, *, profile_namespace: str, snapshot_ttl_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._cluster = cluster
        self._profile_namespace = profile_namespace
        self._ttl_s = snapshot_ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._holds: tuple[float, GpuHolds] | None = None

    def nodes(self) -> dict[str, Mapping[str, Any]]:
        return {str((n.get("metadata") or {}).get("name", "")): n
                for n in self._cluster.list_nodes()}

    def stored_profiles(self) -> StoredProfiles:
        return read_stored_profiles(self._cluster.list_config_maps(
            self._profile_namespace, selector=profile_selector()))

    def gpu_holds(self, *, pods: frozenset[PodKey] = frozenset()) -> GpuHolds:  # noqa: ARG002
        with self._lock:  # by pod every one, a superset of ``pods``
            now = self._clock()
            if self._holds is None or now - self._holds[0] >= self._ttl_s:
                self._holds = (now, GpuHolds.of_pods(self._cluster.list_active_pods()))
            return self._holds[1]

    def priority(self, priority_class: str | None) -> int:
        return self._cluster.priority_of(priority_class)


class WatchedInventory:
    """:class:`Inventory` kept from watch events: nodes (without their managed fields), the
    GPUs of every non-terminated pod (never the pods themselves), priority class values and
    the measured profiles of the operator's namespace. :meth:`start`, then
    :meth:`wait_synced` before the first pass: an empty copy would admit onto GPUs that
    others hold."""

    def __init__(self, source: WatchSource, *, profile_namespace: str,
                 relist_s: float = 600.0,
                 on_nodes_changed: Callable[[], None] | None = None) -> None:
        # Called when a node comes or goes after the first list (it may let a waiting job in,
        # or break a planned one); readiness and label changes wait for the resync, as
        # heartbeats make a node change every few seconds.
        self._on_nodes_changed = on_nodes_changed
        self._lock = threading.Lock()
        self._nodes: dict[str, Mapping[str, Any]] = {}
        self._profile_maps: dict[str, Mapping[str, Any]] = {}
        self._stored: StoredProfiles = {}
        self._priorities: dict[str, int] = {}
        self._holds = HoldBook()
        selector = ",".join(f"{k}={v}" for k, v in sorted(profile_selector().items()))
        self._node_informer = Informer(source, path="/api/v1/nodes", sink=self._on_node,
                                       relist_s=relist_s)
        self.informers = [
            self._node_informer,
            Informer(source, path="/api/v1/pods", sink=self._on_pod, relist_s=relist_s,
                     query={"fieldSelector": ACTIVE_PODS}),
            Informer(source, path="/apis/scheduling.k8s.io/v1/priorityclasses",
                     sink=self._on_priority_class, relist_s=relist_s),
            Informer(source, path=f"/api/v1/namespaces/{profile_namespace}/configmaps",
                     sink=self._on_profile, relist_s=relist_s,
                     query={"labelSelector": selector}),
        ]
        self._stop = threading.Event()

    # --- life ---------------------------------------------------------------------------------
    def start(self) -> None:
        for informer in self.informers:
            informer.start(self._stop)

    def wait_synced(self, timeout_s: float) -> bool:
        """Whether every informer made its first list within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        return all(i.wait_synced(max(0.0, deadline - time.monotonic())) for i in self.informers)

    def stop(self) -> None:
        self._stop.set()

    # --- sinks (informer threads) --------------------------------------------------------------
    def _on_node(self, key: str, obj: Mapping[str, Any] | None) -> None:
        with self._lock:
            if obj is None:
                came_or_went = self._nodes.pop(key, None) is not None
            else:
                came_or_went = key not in self._nodes
                self._nodes[key] = obj
        if (came_or_went and self._on_nodes_changed is not None
                and self._node_informer.wait_synced(0)):
            self._on_nodes_changed()

    def _on_pod(self, key: str, obj: Mapping[str, Any] | None) -> None:
        ns, _, name = key.partition("/")
        self._holds.put((ns, name), None if obj is None else hold_of(obj))

    def _on_priority_class(self, key: str, obj: Mapping[str, Any] | None) -> None:
        value = None if obj is None else obj.get("value")
        with self._lock:
            if isinstance(value, int):
                self._priorities[key] = value
            else:
                self._priorities.pop(key, None)

    def _on_profile(self, key: str, obj: Mapping[str, Any] | None) -> None:
        with self._lock:
            if obj is None:
                self._profile_maps.pop(key, None)
            else:
                self._profile_maps[key] = obj
            # A few ConfigMaps (one per measured node), changed rarely: read them all again.
            self._stored = read_stored_profiles(self._profile_maps.values())

    # --- Inventory ----------------------------------------------------------------------------
    def nodes(self) -> dict[str, Mapping[str, Any]]:
        with self._lock:
            return dict(self._nodes)

    def stored_profiles(self) -> StoredProfiles:
        with self._lock:
            return self._stored

    def gpu_holds(self, *, pods: frozenset[PodKey] = frozenset()) -> GpuHolds:
        return self._holds.snapshot(pods=pods)

    def priority(self, priority_class: str | None) -> int:
        if not priority_class:
            return 0
        with self._lock:
            return self._priorities.get(priority_class, 0)
