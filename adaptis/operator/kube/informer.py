"""A watch-fed copy of one API collection: :class:`Informer` (list once, then follow the watch).

Sits under the caches the reconcile passes read instead of listing the cluster
(:mod:`adaptis.operator.scheduling.inventory`): nodes, the pods that hold GPUs, priority classes
and the measured node profiles. It talks to the API server through :class:`WatchSource` (the
HTTP client, :class:`adaptis.operator.kube.client.KubeCluster`, or a test's fake), so it stays
plain code over dicts.

What it does is client-go's reflector, cut to what the operator needs:

- **list** the collection (``resourceVersion=0``: from the API server's watch cache) and hand
  every object to the ``sink`` as an upsert, and every object it held before and no longer
  sees as a delete (``None``): after a relist the sink holds exactly the list;
- **watch** from the list's resourceVersion, with bookmarks (so that a quiet collection's
  version stays recent), and hand each ADDED/MODIFIED/DELETED to the sink as it comes;
- **relist** when the watch says its version is too old (410 Gone), after an error (waiting
  ``backoff`` doubling to ``max_backoff_s``), and every ``relist_s`` in any case, which heals
  whatever a bug or a lost event left behind.

Objects are handed over without ``metadata.managedFields`` (most of a node's bytes, read by
no one here). The sink is called from the informer's own thread, one object at a time; it
does its own locking.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from adaptis.operator.kube.cluster import ApiError

__all__ = ["Informer", "Sink", "WatchSource", "object_key"]

log = logging.getLogger(__name__)

# An object, or None when it is gone; keyed by "namespace/name" (or "name", cluster-scoped).
Sink = Callable[[str, Mapping[str, Any] | None], None]

_GONE = 410


class WatchSource(Protocol):
    """What an informer needs from the API server: a list and a watch of one collection."""

    def list_collection(self, path: str, *, query: Mapping[str, str]
                        ) -> tuple[list[dict[str, Any]], str]:
        """The collection's items and its resourceVersion."""
        ...

    def watch_collection(self, path: str, *, query: Mapping[str, str], resource_version: str,
                         timeout_s: float) -> Iterator[dict[str, Any]]:
        """Watch events ({"type", "object"}) from ``resource_version`` until the server ends
        the stream (after at most ``timeout_s``)."""
        ...


def object_key(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    ns = meta.get("namespace")
    return f"{ns}/{meta.get('name', '')}" if ns else str(meta.get("name", ""))


def _slim(obj: Mapping[str, Any]) -> dict[str, Any]:
    meta = obj.get("metadata") or {}
    if "managedFields" not in meta:
        return dict(obj)
    return {**obj, "metadata": {k: v for k, v in meta.items() if k != "managedFields"}}


class _Expired(Exception):
    """The watch's resourceVersion is too old (410): list again."""


class Informer:
    """Keeps ``sink`` in step with one collection (see the module docstring)."""

    def __init__(
        self,
        source: WatchSource,
        *,
        path: str,
        sink: Sink,
        query: Mapping[str, str] | None = None,
        relist_s: float = 600.0,
        watch_timeout_s: float = 300.0,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._source = source
        self._path = path
        self._query = dict(query or {})
        self._sink = sink
        self._relist_s = relist_s
        self._watch_timeout_s = watch_timeout_s
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._clock = clock
        self._versions: dict[str, str] = {}  # key -> resourceVersion of what the sink holds
        self._synced = threading.Event()
        self._thread: threading.Thread | None = None
        self.relists = 0  # how many lists it made (for tests and logs)

    @property
    def path(self) -> str:
        return self._path

    def wait_synced(self, timeout_s: float) -> bool:
        """Whether the first list reached the sink within ``timeout_s``."""
        return self._synced.wait(timeout_s)

    def start(self, stop: threading.Event) -> None:
        """Run :meth:`run` in a daemon thread until ``stop`` is set."""
        self._thread = threading.Thread(target=self.run, args=(stop,), daemon=True,
                                        name=f"informer {self._path}")
        self._thread.start()

    def run(self, stop: threading.Event) -> None:
        """List and watch until ``stop`` is set; never raises."""
        backoff = self._backoff_s
        while not stop.is_set():
            try:
                version = self.relist()
                backoff = self._backoff_s
                deadline = self._clock() + self._relist_s
                while not stop.is_set() and self._clock() < deadline:
                    version = self.follow(version, stop=stop,
                                          timeout_s=min(self._watch_timeout_s,
                                                        max(1.0, deadline - self._clock())))
            except _Expired:
                log.info("watch of %s: resourceVersion too old; listing again", self._path)
            except Exception as err:  # noqa: BLE001 - a dead informer leaves its cache stale
                log.warning("watch of %s failed (%s); listing again in %.1fs", self._path,
                            str(err).splitlines()[0][:200] if str(err) else type(err).__name__,
                            backoff)
                stop.wait(backoff)
                backoff = min(self._max_backoff_s, backoff * 2)

    def relist(self) -> str:
        """List the collection into the sink (deleting what it no longer holds); its version."""
        items, version = self._source.list_collection(self._path, query=self._query)
        self.relists += 1
        seen: set[str] = set()
        for item in items:
            key = object_key(item)
            seen.add(key)
            rv = str((item.get("metadata") or {}).get("resourceVersion", ""))
            if not rv or self._versions.get(key) != rv:
                self._versions[key] = rv
                self._sink(key, _slim(item))
        for key in [k for k in self._versions if k not in seen]:
            del self._versions[key]
            self._sink(key, None)
        self._synced.set()
        return version

    def follow(self, version: str, *, stop: threading.Event, timeout_s: float) -> str:
        """Apply one watch stream's events from ``version``; the version it reached."""
        stream = self._source.watch_collection(self._path, query=self._query,
                                               resource_version=version, timeout_s=timeout_s)
        for event in stream:
            kind = event.get("type")
            obj = event.get("object") or {}
            if kind == "ERROR":
                code = obj.get("code")
                if code == _GONE:
                    raise _Expired
                raise ApiError(f"watch {self._path}: {code} {obj.get('message', '')}",
                               status=int(code) if isinstance(code, int) else 0)
            version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
            if kind == "BOOKMARK":
                continue
            key = object_key(obj)
            if kind == "DELETED":
                if self._versions.pop(key, None) is not None:
                    self._sink(key, None)
            elif kind in {"ADDED", "MODIFIED"}:
                self._versions[key] = version
                self._sink(key, _slim(obj))
            if stop.is_set():
                break
        return version
