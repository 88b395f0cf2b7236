"""The list scheduler's rules (adaptis.planner.scheduler) on pipelines small enough to work by hand.

test_planner_scheduler.py checks that every schedule replays to the time it reports; these
check *which* schedule: B before F before W, oldest microbatch first, a microbatch admitted
only where memory holds it, and the capacities that admission reads.

Two stages of one layer each on two devices, F = B = W = 1, no transfers, 3 microbatches:
device 0 runs F0 (0-1), F1, F2 (to 3), then B0 as soon as device 1's B0 ends (3), W0 in the
gap before B1 arrives (5), and so on; device 1 alternates F and B from 1 and runs its Ws last.
Each device does 9 units of work and device 1 cannot start before 1: 10 is optimal.
"""

from __future__ import annotations

import math

import pytest

from adaptis.api.problem import parse_problem
from adaptis.planner.costs import Costs
from adaptis.planner.errors import OutOfTime, PlannerError
from adaptis.planner.scheduler import Policy, inflight_caps, list_schedule

TWO = [(0, 1), (1, 2)]


def _costs(*, microbatches: int = 3, layers: int = 2, devices: int = 2, memory: float | None = None,
           activation: float = 0.0, params: float = 0.0, w: float = 1.0, overhead: float = 0.0,
           hop: float = 0.0, unit: float = 1.0) -> Costs:
    """Every layer F = B = ``unit``, W = ``w`` x ``unit``; ``hop``: each device on a node of its
    own, every transfer between devices that long (else one node, no transfers)."""
    docs = [{"name": f"l{i}", "forward": unit, "backward": unit, "weight": w * unit, "activation_bytes": activation,
             "param_bytes": params, "output_bytes": 1.0} for i in range(layers)]
    dev: dict[str, object] = {"count": devices}
    if memory is not None:
        dev["memory_bytes"] = memory
    doc: dict[str, object] = {"name": "t", "microbatches": microbatches, "layers": docs, "devices": dev,
                              "time_unit": "s", "action_overhead_s": overhead}
    if hop:
        dev = {"list": [{"name": f"d{d}", "node": f"n{d}", **({"memory_bytes": memory} if memory else {})}
                        for d in range(devices)]}
        doc |= {"devices": dev, "network": {"inter_node": {"bandwidth_bytes_per_s": 1.0 / hop, "latency_s": 0.0}}}
    return Costs.from_problem(parse_problem(doc))


def _order(actions: tuple[tuple[tuple[str, int, int], ...], ...]) -> list[str]:
    return [" ".join(f"{k}{mb}" for k, _s, mb in dev) for dev in actions]


@pytest.mark.parametrize("unit", [1.0, 0.25])
def test_b_before_f_before_w_oldest_first(unit: float) -> None:
    """Also with every action a quarter as long (the rules have no threshold in time units)."""
    sched = list_schedule(_costs(unit=unit), stages=TWO, owner=[0, 1])
    assert sched.feasible and sched.reason is None
    assert _order(sched.actions) == ["F0 F1 F2 B0 W0 B1 W1 B2 W2", "F0 B0 F1 B1 F2 B2 W0 W1 W2"]
    assert sched.iteration_time == 10.0 * unit
    assert all(s == 0 for _k, s, _mb in sched.actions[0]) and all(s == 1 for _k, s, _mb in sched.actions[1])


def test_fused_backward_runs_bw_actions() -> None:
    """BW takes B + W = 2: device 1's BW0 ends at 4, device 0's BWs run 4-6, 7-9 and 10-12."""
    sched = list_schedule(_costs(), stages=TWO, owner=[0, 1], policy=Policy(split_backward=False))
    assert _order(sched.actions) == ["F0 F1 F2 BW0 BW1 BW2", "F0 BW0 F1 BW1 F2 BW2"]
    assert sched.iteration_time == 12.0


