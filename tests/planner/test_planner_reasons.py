"""Reasons a person can read (issue 32 item 4): an infeasible answer on many devices names the
worst device, the count and a lever, in a bounded sentence, never one clause per device.

The operator cuts reasons longer than 300 characters (``adaptis/operator/planning.py``); the
planner's reasons must stay under that cut so it never bites mid-clause.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import yaml

from adaptis.api.problem import Problem, parse_problem
from adaptis.cli import main
from adaptis.planner.costs import Costs
from adaptis.planner.reasons import (
    MAX_REASON_CHARS,
    blocked_devices,
    memory_lever,
    over_memory,
    show_bytes,
)
from adaptis.planner.strategies import compare, plan_strategy

_OPERATOR_CUT = 300  # adaptis/operator/planning.py::_MAX_REASON


def _wide(*, devices: int = 128, memory_bytes: float, param_bytes: float = 1.0e9,
          big: dict[int, float] | None = None) -> Problem:
    """``devices`` devices, two layers each, a microbatch a device: every device holds
    parameters of about 2 x ``param_bytes`` (``big``: layer -> its own) and 16 MB of
    activations a microbatch and layer."""
    layers = [{"name": f"l{i}", "forward": 1.0, "backward": 2.0, "weight": 0.5,
               "activation_bytes": 1.6e7, "param_bytes": (big or {}).get(i, param_bytes),
               "output_bytes": 1.0e6}
              for i in range(2 * devices)]
    return parse_problem({"name": "wide", "microbatches": devices, "layers": layers,
                          "devices": {"count": devices, "per_node": 8, "memory_bytes": memory_bytes}})


def _clauses(reason: str) -> int:
    """How many devices a reason names ("device 17 needs ...", "device 3 waits ...")."""
    return len(re.findall(r"\bdevice \d+\b", reason))


def test_128_devices_over_memory_name_one_device_and_the_count() -> None:
    out = plan_strategy(_wide(memory_bytes=1.5e9), "adaptis", time_limit_s=30)
    reason = out.result.reason or ""
    assert not out.result.feasible
    assert len(reason) <= MAX_REASON_CHARS < _OPERATOR_CUT, reason
    assert _clauses(reason) == 1, reason
    assert "the worst of all 128 devices, each over memory" in reason, reason
    # Parameters alone: 256 GB against 128 x 1.5 GB: the lever says to add devices or memory.
    assert "the parameters alone need 256.0 GB, all devices together have 192.0 GB" in reason, reason


def test_every_baseline_reason_of_a_wide_comparison_is_bounded() -> None:
    # 48 devices: a per-device list would be ~2 KB already; the baselines on 128 take seconds.
    comparison, _ = compare(_wide(devices=48, memory_bytes=1.5e9), time_limit_s=30, bound=False)
    for name, r in comparison.strategies.items():
        assert r.reason is not None and len(r.reason) <= MAX_REASON_CHARS, (name, r.reason)
        assert _clauses(r.reason) <= 1, (name, r.reason)


def test_the_cli_prints_one_short_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = _wide(memory_bytes=1.5e9).model_dump(mode="json", exclude_none=True)
    path = tmp_path / "wide.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert main(["plan", str(path), "--time-limit", "30"]) == 1
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("adaptis plan:")]
    assert len(line) <= MAX_REASON_CHARS + 60 and _clauses(line) == 1, line


def test_over_memory_picks_the_worst_ratio_and_counts_the_rest() -> None:
    peaks = [90e9] * 100 + [50e9] * 28
    memory = [80e9] * 127 + [40e9]  # the last device is over by 1.25x, the others by 1.125x
    assert over_memory(peaks, memory) == (
        "device 127 needs 50.0 GB, has 40.0 GB (1.25x), the worst of 101 of the 128 devices over memory")
    assert over_memory([1.0, 2.0], [math.inf, 2.0]) is None  # unbounded memory and an exact fit


def test_a_lever_for_a_layer_no_device_can_hold() -> None:
    costs = Costs.from_problem(_wide(devices=4, memory_bytes=5.0e9, param_bytes=6.0e9))
    assert memory_lever(costs) == ("the parameters alone need 48.0 GB, all devices together have "
                                   "20.0 GB: add devices or memory")
    costs = Costs.from_problem(_wide(devices=4, memory_bytes=5.0e9, param_bytes=1.0e8))
    assert "add devices or memory per device" in memory_lever(costs)
    # 5.5 GB on one layer: no device of 5 GB holds it, though all of them hold every layer.
    big = _wide(devices=4, memory_bytes=5.0e9, param_bytes=1.0e8, big={3: 5.5e9})
    assert memory_lever(Costs.from_problem(big)) == (
        "layer 3 alone needs 5.5 GB, more than any device has: more memory per device or a "
        "shorter sequence")


def test_a_deadlock_names_three_devices_then_a_count() -> None:
    waiting = [("F", s, 0) for s in range(128)]
    text = blocked_devices(list(range(128)), waiting)
    assert _clauses(text) == 3 and text.endswith("and 125 more"), text
    assert blocked_devices([1], waiting) == "device 1 waits on ('F', 1, 0)"


def test_bytes_are_shown_in_the_unit_a_person_reads() -> None:
    assert [show_bytes(x) for x in (205.0, 1.6e7, 8.0e10)] == ["205 bytes", "16.0 MB", "80.0 GB"]
