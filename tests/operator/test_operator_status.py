"""Status arithmetic: conditions, pod census, observed bubble ratio."""

from __future__ import annotations

import json
from typing import Any

from adaptis.operator.status import census, parse_status, set_condition, status_payload


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
    c = census(pods, total=8)
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
