"""What a plan's timeline shows, computed without matplotlib (drawn by ``timeline.py``).

Sits in the planner layer beside :mod:`adaptis.planner.timeline`: it reads a simulated plan and,
when the caller has them, the :class:`~adaptis.api.plan.Plan` (stage -> layer ranges) and the
:class:`~adaptis.api.problem.Problem` (device names, nodes, speeds), and decides everything the
picture says in words: each row's labels, the busy shares, the title, the figure size, and
whether the plan is drawn box by box or as a summary. Keeping this pure lets the tests check
the words without a plotting library, and keeps the drawing module about drawing.

Two views. *Detailed*: one box per F/B/W action, microbatch numbers where they fit. *Summary*
(past :data:`DETAIL_MAX_ACTIONS` actions on some device, e.g. 16 devices x 128 microbatches,
where boxes shrink to 2-3 pixels and per-box edges turn into noise): each row becomes a band of
:data:`SUMMARY_BINS` time slices, each a stack of the shares of it that F, B, W and BW fill, idle
(grey) on top, so warm-up, steady state, cool-down and the bubbles stay visible at any size and
the drawing's cost no longer grows with the number of actions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from adaptis.planner.errors import PlannerError

if TYPE_CHECKING:
    from adaptis.api.plan import Plan
    from adaptis.api.problem import Problem
    from adaptis.planner.simulator import Simulation, TimedAction

__all__ = [
    "DETAIL_MAX_ACTIONS",
    "SUMMARY_BINS",
    "BandSlice",
    "Row",
    "StageSpan",
    "TimelineLayout",
    "band",
    "chunk_of",
    "layout_timeline",
]

#: Above this many actions on one device the detailed view's boxes get narrower than about
#: 8 px on the figure's 1,650-px time axis: the summary view takes over.
DETAIL_MAX_ACTIONS = 200
#: Time slices per row in the summary view (about 10 px each on the time axis): coarse enough
#: that each slice spans several actions, so the band shows shares, not aliased stripes.
SUMMARY_BINS = 160
_WIDTH_IN = 15.0
_ROW_IN = 0.46  # two lines of 7-pt label text per row
_HEADER_IN = 1.55  # title, subtitle, axis labels and legend
_MAX_HEIGHT_IN = 18.0  # past ~36 rows they shrink instead of the figure growing further
_KIND_ORDER = ("F", "B", "W", "BW")
_SPECIAL_KINDS = ("embedding", "head")  # the layers a reader looks for in a partition


@dataclass(frozen=True, slots=True)
class StageSpan:
    """One pipeline stage: its layers ``[first, last]`` (inclusive) and its device."""

    stage: int
    device: int
    first: int
    last: int
    text: str  # "s3: L12-17"


@dataclass(frozen=True, slots=True)
class Row:
    """One device's row: who it is, what it holds, how busy it is."""

    device: int
    label: str  # "dev 4 · a100-0 · slow · 0.45x"
    work: str  # "s3: L12-17 · 6 layers"
    busy: float  # share of the iteration spent computing, 0..1
    actions: int


@dataclass(frozen=True, slots=True)
class BandSlice:
    """One summary time slice: the share of it each (kind, later chunk) fills, in drawing order."""

    shares: tuple[tuple[str, bool, float], ...]  # (kind, later chunk, share 0..1)

    @property
    def busy(self) -> float:
        return min(1.0, sum(share for _, _, share in self.shares))


@dataclass(frozen=True, slots=True)
class TimelineLayout:
    """Everything the drawing says in words, plus its size and view."""

    title: str
    subtitle: str
    mode: Literal["detailed", "summary"]
    rows: tuple[Row, ...]
    stages: tuple[StageSpan, ...]
    width_in: float
    height_in: float
    row_in: float