def test_stage_0_fuses_its_backward_from_the_microbatch_it_is_told() -> None:
    """``fuse_first_from=1``: stage 0 runs B and W for microbatch 0, one BW (B + W = 2, its B
    being empty) for 1 and 2, as soon as their gradients arrive (5, 7): 10, as unfused.
    Without the B/W split every backward is a BW already and the knob changes nothing."""
    fused = list_schedule(_costs(), stages=TWO, owner=[0, 1], policy=Policy(fuse_first_from=1))
    assert _order(fused.actions) == ["F0 F1 F2 B0 W0 BW1 BW2", "F0 B0 F1 B1 F2 B2 W0 W1 W2"]
    assert fused.iteration_time == 10.0
    unsplit = list_schedule(_costs(), stages=TWO, owner=[0, 1], policy=Policy(split_backward=False, fuse_first_from=1))
    assert _order(unsplit.actions) == ["F0 F1 F2 BW0 BW1 BW2", "F0 BW0 F1 BW1 F2 BW2"]
    assert unsplit.iteration_time == 12.0


def test_a_recomputed_stage_pays_its_forward_again_in_its_backward() -> None:
    """Stage 1 recomputed, fused backwards: its BW is F + B + W = 3. Device 1: F0 1-2, BW0 2-5,
    F1 5-6, BW1 6-9, F2 9-10, BW2 10-13; device 0's BWs (2 each) 5-7, 9-11, 13-15: 15."""
    sched = list_schedule(_costs(), stages=TWO, owner=[0, 1], policy=Policy(split_backward=False),
                          recompute=(False, True))
    assert _order(sched.actions) == ["F0 F1 F2 BW0 BW1 BW2", "F0 BW0 F1 BW1 F2 BW2"]
    assert sched.iteration_time == 15.0
    with pytest.raises(PlannerError, match=r"^list_schedule: a recomputed stage runs fused backwards; "
                                           r"pass a policy with split_backward=False$"):
        list_schedule(_costs(), stages=TWO, owner=[0, 1], recompute=(False, True))
    # Nothing recomputed: the split policy is fine.
    assert list_schedule(_costs(), stages=TWO, owner=[0, 1], recompute=(False, False)).iteration_time == 10.0


def test_at_most_one_microbatch_in_flight_runs_them_one_by_one() -> None:
    """A microbatch is admitted once both devices ran its W: F F B B W, 5 each, 15 in all."""
    sched = list_schedule(_costs(), stages=TWO, owner=[0, 1], policy=Policy(max_inflight=1))
    assert _order(sched.actions) == ["F0 B0 W0 F1 B1 W1 F2 B2 W2"] * 2
    assert sched.iteration_time == 15.0


def test_memory_for_one_microbatch_admits_one_at_a_time() -> None:
    """Parameters 4 bytes, activations 2 a microbatch, memory 7: one microbatch fits, not two."""
    costs = _costs(memory=7.0, activation=2.0, params=4.0)
    sched = list_schedule(costs, stages=TWO, owner=[0, 1])
    assert _order(sched.actions) == ["F0 B0 W0 F1 B1 W1 F2 B2 W2"] * 2
    # Per device, device 0 takes the next microbatch once its own W frees the first.
    per_device = list_schedule(costs, stages=TWO, owner=[0, 1], policy=Policy(admit_per_device=True))
    assert per_device.iteration_time <= sched.iteration_time == 15.0


def test_per_device_admission_with_room_for_all_is_the_unlimited_schedule() -> None:
    sched = list_schedule(_costs(), stages=TWO, owner=[0, 1], policy=Policy(admit_per_device=True))
    assert _order(sched.actions) == ["F0 F1 F2 B0 W0 B1 W1 B2 W2", "F0 B0 F1 B1 F2 B2 W0 W1 W2"]


def test_two_stages_on_one_device_run_the_older_microbatch_first() -> None:
    sched = list_schedule(_costs(devices=1, microbatches=2), stages=TWO, owner=[0, 0])
    # F of stage 0 then stage 1 for microbatch 0 (older first beats the new F of stage 0), its B
    # on the last stage at once, then stage 0's B; the Ws fill in at the end.
    assert [f"{k}{s}.{mb}" for k, s, mb in sched.actions[0]] == [
        "F0.0", "F1.0", "B1.0", "B0.0", "F0.1", "F1.1", "B1.1", "B0.1", "W1.0", "W0.0", "W1.1", "W0.1"]
    assert sched.iteration_time == 12.0


