"""The packed form of a plan's actions (adaptis.api.plan_packing) and Plan reading it."""

from __future__ import annotations

import base64
import json
import sys
import tracemalloc
import zlib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from adaptis.api.plan import PACKED_ACTIONS, Plan
from adaptis.api.plan_packing import CRD_LIMITS, PackingError, PackLimits, pack_actions, unpack_actions

# One builder of large valid plans for the api's and the operator's storage tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))
from plan_kit import split_backward_plan as zero_bubble_plan


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


def _bomb(*, devices: int, actions: int) -> str:
    """A packed string whose header claims ``actions`` actions over ``devices`` devices, its body
    all zeros: it compresses about 1000:1 (the tenant's crafted plan of issue 27)."""
    raw = bytearray(b"APK1")
    raw += devices.to_bytes(4, "little") + actions.to_bytes(4, "little")
    raw += bytes(4 * devices + 9 * actions)
    return "apk1:" + base64.b64encode(zlib.compress(bytes(raw), 9)).decode("ascii")


def test_a_decompression_bomb_is_refused_from_its_header_before_it_is_inflated() -> None:
    # 59,652,321 actions claimed (536,870,909 bytes raw) in ~700 kB of text: over the CRD's
    # maxima, and far over a small job's.
    bomb = _bomb(devices=1, actions=59_652_321)
    assert len(bomb) < 1024 * 1024  # it fits a ConfigMap
    small = PackLimits.of(devices=4, stages=8, microbatches=16)
    for limits in (CRD_LIMITS, small):
        tracemalloc.start()
        with pytest.raises(PackingError,
                           match=r"claims 1 devices and 59652321 actions|longer than any plan within 4 devices"):
            unpack_actions(bomb, limits=limits)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < 4 * len(bomb), f"refusing the bomb allocated {peak} bytes"


def test_a_plan_within_the_crd_maxima_but_over_its_jobs_is_refused() -> None:
    plan = zero_bubble_plan(devices=8, microbatches=64)  # 8 x 64 x 3 actions
    text = pack_actions(plan.actions)
    assert unpack_actions(text, limits=PackLimits.of(devices=8, stages=8, microbatches=64))
    with pytest.raises(PackingError, match="over the 8 devices and 768 actions"):
        unpack_actions(text, limits=PackLimits.of(devices=8, stages=8, microbatches=32))
    with pytest.raises(PackingError, match="devices"):
        unpack_actions(text, limits=PackLimits.of(devices=4, stages=8, microbatches=64))


def test_the_plans_reader_passes_its_limits_to_the_decoder() -> None:
    plan = zero_bubble_plan(devices=8, microbatches=64)
    doc = plan.packed()
    tight = {"pack_limits": PackLimits.of(devices=8, stages=8, microbatches=32)}
    assert Plan.model_validate(doc) == plan
    with pytest.raises(ValidationError, match="over the 8 devices and 768 actions"):
        Plan.model_validate(doc, context=tight)
