"""The Zero Bubble greedy order: chunk counts on even devices, bytes where a device's chunks differ."""

from __future__ import annotations

from typing import Any

from adaptis.api.problem import parse_problem
from adaptis.planner.baselines import BASELINES
from adaptis.planner.costs import Costs
from adaptis.planner.partition import megatron_partition
from adaptis.planner.simulator import simulate
from adaptis.planner.zero_bubble import _budgets


def _model(*, embedding_params: float, head_params: float, layer_activation: float) -> Costs:
    """4 devices, 16 layers, a cheap embedding and a head whose activation is 45 layers' worth."""
    doc: dict[str, Any] = {
        "microbatches": 16,
        "layers": [
            {"name": "embedding", "kind": "embedding", "forward": 0.05, "weight": 0.05,
             "activation_bytes": 1e8, "param_bytes": embedding_params},
            {"repeat": 16, "layers": [{"name": "layer", "forward": 1.0, "backward": 1.0, "weight": 1.0,
                                       "activation_bytes": layer_activation, "param_bytes": 1e9}]},
            {"name": "head", "kind": "head", "forward": 5.0, "backward": 1.0, "weight": 0.5,
             "activation_bytes": 9e9, "param_bytes": head_params},
        ],
        "devices": {"count": 4, "memory_bytes": 8e10},
    }
    return Costs.from_problem(parse_problem(doc))


def test_even_chunks_are_counted_as_before() -> None:
    # One stage a device (ZB-H1), and two equal ones (ZB-V's inner devices): plain chunk counts,
    # even where a cap exceeds the memory (the simulator reports that, the order keeps its shape).
    costs = _model(embedding_params=1e9, head_params=70e9, layer_activation=2e8)
    size, reserve, budget = _budgets(costs, stages=[(0, 5), (5, 9), (9, 13), (13, 18)],
                                     owned=[[0], [1], [2], [3]], caps=[4, 3, 2, 1])
    assert size == [1.0] * 4 and reserve == [0.0] * 4 and budget == [4.0, 3.0, 2.0, 1.0]
    size, reserve, budget = _budgets(costs, stages=[(0, 3), (3, 5), (5, 7), (7, 18)],
                                     owned=[[0, 3], [1, 2]], caps=[0, 5])
    assert size[1:3] == [1.0, 1.0] and reserve[1] == 1.0 and budget[1] == 5.0
    assert budget[0] == size[0] + 1.0  # raised to one entering chunk plus the reserve


def test_small_chunk_beside_the_head_is_charged_its_bytes() -> None:
    # Device 0 holds the embedding stage (0.5 GB a microbatch) and the head stage (9.4 GB):
    # 35 GB free, so three head chunks, or one head chunk and many embedding-stage chunks.
    costs = _model(embedding_params=25e9, head_params=40e9, layer_activation=2e8)
    stages = megatron_partition(costs, stages_count=8)
    owned = [[d, 7 - d] for d in range(4)]
    size, reserve, budget = _budgets(costs, stages=stages, owned=owned, caps=[2, 8, 8, 8])
    assert size[7] == 1.0 and 0.0 < size[0] < 0.1
    assert reserve[0] == 1.0 and 1.0 < budget[0] <= 2.0  # cut to the free memory, over one entry
    sim = simulate(costs, BASELINES["zb-v"](costs))
    one_f_one_b = simulate(costs, BASELINES["1f1b"](costs))
    assert sim.feasible
    # Counting every chunk as a head chunk starved the pipeline (641.6 against 1F1B's 332.1).
    assert sim.iteration_time <= 1.1 * one_f_one_b.iteration_time


def test_budget_never_below_one_entering_microbatch() -> None:
    # Memory too short even for one microbatch: the order must still make progress (the
    # simulator then reports the plan infeasible).
    costs = _model(embedding_params=40e9, head_params=39e9, layer_activation=2e8)
    stages = megatron_partition(costs, stages_count=8)
    owned = [[d, 7 - d] for d in range(4)]
    size, reserve, budget = _budgets(costs, stages=stages, owned=owned, caps=[2, 8, 8, 8])
    assert budget[0] == size[0] + reserve[0]
    sim = simulate(costs, BASELINES["zb-v"](costs))
    assert not sim.feasible and "device 0" in (sim.reason or "")
