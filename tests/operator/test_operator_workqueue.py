"""The work queue: coalescing, one pass per key at a time, retries, delays, resync."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter

import pytest

from adaptis.operator.control.workqueue import WorkQueue


def _wait(cond, timeout: float = 30.0) -> bool:  # a deadline, generous for a loaded CI  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_keys_added_while_queued_or_running_coalesce_and_never_overlap() -> None:
    seen: Counter[str] = Counter()
    running: set[str] = set()
    overlap: list[str] = []
    gate = threading.Event()
    lock = threading.Lock()

    def process(key: str) -> None:
        with lock:
            if key in running:
                overlap.append(key)
            running.add(key)
        gate.wait(2)
        with lock:
            running.discard(key)
            seen[key] += 1

    q: WorkQueue[str] = WorkQueue(process, workers=4, resync_s=3600)
    q.start()
    try:
        q.add("a")
        assert _wait(lambda: "a" in running)
        for _ in range(50):  # 50 events while "a" runs: one more pass, not 50
            q.add("a")
            q.add("b")
        gate.set()
        assert _wait(lambda: seen["a"] == 2 and seen["b"] == 1 and q.idle())
        time.sleep(0.1)
        assert seen == Counter({"a": 2, "b": 1}) and overlap == []
    finally:
        q.stop()


def test_failures_retry_with_backoff_and_requeue_after() -> None:
    calls: list[float] = []

    def process(key: str) -> float | None:
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise RuntimeError("API down")
        return 0.2 if len(calls) == 2 else None

    q: WorkQueue[str] = WorkQueue(process, workers=1, resync_s=3600)
    q.start()
    try:
        q.add("job")
        assert _wait(lambda: len(calls) == 3)
        assert calls[1] - calls[0] >= 0.45  # first backoff step is 0.5 s
        assert calls[2] - calls[1] >= 0.18  # asked to look again after 0.2 s
        time.sleep(0.3)
        assert len(calls) == 3
    finally:
        q.stop()


def test_resync_revisits_known_keys_until_forgotten() -> None:
    seen: Counter[str] = Counter()
    q: WorkQueue[str] = WorkQueue(lambda k: seen.update([k]), workers=1, resync_s=0.1)
    q.start()
    try:
        q.add("x")
        assert _wait(lambda: seen["x"] >= 3)
        q.forget("x")
        assert _wait(q.idle)  # a pass already under way may still finish
        n = seen["x"]
        time.sleep(0.3)
        assert seen["x"] == n
        q.add("y")
        q.add("z")
        before = seen["y"]
        q.add_all()
        assert _wait(lambda: seen["y"] > before)
    finally:
        q.stop()


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_backoff_holds_across_resyncs_and_node_events() -> None:
    clock = FakeClock()
    calls: list[float] = []

    def process(key: str) -> None:
        calls.append(clock.now)
        raise RuntimeError("API server: 500")

    q: WorkQueue[str] = WorkQueue(process, workers=1, resync_s=3.0, clock=clock)
    q.add("job")
    # Forty resync periods (120 s) with a node event every period: the failing key runs only
    # when its backoff (0.5, 1, 2, 4, ... 60 s) has passed, never once per resync.
    for _ in range(1200):
        clock.now += 0.1
        if round(clock.now * 10) % 30 == 0:
            q.add_all()
        q.process_due()
    gaps = [b - a for a, b in itertools.pairwise(calls)]
    # Each gap is the backoff, give or take the 0.1 s step of the fake clock.
    for gap, want in zip(gaps, [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0], strict=False):
        assert want - 1e-6 <= gap <= want + 0.15, gaps
    assert len(calls) <= 9, calls  # 0.5+1+...+32 = 63.5 s, then 60 s steps: 8 passes in 120 s
    # A success resets it: the next resync finds the key again.
    q2: WorkQueue[str] = WorkQueue(lambda k: None, workers=1, resync_s=3.0, clock=clock)
    q2.add("job")
    assert q2.process_due() == 1
    clock.now += 3.0
    assert q2.process_due() == 1


def test_an_event_about_the_job_itself_still_wakes_a_key_in_backoff() -> None:
    clock = FakeClock()
    calls: list[float] = []

    def process(key: str) -> None:
        calls.append(clock.now)
        if len(calls) < 4:
            raise RuntimeError("API server: 503")

    q: WorkQueue[str] = WorkQueue(process, workers=1, resync_s=3.0, clock=clock)
    q.add("job")
    q.process_due()
    clock.now += 0.6
    q.process_due()  # second failure: 1 s backoff
    clock.now += 0.1
    assert q.process_due() == 0
    q.add("job")  # e.g. the user edited the spec
    assert q.process_due() == 1


def test_add_all_re_adds_every_known_key_and_only_those() -> None:
    clock = FakeClock()
    seen: list[str] = []
    q: WorkQueue[str] = WorkQueue(seen.append, workers=1, resync_s=3600.0, clock=clock)
    for key in ("a", "b", "c"):
        q.add(key)
    assert q.process_due() == 3
    q.forget("c")
    assert q.process_due() == 0  # nothing due: no resync for an hour
    q.add_all()  # e.g. a node came: every job may now fit
    assert q.process_due() == 2 and sorted(seen[3:]) == ["a", "b"], seen


def test_a_key_re_added_during_a_failing_pass_keeps_its_backoff() -> None:
    clock = FakeClock()
    calls: list[float] = []
    queues: list[WorkQueue[str]] = []

    def process(key: str) -> None:
        calls.append(clock.now)
        queues[0].add(key)  # the pass's own pod deletions come back as pod events while it runs
        raise RuntimeError("API server: 500")

    q: WorkQueue[str] = WorkQueue(process, workers=1, resync_s=3.0, clock=clock)
    queues.append(q)
    q.add("job")
    assert q.process_due() == 1
    assert q.process_due() == 0, "a key re-added during a failed pass ran again at once"
    for _ in range(1200):  # 120 s in 0.1 s steps, as in the resync test above
        clock.now += 0.1
        q.process_due()
    gaps = [b - a for a, b in itertools.pairwise(calls)]
    for gap, want in zip(gaps, [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0], strict=False):
        assert want - 1e-6 <= gap <= want + 0.15, gaps
    assert len(calls) <= 9, calls


def test_a_forgotten_key_is_never_processed_again() -> None:
    clock = FakeClock()
    seen: list[str] = []

    def process(key: str) -> float | None:
        seen.append(key)
        if key == "failing":
            raise RuntimeError("API server: 503")
        return 5.0  # e.g. a deadline to check in 5 s

    q: WorkQueue[str] = WorkQueue(process, workers=1, resync_s=2.0, clock=clock)
    q.add("timed")
    q.add("failing")
    assert q.process_due() == 2
    q.forget("timed")  # its job was deleted: neither its timer nor its backoff may fire
    q.forget("failing")
    for _ in range(100):
        clock.now += 0.1
        q.process_due()
    assert seen == ["timed", "failing"], seen


def test_add_after_runs_the_key_once_its_delay_has_passed_and_at_once_without_one() -> None:
    clock = FakeClock()
    seen: list[str] = []
    q: WorkQueue[str] = WorkQueue(seen.append, workers=1, resync_s=3600.0, clock=clock)
    q.add_after("later", 5.0)  # e.g. a TTL that fires in 5 s
    q.add_after("sooner", 2.0)
    q.add_after("now", 0.0)  # no delay is an add
    assert q.process_due() == 1 and seen == ["now"]
    clock.now += 1.9
    assert q.process_due() == 0
    clock.now += 0.1  # exactly its time: due (1001.9 + 0.1 == 1002.0 in binary floating point)
    assert q.process_due() == 1 and seen[-1] == "sooner"
    clock.now += 3.0
    assert q.process_due() == 1 and seen[-1] == "later"
    clock.now += 10.0
    assert q.process_due() == 0, seen  # a delayed add fires once
    # A delayed key is known: the hourly resync revisits it.
    clock.now += 3600.0
    assert q.process_due() == 3 and sorted(seen[-3:]) == ["later", "now", "sooner"], seen
    clock.now += 1.0
    assert q.process_due() == 0, "a resync ran again before its period had passed"


def test_forget_drops_only_that_keys_timers() -> None:
    clock = FakeClock()
    seen: list[str] = []
    q: WorkQueue[str] = WorkQueue(seen.append, workers=1, resync_s=3600.0, clock=clock)
    q.add_after("gone", 1.0)
    q.add_after("kept", 2.0)
    q.forget("gone")
    clock.now += 5.0
    assert q.process_due() == 1 and seen == ["kept"], seen


def test_a_forgotten_key_that_comes_back_starts_without_its_old_backoff() -> None:
    clock = FakeClock()
    calls: list[float] = []

    def process(key: str) -> None:
        calls.append(clock.now)
        raise RuntimeError("API server: 500")

    q: WorkQueue[str] = WorkQueue(process, workers=1, resync_s=3600.0, clock=clock)
    q.add("job")
    for _ in range(100):  # 10 s: failures at 0, 0.5, 1.5, 3.5, 7.5 s; the next backoff is 16 s
        clock.now += 0.1
        q.process_due()
    assert len(calls) == 5, calls
    q.forget("job")  # deleted, then created again under the same name
    q.add_after("job", 100.0)  # known again, with a timer far off
    q.add_all()  # a node event: a key with no backoff is re-added at once
    assert q.process_due() == 1, "the forgotten key's old backoff still held it"
    start = calls[-1]
    for _ in range(10):  # a fresh failure count: the first retry is 0.5 s later, not 32 s
        clock.now += 0.1
        q.process_due()
    assert len(calls) == 7 and abs(calls[-1] - start - 0.5) < 0.15, calls


def test_idle_is_false_while_a_pass_runs() -> None:
    idle_during: list[bool] = []
    queues: list[WorkQueue[str]] = []
    q: WorkQueue[str] = WorkQueue(lambda k: idle_during.append(queues[0].idle()), workers=1,
                                  resync_s=3600.0, clock=FakeClock())
    queues.append(q)
    q.add("job")
    assert not q.idle()  # queued
    assert q.process_due() == 1 and idle_during == [False]  # running, nothing queued
    assert q.idle()


def test_workers_are_named_daemon_threads_and_stop_does_not_wait_on_a_stuck_pass() -> None:
    release = threading.Event()
    running = threading.Event()

    def process(key: str) -> None:
        running.set()
        release.wait(60)  # a pass stuck on a dead API connection

    q: WorkQueue[str] = WorkQueue(process, workers=2, resync_s=3600.0)
    q.start()
    try:
        workers = [t for t in threading.enumerate() if t.name.startswith("adaptis-reconcile-")]
        # Named for thread dumps and log lines; daemons, so a stuck pass never keeps the
        # operator's process alive at exit.
        assert sorted(t.name for t in workers) == ["adaptis-reconcile-0", "adaptis-reconcile-1"]
        assert all(t.daemon for t in workers)
        q.add("job")
        assert _wait(running.is_set)
        begun = time.monotonic()
        q.stop(timeout_s=0.2)
        assert time.monotonic() - begun < 10.0, "stop() waited for the stuck pass"
    finally:
        release.set()


class CountingClock:
    """A clock frozen at one time that counts how often the workers read it (once a wake-up)."""

    def __init__(self) -> None:
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return 1000.0


def test_an_idle_worker_sleeps_until_its_next_delayed_key() -> None:
    clock = CountingClock()
    q: WorkQueue[str] = WorkQueue(lambda k: None, workers=1, resync_s=3600.0, clock=clock)
    q.add_after("job", 5.0)  # due in 5 s of the (frozen) clock: nothing to do before then
    q.start()
    try:
        assert _wait(lambda: clock.reads >= 2)  # the worker is waiting
        time.sleep(0.5)  # absence of wake-ups can only be watched for a while
        # One wake-up per 5 s wait (the real clock), not one per 10 ms: an idle operator does
        # not spin.
        assert clock.reads <= 5, clock.reads
    finally:
        q.stop()


def test_a_worker_wakes_promptly_for_a_delayed_key_due_soon() -> None:
    clock = CountingClock()
    q: WorkQueue[str] = WorkQueue(lambda k: None, workers=1, resync_s=3600.0, clock=clock)
    q.add_after("job", 0.001)  # due 1 ms after the frozen clock's time, i.e. never
    q.start()
    try:
        # It re-checks at the shortest wait, 10 ms (about 100 reads a second), not once a
        # second: a key due in 0.2 s must not run a second late.
        assert _wait(lambda: clock.reads >= 30, timeout=10.0), clock.reads
    finally:
        q.stop()


def test_a_success_resets_the_backoff_of_a_key() -> None:
    clock = FakeClock()
    calls: list[float] = []
    outcomes = [False, False, False, True, False]  # fails 3 times, succeeds, fails again

    def process(key: str) -> None:
        calls.append(clock.now)
        if not outcomes[len(calls) - 1]:
            raise RuntimeError("API server: 500")

    q: WorkQueue[str] = WorkQueue(process, workers=1, resync_s=3600.0, clock=clock)
    q.add("job")
    q.process_due()
    for _ in range(40):  # retries at +0.5, +1.5 s, then at +3.5 s (its 2 s backoff); 4 s
        clock.now += 0.1
        q.process_due()
    assert len(calls) == 4, calls
    q.add("job")  # succeeded; an event runs it again and it fails: the count starts afresh
    q.process_due()
    failed_at = calls[-1]
    for _ in range(7):
        clock.now += 0.1
        q.process_due()
    assert len(calls) == 6 and abs(calls[-1] - failed_at - 0.5) < 0.15, calls


def test_a_key_that_succeeds_early_in_its_backoff_is_resynced_again() -> None:
    clock = FakeClock()
    calls: list[float] = []

    def process(key: str) -> None:
        calls.append(clock.now)
        if len(calls) < 3:
            raise RuntimeError("API server: 503")

    q: WorkQueue[str] = WorkQueue(process, workers=1, resync_s=3600.0, clock=clock)
    q.add("job")
    q.process_due()
    clock.now += 0.5
    q.process_due()  # second failure: backoff until +1 s
    q.add("job")  # an event about the job wakes it at once, and it succeeds
    assert q.process_due() == 1 and len(calls) == 3
    q.add_all()  # a node event: nothing holds the key back any more
    assert q.process_due() == 1, "the backoff of a key that succeeded still held it"


class Opaque:
    """A hashable key with no order, as WorkQueue's type allows (bound=Hashable)."""


