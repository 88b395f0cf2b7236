"""The strict schema of a measured hardware profile (adaptis/api/measured_hardware.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from adaptis.api.errors import SpecError
from adaptis.api.measured_hardware import (
    MAX_BANDWIDTH,
    MAX_MEMORY_BYTES,
    MAX_TFLOPS,
    MIN_TFLOPS,
    parse_measured_hardware,
)

DOC: dict[str, Any] = {
    "device": {"name": "NVIDIA H100 80GB HBM3", "speed": 0.7, "memory_bytes": 8.5e10,
               "matmul_tflops": 700.0, "precision": "bfloat16", "speed_reference_tflops": 989.0},
    "links": {"intra_node": {"bandwidth_bytes_per_s": 4e11, "latency_s": 1e-5}},
    "tflops": 700.0, "memory_bytes": 8.5e10, "intra_node_bandwidth": 4e11, "ranks_per_node": 8,
}


def test_what_the_hardware_profiler_prints_passes() -> None:
    hw = parse_measured_hardware(json.dumps(DOC))
    assert hw.figures() == {"tflops": 700.0, "memory_bytes": 8.5e10,
                            "intra_node_bandwidth": 4e11}
    flat = parse_measured_hardware(json.dumps({"tflops": 5, "memory_bytes": 2**30}))
    assert flat.figures() == {"tflops": 5.0, "memory_bytes": 2.0**30}  # bandwidth: the table's


@pytest.mark.parametrize(("change", "field"), [
    ({"tflops": MAX_TFLOPS * 1.01}, "tflops"),
    ({"tflops": MIN_TFLOPS / 2}, "tflops"),
    ({"memory_bytes": MAX_MEMORY_BYTES * 2}, "memory_bytes"),
    ({"memory_bytes": 1000.0}, "memory_bytes"),
    ({"intra_node_bandwidth": MAX_BANDWIDTH * 2}, "intra_node_bandwidth"),
    ({"intra_node_bandwidth": 0}, "intra_node_bandwidth"),
    ({"ranks_per_node": 0}, "ranks_per_node"),
    ({"tflops": "700"}, "tflops"),  # strict: no strings for numbers
    ({"tflops": True}, "tflops"),
    ({"planner": {"strategy": "gpipe"}}, "planner"),  # no unknown key
    ({"device": {**DOC["device"], "extra": 1}}, "device.extra"),
    ({"device": {**DOC["device"], "precision": "bf16; rm -rf"}}, "device.precision"),
    ({"links": {"inter_node": {"bandwidth_bytes_per_s": 1e9, "latency_s": 5.0}}},
     "links.inter_node.latency_s"),
])
def test_out_of_bounds_or_unknown_is_refused_naming_the_field(change: dict[str, Any],
                                                              field: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_measured_hardware(json.dumps({**DOC, **change}))
    assert field in info.value.fields


def test_non_finite_and_oversized_documents_are_refused() -> None:
    with pytest.raises(SpecError, match="tflops"):
        parse_measured_hardware('{"tflops": Infinity, "memory_bytes": 1e10}')
    with pytest.raises(SpecError, match="characters"):
        parse_measured_hardware(json.dumps({**DOC, "pad": "x" * 5000}))
