"""The per-device timeline: its words (layout, no matplotlib), real figures and files at real sizes."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from adaptis.api.plan import Plan
from adaptis.api.problem import Problem, parse_problem
from adaptis.cli import main
from adaptis.planner.baselines import BASELINES
from adaptis.planner.costs import Costs
from adaptis.planner.errors import PlannerError
from adaptis.planner.simulator import Simulation, TimedAction, simulate
from adaptis.planner.timeline import draw_timeline, timeline_figure
from adaptis.planner.timeline_layout import DETAIL_MAX_ACTIONS, band, layout_timeline

HETERO = Path(__file__).resolve().parents[2] / "examples" / "problems" / "heterogeneous-cluster.yaml"


def _gemma_like_doc(*, devices: int, microbatches: int, layers: int) -> dict[str, Any]:
    """The paper's Gemma-like costs (layer 1 / 1.65 / 0.22, head 5.72 / 1.21 / 0.58)."""
    return {
        "name": "gemma-like",
        "microbatches": microbatches,
        "layers": [
            {"name": "embedding", "kind": "embedding", "forward": 0.2, "backward": 0.1, "weight": 0.1},
            {"repeat": layers, "layers": [{"name": "layer", "forward": 1.0, "backward": 1.65, "weight": 0.22}]},
            {"name": "head", "kind": "head", "forward": 5.72, "backward": 1.21, "weight": 0.58},
        ],
        "devices": {"count": devices},
    }


def _gemma_like(*, devices: int, microbatches: int, layers: int) -> Costs:
    return Costs.from_problem(parse_problem(_gemma_like_doc(devices=devices, microbatches=microbatches, layers=layers)))


@pytest.fixture(scope="module")
def big() -> tuple[Problem, Plan, Simulation]:
    """16 devices x 128 microbatches, zb-v: two chunks per device, 384 actions on each."""
    problem = parse_problem(_gemma_like_doc(devices=16, microbatches=128, layers=128))
    costs = Costs.from_problem(problem)
    plan = BASELINES["zb-v"](costs)
    return problem, plan, simulate(costs, plan)


@pytest.fixture(scope="module")
def mixed() -> tuple[Problem, Plan, Simulation]:
    """Two devices of different kinds; device 0 holds the first and last stage (a V shape)."""
    problem = parse_problem({
        "name": "mixed",
        "microbatches": 2,
        "layers": [
            {"name": "emb", "kind": "embedding", "forward": 0.5, "backward": 0.5, "weight": 0.5},
            {"repeat": 4, "layers": [{"name": "dense", "forward": 10.0, "backward": 10.0, "weight": 10.0}]},
            {"name": "head", "kind": "head", "forward": 10.0, "backward": 10.0, "weight": 10.0},
        ],
        "devices": {"list": [{"name": "h100-a", "node": "node-a"}, {"name": "a10-0", "node": "node-b", "speed": 0.5}]},
    })
    f, b, w = "F", "B", "W"
    plan = Plan(
        stages=[(0, 2), (2, 4), (4, 6)],
        placement=[[0, 2], [1]],
        actions=[
            [(f, 0, 0), (f, 0, 1), (f, 2, 0), (b, 2, 0), (w, 2, 0), (f, 2, 1), (b, 2, 1), (w, 2, 1),
             (b, 0, 0), (w, 0, 0), (b, 0, 1), (w, 0, 1)],
            [(f, 1, 0), (f, 1, 1), (b, 1, 0), (w, 1, 0), (b, 1, 1), (w, 1, 1)],
        ],
        strategy="hand-made",
    )
    return problem, plan, simulate(Costs.from_problem(problem), plan)


def _texts(fig: Any) -> list[str]:
    from matplotlib.text import Text

    return [t.get_text() for t in fig.findobj(Text) if t.get_text()]


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", head[16:24])
    return width, height