def test_keys_due_at_the_same_time_need_no_order() -> None:
    clock = FakeClock()
    a, b = Opaque(), Opaque()
    seen: list[Opaque] = []

    def process(key: Opaque) -> float:
        seen.append(key)
        return 5.0  # both ask to be looked at again at the same time

    q: WorkQueue[Opaque] = WorkQueue(process, workers=1, resync_s=3600.0, clock=clock)
    q.add_after(a, 1.0)
    q.add_after(b, 1.0)  # the same due time: the heap must not compare the keys
    clock.now += 1.0
    assert q.process_due() == 2
    clock.now += 5.0
    assert q.process_due() == 2 and len(seen) == 4


def test_a_failed_pass_is_logged_with_its_key_and_traceback(
        caplog: pytest.LogCaptureFixture) -> None:
    def process(key: str) -> None:
        raise RuntimeError("API server: 500")

    q: WorkQueue[str] = WorkQueue(process, workers=1, resync_s=3600.0, clock=FakeClock())
    q.add("ns/job")
    with caplog.at_level(logging.ERROR, logger="adaptis.operator.control.workqueue"):
        q.process_due()
    [record] = caplog.records
    assert record.getMessage() == "reconcile of ns/job failed; retrying with backoff"
    assert record.exc_info is not None and "API server: 500" in str(record.exc_info[1])


def test_an_outage_logs_one_traceback_per_key_then_a_line_per_retry_and_the_recovery(
        caplog: pytest.LogCaptureFixture) -> None:
    outage = {"on": True}

    def process(key: str) -> None:
        if outage["on"]:
            raise RuntimeError("API server: 503\nsecond line")

    clock = FakeClock()
    q: WorkQueue[str] = WorkQueue(process, workers=1, resync_s=3600.0, clock=clock)
    q.add("ns/job")
    with caplog.at_level(logging.INFO, logger="adaptis.operator.control.workqueue"):
        for _ in range(4):  # the first pass and three backoff retries
            assert q.process_due() == 1
            clock.now += 120.0
        outage["on"] = False
        assert q.process_due() == 1
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 1
    retries = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert retries == [f"reconcile of ns/job failed again ({n} in a row): RuntimeError: API "
                       "server: 503" for n in (2, 3, 4)]
    assert caplog.records[-1].getMessage() == "reconcile of ns/job succeeded after 4 failed pass(es)"
