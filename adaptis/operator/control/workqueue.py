"""A work queue of job keys: coalescing, one pass per key at a time, delayed and periodic retries.

Sits between the kopf handlers (which only *add* keys: a job event, a pod event, a node event) and
:class:`~adaptis.operator.control.reconcile.Reconciler` (which processes one key per call). As in
client-go's workqueue:

- a key added while queued is queued once (64 pod events of one job make one pass, not 64);
- a key added while being processed is marked dirty and processed again right after, never by
  two workers at once (so passes of one job never race each other);
- a failed pass is retried with exponential backoff, also when the key was added while it ran:
  a failing pass's own pod deletions come back as pod events during the pass, and running
  again at once on those would retry a failing job in a hot loop (the backoff retry re-reads
  everything, so the event is only delayed, never lost); a pass may ask to be looked at again
  later (``add_after``), which is how deadlines and TTLs fire;
- every known key is re-added every ``resync_s`` seconds as a safety net (a missed watch event
  costs at most one resync period), except a key waiting out its backoff: the resync and
  :meth:`WorkQueue.add_all` leave it to its delayed retry, or a failing job would be retried
  every resync period however long its backoff had grown. An event about the job itself
  (:meth:`WorkQueue.add`) still wakes it at once, as in client-go: something changed.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["WorkQueue"]

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)

_BACKOFF_BASE_S = 0.5
_BACKOFF_MAX_S = 60.0


class WorkQueue(Generic[K]):
    """Keys to process by ``process(key) -> seconds until the next look, or None``."""

    def __init__(
        self,
        process: Callable[[K], float | None],
        *,
        workers: int = 2,
        resync_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._process = process
        self._workers = workers
        self._resync_s = resync_s
        self._clock = clock
        self._cv = threading.Condition()
        self._queue: deque[K] = deque()
        self._queued: set[K] = set()
        self._processing: set[K] = set()
        self._dirty: set[K] = set()
        self._delayed: list[tuple[float, int, K]] = []
        self._seq = 0
        self._failures: dict[K, int] = {}
        self._backoff_until: dict[K, float] = {}  # failing keys: no resync before this time
        self._known: set[K] = set()
        self._threads: list[threading.Thread] = []
        self._stopped = False
        self._next_resync = clock() + resync_s

    # --- producers --------------------------------------------------------------------------
    def add(self, key: K) -> None:
        with self._cv:
            self._known.add(key)
            self._add_locked(key)

    def add_after(self, key: K, delay_s: float) -> None:
        if delay_s <= 0:
            self.add(key)
            return
        with self._cv:
            self._known.add(key)
            self._seq += 1
            heapq.heappush(self._delayed, (self._clock() + delay_s, self._seq, key))
            self._cv.notify()

    def forget(self, key: K) -> None:
        """Stop resyncing a key (its object is gone), and drop its timers and backoff retry.
        An add while a pass of it runs still brings one more pass (the object may be back)."""
        with self._cv:
            self._known.discard(key)
            self._failures.pop(key, None)
            self._backoff_until.pop(key, None)
            kept = [entry for entry in self._delayed if entry[2] != key]
            if len(kept) != len(self._delayed):
                heapq.heapify(kept)
                self._delayed = kept

    def add_all(self) -> None:
        """Re-add every known key (something cluster-wide changed, e.g. a node)."""
        with self._cv:
            self._resync_locked(self._clock())

    def _resync_locked(self, now: float) -> None:
        for key in self._known:
            if self._backoff_until.get(key, now) <= now:
                self._add_locked(key)

    def _pump_locked(self, now: float) -> None:
        """Queue the delayed keys now due, and every known key when a resync is due."""
        while self._delayed and self._delayed[0][0] <= now:
            self._add_locked(heapq.heappop(self._delayed)[2])
        if now >= self._next_resync:
            self._next_resync = now + self._resync_s
            self._resync_locked(now)

    def _add_locked(self, key: K) -> None:
        if key in self._processing:
            self._dirty.add(key)
        elif key not in self._queued:
            self._queued.add(key)
            self._queue.append(key)
            self._cv.notify()

    # --- consumers --------------------------------------------------------------------------
    def start(self) -> None:
        for i in range(self._workers):
            t = threading.Thread(target=self._loop, name=f"adaptis-reconcile-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, *, timeout_s: float = 10.0) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout=timeout_s)

    def depth(self) -> int:
        """Keys queued now (not those running or delayed)."""
        with self._cv:
            return len(self._queue)

    def idle(self) -> bool:
        """Nothing queued or running (delayed keys do not count)."""
        with self._cv:
            return not self._queue and not self._processing

    def _take(self) -> K | None:
        with self._cv:
            while not self._stopped:
                now = self._clock()
                self._pump_locked(now)
                if self._queue:
                    key = self._queue.popleft()
                    self._queued.discard(key)
                    self._processing.add(key)
                    return key
                wake = self._next_resync
                if self._delayed:
                    wake = min(wake, self._delayed[0][0])
                self._cv.wait(timeout=max(0.01, wake - now))
            return None

    def _done(self, key: K, *, again_after: float | None, failed: bool) -> None:
        with self._cv:
            self._processing.discard(key)
            if failed:
                n = self._failures.get(key, 0) + 1
                self._failures[key] = n
                again_after = min(_BACKOFF_BASE_S * 2 ** (n - 1), _BACKOFF_MAX_S)
                self._backoff_until[key] = self._clock() + again_after
                self._dirty.discard(key)  # the backoff retry is the next pass (docstring)
            else:
                self._failures.pop(key, None)
                self._backoff_until.pop(key, None)
            if key in self._dirty:
                self._dirty.discard(key)
                self._add_locked(key)
            elif again_after is not None:
                self._seq += 1
                heapq.heappush(self._delayed, (self._clock() + again_after, self._seq, key))
                self._cv.notify()

    def _run_one(self, key: K) -> None:
        try:
            again = self._process(key)
        except Exception as err:  # a failed pass is retried, never kills a worker
            with self._cv:
                before = self._failures.get(key, 0)
            # One traceback per outage: the retries of the same key say one line each.
            if before == 0:
                log.exception("reconcile of %s failed; retrying with backoff", key)
            else:
                first_line = (str(err).splitlines() or [""])[0][:200]
                log.warning("reconcile of %s failed again (%d in a row): %s: %s", key,
                            before + 1, type(err).__name__, first_line)
            self._done(key, again_after=None, failed=True)
        else:
            with self._cv:
                before = self._failures.get(key, 0)
            if before:
                log.info("reconcile of %s succeeded after %d failed pass(es)", key, before)
            self._done(key, again_after=again, failed=False)

    def _loop(self) -> None:
        while (key := self._take()) is not None:
            self._run_one(key)

    def process_due(self) -> int:
        """Run, in the calling thread, one pass of every key due now; how many ran. What the
        worker threads do, one round of it: lets a test drive the queue with a fake clock."""
        with self._cv:
            self._pump_locked(self._clock())
            keys = list(self._queue)
            self._queue.clear()
            self._queued.clear()
            self._processing.update(keys)
        for key in keys:
            self._run_one(key)
        return len(keys)
