"""The list scheduler's promise: the time it reports is the time ``simulate()`` gives the plan it
emits (the search ranks candidates by that time, the executor runs the order).

Random problems with slow links between nodes (transfers matter), per-action overhead,
mixed device speeds and tight memory (admission holds stage 0 back, or each device on its
own), random partitions and
placements (several stages a device, in any order) and every policy the search tries.
"""

from __future__ import annotations

import math
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from adaptis.api.plan import Plan
from adaptis.api.problem import parse_problem
from adaptis.planner.costs import Costs
from adaptis.planner.scheduler import Policy, Schedule, list_schedule
from adaptis.planner.simulator import simulate

POLICIES = (Policy(), Policy(fill_with_w=False), Policy(split_backward=False),
            Policy(max_inflight=2), Policy(admit_per_device=True),
            Policy(split_backward=False, admit_per_device=True),
            Policy(fill_with_w=False, max_inflight=2, admit_per_device=True))


def _plan(schedule: Schedule, *, stages: list[tuple[int, int]], owner: list[int], devices: int) -> Plan:
    """The plan the search makes of a schedule (as strategies.py does)."""
    return Plan.model_construct(
        stages=stages,
        placement=[[s for s, d in enumerate(owner) if d == dev] for dev in range(devices)],
        actions=[list(a) for a in schedule.actions],
    )


def _replays(costs: Costs, *, stages: list[tuple[int, int]], owner: list[int], policy: Policy) -> Schedule:
    """Schedule, replay in the simulator, and check the promise; the schedule."""
    sched = list_schedule(costs, stages=stages, owner=owner, policy=policy)
    if not sched.feasible:
        assert sched.reason and sched.iteration_time == math.inf
        return sched
    sim = simulate(costs, _plan(sched, stages=stages, owner=owner, devices=costs.devices))
    assert math.isclose(sim.iteration_time, sched.iteration_time, rel_tol=1e-9), (
        policy, sched.iteration_time, sim.iteration_time)
    assert sim.feasible, sim.reason  # admission kept every device within its memory
    per_mb = 3 if policy.split_backward else 2
    assert sum(len(a) for a in sched.actions) == len(stages) * costs.microbatches * per_mb
    return sched


@st.composite
def problems(draw: st.DrawFn) -> tuple[dict[str, Any], list[tuple[int, int]], list[int]]:
    """A problem document, a partition and a placement."""
    n = draw(st.integers(1, 10))
    layers = [{
        "name": f"l{i}",
        "forward": draw(st.floats(0.1, 5)),
        "backward": draw(st.floats(0, 5)),
        "weight": draw(st.floats(0, 3)),
        "activation_bytes": draw(st.floats(0, 5)),
        "param_bytes": draw(st.floats(0, 5)),
        "output_bytes": draw(st.floats(0.5, 5)),
    } for i in range(n)]
    count = draw(st.integers(1, 5))
    memory = draw(st.one_of(st.none(), st.floats(5, 40)))
    devices = [{"name": f"d{d}", "node": f"n{d // 2}", "speed": draw(st.sampled_from([1.0, 1.5, 2.0])),
                **({"memory_bytes": memory} if memory else {})} for d in range(count)]
    doc: dict[str, Any] = {
        "name": "t", "microbatches": draw(st.integers(1, 10)), "layers": layers,
        "devices": {"list": devices},
        # Seconds per byte of the order of the compute times: a transfer can be on the critical path.
        "network": {"intra_node": {"bandwidth_bytes_per_s": 4.0, "latency_s": 0.1},
                    "inter_node": {"bandwidth_bytes_per_s": 1.0, "latency_s": 0.5}},
        "time_unit": "s",
        "action_overhead_s": draw(st.sampled_from([0.0, 0.05])),
    }
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=5))) if n > 1 else []
    bounds = [0, *cuts, n]
    stages = [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
    owner = draw(st.lists(st.integers(0, count - 1), min_size=len(stages), max_size=len(stages)))
    return doc, stages, owner


@st.composite
def cases(draw: st.DrawFn) -> tuple[Costs, list[tuple[int, int]], list[int]]:
    doc, stages, owner = draw(problems())
    return Costs.from_problem(parse_problem(doc)), stages, owner


def _rescaled(doc: dict[str, Any], k: float) -> dict[str, Any]:
    """The same problem with every duration k times as long: compute, overhead, transfers."""
    layers = [{**lay, **{f: lay[f] * k for f in ("forward", "backward", "weight")}} for lay in doc["layers"]]
    network = {name: {"bandwidth_bytes_per_s": link["bandwidth_bytes_per_s"] / k, "latency_s": link["latency_s"] * k}
               for name, link in doc["network"].items()}
    return {**doc, "layers": layers, "network": network, "action_overhead_s": doc["action_overhead_s"] * k}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_every_schedule_replays_to_the_time_it_reports(case: tuple[Costs, list[tuple[int, int]], list[int]]) -> None:
    costs, stages, owner = case
    for policy in POLICIES:
        _replays(costs, stages=stages, owner=owner, policy=policy)


# Forwards shorter than 1 and transfers between them: a rule that read an input as arrived
# when its producer ended before 1 (not after the transfer) changed device 1's order here.
_SUB_UNIT = ({"name": "t", "microbatches": 3, "time_unit": "s", "action_overhead_s": 0.0,
              "layers": [{"name": "l0", "forward": 0.5, "backward": 0.25, "weight": 3.0, "activation_bytes": 1.0,
                          "output_bytes": 2.0},
                         {"name": "l1", "forward": 0.25, "backward": 0.5, "weight": 2.0, "activation_bytes": 2.0,
                          "output_bytes": 2.0}],
              "devices": {"list": [{"name": "d0", "node": "n0"}, {"name": "d1", "node": "n0"}]},
              "network": {"intra_node": {"bandwidth_bytes_per_s": 4.0, "latency_s": 0.25}}},
             [(0, 1), (1, 2)], [0, 1])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=problems(), policy=st.sampled_from(POLICIES))