# --- the words, without matplotlib -------------------------------------------------------------
def test_rows_name_the_devices_and_their_layer_ranges(mixed: tuple[Problem, Plan, Simulation]) -> None:
    problem, plan, sim = mixed
    layout = layout_timeline(sim, title="mixed: by hand", time_unit="ms", plan=plan, problem=problem)
    assert [r.label for r in layout.rows] == ["dev 0 · h100-a · node-a · 1x", "dev 1 · a10-0 · node-b · 0.5x"]
    assert [r.work for r in layout.rows] == [
        "s0: L0-1 +embedding, s2: L4-5 +head · 4 layers",
        "s1: L2-3 · 2 layers",
    ]
    assert [(s.stage, s.device, s.first, s.last) for s in layout.stages] == [(0, 0, 0, 1), (1, 1, 2, 3), (2, 0, 4, 5)]
    assert layout.mode == "detailed"
    assert layout.title == (
        f"mixed: by hand [hand-made]: iteration {sim.iteration_time:.4g} ms, bubble {sim.bubble_ratio:.1%}"
    )
    for row in layout.rows:
        assert row.busy == pytest.approx(sim.busy[row.device] / sim.iteration_time)
    assert layout.rows[0].actions == 12 and layout.rows[1].actions == 6


def test_rows_fall_back_to_indices_without_plan_and_problem(mixed: tuple[Problem, Plan, Simulation]) -> None:
    _, _, sim = mixed
    layout = layout_timeline(sim, title="t", time_unit="ms")
    assert [(r.label, r.work) for r in layout.rows] == [("dev 0", "s0, s2"), ("dev 1", "s1")]
    assert layout.stages == ()


def test_a_plan_of_another_size_is_refused(mixed: tuple[Problem, Plan, Simulation], big: Any) -> None:
    _, _, sim = mixed
    with pytest.raises(PlannerError, match="plan has 16 devices, the simulation 2"):
        layout_timeline(sim, title="t", time_unit="ms", plan=big[1])


def test_many_actions_switch_to_the_summary_view(big: tuple[Problem, Plan, Simulation]) -> None:
    problem, plan, sim = big
    layout = layout_timeline(sim, title="zb-v", time_unit="ms", plan=plan, problem=problem)
    assert max(r.actions for r in layout.rows) > DETAIL_MAX_ACTIONS
    assert layout.mode == "summary" and "summary view" in layout.subtitle
    assert layout.rows[15].label == "dev 15 · node1"  # identical devices: no name, no speed
    # zb-v's V: device 0 holds the first and the last stage.
    assert layout.rows[0].work.startswith("s0: L0-") and ", s31: L" in layout.rows[0].work
    assert "+head" in layout.rows[0].work
    assert 4 <= layout.height_in <= 18 and layout.row_in * 16 <= layout.height_in


def test_band_stacks_the_shares_of_each_slice() -> None:
    acts = [
        TimedAction(kind="F", stage=0, microbatch=0, start=0.0, end=1.0),
        TimedAction(kind="F", stage=0, microbatch=1, start=1.0, end=3.0),  # shares a slice with the first
        TimedAction(kind="B", stage=0, microbatch=0, start=3.0, end=4.0),
        TimedAction(kind="W", stage=1, microbatch=0, start=6.0, end=10.0),
    ]
    slices = band(acts, end=10.0, bins=5)
    assert [s.shares for s in slices] == [
        (("F", False, 1.0),),
        (("F", False, 0.5), ("B", False, 0.5)),
        (),
        (("W", True, 1.0),),  # stage 1 is this device's later chunk
        (("W", True, 1.0),),
    ]
    assert [s.busy for s in slices] == [1.0, 1.0, 0.0, 1.0, 1.0]


