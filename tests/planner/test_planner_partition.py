"""Partitions (adaptis.planner.partition) against known answers: sizes, pinned layers, optima.

The baselines' and the properties' tests check the partitions as they are used (optimal by
brute force, never worse than Megatron's); these pin each rule's exact answer and its errors.
"""

from __future__ import annotations

import pytest

from adaptis.api.problem import parse_problem
from adaptis.planner.costs import Costs
from adaptis.planner.errors import PlannerError
from adaptis.planner.partition import balanced_partition, body_span, bottleneck, even_split, megatron_partition


def _model(kinds_work: list[tuple[str | None, float]]) -> Costs:
    layers = [{"name": f"l{i}", "forward": work, **({"kind": k} if k else {})}
              for i, (k, work) in enumerate(kinds_work)]
    return Costs.from_problem(parse_problem({"microbatches": 1, "layers": layers, "devices": {"count": 1}}))


def _plain(*works: float) -> Costs:
    return _model([(None, w) for w in works])


def test_even_split_gives_the_remainder_to_the_first_runs() -> None:
    assert even_split(10, parts=4) == [3, 3, 2, 2]
    assert even_split(7, parts=7) == [1] * 7
    assert even_split(9, parts=3) == [3, 3, 3]
    assert even_split(5, parts=1) == [5]


@pytest.mark.parametrize(("count", "parts"), [(3, 4), (3, 0), (0, 1), (5, -1)])
def test_even_split_refuses_empty_runs(count: int, parts: int) -> None:
    with pytest.raises(PlannerError, match=f"cannot split {count} layers into {parts} non-empty stages"):
        even_split(count, parts=parts)


def test_body_span_counts_only_the_leading_embeddings_and_the_trailing_heads() -> None:
    e, h, x = "embedding", "head", None
    assert body_span(_model([(e, 1), (e, 1), (x, 1), (e, 1), (h, 1), (x, 1), (h, 1), (h, 1)])) == (2, 2)
    assert body_span(_model([(x, 1), (e, 1), (h, 1), (x, 1)])) == (0, 0)
    # A model of embeddings only: all of it is the lead, none is left to be a head.
    assert body_span(_model([(e, 1), (e, 1)])) == (2, 0)
    assert body_span(_model([(h, 1), (h, 1), (h, 1)])) == (0, 3)
    assert body_span(_model([(e, 1), (h, 1)])) == (1, 1)


def test_megatron_partition_with_as_many_body_layers_as_stages() -> None:
    costs = _model([("embedding", 1.0), (None, 1.0), (None, 1.0), ("head", 1.0)])
    # body == stages: each body layer is a stage, the embedding and the head pinned to them.
    assert megatron_partition(costs, stages_count=2) == [(0, 2), (2, 4)]
    # Two heads: the pinned split (2 | 3) is not the even one by count (3 | 2).
    two_heads = _model([("embedding", 1.0), (None, 1.0), (None, 1.0), ("head", 1.0), ("head", 1.0)])
    assert megatron_partition(two_heads, stages_count=2) == [(0, 2), (2, 5)]
    # body < stages: all four layers split by count.
    assert megatron_partition(costs, stages_count=3) == [(0, 2), (2, 3), (3, 4)]
    assert megatron_partition(costs, stages_count=4) == [(0, 1), (1, 2), (2, 3), (3, 4)]


@pytest.mark.parametrize("stages", [0, 5])
def test_megatron_partition_refuses_a_stage_count_out_of_range(stages: int) -> None:
    with pytest.raises(PlannerError, match=f"cannot split 4 layers into {stages} non-empty stages"):
        megatron_partition(_plain(1, 1, 1, 1), stages_count=stages)


def test_bottleneck_divides_each_stage_by_its_speed() -> None:
    costs = _plain(1.0, 2.0, 3.0, 4.0)
    work = costs.layer_work()
    stages = [(0, 2), (2, 3), (3, 4)]
    assert bottleneck(costs, stages) == pytest.approx(max(work[0] + work[1], work[2], work[3]))
    assert bottleneck(costs, stages, speeds=[1.0, 1.0, 4.0]) == pytest.approx(max(work[0] + work[1], work[2]))
    assert bottleneck(costs, stages, speeds=[0.5, 1.0, 1.0]) == pytest.approx(2 * (work[0] + work[1]))


@pytest.mark.parametrize("stages", [0, 4])
def test_balanced_partition_refuses_a_stage_count_out_of_range(stages: int) -> None:
    with pytest.raises(PlannerError, match=f"cannot split 3 layers into {stages} non-empty stages"):
        balanced_partition(_plain(1, 1, 1), stages_count=stages)


def test_balanced_partition_refuses_a_speed_per_stage_mismatch() -> None:
    with pytest.raises(PlannerError, match="2 speeds for 3 stages"):
        balanced_partition(_plain(1, 1, 1), stages_count=3, speeds=[1.0, 1.0])


