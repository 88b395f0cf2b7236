"""Activation recomputation in the performance model and in the plan's rules.

A stage the plan recomputes pays its forward again in its backward, holds only its input per
microbatch in flight, and counts one microbatch's activations as its recomputation's working
set (:meth:`adaptis.planner.costs.Costs.stage_costs`); plans may mark only fused-BW stages.
"""

from __future__ import annotations

import pytest

from adaptis.api.errors import SpecError
from adaptis.api.plan import Plan
from adaptis.api.problem import parse_problem
from adaptis.planner.costs import Costs
from adaptis.planner.simulator import simulate

M = 4
ACT = 100.0  # activation bytes of one layer and microbatch
OUT = 10.0  # what a layer sends on


def _costs() -> Costs:
    layer = {"forward": 1.0, "backward": 1.0, "weight": 1.0, "backward_fused": 1.8,
             "activation_bytes": ACT, "output_bytes": OUT, "param_bytes": 1000.0}
    return Costs.from_problem(parse_problem({
        "microbatches": M,
        "layers": [{"name": f"l{i}", **layer} for i in range(4)],
        "devices": {"count": 2},
    }))


def _gpipe(recompute: list[bool] | None, *, split: bool = False) -> Plan:
    """Two stages of two layers, all forwards then all backwards: M microbatches in flight."""
    def rank(s: int) -> list[tuple[str, int, int]]:
        back = [(k, s, mb) for mb in reversed(range(M)) for k in (("B", "W") if split else ("BW",))]
        return [("F", s, mb) for mb in range(M)] + back

    return Plan(stages=[(0, 2), (2, 4)], placement=[[0], [1]], actions=[rank(0), rank(1)],
                recompute=recompute)


def test_recompute_adds_the_forward_to_the_backward_and_keeps_only_the_input() -> None:
    costs = _costs()
    plain = costs.stage_costs([(0, 2), (2, 4)])
    again = costs.stage_costs([(0, 2), (2, 4)], recompute=[False, True])
    assert plain.fused == pytest.approx((3.6, 3.6))
    assert again.fused == pytest.approx((3.6, 3.6 + 2.0))  # stage 1's forward runs again
    assert again.activation_bytes == pytest.approx((2 * ACT, OUT))  # stage 1 keeps its input
    # the recomputation's working set (one microbatch of the stage) is held all iteration
    assert again.param_bytes == pytest.approx((2000.0, 2000.0 + 2 * ACT - OUT))
    first = costs.stage_costs([(0, 2), (2, 4)], recompute=[True, False])
    assert first.activation_bytes[0] == 0.0  # token ids: nothing worth counting


def test_recompute_lowers_the_simulated_peak_and_raises_the_time() -> None:
    costs = _costs()
    plain = simulate(costs, _gpipe(None))
    again = simulate(costs, _gpipe([True, True]))
    assert again.iteration_time > plain.iteration_time
    for d in range(2):
        assert again.peak_memory[d] < plain.peak_memory[d]
    # Device 1: parameters 2000 + M inputs of 10 + a working set of 200 - 10, against
    # 2000 + M x 200 without recompute.
    assert again.peak_memory[1] == pytest.approx(2000 + M * OUT + 2 * ACT - OUT)
    assert plain.peak_memory[1] == pytest.approx(2000 + M * 2 * ACT)
    unmarked = simulate(costs, _gpipe([False, False]))
    assert unmarked.iteration_time == pytest.approx(plain.iteration_time)


def test_the_plan_refuses_recompute_on_split_backwards_or_of_the_wrong_length() -> None:
    with pytest.raises(SpecError, match=r"stage 1 recomputes but runs split B/W"):
        _gpipe([False, True], split=True).check(layers=4, microbatches=M, devices=2)
    _gpipe([False, False], split=True).check(layers=4, microbatches=M, devices=2)  # nothing marked
    with pytest.raises(SpecError, match="3 flags, the plan has 2 stages"):
        _gpipe([True, True, True]).check(layers=4, microbatches=M, devices=2)
    assert "recompute" not in _gpipe(None).to_json()  # optional: absent unless set
