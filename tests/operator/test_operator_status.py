"""Status arithmetic: conditions, pod census, observed bubble ratio."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Any

import pytest
from plan_kit import split_backward_plan

from adaptis.operator.core.conditions import (
    condition_true,
    now_rfc3339,
    set_condition,
)
from adaptis.operator.core.records import PlanRecord
from adaptis.operator.resources.status import (
    census,
    parse_status,
    plan_summary,
    status_payload,
    summarize,
)


def _pod(name: str, phase: str, *, ready: bool = False, **status: Any) -> dict[str, Any]:
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    conditions += status.pop("conditions", [])
    return {"metadata": {"name": name}, "status": {"phase": phase, "conditions": conditions,
                                                   **status}}


def test_transition_time_moves_only_when_status_changes() -> None:
    c1 = set_condition([], type_="Running", status="False", reason="Starting", now="t1")
    c2 = set_condition(c1, type_="Running", status="False", reason="Waiting", now="t2")
    assert c2[0].last_transition_time == "t1" and c2[0].reason == "Waiting"
    c3 = set_condition(c2, type_="Running", status="True", reason="Up", now="t3")
    assert c3[0].last_transition_time == "t3"
    c4 = set_condition(c3, type_="Planned", status="True", reason="Planned", now="t4")
    assert [c.type for c in c4] == ["Running", "Planned"]


def test_census_counts_and_explains() -> None:
    unsched = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
               "message": "0/4 nodes are available"}
    done = {"containerStatuses": [{"state": {"terminated": {
        "message": json.dumps({"observedBubbleRatio": 0.2})}}}]}
    pods = [
        _pod("r0", "Running", ready=True),
        _pod("r1", "Running"),
        _pod("r2", "Pending", conditions=[unsched]),
        _pod("r3", "Failed", message="OOMKilled"),
        _pod("r4", "Succeeded", **done),
        _pod("r5", "Succeeded", containerStatuses=[{"state": {"terminated": {
            "message": '{"bubble_ratio": 0.4}'}}}]),
    ]
    pods.append({"metadata": {"name": "r6", "deletionTimestamp": "x"}, "status": {}})
    pods.append({"metadata": {"name": "r7"}, "status": {"phase": "Pending"},
                 "spec": {"schedulingGates": [{"name": "kueue.x-k8s.io/admission"}]}})
    c = census(pods)
    assert (c.ready, c.running, c.pending, c.failed, c.succeeded, c.terminating) == (
        1, 2, 2, 1, 2, 1)
    assert c.gated == ("r7: gated by kueue.x-k8s.io/admission",)
    assert c.unschedulable == ("r2: 0/4 nodes are available",)
    assert c.failures == ("r3: OOMKilled",)
    assert c.observed_bubble_ratio == 0.3


def test_status_round_trips_and_unreadable_status_restarts() -> None:
    st = parse_status({"phase": "Running", "restarts": 2, "workersReady": "1/2"})
    assert (st.phase, st.restarts, st.workers_ready) == ("Running", 2, "1/2")
    assert status_payload(st)["workersReady"] == "1/2"
    assert parse_status({"phase": "Bogus"}).phase == "Pending"


# --- What each status field promises, pinned one by one (issue 18: mutation testing found the
# spellings, bounds, defaults and counts below unchecked).


def _terminated(*messages: str) -> dict[str, Any]:
    return {"containerStatuses": [{"state": {"terminated": {"message": m}}} for m in messages]}


@pytest.mark.parametrize("key", ["observedBubbleRatio", "bubble_ratio", "bubbleRatio"])
def test_every_spelling_of_the_workers_bubble_ratio_is_read(key: str) -> None:
    pods = [_pod("r0", "Succeeded", **_terminated(json.dumps({key: 0.25})))]
    assert census(pods).bubble_ratios == (0.25,)


@pytest.mark.parametrize(("value", "read"), [(0, 0.0), (1, 1.0), (1.5, None), (2, None), (-0.1, None)])
def test_a_bubble_ratio_is_read_only_within_zero_and_one_inclusive(value: float,
                                                                   read: float | None) -> None:
    pods = [_pod("r0", "Succeeded", **_terminated(json.dumps({"bubbleRatio": value})))]
    assert census(pods).bubble_ratios == (() if read is None else (read,))


def test_an_unreadable_termination_message_does_not_hide_a_later_one() -> None:
    # A container's own crash text can precede the worker's JSON line.
    pods = [_pod("r0", "Succeeded", **_terminated("Traceback ...", '{"bubble_ratio": 0.3}'))]
    assert census(pods).observed_bubble_ratio == 0.3


def test_census_counts_every_pod_of_each_phase() -> None:
    gone = {"metadata": {"name": "t", "deletionTimestamp": "2026-01-01T00:00:00Z"}, "status": {}}
    pods = [gone, gone, _pod("f0", "Failed"), _pod("f1", "Failed", reason="Evicted"),
            {"metadata": {}, "status": {"phase": "Failed", "message": "boom"}},
            {"metadata": {"name": "new"}}]  # no status yet: Pending
    c = census(pods)
    assert (c.terminating, c.failed, c.pending) == (2, 3, 1)
    # The pod's message, else its reason, else just "failed"; a pod without a name is "?".
    assert c.failures == ("f0: failed", "f1: Evicted", "?: boom")


def test_why_pending_pods_wait_unschedulable_or_gated() -> None:
    def pending(name: str, sched: dict[str, Any] | None, gates: list[dict[str, str]] | None = None
                ) -> dict[str, Any]:
        pod = _pod(name, "Pending", conditions=[{"type": "PodScheduled", **sched}] if sched else [])
        if gates is not None:
            pod["spec"] = {"schedulingGates": gates}
        return pod

    # What the API server writes for a gated pod: PodScheduled False, reason SchedulingGated.
    by_reason = {"status": "False", "reason": "SchedulingGated"}
    c = census([
        pending("u0", {"status": "False", "reason": "Unschedulable"}),  # no message
        pending("g0", by_reason),  # the reason alone, gates not in the listing
        pending("g1", by_reason, [{"name": "kueue.x-k8s.io/admission"}, {"name": "other"}]),
        pending("g2", None, [{}]),  # a gate with no name
        pending("p0", {"status": "False", "reason": "Other"}),  # neither
    ])
    assert c.pending == 5
    assert c.unschedulable == ("u0: unschedulable",)
    assert c.gated == ("g0: gated by a scheduling gate",
                       "g1: gated by kueue.x-k8s.io/admission, other", "g2: gated by ?")


def _waiting(name: str, reason: str, message: str = "") -> dict[str, Any]:
    return {"name": name, "state": {"waiting": {"reason": reason, "message": message}}}


def test_containers_the_kubelet_cannot_start_are_collected_with_their_reason() -> None:
    """Pending and Running pods' containers and init containers waiting for something outside
    the pod (a Secret, an image); not those starting normally, nor finished pods'."""
    secret = 'secret "hf-token" not found'
    pods = [
        _pod("p0", "Pending", containerStatuses=[
            _waiting("worker", "CreateContainerConfigError", secret),
            _waiting("sidecar", "ContainerCreating")]),
        _pod("p1", "Pending", initContainerStatuses=[_waiting("fetch", "ErrImagePull", "nope")],
             containerStatuses=[_waiting("worker", "PodInitializing")]),
        _pod("p2", "Running", containerStatuses=[_waiting("worker", "ImagePullBackOff")]),
        _pod("p3", "Pending", containerStatuses=[{"name": "worker", "state": {}}]),
        _pod("p4", "Failed", containerStatuses=[_waiting("worker", "InvalidImageName", "x")]),
        {"metadata": {"name": "p5", "deletionTimestamp": "t"}, "status": {
            "phase": "Pending", "containerStatuses": [_waiting("w", "CreateContainerError")]}},
        _pod("p6", "Pending", containerStatuses=[_waiting("worker", "InvalidImageName", "bad"),
                                                 _waiting("b", "ErrImageNeverPull", "never"),
                                                 _waiting("c", "CreateContainerError", "rt")]),
    ]
    c = census(pods)
    assert [str(s) for s in c.stuck] == [
        f"p0: worker: CreateContainerConfigError: {secret}",
        "p1: fetch: ErrImagePull: nope",
        "p2: worker: ImagePullBackOff: no message",
        "p6: worker: InvalidImageName: bad",
        "p6: b: ErrImageNeverPull: never",
        "p6: c: CreateContainerError: rt",
    ]
    assert census([_pod("ok", "Running", ready=True)]).stuck == ()


