"""The allocation ledger on its own: GPU counting, reservations, the queue and its strict turn.

test_operator_capacity.py drives the ledger through the reconciler; these tests pin each of its
promises directly, with a hand-driven clock (issue 18: mutation testing found the boundaries,
sums and defaults below unchecked).
"""

from __future__ import annotations

from typing import Any

import pytest

from adaptis.operator.scheduling.capacity import (
    CapacityLedger,
    GpuHolds,
    QueueOrder,
    pod_gpus,
    unschedulable_since,
)

A = ("ns", "a")
B = ("ns", "b")
C = ("other", "c")
ALLOCATABLE = {"n0": 4, "n1": 4}


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _container(*, requests: str | None = None, limits: str | None = None) -> dict[str, Any]:
    res: dict[str, Any] = {}
    if requests is not None:
        res["requests"] = {"nvidia.com/gpu": requests}
    if limits is not None:
        res["limits"] = {"nvidia.com/gpu": limits}
    return {"name": "c", "resources": res}


def _pod(name: str, *, node: str | None = "n0", gpus: int = 1, ns: str = "other",
         job: str | None = None, managed: bool = False, pinned: str | None = None,
         conditions: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    labels: dict[str, str] = {}
    if managed:
        labels["app.kubernetes.io/managed-by"] = "adaptis"
    if job is not None:
        labels["adaptis.io/job"] = job
    meta: dict[str, Any] = {"name": name, "namespace": ns, "labels": labels}
    if pinned is not None:
        meta["annotations"] = {"adaptis.io/node": pinned}
    spec: dict[str, Any] = {"containers": [_container(limits=str(gpus))]}
    if node is not None:
        spec["nodeName"] = node
    return {"metadata": meta, "spec": spec, "status": {"conditions": conditions or []}}


def _order(key: tuple[str, str], *, priority: int = 0, created: str = "2026-01-01T00:00:00Z"
           ) -> QueueOrder:
    return QueueOrder.of(key, priority=priority, created=created)


# --- counting GPUs -------------------------------------------------------------------------------


def test_pod_gpus_sums_containers_prefers_requests_and_skips_what_it_cannot_read() -> None:
    assert pod_gpus({}) == 0
    pod = {"spec": {"containers": [
        _container(requests="2", limits="3"),  # the request counts
        _container(limits="1"),  # no request: the limit
        _container(limits="lots"),  # unreadable: skipped, the next still counts
        _container(requests="4"),
        _container(),
    ]}}
    assert pod_gpus(pod) == 7


def test_free_gpus_subtracts_every_other_pod_and_reservation_summed_per_node() -> None:
    ledger = CapacityLedger()
    ledger.reserve(B, {"n1": 1})
    ledger.reserve(C, {"n1": 2})
    pods = [_pod("x", node="n0", gpus=1), _pod("y", node="n0", gpus=2),
            _pod("unbound", node=None)]  # someone else's pod, not bound: holds nothing yet
    assert ledger.free_gpus(allocatable=ALLOCATABLE, holds=GpuHolds.of_pods(pods), job=A) == {"n0": 1, "n1": 1}
    # The asker's own reservation is not subtracted from what it may use.
    assert ledger.free_gpus(allocatable=ALLOCATABLE, holds=GpuHolds.of_pods([]), job=B) == {"n0": 4, "n1": 2}


def test_own_reserved_and_ignored_pods_are_skipped_and_the_rest_still_counted() -> None:
    ledger = CapacityLedger()
    ledger.reserve(B, {"n1": 2})
    pods = [
        _pod("profiler", ns="ns", node="n0", gpus=1),  # ignored: the asker's profiler pod
        _pod("a-0", ns="ns", job="a", managed=True, node="n0", gpus=1),  # the asker's own
        _pod("b-0", ns="ns", job="b", managed=True, node="n1", gpus=2),  # through B's reservation
        _pod("x", node="n0", gpus=1),
        _pod("y", node="n1", gpus=1),
    ]
    free = ledger.free_gpus(allocatable=ALLOCATABLE, holds=GpuHolds.of_pods(pods), job=A,
                            ignore=frozenset({("ns", "profiler")}))
    assert free == {"n0": 3, "n1": 1}


def test_only_pods_managed_by_adaptis_with_a_job_label_count_as_a_jobs_own() -> None:
    ledger = CapacityLedger()
    pods = [
        # A tenant's pod that borrows the job label without being ours: it holds its GPUs.
        _pod("fake", ns="ns", job="a", node="n0", gpus=2),
        # Ours but of no job (a profiler pod): anyone's.
        _pod("prof", ns="ns", managed=True, node="n1", gpus=1),
    ]
    assert ledger.free_gpus(allocatable=ALLOCATABLE, holds=GpuHolds.of_pods(pods), job=A) == {"n0": 2, "n1": 3}


def test_a_managed_pod_pins_its_annotated_node_before_it_is_bound() -> None:
    ledger = CapacityLedger()
    pods = [_pod("w", ns="x", job="j", managed=True, node=None, pinned="n1", gpus=3),
            _pod("nopin", ns="x", job="j", managed=True, node=None, gpus=3)]
    assert ledger.free_gpus(allocatable=ALLOCATABLE, holds=GpuHolds.of_pods(pods), job=A) == {"n0": 4, "n1": 1}


# --- reservations --------------------------------------------------------------------------------


def test_a_reservation_keeps_the_nodes_with_gpus_and_takes_the_job_off_the_queue() -> None:
    ledger = CapacityLedger()
    assert ledger.reservation(A) is None
    ledger.enqueue(A, order=_order(A), gpus=3)
    ledger.reserve(A, {"n0": 1, "n1": 0, "n2": 2})
    assert ledger.reservation(A) == {"n0": 1, "n2": 2}
    assert ledger.waiting() == []


def test_release_wakes_the_waiting_jobs_in_order_only_when_it_freed_gpus() -> None:
    woken: list[tuple[str, str]] = []
    ledger = CapacityLedger(wake=woken.append)
    ledger.enqueue(B, order=_order(B, created="2026-01-02T00:00:00Z"), gpus=1)
    ledger.enqueue(C, order=_order(C, created="2026-01-01T00:00:00Z"), gpus=1)
    ledger.enqueue(A, order=_order(A), gpus=1)
    ledger.release(A)  # held nothing: leaves the queue, wakes nobody
    assert woken == [] and ledger.waiting() == [C, B]
    ledger.release(("ns", "never-seen"))
    assert woken == []
    ledger.reserve(A, {"n0": 2})
    ledger.release(A)
    assert woken == [C, B] and ledger.reservation(A) is None


# --- the queue -----------------------------------------------------------------------------------


def test_queue_order_is_higher_priority_then_older_then_name() -> None:
    order = QueueOrder.of(C, priority=5, created="2026-01-01T00:00:00Z")
    assert (order.neg_priority, order.created, order.namespace, order.name) == (
        -5, "2026-01-01T00:00:00Z", "other", "c")
    ledger = CapacityLedger()
    ledger.enqueue(A, order=_order(A, created="2026-01-03T00:00:00Z"), gpus=1)
    ledger.enqueue(B, order=_order(B, created="2026-01-02T00:00:00Z"), gpus=1)
    ledger.enqueue(C, order=_order(C, priority=1, created="2026-01-09T00:00:00Z"), gpus=1)
    assert ledger.waiting() == [C, B, A]


def test_position_counts_the_asker_whether_or_not_it_waits_yet() -> None:
    ledger = CapacityLedger()
    ledger.enqueue(B, order=_order(B, created="2026-01-01T00:00:00Z"), gpus=1)
    late = _order(A, created="2026-01-05T00:00:00Z")
    assert ledger.position(A, order=late) == (2, 2)
    ledger.enqueue(A, order=late, gpus=1)
    assert ledger.position(A, order=late) == (2, 2)
    assert ledger.position(B, order=_order(B, created="2026-01-01T00:00:00Z")) == (1, 2)


def test_a_job_ahead_blocks_from_exactly_strict_after_with_its_gpus_and_wait() -> None:
    clock = Clock(1000.0)
    ledger = CapacityLedger(strict_after_s=120.0, clock=clock)
    first = _order(B, created="2026-01-01T00:00:00Z")
    ledger.enqueue(B, order=first, gpus=6)
    clock.now = 1050.0
    ledger.enqueue(B, order=first, gpus=6)  # waiting again keeps the first wait time
    mine = _order(A, created="2026-01-02T00:00:00Z")
    clock.now = 1119.9
    assert ledger.blocker(A, order=mine) is None
    clock.now = 1120.0
    assert ledger.blocker(A, order=mine) == (B, 6, pytest.approx(120.0))


def test_nothing_behind_a_job_or_the_job_itself_blocks_it() -> None:
    clock = Clock(0.0)
    ledger = CapacityLedger(strict_after_s=10.0, clock=clock)
    mine = _order(A, created="2026-01-02T00:00:00Z")
    ledger.enqueue(A, order=mine, gpus=1)
    ledger.enqueue(B, order=_order(B, created="2026-01-03T00:00:00Z"), gpus=1)  # behind
    clock.now = 100.0
    assert ledger.blocker(A, order=mine) is None


# --- unschedulable pods --------------------------------------------------------------------------


def _unsched(at: str, *, type_: str = "PodScheduled", status: str = "False",
             reason: str = "Unschedulable") -> dict[str, Any]:
    return {"type": type_, "status": status, "reason": reason, "lastTransitionTime": at}


def test_unschedulable_since_is_the_oldest_unschedulable_pods_time_and_its_pins() -> None:
    pods = [
        _pod("old", job="j", managed=True, node=None, pinned="n0",
             conditions=[_unsched("2026-01-01T00:00:00Z")]),
        _pod("garbled", conditions=[_unsched("yesterday")]),  # skipped, the next still read
        _pod("new", job="j", managed=True, node=None, pinned="n1",
             conditions=[_unsched("2026-01-01T00:05:00Z")]),
        _pod("nopin", job="j", managed=True, node=None,
             conditions=[_unsched("2026-01-01T00:06:00Z")]),
        # Not unschedulable: a scheduled pod, another condition with the same reason.
        _pod("ok", node="n2", conditions=[{"type": "PodScheduled", "status": "True",
                                           "lastTransitionTime": "2025-01-01T00:00:00Z"}]),
        _pod("odd", node="n3", conditions=[_unsched("2025-01-01T00:00:00Z", type_="Ready")]),
    ]
    oldest, nodes = unschedulable_since(pods)
    assert oldest is not None and oldest.isoformat() == "2026-01-01T00:00:00+00:00"
    assert nodes == {"n0", "n1"}
