"""The step after the pipeline: data-parallel all-reduce and optimizer, on hand-made plans whose
figures are worked out by hand (adaptis.planner.post_pipeline)."""

from __future__ import annotations

from typing import Any

import pytest

from adaptis.api.errors import SpecError
from adaptis.api.plan import Plan
from adaptis.api.problem import parse_problem
from adaptis.planner.costs import Costs
from adaptis.planner.simulator import simulate
from adaptis.planner.strategies import plan_strategy

# 1e6 gradient bytes (param_bytes / 4) over 1 GB/s with 0.1 ms latency, R = 2, in ms:
# 2 x 0.1 + 2 (R-1)/R x 1e6 / 1e9 x 1e3 = 0.2 + 1.0.
ALLREDUCE_MS = 1.2


def _problem(*, replicas: int = 2, speed: float = 1.0, **extra: Any) -> dict[str, Any]:
    layer = {"forward": 1.0, "backward": 1.0, "weight": 1.0, "param_bytes": 4e6, "optimizer": 0.5}
    return {
        "microbatches": 2,
        "data_parallel": replicas,
        "layers": [{"name": "a", **layer}, {"name": "b", **layer}],
        "devices": {"count": 2, "per_node": 2, "speed": speed},
        "network": {"data_parallel": {"bandwidth_bytes_per_s": 1e9, "latency_s": 1e-4}},
        **extra,
    }


# One stage a device, fused backwards: device 0 F 0-1, 1-2; device 1 F 1-2, BW 2-4, F 4-5,
# BW 5-7; device 0 BW 4-6 (stage 0's fused backward is 2), 7-9. The pipeline ends at 9.
PLAN = Plan(stages=[(0, 1), (1, 2)], placement=[[0], [1]],
            actions=[[("F", 0, 0), ("F", 0, 1), ("BW", 0, 0), ("BW", 0, 1)],
                     [("F", 1, 0), ("BW", 1, 0), ("F", 1, 1), ("BW", 1, 1)]])


def test_two_replicas_one_stage_a_device_worked_out_by_hand() -> None:
    sim = simulate(Costs.from_problem(parse_problem(_problem())), PLAN)
    assert sim.iteration_time == pytest.approx(9.0)
    post = sim.post
    assert post is not None
    # Stage 1's reduction starts at its last BW's end (7) and hides under device 0's compute;
    # stage 0's starts at 9, after the pipeline, and is exposed.
    assert [(r.stage, r.start, r.end) for r in post.reductions[1]] == [
        (1, pytest.approx(7.0), pytest.approx(7.0 + ALLREDUCE_MS))]
    assert [(r.stage, r.start, r.end) for r in post.reductions[0]] == [
        (0, pytest.approx(9.0), pytest.approx(9.0 + ALLREDUCE_MS))]
    # The optimizer starts everywhere once every gradient is final (clipping's global norm).
    assert post.gradients_ready == pytest.approx(9.0 + ALLREDUCE_MS)
    assert sim.step_time == pytest.approx(9.0 + ALLREDUCE_MS + 0.5)
    assert sim.post_pipeline_time == pytest.approx(ALLREDUCE_MS + 0.5)


def test_one_replica_adds_only_the_optimizer_and_nothing_without_one() -> None:
    sim = simulate(Costs.from_problem(parse_problem(_problem(replicas=1))), PLAN)
    assert sim.post is not None and sim.post.reductions == ((), ())
    assert sim.step_time == pytest.approx(9.5)
    bare = _problem(replicas=1)
    bare["layers"] = [{k: v for k, v in lay.items() if k != "optimizer"} for lay in bare["layers"]]
    sim = simulate(Costs.from_problem(parse_problem(bare)), PLAN)
    assert sim.step_time == sim.iteration_time
    assert sim.post_pipeline_time == 0.0


def test_reductions_of_one_device_run_in_ready_order() -> None:
    # Both stages on device 0 (device 1 idle): the reductions run in the order their
    # gradients are ready, one at a time.
    plan = Plan(stages=[(0, 1), (1, 2)], placement=[[0, 1], []],
                actions=[[("F", 0, 0), ("F", 1, 0), ("BW", 1, 0), ("BW", 0, 0),
                          ("F", 0, 1), ("F", 1, 1), ("BW", 1, 1), ("BW", 0, 1)], []])
    data = _problem()
    data["layers"][1]["backward"] = 0.0  # stage 1's BW: 1, so the two reductions overlap in time
    data["layers"][1]["weight"] = 0.0
    data["layers"][1]["backward_fused"] = 0.1
    sim = simulate(Costs.from_problem(parse_problem(data)), plan)
    # F 0-1, F 1-2, BW1 2-2.1, BW0 2.1-4.1, F 4.1-5.1, F 5.1-6.1, BW1 6.1-6.2, BW0 6.2-8.2.
    assert sim.iteration_time == pytest.approx(8.2)
    post = sim.post
    assert post is not None
    first, second = post.reductions[0]
    assert (first.stage, first.start) == (1, pytest.approx(6.2))
    # Stage 0's gradients are ready at 8.2 but the channel is busy until 7.4: starts at 8.2.
    assert (second.stage, second.start) == (0, pytest.approx(8.2))
    assert second.start >= first.end
    assert sim.step_time == pytest.approx(8.2 + ALLREDUCE_MS + 1.0)  # one device, both layers


