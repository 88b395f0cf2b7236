"""Unit tests of bench/soak_invariants.py on small hand-made object lists (no cluster)."""

from __future__ import annotations

from bench.soak_invariants import (
    attempts_alive,
    children_left,
    counted_gang,
    gpu_double_booked,
    job_consistent,
    no_hot_loop,
)


def _node(name: str, gpus: int) -> dict:
    return {"metadata": {"name": name}, "status": {"allocatable": {"nvidia.com/gpu": str(gpus)}}}


def _pod(name: str, *, node: str | None = None, gpus: int = 1, job: str = "j", attempt: str = "1",
         phase: str = "Running") -> dict:
    return {"metadata": {"name": name, "namespace": "ns",
                         "labels": {"adaptis.io/job": job, "adaptis.io/attempt": attempt}},
            "spec": {"nodeName": node,
                     "containers": [{"resources": {"requests": {"nvidia.com/gpu": str(gpus)}}}]},
            "status": {"phase": phase}}


def test_gpu_double_booked_counts_only_alive_bound_pods() -> None:
    nodes = [_node("a", 8)]
    fits = [_pod("p1", node="a", gpus=4), _pod("p2", node="a", gpus=4),
            _pod("done", node="a", gpus=8, phase="Succeeded"), _pod("pending", gpus=8)]
    assert gpu_double_booked(nodes, fits) == []
    over = [*fits, _pod("p3", node="a", gpus=1)]
    assert gpu_double_booked(nodes, over) == ["node a: 9 GPUs requested > 8 allocatable"]
    # An orphan of a deleted node (or a pod on a node newer than the list) books no listed node.
    assert gpu_double_booked(nodes, [*fits, _pod("orphan", node="gone", gpus=8)]) == []
    assert gpu_double_booked([*nodes, _node("b", 0)], [_pod("p", node="b")]) == [
        "node b: 1 GPUs requested > 0 allocatable"]


def test_attempts_alive_flags_two_attempts_of_one_job() -> None:
    assert attempts_alive([_pod("a", attempt="1"), _pod("b", attempt="2", phase="Failed")]) == []
    found = attempts_alive([_pod("a", attempt="1"), _pod("b", attempt="2")])
    assert found == ["job ns/j: pods of attempts ['1', '2'] alive together"]


def test_children_left_after_deletion() -> None:
    pods = [_pod("a", job="gone"), _pod("b", job="kept")]
    assert children_left([("ns", "gone")], pods) == ["job ns/gone: pod a left after deletion"]
    assert children_left([("ns", "other")], pods) == []


def _job(phase: str, *, restarts: int, limit: int = 2, message: str = "") -> dict:
    return {"metadata": {"name": "j", "namespace": "ns"}, "spec": {"backoffLimit": limit},
            "status": {"phase": phase, "restarts": restarts, "message": message}}


def test_job_consistent_with_its_faults() -> None:
    assert job_consistent(_job("Succeeded", restarts=2), counted_faults=2) == []
    assert job_consistent(_job("Succeeded", restarts=1), counted_faults=2) == [
        "job ns/j: 1 restarts counted for 2 faults"]
    assert job_consistent(_job("Succeeded", restarts=3), counted_faults=3) != []
    failed = _job("Failed", restarts=2, message="spec.backoffLimit: 2 restart(s) used; evicted")
    assert job_consistent(failed, counted_faults=3) == []
    assert job_consistent(failed, counted_faults=1) != []
    assert job_consistent(_job("Failed", restarts=2, message="oops"), counted_faults=3) != []
    assert job_consistent(_job("Running", restarts=0), counted_faults=0) == [
        "job ns/j: not terminal (Running)"]


def test_no_hot_loop_bounds_requests_per_job_minute() -> None:
    assert no_hot_loop(600, jobs=10, minutes=2, per_job_minute=30) == []
    assert no_hot_loop(601, jobs=10, minutes=2, per_job_minute=30) == [
        "601 requests for 10 jobs in 2.0 min: 30.1 a job a minute > 30"]


def _gang_job(*, launched: str | None, restarts: int = 0, phase: str = "Running") -> dict:
    return {"status": {"launched": launched, "restarts": restarts, "phase": phase}}


def test_a_fault_counts_only_against_a_launched_current_attempt_of_a_live_job() -> None:
    pod = _pod("p", attempt="1")
    assert counted_gang(_gang_job(launched="abc/1", restarts=1), pod) == "abc/1"
    assert counted_gang(_gang_job(launched=None, restarts=1), pod) is None  # not every rank had its pod
    assert counted_gang(_gang_job(launched="abc/1", restarts=2), pod) is None  # already restarted
    assert counted_gang(_gang_job(launched="abc/0", restarts=0), pod) is None  # a stale attempt's pod
    assert counted_gang(_gang_job(launched="abc/1", restarts=1, phase="Succeeded"), pod) is None
    assert counted_gang(None, pod) is None  # a job deleted meanwhile
