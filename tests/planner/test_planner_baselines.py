"""Baselines against the closed forms of the method (docs/problem.md, the paper), and the partition rules they use.

Uniform layers, p devices, m microbatches: per-stage times F, B, W (per device in the
interleaved and V schedules, which split a device's layers into two chunks). All times are
compared exactly up to float noise: these are the yardsticks the AdaPtis speedup is
measured against, so they must be as good as the published schedules, not roughly so.
"""

from __future__ import annotations

import itertools
import math

import pytest

from adaptis.api.plan import STRATEGY_NAMES, Plan
from adaptis.api.problem import parse_problem
from adaptis.planner.baselines import (
    BASELINES,
    interleaved_actions,
    one_f_one_b,
    one_f_one_b_actions,
    zb_h1,
)
from adaptis.planner.costs import Costs
from adaptis.planner.errors import DeadlockError, PlannerError
from adaptis.planner.partition import balanced_partition, bottleneck, megatron_partition
from adaptis.planner.simulator import simulate

TOL = 1e-9


def uniform(
    *, p: int, m: int, layers: int, f: float = 1.0, b: float = 1.0, w: float = 1.0, memory: list[float] | None = None
) -> Costs:
    """``layers`` identical layers (activation 1 byte each) on ``p`` devices."""
    layer = {"name": "l", "forward": f, "backward": b, "weight": w, "activation_bytes": 1.0}
    devices: dict[str, object]
    devices = {"count": p} if memory is None else {"list": [{"node": "n0", "memory_bytes": mem} for mem in memory]}
    doc = {"microbatches": m, "layers": [{"repeat": layers, "layers": [layer]}], "devices": devices}
    return Costs.from_problem(parse_problem(doc))


SHAPES = [(4, 8), (4, 12), (8, 16), (2, 6), (3, 9)]
TIMES = [(1.0, 1.0, 1.0), (1.0, 1.5, 0.5), (2.0, 1.0, 1.0)]


@pytest.mark.parametrize(("p", "m"), SHAPES)
@pytest.mark.parametrize(("f", "b", "w"), TIMES)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_stage_times(
    name: str, p: int, m: int, f: float, b: float, w: float
) -> None:
    costs = uniform(p=p, m=m, layers=p, f=f, b=b, w=w)
    sim = simulate(costs, BASELINES[name](costs))
    for d in range(p):
        assert sim.bubble[d] == pytest.approx((p - 1) * (f + b + w), abs=TOL)
    assert sim.bubble_ratio == pytest.approx((p - 1) / (m + p - 1), abs=TOL)


@pytest.mark.parametrize(("p", "m"), [(4, 8), (4, 12), (8, 16), (2, 6), (3, 9)])
@pytest.mark.parametrize(("f", "b", "w"), TIMES)
def test_i1f1b_bubble_is_1f1b_over_v(p: int, m: int, f: float, b: float, w: float) -> None:
    # 2p layers allow only v = 2 (one layer per chunk); F, B, W are per device (both chunks).
    costs = uniform(p=p, m=m, layers=2 * p, f=f / 2, b=b / 2, w=w / 2)
    plan = BASELINES["i1f1b"](costs)
    assert [len(stages) for stages in plan.placement] == [2] * p
    sim = simulate(costs, plan)
    for d in range(p):
        assert sim.bubble[d] == pytest.approx((p - 1) * (f + b + w) / 2, abs=TOL)


@pytest.mark.parametrize(("p", "m"), SHAPES)
@pytest.mark.parametrize(("f", "b", "w"), TIMES)
def test_zb_h1_bubble_is_p_minus_1_times_f_plus_b_minus_w(p: int, m: int, f: float, b: float, w: float) -> None:
    costs = uniform(p=p, m=m, layers=p, f=f, b=b, w=w)
    sim = simulate(costs, BASELINES["zb-h1"](costs))
    assert max(sim.bubble) == pytest.approx((p - 1) * (f + b - w), abs=TOL)