def test_channel_busy_delays_the_next_reduction() -> None:
    plan = Plan(stages=[(0, 1), (1, 2)], placement=[[0, 1], []],
                actions=[[("F", 0, 0), ("F", 1, 0), ("BW", 1, 0), ("BW", 0, 0)], []])
    data = _problem()
    data["microbatches"] = 1
    data["layers"][0]["backward_fused"] = 0.2  # stage 0's BW ends 0.2 after stage 1's
    sim = simulate(Costs.from_problem(parse_problem(data)), plan)
    post = sim.post
    assert post is not None
    first, second = post.reductions[0]
    # F 0-1, F 1-2, BW1 2-4, BW0 4-4.2: stage 1 reduces 4-5.2, stage 0 waits for the channel.
    assert (first.stage, first.start, first.end) == (1, pytest.approx(4.0), pytest.approx(5.2))
    assert (second.stage, second.start, second.end) == (0, pytest.approx(5.2), pytest.approx(6.4))


def test_gradient_bytes_link_and_speed_are_used() -> None:
    data = _problem(speed=2.0)
    for lay in data["layers"]:
        lay["gradient_bytes"] = 2e6  # twice the default: the bandwidth term doubles
    sim = simulate(Costs.from_problem(parse_problem(data)), PLAN)
    # Speed 2 halves compute: the pipeline ends at 4.5, the optimizer takes 0.25.
    assert sim.step_time == pytest.approx(4.5 + 0.2 + 2.0 + 0.25)
    # Without network.data_parallel the reduction runs over inter_node.
    data = _problem()
    data["network"] = {"inter_node": {"bandwidth_bytes_per_s": 1e9, "latency_s": 1e-4}}
    sim = simulate(Costs.from_problem(parse_problem(data)), PLAN)
    assert sim.step_time == pytest.approx(9.0 + ALLREDUCE_MS + 0.5)


def test_strategies_put_step_time_in_the_plan_and_the_comparison_row() -> None:
    outcome = plan_strategy(parse_problem(_problem()), "1f1b")
    assert outcome.plan is not None and outcome.plan.predicted is not None
    pred = outcome.plan.predicted
    assert pred.step_time == pytest.approx(outcome.result.step_time)
    assert pred.step_time == pytest.approx(pred.iteration_time + pred.post_pipeline_time)
    assert pred.post_pipeline_time >= ALLREDUCE_MS  # the last stage to finish reduces after


def test_bad_data_parallel_names_the_field() -> None:
    with pytest.raises(SpecError, match="data_parallel"):
        parse_problem(_problem(replicas=0))


def test_ring_allreduce_scales_with_the_replicas() -> None:
    # R = 4: 2 x 3 x 0.1 latency + 2 x 3/4 x 1.0 bandwidth = 0.6 + 1.5 ms.
    costs = Costs.from_problem(parse_problem(_problem(replicas=4)))
    assert costs.allreduce_time(1e6) == pytest.approx(2.1)
    assert Costs.from_problem(parse_problem(_problem(replicas=1))).allreduce_time(1e6) == 0.0


def test_the_optimizer_waits_for_every_devices_gradients() -> None:
    # Device 1 (stage 1) has its gradients at 7 + 1.2 but the largest optimizer step (3.0):
    # the global norm needs device 0's too (9 + 1.2), so it starts at 10.2 and the step ends
    # at 13.2, not at max(10.2 + 0.1, 8.2 + 3.0) = 11.2.
    data = _problem()
    data["layers"][0]["optimizer"] = 0.1
    data["layers"][1]["optimizer"] = 3.0
    sim = simulate(Costs.from_problem(parse_problem(data)), PLAN)
    assert sim.post is not None and sim.post.optimizer == pytest.approx((0.1, 3.0))
    assert sim.step_time == pytest.approx(9.0 + ALLREDUCE_MS + 3.0)
