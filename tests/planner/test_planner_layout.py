"""The layout search (adaptis.planner.layout): ranked by predicted step, the pruned search's
first choice equals an exhaustive one's, memory refusals with reasons, the batch identity,
and bad arguments named. Real problems and the real joint search throughout, no mocks."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from layer_strategies import LAYER

from adaptis.api.problem import Problem, load_problem, parse_problem
from adaptis.planner.costs import Costs
from adaptis.planner.errors import LayoutError, PlannerError
from adaptis.planner.layout import LayoutSearch, search_layouts
from adaptis.planner.layout_space import Layout, enumerate_layouts, layout_problem, memory_floor

ROOT = Path(__file__).resolve().parents[2]
SMALL = ROOT / "examples" / "problems" / "nemotron-h-small.yaml"
HETERO = ROOT / "examples" / "problems" / "heterogeneous-cluster.yaml"


def _small(**update: Any) -> Problem:
    doc = load_problem(SMALL).model_dump(mode="json", exclude_none=True)
    for key, value in update.items():
        doc[key] = {**doc[key], **value} if isinstance(value, dict) else value
    return parse_problem(doc)


def _search(problem: Problem, **kw: Any) -> LayoutSearch:
    args: dict[str, Any] = {"gpus": 8, "global_batch": 16, "microbatch_sizes": (1, 2), "per_layout_s": 20.0}
    return search_layouts(problem, **{**args, **kw})


@pytest.fixture(scope="module")
def slow_replicas() -> Problem:
    """A replica link slow enough that the all-reduce decides: iteration order != step order."""
    return _small(network={"data_parallel": {"bandwidth_bytes_per_s": 2.0e9, "latency_s": 1e-4}})


@pytest.fixture(scope="module")
def pruned(slow_replicas: Problem) -> LayoutSearch:
    return _search(slow_replicas)


@pytest.fixture(scope="module")
def exhaustive(slow_replicas: Problem) -> LayoutSearch:
    return _search(slow_replicas, exhaustive=True)


def test_ranked_by_step_not_iteration(pruned: LayoutSearch) -> None:
    steps = [r.step_time for r in pruned.ranked]
    assert steps == sorted(steps)
    assert len(pruned.ranked) >= 5
    # The problem discriminates: the iteration alone would order the top differently.
    iterations = [r.iteration_time for r in pruned.ranked]
    assert iterations != sorted(iterations)
    assert pruned.ranked[0].reason is None
    for r in pruned.ranked[1:]:
        assert r.reason and ("slower" in r.reason or "as fast" in r.reason), r.reason
    best = pruned.ranked[0]
    assert best.sequences_per_s == pytest.approx(16 / (best.step_time * 1e-3))


def test_runner_up_reason_names_the_all_reduce(pruned: LayoutSearch) -> None:
    first = pruned.ranked[0]
    for r in pruned.ranked[1:]:
        if r.layout.data_parallel > first.layout.data_parallel and r.reason and "slower" in r.reason:
            assert "all-reduce" in r.reason or "bubble" in r.reason or "busiest" in r.reason
            pct = float(r.reason.split("%")[0])
            assert pct == pytest.approx(100 * (r.step_time / first.step_time - 1), abs=0.06)


def test_pruned_first_choice_equals_exhaustive(pruned: LayoutSearch, exhaustive: LayoutSearch) -> None:
    assert exhaustive.searched == exhaustive.enumerated - sum(not r.searched for r in exhaustive.refused)
    assert pruned.searched < exhaustive.searched  # the bound pruned something
    assert pruned.pruned > 0 and pruned.searched + pruned.pruned + sum(
        not r.searched for r in pruned.refused) == pruned.enumerated
    assert pruned.ranked[0].layout == exhaustive.ranked[0].layout
    assert pruned.ranked[0].step_time == pytest.approx(exhaustive.ranked[0].step_time)
    # The top five are exact too: nothing pruned could have entered them.
    assert [r.layout for r in pruned.ranked[:5]] == [r.layout for r in exhaustive.ranked[:5]]


def test_step_bound_is_below_every_step(exhaustive: LayoutSearch) -> None:
    for r in exhaustive.ranked:
        assert r.bound <= r.step_time * (1 + 1e-9), r.layout.label()


def test_batch_identity_and_gpu_budget(exhaustive: LayoutSearch) -> None:
    for lay in [r.layout for r in exhaustive.ranked] + [r.layout for r in exhaustive.refused]:
        assert lay.microbatches * lay.microbatch_size * lay.data_parallel == 16
        assert lay.data_parallel * lay.pipeline * lay.tensor == 8
        assert 4 % lay.tensor == 0  # the problem's 4 GPUs a node


def test_fewer_gpus_when_asked() -> None:
    layouts = enumerate_layouts(_small(), gpus=8, global_batch=16, min_gpus=6)
    assert {lay.gpus for lay in layouts} == {6, 7, 8}
    assert all(lay.global_batch == 16 for lay in layouts)


def test_over_memory_refused_with_reason() -> None:
    # 10 GB a GPU: the model's 14.3 GB of parameters do not fit on one GPU (P = T = 1),
    # whatever the schedule; deeper pipelines and tensor groups do.
    tight = _small(devices={"memory_bytes": 1.0e10})
    result = _search(tight)
    unsearched = [r for r in result.refused if not r.searched]
    assert unsearched, "the memory floor refused nothing"
    for r in unsearched:
        assert "over memory" in r.reason and "GB" in r.reason, r.reason
        assert r.layout not in {x.layout for x in result.ranked}
    assert any(r.layout.pipeline == 1 and r.layout.tensor == 1 for r in unsearched)
    for r in result.ranked:
        assert max(r.peak_memory_bytes) <= 1.0e10 * (1 + 1e-9), r.layout.label()
    for r in result.refused:
        assert r.reason


def test_memory_floor_is_below_every_plan(exhaustive: LayoutSearch, slow_replicas: Problem) -> None:
    for r in exhaustive.ranked:
        floor, why = memory_floor(Costs.from_problem(layout_problem(slow_replicas, r.layout)))
        assert why is None and floor <= max(r.peak_memory_bytes) * (1 + 1e-9), r.layout.label()


def test_layout_problem_scales_the_microbatch() -> None:
    base = _small()
    one = Costs.from_problem(layout_problem(base, Layout(1, 2, 1, 1, 8)))
    two = Costs.from_problem(layout_problem(base, Layout(1, 2, 1, 2, 4)))
    assert two.forward == pytest.approx([2 * f for f in one.forward])
    assert two.activation_bytes == pytest.approx([2 * a for a in one.activation_bytes])
    assert two.param_bytes == one.param_bytes and two.microbatches == 4 and two.devices == 2


@pytest.mark.parametrize(("kw", "argument"), [
    ({"gpus": 0}, "gpus"),
    ({"gpus": -1}, "gpus"),
    # Prime and past the 20 layers: only R = 23 makes it, and 16 sequences do not divide by 23.
    ({"gpus": 23}, "global_batch"),
    ({"global_batch": 0}, "global_batch"),
    ({"global_batch": 6, "microbatch_sizes": (4,)}, "global_batch"),
    ({"min_gpus": 9}, "min_gpus"),
    ({"keep": 0}, "keep"),
    ({"sequence_length": 0}, "sequence_length"),
])
def test_bad_arguments_name_themselves(kw: dict[str, Any], argument: str) -> None:
    with pytest.raises(LayoutError) as err:
        _search(_small(), **kw)
    assert err.value.argument == argument
    assert str(err.value).startswith(f"{argument}: ")
    assert isinstance(err.value, PlannerError)


def test_heterogeneous_devices_refused() -> None:
    with pytest.raises(LayoutError) as err:
        _search(load_problem(HETERO))
    assert err.value.argument == "devices"


def test_tensor_widths_limit_the_degree() -> None:
    layouts = enumerate_layouts(_small(), gpus=8, global_batch=16, tensor_widths={"heads": 6})
    assert {lay.tensor for lay in layouts} == {1, 2}


@st.composite
def _layout_problems(draw: st.DrawFn) -> tuple[Problem, int, int]:
    layers = draw(st.lists(LAYER, min_size=2, max_size=6))
    per_node = draw(st.sampled_from([1, 2, 4]))
    held = [lay["param_bytes"] + lay["activation_bytes"] for lay in layers]
    memory = draw(st.floats(min_value=max(held) * 0.5, max_value=sum(held) * 3))
    doc = {"microbatches": 1, "time_unit": "ms",
           "layers": [{"name": f"l{i}", **lay} for i, lay in enumerate(layers)],
           "devices": {"count": 1, "per_node": per_node, "memory_bytes": memory},
           "network": {"intra_node": {"bandwidth_bytes_per_s": 1e11, "latency_s": 1e-5},
                       "inter_node": {"bandwidth_bytes_per_s": 1e10, "latency_s": 2e-5}}}
    gpus = draw(st.integers(min_value=1, max_value=6))
    # R = gpus (P = T = 1) is always a mesh: a multiple of it always has a layout.
    return parse_problem(doc), gpus, gpus * draw(st.integers(min_value=1, max_value=2))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_layout_problems())
def test_properties_on_random_problems(case: tuple[Problem, int, int]) -> None:
    """On random models, memories and budgets: the floor and the bound never exceed what a
    searched layout replays at, every result fits and keeps the batch, and the pruned search's
    first choice is the exhaustive one's."""
    problem, gpus, batch = case
    full = search_layouts(problem, gpus=gpus, global_batch=batch, exhaustive=True, per_layout_s=None)
    pruned = search_layouts(problem, gpus=gpus, global_batch=batch, keep=1, per_layout_s=None)
    memory = problem.device_specs()[0].memory_bytes or math.inf
    for r in full.ranked:
        floor, _why = memory_floor(Costs.from_problem(layout_problem(problem, r.layout)))
        assert floor <= max(r.peak_memory_bytes) * (1 + 1e-9) <= memory * (1 + 1e-6)
        assert r.bound <= r.step_time * (1 + 1e-9)
        assert r.layout.global_batch == batch and r.layout.gpus == gpus
    assert [r.layout for r in full.refused if not r.searched] == [r.layout for r in pruned.refused if not r.searched]
    if full.ranked:
        assert pruned.ranked[0].step_time == pytest.approx(full.ranked[0].step_time, rel=1e-9)
    else:
        assert not pruned.ranked


def test_sequence_parallel_kept_where_there_is_a_tensor_group() -> None:
    base = _small(tensor_parallel=2, sequence_parallel=True)
    assert layout_problem(base, Layout(1, 2, 2, 1, 8)).sequence_parallel
    assert not layout_problem(base, Layout(2, 2, 1, 1, 4)).sequence_parallel
    sent = Costs.from_problem(layout_problem(base, Layout(1, 2, 2, 1, 8))).output_bytes
    whole = Costs.from_problem(layout_problem(_small(), Layout(1, 2, 2, 1, 8))).output_bytes
    assert sent == pytest.approx([b / 2 for b in whole])
