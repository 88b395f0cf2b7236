"""Unit tests of bench/soak_invariants.py on small hand-made object lists (no cluster)."""

from __future__ import annotations

from bench.soak_invariants import attempts_alive, children_left, gpu_double_booked


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


def test_attempts_alive_flags_two_attempts_of_one_job() -> None:
    assert attempts_alive([_pod("a", attempt="1"), _pod("b", attempt="2", phase="Failed")]) == []
    found = attempts_alive([_pod("a", attempt="1"), _pod("b", attempt="2")])
    assert found == ["job ns/j: pods of attempts ['1', '2'] alive together"]


def test_children_left_after_deletion() -> None:
    pods = [_pod("a", job="gone"), _pod("b", job="kept")]
    assert children_left([("ns", "gone")], pods) == ["job ns/gone: pod a left after deletion"]
    assert children_left([("ns", "other")], pods) == []
