"""``bench/search_quality.py``: the before/after table flags a workload that got worse, and
the mixed-speed variant is the same workload on seeded device speeds."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _quality() -> ModuleType:
    path = ROOT / "bench" / "search_quality.py"
    spec = importlib.util.spec_from_file_location("search_quality", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["search_quality"] = module
    spec.loader.exec_module(module)
    return module


def _row(t: float) -> dict[str, float]:
    return {"adaptis": t, "lower_bound": 100.0}


def test_table_flags_a_workload_that_got_worse() -> None:
    before = {"paper": {"a": _row(110.0), "b": _row(120.0)}, "mixed": {"a-mixed": _row(130.0)}}
    after = {"paper": {"a": _row(105.0), "b": _row(121.0)}, "mixed": {"a-mixed": _row(130.0)}}
    lines = _quality().table(before, after)
    assert "| a | 110.0 | 1.1000 | 105.0 | 1.0500 | -4.55 % |" in lines
    assert "| **mean, paper** | | **1.1500** | | **1.1300** | |" in lines
    assert lines[-1] == "Worse than before: b."


def test_mixed_variant_keeps_the_workload_and_seeds_the_speeds() -> None:
    from bench import workloads

    doc = workloads.problem("gemma", "S", seq=2048)
    one, two = _quality().mixed(doc), _quality().mixed(doc)
    assert one == two  # seeded by the name: the same speeds in the before and the after run
    assert one["layers"] == doc["layers"] and one["name"] == doc["name"] + "-mixed"
    devices = one["devices"]["list"]
    assert len(devices) == doc["devices"]["count"]
    assert {d["memory_bytes"] for d in devices} == {doc["devices"]["memory_bytes"]}
    assert {d["speed"] for d in devices} <= set(_quality().SPEEDS)
