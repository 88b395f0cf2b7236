"""The per-device timeline drawing: real matplotlib, real files, at the size users will draw."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import pytest

from adaptis.api.problem import parse_problem
from adaptis.planner.baselines import BASELINES
from adaptis.planner.costs import Costs
from adaptis.planner.errors import PlannerError
from adaptis.planner.simulator import Simulation, simulate
from adaptis.planner.timeline import draw_timeline


def _gemma_like(*, devices: int, microbatches: int, layers: int) -> Costs:
    """The paper's Gemma-like costs (layer 1 / 1.65 / 0.22, head 5.72 / 1.21 / 0.58)."""
    doc = {
        "microbatches": microbatches,
        "layers": [
            {"name": "embedding", "kind": "embedding", "forward": 0.2, "backward": 0.1, "weight": 0.1},
            {"repeat": layers, "layers": [{"name": "layer", "forward": 1.0, "backward": 1.65, "weight": 0.22}]},
            {"name": "head", "kind": "head", "forward": 5.72, "backward": 1.21, "weight": 0.58},
        ],
        "devices": {"count": devices},
    }
    return Costs.from_problem(parse_problem(doc))


@pytest.fixture(scope="module")
def big_zb_v() -> Simulation:
    costs = _gemma_like(devices=16, microbatches=128, layers=128)
    return simulate(costs, BASELINES["zb-v"](costs))


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", head[16:24])
    return width, height


def test_draws_16_devices_by_128_microbatches_as_png_and_svg(big_zb_v: Simulation, tmp_path: Path) -> None:
    png = tmp_path / "out" / "zbv.png"
    svg = tmp_path / "zbv.svg"
    draw_timeline(big_zb_v, path=png, title="zb-v 16x128", time_unit="ms")
    draw_timeline(big_zb_v, path=svg, title="zb-v 16x128", time_unit="ms")
    width, height = _png_size(png)
    assert width >= 1800 and height >= 16 * 40  # a readable row per device
    assert png.stat().st_size > 30_000  # thousands of coloured boxes, not an empty frame
    text = svg.read_text()
    assert text.lstrip().startswith("<?xml") and "</svg>" in text
    assert "zb-v 16x128: iteration" in text and "bubble" in text
    for label in ("F forward", "B input grad", "W weight grad", "idle (bubble)", "device 15"):
        assert label in text


def test_small_plan_gets_microbatch_numbers_and_fused_colour(tmp_path: Path) -> None:
    costs = _gemma_like(devices=4, microbatches=8, layers=8)
    sim = simulate(costs, BASELINES["1f1b"](costs))
    svg = tmp_path / "1f1b.svg"
    draw_timeline(sim, path=svg, title="1f1b", time_unit="ms")
    text = svg.read_text()
    assert "BW fused backward" in text and "W weight grad" not in text
    # matplotlib writes text as glyph references; the numbers' labels appear as comments.
    assert text.count("<!-- 7 -->") >= 4  # microbatch 7's boxes are wide enough to be labelled


def test_rejects_other_suffixes(big_zb_v: Simulation, tmp_path: Path) -> None:
    with pytest.raises(PlannerError, match=r"\.png or \.svg"):
        draw_timeline(big_zb_v, path=tmp_path / "out.pdf", title="x", time_unit="ms")


def test_planner_does_not_import_matplotlib_at_module_level() -> None:
    code = (
        "import sys, adaptis.planner.timeline, adaptis.planner.baselines, adaptis.planner.partition;"
        "print('matplotlib' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