def test_a_waiting_message_is_one_bounded_line() -> None:
    text = "first\nsecond\x1b[0m " + "y" * 1000
    pod = _pod("p0", "Pending", containerStatuses=[
        _waiting("c" * 200, "CreateContainerConfigError", text)])
    (stuck,) = census([pod]).stuck
    assert stuck.message.startswith("first second [0m yyy") and stuck.message.endswith("...")
    assert len(stuck.message) == 160 and len(stuck.container) == 63


def test_summarize_keeps_the_first_items_and_counts_the_rest() -> None:
    assert summarize([]) == ""
    assert summarize(["a", "b", "c"]) == "a; b; c"
    assert summarize(["a", "b", "c", "d", "e"]) == "a; b; c; and 2 more"
    assert summarize(["a", "b"], limit=1) == "a; and 1 more"


def test_condition_true_needs_that_type_with_status_true() -> None:
    conds = set_condition([], type_="Ready", status="True", reason="Up", now="t")
    conds = set_condition(conds, type_="Planned", status="False", reason="No", now="t")
    assert condition_true(conds, "Ready")
    assert not condition_true(conds, "Planned") and not condition_true(conds, "Missing")


def test_a_condition_set_without_a_message_has_an_empty_one() -> None:
    assert set_condition([], type_="Ready", status="True", reason="Up", now="t")[0].message == ""