@pytest.mark.parametrize(("p", "m"), [*SHAPES, (8, 64), (16, 128), (6, 11)])
def test_zb_v_is_zero_bubble_when_f_b_w_are_equal(p: int, m: int) -> None:
    # With m >= 2p-1 (the paper's setting) only the gap before the first input reaches the
    # last device remains: (p-1) chunk forwards,
    # a sixth of 1F1B's (p-1)(F+B+W) with F = B = W = 2 chunk forwards.
    costs = uniform(p=p, m=m, layers=2 * p)
    sim = simulate(costs, BASELINES["zb-v"](costs))
    assert max(sim.bubble) <= (p - 1) * 1.0 + TOL
    one_f = simulate(costs, one_f_one_b(costs))
    assert max(sim.bubble) <= max(one_f.bubble) / 6 + TOL


@pytest.mark.parametrize(("p", "m"), [(4, 8), (4, 12), (8, 16), (2, 6)])
def test_peak_activations_on_the_first_device(p: int, m: int) -> None:
    """In units of one microbatch through the device's layers (2 layers of 1 byte here)."""
    costs = uniform(p=p, m=m, layers=2 * p)
    v = 2
    expected = {
        "gpipe": m,
        "1f1b": p,
        "i1f1b": p * (1 + (p - 1) / (p * v)),
        "zb-h1": p,
        "zb-v": p,
        "balanced": p,
    }
    for name, make in BASELINES.items():
        sim = simulate(costs, make(costs))
        assert sim.peak_memory[0] / 2.0 == pytest.approx(expected[name]), name


def test_1f1b_warm_up_is_p_minus_1_minus_d_forwards() -> None:
    p, m = 5, 9
    for d, acts in enumerate(one_f_one_b_actions(devices=p, microbatches=m)):
        kinds = [k for k, _, _ in acts]
        lead = next(i for i, k in enumerate(kinds) if k != "F")
        assert lead == p - d  # p-1-d warm-up forwards, then the first steady F before BW
        assert kinds[lead] == "BW"


@pytest.mark.parametrize(("p", "v", "m"), [(4, 2, 8), (4, 3, 12), (2, 4, 6)])
def test_i1f1b_warm_up_follows_megatron(p: int, v: int, m: int) -> None:
    for d, acts in enumerate(interleaved_actions(devices=p, chunks=v, microbatches=m)):
        lead = next(i for i, (k, _, _) in enumerate(acts) if k != "F")
        warm = min(2 * (p - 1 - d) + (v - 1) * p, m * v)
        assert lead == (warm + 1 if warm < m * v else m * v)  # warm-up, then the first steady F


def _short_group_order(p: int, v: int, m: int) -> list[list[tuple[str, int, int]]]:
    """Megatron-core's table with a shorter last group and the same warm-up (the rejected option)."""
    table = [(mb, k) for lo in range(0, m, p) for k in range(v) for mb in range(lo, min(lo + p, m))]
    out = []
    for d in range(p):
        fwd = [("F", k * p + d, mb) for mb, k in table]
        bwd = [("BW", (v - 1 - k) * p + d, mb) for mb, k in table]
        warm = min(2 * (p - 1 - d) + (v - 1) * p, m * v)
        acts = fwd[:warm]
        for i in range(m * v - warm):
            acts += [fwd[warm + i], bwd[i]]
        out.append(acts + bwd[m * v - warm:])
    return out


def test_i1f1b_fallback_when_m_is_not_a_multiple_of_p() -> None:
    p, v, m = 5, 2, 7
    costs = uniform(p=p, m=m, layers=p * v)
    owned = [[k * p + d for k in range(v)] for d in range(p)]
    stages = megatron_partition(costs, stages_count=p * v)
    naive = Plan(stages=stages, placement=owned, actions=_short_group_order(p, v, m))
    with pytest.raises(DeadlockError):
        simulate(costs, naive)
    sim = simulate(costs, BASELINES["i1f1b"](costs))
    assert sim.iteration_time < simulate(costs, one_f_one_b(costs)).iteration_time


def test_i1f1b_picks_the_best_chunk_count() -> None:
    # 16 layers on 4 devices: v = 2, 3 or 4; with free links and uniform layers v = 4 wins.
    costs = uniform(p=4, m=8, layers=16)
    plan = BASELINES["i1f1b"](costs)
    assert len(plan.placement[0]) == 4
    assert plan.placement[1] == [1, 5, 9, 13]


