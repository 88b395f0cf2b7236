"""``bench/layout_search.py`` keeps running: one small workload, its row's figures consistent."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("layout_search_bench", ROOT / "bench" / "layout_search.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_one_workload_row(capsys: pytest.CaptureFixture[str]) -> None:
    _bench().main(["--gpus", "8", "--workloads", "nemotron-h-S", "--batch-per-gpu", "1",
                   "--microbatch-sizes", "1", "--per-layout-s", "5"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| nemotron-h-S")]
    assert len(rows) == 1
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    enumerated, floor, searched, exhaustive = int(cells[3]), int(cells[4]), int(cells[5]), int(cells[8])
    assert searched <= exhaustive == enumerated - floor
    assert cells[7] == cells[10] and float(cells[11]) == 1.0  # pruned first choice = exhaustive best
    assert cells[12].endswith("T8 m1 M8")  # the recipe: T = the node's 8 GPUs, m = 1
    assert float(cells[13]) >= 1.0 and float(cells[15]) >= 1.0  # no recipe ahead of the chosen
