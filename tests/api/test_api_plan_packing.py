"""The packed form of a plan's actions (adaptis.api.plan_packing) and Plan reading it."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from adaptis.api.plan import PACKED_ACTIONS, Plan
from adaptis.api.plan_packing import PackingError, pack_actions, unpack_actions

# One builder of large valid plans for the api's and the operator's storage tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))
from plan_kit import split_backward_plan as zero_bubble_plan  # noqa: E402


def test_packed_plan_round_trips_and_stays_small() -> None:
    plan = zero_bubble_plan(devices=64, microbatches=4096)
    doc = plan.packed()
    assert "actions" not in doc and doc["strategy"] == "zb-h1"
    text = json.dumps(doc)
    # 786,432 actions: ~11 MB as plain JSON; packed it must be a small share of 1 MiB.
    assert len(plan.to_json()) > 10_000_000
    assert len(text) < 64 * 1024
    again = Plan.model_validate_json(text)
    assert again == plan
    again.check(layers=64, microbatches=4096, devices=64)


action = st.tuples(st.sampled_from(["F", "B", "W", "BW"]), st.integers(0, 70_000),
                   st.integers(0, 2**31 - 1))


@given(st.lists(st.lists(action, max_size=30), min_size=1, max_size=6))
@settings(max_examples=200, deadline=None)
def test_any_actions_round_trip(actions: list[list[tuple[str, int, int]]]) -> None:
    # Any order, any gaps, microbatches going backwards: packing is lossless, not a schedule
    # template.
    assert unpack_actions(pack_actions(actions)) == actions


@pytest.mark.parametrize("text", [
    "F0,0",                                   # no prefix: not ours
    "apk1:!!!",                               # not base64
    "apk1:" + "aGVsbG8=",                      # base64 of "hello", not zlib
    "apk1:" + pack_actions([[("F", 0, 0)]])[5:-4] + "AAAA",  # truncated/garbled stream
])
def test_corrupt_packed_strings_are_refused(text: str) -> None:
    with pytest.raises(PackingError):
        unpack_actions(text)


def test_plan_names_the_packed_field_when_it_is_bad() -> None:
    base: dict[str, Any] = {"stages": [[0, 1]], "placement": [[0]]}
    with pytest.raises(ValidationError, match="not a packed plan"):
        Plan.model_validate({**base, PACKED_ACTIONS: "F0,0"})
    with pytest.raises(ValidationError, match="either actions or actionsPacked"):
        Plan.model_validate({**base, "actions": [[]], PACKED_ACTIONS: pack_actions([[]])})
    with pytest.raises(ValidationError, match="must be a string"):
        Plan.model_validate({**base, PACKED_ACTIONS: 3})