# --- the figures -------------------------------------------------------------------------------
def test_figure_labels_rows_and_microbatches(mixed: tuple[Problem, Plan, Simulation]) -> None:
    problem, plan, sim = mixed
    layout = layout_timeline(sim, title="mixed", time_unit="ms", plan=plan, problem=problem)
    fig = timeline_figure(sim, layout=layout, time_unit="ms")
    texts = _texts(fig)
    for row in layout.rows:
        assert row.label in texts and row.work in texts
        assert f"{row.busy:.0%}" in texts
    in_rows = [t.get_text() for t in fig.axes[0].texts]  # the time axis's own texts, not its ticks
    # Each microbatch's 3 F, 3 W and 2 B boxes (stage 0 needs no input gradient: its B takes no time).
    assert in_rows.count("0") == in_rows.count("1") == 8


def test_summary_figure_draws_a_bounded_number_of_artists(big: tuple[Problem, Plan, Simulation]) -> None:
    from matplotlib.image import AxesImage

    problem, plan, sim = big
    layout = layout_timeline(sim, title="zb-v", time_unit="ms", plan=plan, problem=problem)
    fig = timeline_figure(sim, layout=layout, time_unit="ms")
    assert len(fig.findobj(AxesImage)) == 16  # one band per device, not one box per action
    assert len(fig.findobj()) < 500  # the detailed view would hold 6,144 boxes
    assert "dev 15 · node1" in _texts(fig)
    in_rows = [t.get_text() for t in fig.axes[0].texts]
    assert len(in_rows) == 2 * 16 and not any(t.isdigit() for t in in_rows)  # row labels, no microbatches


def test_draws_16_devices_by_128_microbatches_as_png_and_svg(
    big: tuple[Problem, Plan, Simulation], tmp_path: Path
) -> None:
    problem, plan, sim = big
    png = tmp_path / "out" / "zbv.png"
    svg = tmp_path / "zbv.svg"
    drawn = draw_timeline(sim, path=png, title="zb-v 16x128", time_unit="ms", plan=plan, problem=problem)
    assert drawn.mode == "summary"
    draw_timeline(sim, path=svg, title="zb-v 16x128", time_unit="ms", plan=plan, problem=problem)
    width, height = _png_size(png)
    assert width >= 1800 and height >= 16 * 40  # a readable row per device
    assert 30_000 < png.stat().st_size < 400_000  # bands of colour, not an empty frame
    text = svg.read_text()
    assert text.lstrip().startswith("<?xml") and "</svg>" in text
    assert "zb-v 16x128: iteration" in text and "bubble" in text
    for label in ("F forward", "B input grad", "W weight grad", "idle (bubble)", "busy share", "dev 15"):
        assert label in text


def test_small_plan_gets_microbatch_numbers_and_fused_colour(tmp_path: Path) -> None:
    costs = _gemma_like(devices=4, microbatches=8, layers=8)
    sim = simulate(costs, BASELINES["1f1b"](costs))
    svg = tmp_path / "1f1b.svg"
    assert draw_timeline(sim, path=svg, title="1f1b", time_unit="ms").mode == "detailed"
    text = svg.read_text()
    assert "BW fused backward" in text and "W weight grad" not in text
    # matplotlib writes text as glyph references; the numbers' labels appear as comments.
    assert text.count("<!-- 7 -->") >= 4  # microbatch 7's boxes are wide enough to be labelled


def test_adaptis_plan_timeline_names_the_mixed_cluster(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    svg = tmp_path / "hetero.svg"
    assert main(["plan", str(HETERO), "--timeline", str(svg)]) == 0, capsys.readouterr().err
    text = svg.read_text()
    for label in ("dev 0 · h100-0 · fast · 1x", "dev 7 · a100-3 · slow · 0.45x", "+head", " layers"):
        assert label in text


def test_rejects_other_suffixes(mixed: tuple[Problem, Plan, Simulation], tmp_path: Path) -> None:
    with pytest.raises(PlannerError, match=r"\.png or \.svg"):
        draw_timeline(mixed[2], path=tmp_path / "out.pdf", title="x", time_unit="ms")


def test_planner_does_not_import_matplotlib_at_module_level() -> None:
    code = (
        "import sys, adaptis.planner.timeline, adaptis.planner.timeline_layout, adaptis.planner.baselines,"
        " adaptis.planner.partition; print('matplotlib' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
