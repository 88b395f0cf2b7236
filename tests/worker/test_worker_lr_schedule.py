"""The learning-rate schedule: warm-up, then constant, cosine or linear decay to the floor, as a
function of the step alone (what makes a resumed run continue the very same curve)."""

from __future__ import annotations

import itertools
import math

import pytest

from adaptis.api.job import OptimizerSpec
from adaptis.worker.runtime.lr_schedule import learning_rate


def _curve(spec: OptimizerSpec, steps: int) -> list[float]:
    return [learning_rate(spec, step=k, total_steps=steps) for k in range(steps)]


def test_constant_is_the_default_and_changes_nothing() -> None:
    assert OptimizerSpec().schedule == "constant"
    assert _curve(OptimizerSpec(lr=3e-4), 5) == [3e-4] * 5


def test_warmup_rises_linearly_and_never_starts_at_zero() -> None:
    spec = OptimizerSpec(lr=1.0, warmup_steps=3)
    assert _curve(spec, 6) == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])


def test_cosine_decays_from_peak_to_the_floor_at_the_last_step() -> None:
    spec = OptimizerSpec(lr=2.0, schedule="cosine", warmup_steps=2, min_lr_ratio=0.1)
    curve = _curve(spec, 12)  # decay over steps 2..11 (span 9)
    assert curve[:2] == pytest.approx([2 / 3, 4 / 3])
    assert curve[2] == pytest.approx(2.0)
    assert curve[-1] == pytest.approx(0.2)
    mid = 0.2 + 1.8 * 0.5 * (1 + math.cos(math.pi * 4 / 9))
    assert curve[6] == pytest.approx(mid)
    assert all(a >= b for a, b in itertools.pairwise(curve[2:]))  # non-increasing after warm-up


def test_linear_decays_evenly() -> None:
    spec = OptimizerSpec(lr=1.0, schedule="linear", min_lr_ratio=0.0)
    assert _curve(spec, 5) == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])


def test_a_step_past_the_end_stays_at_the_floor_and_a_single_step_takes_the_peak() -> None:
    spec = OptimizerSpec(lr=1.0, schedule="cosine", min_lr_ratio=0.5)
    assert learning_rate(spec, step=9, total_steps=5) == pytest.approx(0.5)
    assert learning_rate(spec, step=0, total_steps=1) == pytest.approx(1.0)


def test_bad_schedule_settings_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"min_lr_ratio|minLrRatio"):
        OptimizerSpec(min_lr_ratio=1.5)
    with pytest.raises(ValueError, match="schedule"):
        OptimizerSpec(schedule="step")  # type: ignore[arg-type]
