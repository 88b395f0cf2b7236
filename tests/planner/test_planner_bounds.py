"""The granularity-aware lower bound (adaptis.planner.bounds): tight where it can be, never
above the true optimum of the layer -> device assignment problem."""

from __future__ import annotations

import itertools
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from adaptis.api.problem import parse_problem
from adaptis.planner.bounds import assignment_bound, pipeline_bound
from adaptis.planner.costs import Costs
from adaptis.planner.strategies import lower_bound


def _costs(works: list[float], *, speeds: list[float], microbatches: int = 1) -> Costs:
    doc: dict[str, Any] = {
        "microbatches": microbatches,
        "layers": [{"name": f"l{i}", "forward": w / 3, "backward": w / 3, "weight": w / 3,
                    "activation_bytes": 0, "param_bytes": 0, "output_bytes": 0} for i, w in enumerate(works)],
        "devices": {"list": [{"node": "n0", "speed": v} for v in speeds]},
    }
    return Costs.from_problem(parse_problem(doc))


def _optimum(works: list[float], speeds: list[float]) -> float:
    """The exact least max work / speed over every layer -> device assignment (brute force)."""
    best = float("inf")
    for assign in itertools.product(range(len(speeds)), repeat=len(works)):
        load = [0.0] * len(speeds)
        for w, d in zip(works, assign, strict=True):
            load[d] += w
        best = min(best, max(x / v for x, v in zip(load, speeds, strict=True)))
    return best


def test_equal_layers_count_whole_layers() -> None:
    """40 equal layers on 16 devices: some device runs 3 of them, not the 2.5 of the spread."""
    costs = _costs([1.0] * 40, speeds=[1.0] * 16, microbatches=64)
    assert abs(assignment_bound(costs) - 3 * 64) < 1e-6
    assert abs(pipeline_bound(costs) - 2.5 * 64) < 1e-6
    assert abs(lower_bound(costs) - 3 * 64) < 1e-6


def test_a_head_of_its_own_and_the_rest_on_the_others() -> None:
    """Head 3.5, 40 layers of 1, 16 devices: optimum 3.5 (head alone, 3 layers elsewhere)."""
    costs = _costs([1.0] * 40 + [3.5], speeds=[1.0] * 16)
    assert abs(assignment_bound(costs) - 3.5) < 1e-6


def test_mixed_speeds_count_whole_layers() -> None:
    """5 equal layers, speeds 2 and 1: 4 on the fast one (time 2) or 3 and 2 (time 2)."""
    costs = _costs([1.0] * 5, speeds=[2.0, 1.0])
    assert abs(assignment_bound(costs) - _optimum([1.0] * 5, [2.0, 1.0])) < 1e-6


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.floats(min_value=0.1, max_value=10.0), min_size=1, max_size=7),
    st.lists(st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0]), min_size=1, max_size=3),
)
def test_never_above_the_exact_optimum(works: list[float], speeds: list[float]) -> None:
    costs = _costs(works, speeds=speeds)
    per_layer = [f + b for f, b in zip(costs.forward, costs.least_backward(), strict=True)]
    exact = _optimum(per_layer, speeds)
    bound = assignment_bound(costs)
    assert bound <= exact * (1 + 1e-9)
    # And never weaker than the spread and the heaviest layer it refines.
    assert bound >= max(sum(per_layer) / sum(speeds), max(per_layer) / max(speeds)) * (1 - 1e-5)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.sampled_from([0.5, 1.0, 2.5, 4.0]), min_size=1, max_size=8),
    st.integers(min_value=1, max_value=3),
)
def test_exact_on_identical_devices_with_few_layer_kinds(works: list[float], devices: int) -> None:
    """The bin-packing DP makes the bound the exact optimum there (the paper's models' case)."""
    costs = _costs(works, speeds=[1.0] * devices)
    per_layer = [f + b for f, b in zip(costs.forward, costs.least_backward(), strict=True)]
    exact = _optimum(per_layer, [1.0] * devices)
    assert abs(assignment_bound(costs) - exact) <= 1e-6 * exact