def test_zb_h1_defers_less_where_memory_is_short_and_still_fits() -> None:
    # Device d has room for exactly 1F1B's p-d microbatches (1 byte each): the textbook H1
    # (p in flight everywhere) does not fit, the memory-capped order does, and beats 1F1B.
    p, m = 4, 8
    costs = uniform(p=p, m=m, layers=p, memory=[float(p - d) for d in range(p)])
    sim = simulate(costs, zb_h1(costs))
    assert sim.feasible
    assert all(peak <= p - d for d, peak in enumerate(sim.peak_memory))
    assert sim.iteration_time < simulate(costs, one_f_one_b(costs)).iteration_time


def test_fewer_layers_than_devices_leaves_devices_idle() -> None:
    costs = uniform(p=5, m=4, layers=3)
    plan = BASELINES["1f1b"](costs)
    assert plan.placement == [[0], [1], [2], [], []]
    assert plan.actions[3] == [] and plan.actions[4] == []
    vplan = BASELINES["zb-v"](costs)
    assert vplan.placement == [[0, 1], [], [], [], []]
    with pytest.raises(PlannerError, match="at least 2 layers"):
        BASELINES["i1f1b"](uniform(p=2, m=4, layers=1))


def test_every_baseline_names_its_strategy() -> None:
    costs = uniform(p=3, m=5, layers=6)
    for name, make in BASELINES.items():
        plan = make(costs)
        assert (plan.strategy, plan.microbatches) == (name, 5)
    # The registry is the api's list of names after adaptis, in its order (the comparison's).
    assert ("adaptis", *BASELINES) == STRATEGY_NAMES


# --- partitions ---------------------------------------------------------------------------------
def _model(kinds_work: list[tuple[str | None, float]]) -> Costs:
    layers = [{"name": f"l{i}", "forward": work, **({"kind": k} if k else {})}
              for i, (k, work) in enumerate(kinds_work)]
    return Costs.from_problem(parse_problem({"microbatches": 1, "layers": layers, "devices": {"count": 1}}))


def test_megatron_partition_pins_embedding_and_head_and_spreads_the_remainder_first() -> None:
    costs = _model([("embedding", 1.0)] + [(None, 1.0)] * 10 + [("head", 9.0)])
    # 10 body layers into 4 stages: 3, 3, 2, 2 (the first 10 % 4 stages take one more).
    assert megatron_partition(costs, stages_count=4) == [(0, 4), (4, 7), (7, 9), (9, 12)]
    assert megatron_partition(costs, stages_count=1) == [(0, 12)]


def test_megatron_partition_with_fewer_body_layers_than_stages_splits_all_layers() -> None:
    costs = _model([("embedding", 1.0), (None, 1.0), ("head", 1.0)])
    assert megatron_partition(costs, stages_count=3) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(PlannerError):
        megatron_partition(costs, stages_count=4)


def test_balanced_partition_is_optimal_by_brute_force() -> None:
    works = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0, 5.0]
    costs = _model([(None, x) for x in works])
    n = len(works)
    for parts, speeds in [(3, None), (4, None), (3, [1.0, 2.0, 0.5]), (4, [2.0, 1.0, 1.0, 3.0])]:
        best = math.inf
        for cuts in itertools.combinations(range(1, n), parts - 1):
            bounds = [0, *cuts, n]
            stages = [(bounds[i], bounds[i + 1]) for i in range(parts)]
            best = min(best, bottleneck(costs, stages, speeds=speeds))
        got = balanced_partition(costs, stages_count=parts, speeds=speeds)
        assert got[0][0] == 0 and got[-1][1] == n and all(lo < hi for lo, hi in got)
        assert bottleneck(costs, got, speeds=speeds) == pytest.approx(best, rel=1e-9)


def test_balanced_partition_moves_layers_off_a_heavy_head() -> None:
    costs = _model([(None, 1.0)] * 12 + [("head", 8.0)])
    stages = balanced_partition(costs, stages_count=4)
    assert stages[-1] == (12, 13)  # the head alone on the last stage
    assert bottleneck(costs, stages) < bottleneck(costs, megatron_partition(costs, stages_count=4))