def test_overhead_is_added_to_every_action() -> None:
    sched = list_schedule(_costs(overhead=0.5), stages=TWO, owner=[0, 1])
    assert sched.iteration_time == 15.0  # the same order, every action 1.5


def test_inflight_caps_are_what_memory_holds_after_the_parameters() -> None:
    costs = _costs(microbatches=5, memory=10.0, activation=2.0, params=4.0)
    sc = costs.stage_costs(TWO)
    # (10 - 4) // 2 = 3 on each device; capped by max_inflight; by the microbatch count.
    assert inflight_caps(costs, sc=sc, owner=[0, 1], policy=Policy()) == [3, 3]
    assert inflight_caps(costs, sc=sc, owner=[0, 1], policy=Policy(max_inflight=2)) == [2, 2]
    assert inflight_caps(costs, sc=sc, owner=[0, 1], policy=Policy(max_inflight=9)) == [3, 3]
    roomy = _costs(microbatches=5, memory=100.0, activation=2.0, params=4.0)
    assert inflight_caps(roomy, sc=roomy.stage_costs(TWO), owner=[0, 1], policy=Policy()) == [5, 5]
    # No memory bound, or no activations: every microbatch.
    for free in (_costs(microbatches=5, activation=2.0), _costs(microbatches=5, memory=10.0, params=4.0)):
        assert inflight_caps(free, sc=free.stage_costs(TWO), owner=[0, 1], policy=Policy()) == [5, 5]
    # Both stages on device 0: 8 bytes of parameters and 4 a microbatch do not fit 10.
    assert inflight_caps(costs, sc=sc, owner=[0, 0], policy=Policy()) == (
        "device 0: parameters and one microbatch need 12 bytes, it has 10")
    # Parameters filling the memory exactly, and no activations: every microbatch.
    full = _costs(microbatches=5, memory=4.0, params=4.0)
    assert inflight_caps(full, sc=full.stage_costs(TWO), owner=[0, 1], policy=Policy()) == [5, 5]
    # Exactly one microbatch fits.
    exact = _costs(microbatches=5, memory=6.0, activation=2.0, params=4.0)
    assert inflight_caps(exact, sc=exact.stage_costs(TWO), owner=[0, 1], policy=Policy()) == [1, 1]


def test_a_device_that_cannot_hold_one_microbatch_makes_the_schedule_infeasible() -> None:
    costs = _costs(memory=5.0, activation=2.0, params=4.0)
    sched = list_schedule(costs, stages=TWO, owner=[0, 1])
    assert (sched.feasible, sched.actions, sched.iteration_time) == (False, (), math.inf)
    assert sched.reason == "device 0: parameters and one microbatch need 6 bytes, it has 5"
    # Parameters alone over memory: a negative room is refused too, even with no activations.
    over = _costs(memory=3.0, params=4.0)
    assert inflight_caps(over, sc=over.stage_costs(TWO), owner=[0, 1], policy=Policy()) == (
        "device 0: parameters and one microbatch need 4 bytes, it has 3")


def test_a_deadline_already_passed_stops_a_long_schedule() -> None:
    costs = _costs(microbatches=1500)  # 9000 actions: the clock is read after 4096 steps
    with pytest.raises(OutOfTime, match=r"^the time limit ran out during a list schedule$"):
        list_schedule(costs, stages=TWO, owner=[0, 1], deadline=0.0)
    assert list_schedule(_costs(microbatches=3), stages=TWO, owner=[0, 1], deadline=0.0).feasible
    assert list_schedule(costs, stages=TWO, owner=[0, 1]).feasible  # no deadline: the clock is never read