def test_balanced_partition_fills_early_stages_first() -> None:
    # Bottleneck 3 (the 3-layer); the greedy packs 1+1 before it, leaving the tail light.
    costs = _plain(1, 1, 3, 1, 1)
    assert balanced_partition(costs, stages_count=3) == [(0, 2), (2, 3), (3, 5)]
    assert balanced_partition(_plain(1, 1, 1, 1, 1, 1, 1, 1, 1, 1), stages_count=4) == [(0, 3), (3, 6), (6, 9), (9, 10)]


def test_balanced_partition_with_one_stage_or_one_layer_per_stage() -> None:
    assert balanced_partition(_plain(5, 1, 2), stages_count=1) == [(0, 3)]
    assert balanced_partition(_plain(5, 1, 2), stages_count=3) == [(0, 1), (1, 2), (2, 3)]
    assert balanced_partition(_plain(5, 1, 2), stages_count=3, speeds=[3.0, 1.0, 2.0]) == [(0, 1), (1, 2), (2, 3)]


def test_balanced_partition_is_exact_to_the_relative_tolerance() -> None:
    costs = _plain(1, 2, 3, 4, 5, 6, 7, 8, 9)
    work = costs.layer_work()
    stages = balanced_partition(costs, stages_count=3)
    # The optimum: 1..5 | 6 7 | 8 9 -> 15, 13, 17 (x the per-layer F+B+W factor).
    assert stages == [(0, 5), (5, 7), (7, 9)]
    assert bottleneck(costs, stages) == pytest.approx(work[7] + work[8], rel=1e-12)


def test_balanced_partition_with_unequal_speeds_puts_more_on_the_faster_device() -> None:
    costs = _plain(*([1.0] * 8))
    assert balanced_partition(costs, stages_count=2, speeds=[3.0, 1.0]) == [(0, 6), (6, 8)]
    assert balanced_partition(costs, stages_count=2, speeds=[1.0, 3.0]) == [(0, 2), (2, 8)]
    # Equal speeds given explicitly: the same answer as none.
    assert balanced_partition(costs, stages_count=3, speeds=[2.0, 2.0, 2.0]) == balanced_partition(
        costs, stages_count=3)


def test_spread_evens_the_stages_under_the_bottleneck() -> None:
    ones = _plain(*([1.0] * 10))
    # Without spread: 3, 3, 3, 1; with it, two stages of 3 and two of 2 (the least sum of squares).
    assert sorted(hi - lo for lo, hi in balanced_partition(ones, stages_count=4, spread=True)) == [2, 2, 3, 3]
    # Unequal speeds: the spread minimises the sum of squared *times*, so the fast stage takes more.
    got = balanced_partition(_plain(*([1.0] * 9)), stages_count=3, speeds=[2.0, 1.0, 1.0], spread=True)
    assert got == [(0, 5), (5, 7), (7, 9)]


def test_spread_is_skipped_past_its_size_limit() -> None:
    """The spread's DP costs layers^2 x stages steps (seconds of Python past a few million): up
    to 2e6 it spreads, past it the fill-early optimum is returned (docstring: "skipped on very
    large inputs"). 500 unit layers on 8 stages sit exactly at the limit, 501 just past it."""
    at_limit = balanced_partition(_plain(*([1.0] * 500)), stages_count=8, spread=True)
    assert [hi - lo for lo, hi in at_limit] == [63, 63, 63, 63, 62, 62, 62, 62]
    past = balanced_partition(_plain(*([1.0] * 501)), stages_count=8, spread=True)
    assert [hi - lo for lo, hi in past] == [63] * 7 + [60]  # fill-early: 7 x 63, the rest last


def test_spread_may_leave_single_layer_stages_first() -> None:
    """Layers of work 1, 1, 3, 3, 1 on devices of speed 2, 1, 1, 2: the bottleneck is 3 (a layer
    of 3 alone on a speed-1 device). Two partitions reach it: 1 | 1 | 3 | 3+1 (stage times 0.5,
    1, 3, 2; squares 14.25) and 1+1 | 3 | 3 | 1 (1, 3, 3, 0.5; squares 19.25): spread takes the
    first, whose first stages have one layer each."""
    costs = _plain(1, 1, 3, 3, 1)
    speeds = [2.0, 1.0, 1.0, 2.0]
    assert balanced_partition(costs, stages_count=4, speeds=speeds, spread=True) == [(0, 1), (1, 2), (2, 3), (3, 5)]


def test_balanced_partition_of_layers_far_below_one_time_unit() -> None:
    # The bisection starts from 0, not from any fixed time: microsecond layers split as well.
    costs = _plain(1e-3, 1e-3, 3e-3, 1e-3, 1e-3)
    assert balanced_partition(costs, stages_count=3) == [(0, 2), (2, 3), (3, 5)]
