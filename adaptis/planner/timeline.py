"""Per-device timeline of a simulated plan, drawn with matplotlib (``adaptis plan --timeline``).

Sits at the edge of the planner layer: it reads a :class:`~adaptis.planner.simulator.Simulation`
and, through :mod:`adaptis.planner.timeline_layout` (which decides every word, the size and the
view without matplotlib), the plan and problem it came from. matplotlib is an optional extra
(``adaptis[timeline]``), so it is imported inside :func:`timeline_figure` and nothing else in
the planner pays for it. The figure uses matplotlib's object API with the Agg canvas, never
pyplot, so no global state is touched.

What the reader should see at a glance: one row per device, labelled with the device (index,
name, node, speed) and what it holds (stages and their layer ranges), F / B / W / fused BW in
distinct colours, idle time as the grey row background (the bubbles), a second shade for a
device's later model chunks (interleaved and V schedules), microbatch numbers where a box is
wide enough, and a busy-share bar per device on the right. Large plans get the summary band
(see the layout module) instead of one box per action.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from adaptis.planner.errors import PlannerError
from adaptis.planner.timeline_layout import TimelineLayout, band, chunk_of, layout_timeline

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from adaptis.api.plan import Plan
    from adaptis.api.problem import Problem
    from adaptis.planner.simulator import Simulation

__all__ = ["KIND_COLOURS", "draw_timeline", "timeline_figure"]

log = logging.getLogger(__name__)

# (first chunk, later chunks) per kind: the hue says the kind, the shade says the chunk.
KIND_COLOURS: dict[str, tuple[str, str]] = {
    "F": ("#3a78c2", "#8fb8e8"),
    "B": ("#2e9e55", "#8ad3a1"),
    "W": ("#e08a1e", "#f4c27f"),
    "BW": ("#8e5bb5", "#c7a6e0"),
}
_KIND_NAMES = {"F": "F forward", "B": "B input grad", "W": "W weight grad", "BW": "BW fused backward"}
_OTHER = ("#777777", "#aaaaaa")
_IDLE = "#dcdcdc"
_BUSY = "#4d6f8f"
_DPI = 150
_UTIL_IN = 1.0  # the busy-share panel
_GAP_IN = 0.15
_RIGHT_IN = 0.55  # room for the busy percentages
_TOP_IN, _BOTTOM_IN = 0.85, 0.7
_CHAR_IN = 0.058  # width of one 7.5-pt character, for sizing the label margin
_LABEL_MIN_PX = 7.0  # per character; narrower boxes get no text
_EDGE_MIN_PX = 4.0  # boxes narrower than this get no white edge (it would hide the colour)
_RASTER_BOXES = 4000  # above this many boxes an SVG embeds them as an image (file size)
_BAR_H = 0.8
_BAND_PX = 24  # vertical resolution of a summary row's stacks


def draw_timeline(
    sim: Simulation,
    *,
    path: Path,
    title: str,
    time_unit: str,
    plan: Plan | None = None,
    problem: Problem | None = None,
) -> TimelineLayout:
    """Write the timeline of ``sim`` to ``path`` (``.png`` or ``.svg`` by suffix); say what it drew.

    ``plan`` adds each device's stages and layer ranges, ``problem`` the devices' names, nodes
    and speeds; without them rows are labelled by index and stage number only.
    """
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in ("png", "svg"):
        raise PlannerError(f"timeline: {path} must end in .png or .svg")
    layout = layout_timeline(sim, title=title, time_unit=time_unit, plan=plan, problem=problem)
    total_boxes = sum(len(t) for t in sim.timeline)
    fig = timeline_figure(
        sim, layout=layout, time_unit=time_unit, raster=fmt == "svg" and total_boxes > _RASTER_BOXES
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format=fmt)
    log.info("timeline: wrote %s (%s view, %d devices, %d actions)", path, layout.mode, len(layout.rows), total_boxes)
    return layout


def timeline_figure(sim: Simulation, *, layout: TimelineLayout, time_unit: str, raster: bool = False) -> Figure:
    """The timeline as a matplotlib Figure (Agg canvas attached), not yet saved."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ModuleNotFoundError as err:
        raise PlannerError(
            f"timeline: needs matplotlib ({err.name} is missing): pip install 'adaptis[timeline]'"
        ) from None

    width, height = layout.width_in, layout.height_in
    fig = Figure(figsize=(width, height), dpi=_DPI)
    FigureCanvasAgg(fig)
    longest = max((max(len(r.label), len(r.work)) for r in layout.rows), default=8)
    left_in = min(3.8, max(1.0, 0.3 + _CHAR_IN * longest))
    plot_w = width - left_in - _GAP_IN - _UTIL_IN - _RIGHT_IN
    plot_h = height - _TOP_IN - _BOTTOM_IN
    ax = fig.add_axes((left_in / width, _BOTTOM_IN / height, plot_w / width, plot_h / height))
    ux = fig.add_axes(
        ((left_in + plot_w + _GAP_IN) / width, _BOTTOM_IN / height, _UTIL_IN / width, plot_h / height), sharey=ax
    )
    n = len(layout.rows)
    end = sim.iteration_time if sim.iteration_time > 0 else 1.0
    px_per_unit = plot_w * _DPI / end
    row_px = layout.row_in * _DPI
    used: set[str] = set()
    chunked = False
    for d, acts in enumerate(sim.timeline):
        y = n - 1 - d  # device 0 on top, as pipelines are usually drawn
        used.update(a.kind for a in acts)
        chunked = chunked or len(chunk_of(acts)) > 1
        if layout.mode == "summary":
            _draw_band(ax, acts=acts, y=y, end=end)
            continue
        ax.broken_barh([(0.0, end)], (y - _BAR_H / 2, _BAR_H), facecolors=_IDLE, linewidth=0)
        _draw_boxes(ax, acts=acts, y=y, px_per_unit=px_per_unit, raster=raster)
        if row_px >= 9:
            _label_boxes(ax, acts=acts, y=y, px_per_unit=px_per_unit, row_px=row_px)

    ax.set_xlim(0, end)
    ax.set_ylim(-0.6, n - 0.4)
    ax.set_yticks([])
    _row_labels(ax, layout=layout)
    ax.set_xlabel(f"time ({time_unit})", fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    _busy_panel(ux, layout=layout)
    fig.text(left_in / width, 1 - 0.3 / height, layout.title, fontsize=12, weight="bold", ha="left", va="center")
    fig.text(left_in / width, 1 - 0.58 / height, layout.subtitle, fontsize=8.5, color="#444444", ha="left", va="center")
    _legend(fig, used=used, chunked=chunked)
    return fig


def _draw_boxes(ax: Any, *, acts: Any, y: float, px_per_unit: float, raster: bool) -> None:
    """One box per action, one collection per (kind, chunk) so the artist count stays small."""
    chunk = chunk_of(acts)
    groups: dict[tuple[str, bool], list[tuple[float, float]]] = defaultdict(list)
    for a in acts:
        groups[(a.kind, chunk[a.stage] > 0)].append((a.start, a.end - a.start))
    for (kind, later), spans in groups.items():
        widest = max(w for _, w in spans) * px_per_unit
        ax.broken_barh(
            spans,
            (y - _BAR_H / 2, _BAR_H),
            facecolors=KIND_COLOURS.get(kind, _OTHER)[1 if later else 0],
            edgecolors="white",
            linewidth=0.4 if widest >= _EDGE_MIN_PX else 0.0,
            rasterized=raster,
        )


def _draw_band(ax: Any, *, acts: Any, y: float, end: float) -> None:
    """The summary row: one image, each time slice a bottom-up stack of its work's shares."""
    from matplotlib.colors import to_rgb

    idle = to_rgb(_IDLE)
    slices = band(acts, end=end)
    if not slices:
        return
    # columns[i]: slice i's pixels, bottom first; rounding the cumulative share keeps stacks whole.
    columns = []
    for piece in slices:
        column: list[tuple[float, float, float]] = []
        done = 0.0
        for kind, later, share in piece.shares:
            done += share
            hue = to_rgb(KIND_COLOURS.get(kind, _OTHER)[1 if later else 0])
            column += [hue] * (min(_BAND_PX, round(done * _BAND_PX)) - len(column))
        column += [idle] * (_BAND_PX - len(column))
        columns.append(column)
    image = [[columns[i][_BAND_PX - 1 - j] for i in range(len(columns))] for j in range(_BAND_PX)]
    ax.imshow(image, extent=(0.0, end, y - _BAR_H / 2, y + _BAR_H / 2), aspect="auto", interpolation="nearest")


def _row_labels(ax: Any, *, layout: TimelineLayout) -> None:
    """Each row's device on the first line, its stages and layers below, left of the row."""
    n = len(layout.rows)
    size = min(7.5, layout.row_in * 72 * 0.36)
    two_lines = layout.row_in * 72 >= 2.4 * size
    trans = ax.get_yaxis_transform()  # x in axes fraction, y in data
    for r in layout.rows:
        y = n - 1 - r.device
        if two_lines:
            ax.text(-0.008, y + 0.04, r.label, transform=trans, ha="right", va="bottom", fontsize=size,
                    weight="bold", color="#222222")
            ax.text(-0.008, y - 0.04, r.work, transform=trans, ha="right", va="top", fontsize=size,
                    color="#555555")
        else:
            ax.text(-0.008, y, f"{r.label}  {r.work}", transform=trans, ha="right", va="center",
                    fontsize=size, color="#222222")


def _busy_panel(ux: Any, *, layout: TimelineLayout) -> None:
    """Busy share per device: a bar and its percentage, the bubble's complement."""
    n = len(layout.rows)
    ys = [n - 1 - r.device for r in layout.rows]
    busy = [r.busy for r in layout.rows]
    ux.barh(ys, busy, height=_BAR_H, color=_BUSY, linewidth=0)
    ux.barh(ys, [1 - b for b in busy], left=busy, height=_BAR_H, color=_IDLE, linewidth=0)
    size = min(7.5, layout.row_in * 72 * 0.4)
    for y, b in zip(ys, busy, strict=True):
        ux.text(1.04, y, f"{b:.0%}", ha="left", va="center", fontsize=size, color="#333333")
    ux.set_xlim(0, 1)
    ux.set_xticks([0, 0.5, 1], ["0", "50%", "100%"], fontsize=7)
    ux.set_title("busy share", fontsize=8, loc="left")
    ux.tick_params(axis="y", left=False, labelleft=False)
    for side in ("top", "right", "left"):
        ux.spines[side].set_visible(False)


def _legend(fig: Any, *, used: set[str], chunked: bool) -> None:
    from matplotlib.patches import Patch

    handles: list[Any] = [
        Patch(facecolor=KIND_COLOURS[k][0], label=_KIND_NAMES[k]) for k in ("F", "B", "W", "BW") if k in used
    ]
    handles.append(Patch(facecolor=_IDLE, label="idle (bubble)"))
    if chunked:
        handles.append(Patch(facecolor="#ffffff", edgecolor="#999999", label="lighter: later chunk"))
    handles.append(Patch(facecolor=_BUSY, label="busy share"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)


def _label_boxes(ax: Any, *, acts: Any, y: float, px_per_unit: float, row_px: float) -> None:
    """Microbatch numbers inside the boxes wide enough for them."""
    size = min(7.0, row_px * 0.3)
    for a in acts:
        text = str(a.microbatch)
        if (a.end - a.start) * px_per_unit >= _LABEL_MIN_PX * (len(text) + 0.5):
            ax.text(
                (a.start + a.end) / 2,
                y,
                text,
                ha="center",
                va="center",
                fontsize=size,
                color="white" if a.kind != "W" else "#3a2a00",
            )
