"""Per-device timeline of a simulated plan, drawn with matplotlib (``adaptis plan --timeline``).

Sits at the edge of the planner layer: it only reads a :class:`~adaptis.planner.simulator.
Simulation`. matplotlib is an optional extra (``adaptis[timeline]``), so it is imported inside
:func:`draw_timeline` and nothing else in the planner pays for it. The figure uses
matplotlib's object API with the Agg canvas, never pyplot, so no global state is touched.

What the reader should see at a glance: one row per device, F / B / W / fused BW in distinct
colours, idle time as the grey row background (the bubbles), a second shade for a device's
later model chunks (interleaved and V schedules), microbatch numbers only where a box is
wide enough to hold them, and per-device idle share on the right.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from adaptis.planner.errors import PlannerError

if TYPE_CHECKING:
    from adaptis.planner.simulator import Simulation

__all__ = ["KIND_COLOURS", "draw_timeline"]

log = logging.getLogger(__name__)

# (first chunk, later chunks) per kind: the hue says the kind, the shade says the chunk.
KIND_COLOURS: dict[str, tuple[str, str]] = {
    "F": ("#3a78c2", "#8fb8e8"),
    "B": ("#2e9e55", "#8ad3a1"),
    "W": ("#e08a1e", "#f4c27f"),
    "BW": ("#8e5bb5", "#c7a6e0"),
}
_KIND_NAMES = {"F": "F forward", "B": "B input grad", "W": "W weight grad", "BW": "BW fused backward"}
_IDLE = "#dcdcdc"
_DPI = 150
_WIDTH_IN = 14.0
_ROW_IN = 0.34
_LABEL_MIN_PX = 7.0  # per character; narrower boxes get no text
_EDGE_MIN_PX = 4.0  # boxes narrower than this get no white edge (it would hide the colour)
_RASTER_BOXES = 4000  # above this many boxes an SVG embeds them as an image (file size)


def draw_timeline(sim: Simulation, *, path: Path, title: str, time_unit: str) -> None:
    """Write the timeline of ``sim`` to ``path``; ``.png`` or ``.svg`` by suffix."""
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in ("png", "svg"):
        raise PlannerError(f"timeline: {path} must end in .png or .svg")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ModuleNotFoundError as err:
        raise PlannerError(
            f"timeline: needs matplotlib ({err.name} is missing): pip install 'adaptis[timeline]'"
        ) from None

    devices = len(sim.timeline)
    end = sim.iteration_time
    height = max(3.0, 1.6 + _ROW_IN * devices)
    fig = Figure(figsize=(_WIDTH_IN, height), dpi=_DPI)
    FigureCanvasAgg(fig)
    left_in, right_in, top_in, bottom_in = 0.9, 0.8, 0.75, 0.85
    fig.subplots_adjust(
        left=left_in / _WIDTH_IN,
        right=1 - right_in / _WIDTH_IN,
        top=1 - top_in / height,
        bottom=bottom_in / height,
    )
    ax = fig.add_subplot(1, 1, 1)
    px_per_unit = (_WIDTH_IN - left_in - right_in) * _DPI / end if end > 0 else 0.0
    row_px = (height - top_in - bottom_in) * _DPI / max(devices, 1)
    total_boxes = sum(len(t) for t in sim.timeline)
    raster = fmt == "svg" and total_boxes > _RASTER_BOXES
    bar_h = 0.8
    used: set[str] = set()
    for d, acts in enumerate(sim.timeline):
        y = devices - 1 - d  # device 0 on top, as pipelines are usually drawn
        ax.broken_barh([(0.0, end)], (y - bar_h / 2, bar_h), facecolors=_IDLE, linewidth=0)
        chunk = {s: i for i, s in enumerate(sorted({a.stage for a in acts}))}
        groups: dict[tuple[str, bool], list[tuple[float, float]]] = defaultdict(list)
        for a in acts:
            groups[(a.kind, chunk[a.stage] > 0)].append((a.start, a.end - a.start))
            used.add(a.kind)
        for (kind, later), spans in groups.items():
            widest = max(w for _, w in spans) * px_per_unit
            ax.broken_barh(
                spans,
                (y - bar_h / 2, bar_h),
                facecolors=KIND_COLOURS.get(kind, ("#777777", "#aaaaaa"))[1 if later else 0],
                edgecolors="white",
                linewidth=0.4 if widest >= _EDGE_MIN_PX else 0.0,
                rasterized=raster,
            )
        if row_px >= 9:
            _label_boxes(ax, acts=acts, y=y, px_per_unit=px_per_unit, row_px=row_px)
        idle = sim.bubble[d] / end if end > 0 else 0.0
        ax.text(end * 1.005, y, f"idle {idle:.0%}", va="center", ha="left", fontsize=7, color="#555555")

    ax.set_xlim(0, end if end > 0 else 1)
    ax.set_ylim(-0.6, devices - 0.4)
    step = 1 if devices <= 24 else max(1, devices // 16)
    ticks = list(range(0, devices, step))
    ax.set_yticks([devices - 1 - d for d in ticks], [f"device {d}" for d in ticks], fontsize=8)
    ax.set_xlabel(f"time ({time_unit})", fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_title(
        f"{title}: iteration {end:.4g} {time_unit}, bubble {sim.bubble_ratio:.1%}",
        fontsize=11,
        loc="left",
    )
    handles: list[Any] = [
        Patch(facecolor=KIND_COLOURS[k][0], label=_KIND_NAMES[k]) for k in ("F", "B", "W", "BW") if k in used
    ]
    handles.append(Patch(facecolor=_IDLE, label="idle (bubble)"))
    if any(len({a.stage for a in acts}) > 1 for acts in sim.timeline):
        handles.append(Patch(facecolor="#ffffff", edgecolor="#999999", label="lighter: later chunk"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format=fmt)
    log.info("timeline: wrote %s (%d devices, %d actions)", path, devices, total_boxes)


def _label_boxes(ax: Any, *, acts: tuple[Any, ...], y: float, px_per_unit: float, row_px: float) -> None:
    """Microbatch numbers inside the boxes wide enough for them."""
    size = min(7.0, row_px * 0.45)
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