@pytest.mark.parametrize("unit", [1.0, 0.25])
def test_w_fills_a_gap_even_past_the_next_arrival_unless_told_to_fit(unit: float) -> None:
    """Transfers of 1 and W = 2. Device 1 runs F B F B F B from 2 (after the first transfer),
    then its three Ws, 8-14; the gradients reach device 0 at 5, 7 and 9. Stage 0's B is empty
    (it has no input to pass a gradient to), so its W is the whole backward, 1 + 2 = 3.
    By default device 0 runs each W as soon as its B is done: W0 5-8, W1 8-11, W2 11-14: 14.
    With ``fill_with_w=False`` a W runs only where it ends before the next known arrival: at 8
    W1 would end at 11, past gradient 2's arrival at 9, so device 0 waits for it: W1 9-12,
    W2 12-15. (At 5 gradient 1's arrival is not known yet: device 1 starts that B only at 5.)
    The same with every duration a quarter as long."""
    costs = _costs(w=2.0, hop=unit, unit=unit)
    fill = list_schedule(costs, stages=TWO, owner=[0, 1])
    assert _order(fill.actions) == ["F0 F1 F2 B0 W0 B1 W1 B2 W2", "F0 B0 F1 B1 F2 B2 W0 W1 W2"]
    assert fill.iteration_time == 14.0 * unit
    fit = list_schedule(costs, stages=TWO, owner=[0, 1], policy=Policy(fill_with_w=False))
    assert _order(fit.actions) == ["F0 F1 F2 B0 W0 B1 B2 W1 W2", "F0 B0 F1 B1 F2 B2 W0 W1 W2"]
    assert fit.iteration_time == 15.0 * unit


def test_a_w_that_ends_exactly_at_the_next_arrival_fits() -> None:
    """Stage 0's forward takes 3: device 0's Fs end at 3, 6 and 9, when device 1 can start
    them. Device 1 runs F0 3-4 and B0 4-5; F1 arrives at 6 (device 0 started it at 3, so the
    arrival is known), and W0 5-6 ends just then: it fits, even with ``fill_with_w=False``.
    Device 0 ends the iteration: its Bs are empty, its Ws (B + W = 2) run 9-15."""
    layers = [{"name": "l0", "forward": 3.0, "backward": 1.0, "weight": 1.0},
              {"name": "l1", "forward": 1.0, "backward": 1.0, "weight": 1.0}]
    costs = Costs.from_problem(parse_problem({"name": "t", "microbatches": 3, "layers": layers,
                                              "devices": {"count": 2}, "time_unit": "s"}))
    sched = list_schedule(costs, stages=TWO, owner=[0, 1], policy=Policy(fill_with_w=False))
    assert _order(sched.actions) == ["F0 F1 B0 F2 B1 W0 B2 W1 W2", "F0 B0 W0 F1 B1 W1 F2 B2 W2"]
    assert sched.iteration_time == 15.0


def test_a_device_that_blocks_admission_runs_its_w_before_a_forward() -> None:
    """Each device holds two microbatches (2 bytes, 1 a microbatch). Device 0 admits 0 and 1
    (F 0-1, 1-2); microbatch 2 waits, both devices are full. Device 1 runs F0 1-2, B0 2-3; at 3
    F1 is ready, but a W frees memory and a forward takes more: W0 3-4, then F1 4-5, and device
    0's W0 (3-5) frees it there too, so microbatch 2 enters at 5: 10 in all. (Forwards first,
    device 1 would run F1 and B1 before W0: 12.)"""
    sched = list_schedule(_costs(memory=2.0, activation=1.0), stages=TWO, owner=[0, 1])
    assert _order(sched.actions) == ["F0 F1 B0 W0 F2 B1 W1 B2 W2", "F0 B0 W0 F1 B1 F2 B2 W1 W2"]
    assert sched.iteration_time == 10.0


def test_a_full_device_still_runs_a_ready_backward_before_its_w() -> None:
    """As above, each device admitting on its own. Device 1 is full at 4 (microbatch 0 waits for
    its W, F1 ends) but B1 is ready: B first, it unblocks device 0 (B1 4-5, then W0 5-6). Device
    0, holding only microbatch 1 after its W0, runs the arrived B1 at 5 before F2."""
    sched = list_schedule(_costs(memory=2.0, activation=1.0), stages=TWO, owner=[0, 1],
                          policy=Policy(admit_per_device=True))
    assert _order(sched.actions) == ["F0 F1 B0 W0 B1 F2 W1 B2 W2", "F0 B0 F1 B1 W0 F2 B2 W1 W2"]
    assert sched.iteration_time == 10.0