def test_now_is_utc_whatever_the_local_time_zone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TZ", "IST-05:30")  # POSIX rule: UTC+05:30, needs no zone database
    time.tzset()
    try:
        before = datetime.now(UTC).replace(microsecond=0)
        stamp = now_rfc3339()
        after = datetime.now(UTC)
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()
    assert before <= datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC) <= after


def test_plan_summary_reports_the_plan_rounded_with_every_ranks_node_gpu_and_stages() -> None:
    record = PlanRecord(
        spec_hash="0" * 16, plan=split_backward_plan(devices=2, microbatches=2),
        # A third node past the plan's placement holds no stage.
        nodes=["n0", "n1", "n2"], hostnames=["n0", "n1", "n2"], gpus=["H100", "A100", None],
        node_fingerprints={}, strategy="adaptis", predicted_iteration_seconds=1.23456789,
        predicted_bubble_ratio=0.123456, predicted_speedup_over_i1f1b=1.5, predicted_step_seconds=2.34567891,
    )
    summary = plan_summary(record)
    placement = summary.pop("placement")
    assert summary == {"stages": 2, "strategy": "adaptis", "predicted_iteration_seconds": 1.234568,
                       "predicted_bubble_ratio": 0.1235, "predicted_speedup_over_i1f1b": 1.5,
                       "predicted_step_seconds": 2.345679}
    assert [(a.rank, a.node, a.gpu, a.stages, a.pod) for a in placement] == [
        (0, "n0", "H100", [0], None), (1, "n1", "A100", [1], None), (2, "n2", None, [], None)]  # no job: no pods


def test_the_stored_status_has_no_nulls() -> None:
    payload = status_payload(parse_status({"phase": "Running"}))
    assert payload["phase"] == "Running"
    assert None not in payload.values() and "message" not in payload