def layout_timeline(
    sim: Simulation, *, title: str, time_unit: str, plan: Plan | None = None, problem: Problem | None = None
) -> TimelineLayout:
    """The words and shape of ``sim``'s timeline; ``plan`` and ``problem`` add names and layers."""
    devices = len(sim.timeline)
    if plan is not None and plan.device_count != devices:
        raise PlannerError(f"timeline: the plan has {plan.device_count} devices, the simulation {devices}")
    if problem is not None and problem.device_count != devices:
        raise PlannerError(f"timeline: the problem has {problem.device_count} devices, the simulation {devices}")
    stages = _stage_spans(plan, problem) if plan is not None else ()
    by_stage = {s.stage: s for s in stages}
    labels = _device_labels(problem, devices)
    end = sim.iteration_time
    rows = []
    for d, acts in enumerate(sim.timeline):
        held = sorted({a.stage for a in acts} | set(plan.placement[d] if plan is not None else ()))
        rows.append(
            Row(
                device=d,
                label=labels[d],
                work=_work_text(held, by_stage),
                busy=min(1.0, sim.busy[d] / end) if end > 0 else 0.0,
                actions=len(acts),
            )
        )
    most = max((r.actions for r in rows), default=0)
    mode: Literal["detailed", "summary"] = "summary" if most > DETAIL_MAX_ACTIONS else "detailed"
    microbatches = 1 + max((a.microbatch for acts in sim.timeline for a in acts), default=-1)
    layers = f"{stages[-1].last + 1} layers in {len(stages)} stages, " if stages else ""
    view = (
        f"summary view ({most} actions on the busiest device): each time slice stacks the share "
        "of it each kind of work fills, idle on top"
        if mode == "summary"
        else "one box per action, microbatch numbers where they fit"
    )
    strategy = f" [{plan.strategy}]" if plan is not None and plan.strategy and plan.strategy not in title else ""
    row_in = min(_ROW_IN, (_MAX_HEIGHT_IN - _HEADER_IN) / max(devices, 1))
    return TimelineLayout(
        title=f"{title}{strategy}: iteration {end:.4g} {time_unit}, bubble {sim.bubble_ratio:.1%}",
        subtitle=f"{devices} devices x {microbatches} microbatches, {layers}{view}",
        mode=mode,
        rows=tuple(rows),
        stages=stages,
        width_in=_WIDTH_IN,
        height_in=max(3.2, _HEADER_IN + row_in * devices),
        row_in=row_in,
    )


def chunk_of(acts: Sequence[TimedAction]) -> dict[int, int]:
    """A device's stages numbered 0, 1, ... in pipeline order (its model chunks)."""
    return {s: i for i, s in enumerate(sorted({a.stage for a in acts}))}


def band(acts: Sequence[TimedAction], *, end: float, bins: int = SUMMARY_BINS) -> tuple[BandSlice, ...]:
    """``bins`` equal time slices of ``[0, end]``: the share of each that each kind of work fills."""
    if end <= 0 or bins < 1:
        return ()
    width = end / bins
    chunk = chunk_of(acts)
    # cover[i][(kind, later)]: time that work fills in slice i.
    cover: list[dict[tuple[str, bool], float]] = [{} for _ in range(bins)]
    for a in acts:
        key = (a.kind, chunk[a.stage] > 0)
        lo = max(0.0, a.start)
        hi = min(end, a.end)
        i = min(bins - 1, int(lo / width))
        while i < bins and i * width < hi:
            part = min(hi, (i + 1) * width) - max(lo, i * width)
            if part > 0:
                cover[i][key] = cover[i].get(key, 0.0) + part
            i += 1
    # A fixed order (F, B, W, BW; first chunk before later) so the stacks line up across rows.
    order = {k: i for i, k in enumerate(_KIND_ORDER)}
    return tuple(
        BandSlice(
            shares=tuple(
                (kind, later, t / width)
                for (kind, later), t in sorted(c.items(), key=lambda kv: (order.get(kv[0][0], 9), kv[0][1]))
            )
        )
        for c in cover
    )


def _stage_spans(plan: Plan, problem: Problem | None) -> tuple[StageSpan, ...]:
    owner = plan.stage_device()
    kinds = [layer.kind for layer in problem.expanded_layers()] if problem is not None else []
    spans = []
    for s, (lo, hi) in enumerate(plan.stages):
        layers = f"L{lo}" if hi - lo == 1 else f"L{lo}-{hi - 1}"
        special = [k for k in _SPECIAL_KINDS if k in kinds[lo:hi]]
        text = f"s{s}: {layers}" + "".join(f" +{k}" for k in special)
        spans.append(StageSpan(stage=s, device=owner[s], first=lo, last=hi - 1, text=text))
    return tuple(spans)


def _work_text(held: list[int], by_stage: dict[int, StageSpan]) -> str:
    """What a device holds: every stage's layers when up to two, else the stage list and count."""
    if not held:
        return "no stages"
    if not by_stage:
        return ", ".join(f"s{s}" for s in held)
    layers = sum(by_stage[s].last - by_stage[s].first + 1 for s in held)
    count = f"{layers} layer" + ("s" if layers != 1 else "")
    if len(held) <= 2:
        return ", ".join(by_stage[s].text for s in held) + f" · {count}"
    return "s" + ",".join(str(s) for s in held) + f" · {count}"


def _device_labels(problem: Problem | None, devices: int) -> list[str]:
    """``dev 4 · a100-0 · slow · 0.45x``: index, then what the problem says about the device."""
    if problem is None:
        return [f"dev {d}" for d in range(devices)]
    specs = problem.device_specs()
    show_speed = any(spec.speed != 1.0 for spec in specs)
    labels = []
    for d, spec in enumerate(specs):
        parts = [f"dev {d}"]
        if spec.name and spec.name != f"device{d}":  # device_specs() names unnamed ones so
            parts.append(spec.name)
        parts.append(spec.node)
        if show_speed:
            parts.append(f"{spec.speed:g}x")
        labels.append(" · ".join(parts))
    return labels