def _v_order(actions: tuple[tuple[tuple[str, int, int], ...], ...]) -> list[str]:
    return [" ".join(f"{k}{s}.{mb}" for k, s, mb in dev) for dev in actions]


def test_the_older_microbatchs_backward_goes_first_whatever_its_stage() -> None:
    """Three stages in a V: device 0 holds stages 0 and 2, device 1 stage 1; 2 microbatches.
    At 5 device 0 has two Bs ready: stage 0's for microbatch 0 (device 1's B1.0 ends at 5) and
    stage 2's for microbatch 1 (its F2.1 ends at 5). The older microbatch's goes first."""
    sched = list_schedule(_costs(microbatches=2, layers=3), stages=[(0, 1), (1, 2), (2, 3)], owner=[0, 1, 0])
    assert _v_order(sched.actions)[0] == "F0.0 F0.1 F2.0 B2.0 F2.1 B0.0 B2.1 W2.0 B0.1 W0.0 W2.1 W0.1"
    assert sched.iteration_time == 12.0


def test_a_backward_waits_for_its_gradient_to_cross_back() -> None:
    """The same V with transfers of 1 between the devices. Device 0's B2.0 ends at 6, B2.1 at 8;
    their gradients reach device 1 at 7 and 9. Device 1 runs B1.0 7-8, fills the gap until the
    next gradient with W1.0 8-9, then B1.1 9-10 and W1.1."""
    sched = list_schedule(_costs(microbatches=2, layers=3, hop=1.0), stages=[(0, 1), (1, 2), (2, 3)],
                          owner=[0, 1, 0])
    assert _v_order(sched.actions)[1] == "F1.0 F1.1 B1.0 W1.0 B1.1 W1.1"
    assert sched.iteration_time == 14.0


def test_a_full_device_admitting_on_its_own_runs_its_w_before_another_stages_forward() -> None:
    """The V, each device admitting on its own; device 0 (stages 0 and 2) has room for two
    microbatches (4 bytes, 1 a stage and microbatch), device 1 for all three. Device 0 admits
    0 and 1 (F0.0, F0.1), runs F2.0 2-3 and B2.0 3-4; at 4 it is full and F2.1 has arrived
    (device 1's F1.1 ended at 3), but its W2.0 goes first: a full device frees memory before
    it runs more forwards."""
    sched = list_schedule(_costs(layers=3, memory=4.0, activation=1.0), stages=[(0, 1), (1, 2), (2, 3)],
                          owner=[0, 1, 0], policy=Policy(admit_per_device=True))
    assert _v_order(sched.actions)[0].startswith("F0.0 F0.1 F2.0 B2.0 W2.0 B0.0 W0.0 F2.1 ")


def test_an_input_wakes_its_device_when_it_arrives_whatever_the_other_links() -> None:
    """Four stages on four nodes, F = 1, B = 2, W = 1 time units, 8 microbatches; only the first
    link is slow (6), the others free. F1.k runs k+7 to k+8, F2.k k+8 to k+9, so device 3 gets
    F3.0's input at 9 and, idle, must start it then (not when some other link's time has
    passed): B3.0 ends at 12 and its gradient is back on device 2 at 12, just as F2.4's input
    arrives: B before F, so device 2 runs B2.0 right after F2.3."""
    layers = [{"name": f"l{i}", "forward": 1.0, "backward": 2.0, "weight": 1.0, "activation_bytes": 1.0,
               "output_bytes": 6.0 if i == 0 else 0.0} for i in range(4)]
    costs = Costs.from_problem(parse_problem({
        "name": "t", "microbatches": 8, "layers": layers, "time_unit": "s",
        "devices": {"count": 4, "per_node": 1},
        "network": {"inter_node": {"bandwidth_bytes_per_s": 1.0}}}))
    sched = list_schedule(costs, stages=[(i, i + 1) for i in range(4)], owner=[0, 1, 2, 3])
    assert _order(sched.actions)[3].startswith("F0 B0 F1 B1 ")
    assert _order(sched.actions)[2].startswith("F0 F1 F2 F3 B0 F4 B1 ")