@example(case=_SUB_UNIT, policy=Policy(admit_per_device=True))
def test_the_schedule_does_not_depend_on_the_unit_of_time(
        case: tuple[dict[str, Any], list[tuple[int, int]], list[int]], policy: Policy) -> None:
    """Every duration 8 times shorter or longer: the same order, 8 times less or more time (the
    rules compare times with each other, never with a constant; powers of two keep it exact)."""
    doc, stages, owner = case
    base = list_schedule(Costs.from_problem(parse_problem(doc)), stages=stages, owner=owner, policy=policy)
    for k in (0.125, 8.0):
        scaled = list_schedule(Costs.from_problem(parse_problem(_rescaled(doc, k))), stages=stages, owner=owner,
                               policy=policy)
        assert scaled.actions == base.actions, k
        assert (scaled.feasible, scaled.reason) == (base.feasible, base.reason)
        assert scaled.iteration_time == base.iteration_time * k


def test_a_schedule_held_back_by_memory_reports_the_replayed_time() -> None:
    """Both devices hold one microbatch (3 bytes, 2 a microbatch). Stage 0's device is done
    with microbatch 0 at 9 (its B and W cost nothing), stage 1's at 10, so the scheduler admits
    microbatch 1 at 10. The executor (and the simulator) runs the same order without waiting:
    F(0,1) 9-12, F(1,1) 12-15, B 15-18, W 18-19. The scheduler used to report 20."""
    layers = [{"name": "l0", "forward": 3.0, "backward": 0.0, "weight": 0.0, "activation_bytes": 2.0},
              {"name": "l1", "forward": 3.0, "backward": 3.0, "weight": 1.0, "activation_bytes": 2.0}]
    devices = [{"name": f"d{d}", "node": "n", "memory_bytes": 3.0} for d in range(2)]
    costs = Costs.from_problem(parse_problem(
        {"name": "t", "microbatches": 2, "layers": layers, "devices": {"list": devices}}))
    sched = _replays(costs, stages=[(0, 1), (1, 2)], owner=[0, 1], policy=Policy())
    assert sched.actions[0][3] == ("F", 0, 1)  # microbatch 1 enters only after 0 has left both
    assert sched.iteration_time == 19.0


def test_transfers_are_on_the_critical_path_of_the_reported_time() -> None:
    """Two devices on two nodes, one layer each, one microbatch: F, transfer, F, B, transfer
    back, B (stage 0's backward is all W); each transfer is 0.5 + 2 bytes / 1 B/s."""
    layers = [{"name": f"l{i}", "forward": 1.0, "backward": 1.0, "weight": 1.0, "output_bytes": 2.0}
              for i in range(2)]
    devices = [{"name": f"d{d}", "node": f"n{d}"} for d in range(2)]
    doc = {"name": "t", "microbatches": 1, "layers": layers, "devices": {"list": devices}, "time_unit": "s",
           "network": {"inter_node": {"bandwidth_bytes_per_s": 1.0, "latency_s": 0.5}}}
    costs = Costs.from_problem(parse_problem(doc))
    sched = _replays(costs, stages=[(0, 1), (1, 2)], owner=[0, 1], policy=Policy())
    # F0 1, hop 2.5, F1 1, B1 1, hop 2.5, B0 0, W0 2 (stage 0's whole backward): 10.
    assert sched.iteration_time == 10.0


def test_per_device_admission_fills_a_pipeline_the_global_rule_starves() -> None:
    """Four stages; the last device holds one microbatch's activations, the others eight.
    The global rule admits a microbatch only when every device has room, so the whole
    pipeline runs about one microbatch at a time. Per device, the first three keep it full
    while the last takes one at a time, within its memory (``_replays`` checks it): its F of
    microbatch 0 starts at 3, then F+B of 2 a microbatch back to back (16), the backward
    crosses stages 2 and 1 (2), and stage 0's backward, all W, takes 1: 22."""
    layers = [{"name": f"l{i}", "forward": 1.0, "backward": 1.0, "weight": 0.0,
               "activation_bytes": 4.0 if i == 3 else 1.0} for i in range(4)]
    devices = [{"name": f"d{d}", "node": "n", "memory_bytes": 4.0 if d == 3 else 8.0}
               for d in range(4)]
    costs = Costs.from_problem(parse_problem(
        {"name": "t", "microbatches": 8, "layers": layers, "devices": {"list": devices}}))
    stages, owner = [(i, i + 1) for i in range(4)], [0, 1, 2, 3]
    starved = _replays(costs, stages=stages, owner=owner, policy=Policy())
    full = _replays(costs, stages=stages, owner=owner, policy=Policy(admit_per_device=True))
    assert full.iteration_time == 22.0
    assert starved.iteration_time > 2 * full.iteration_time
    # Device 0 ran ahead: seven forwards before its first backward.
    assert [a[0] for a in full.actions[0][:8]] == ["F"] * 7 + ["B"]
