"""``adaptis run --trace DIR``: the last step's measured timeline next to the predicted one.

Sits beside :mod:`adaptis.cli.run`, after the ranks have written their traces
(:mod:`adaptis.worker.runtime.trace`). Each rank's timed calls are lined up with its actions in the
plan (the runtime runs them in the plan's order; the head's loss is timed as one more call
after each forward of the last stage, and counts as that forward), and set beside the
simulator's timeline of the same plan. What it tells a performance engineer, per rank:

- **busy**: measured compute against predicted (the profile's error, stage by stage);
- **gap**: the median time between two consecutive actions, the runtime's own cost per
  action where the rank does not wait (the problem charges ``action_overhead_s``);
- **hop latency**: for each action that waited for another rank's output, from that output's
  end to its own start: what a message between the ranks costs (0 in a local problem).

Written to ``DIR/trace.json`` (times in seconds from the step's first action); docs/profiling.md.
"""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path
from typing import Any

from adaptis.api.plan import Plan
from adaptis.api.problem import TIME_UNIT_SECONDS, Problem
from adaptis.planner.costs import Costs
from adaptis.planner.simulator import simulate
from adaptis.worker.runtime.trace import rank_trace_path

__all__ = ["TraceMismatch", "print_trace", "trace_report"]


class TraceMismatch(ValueError):
    """A rank's trace does not follow its actions in the plan."""


def _aligned(plan: Plan, *, rank: int, calls: list[list[Any]]) -> list[dict[str, Any]]:
    last = len(plan.stages) - 1
    out, i = [], 0
    for kind, stage, mb in plan.actions[rank]:
        if i >= len(calls) or calls[i][0] != kind:
            got = calls[i][0] if i < len(calls) else "nothing"
            raise TraceMismatch(f"rank {rank}: call {i} is {got}, the plan's action is {kind}{stage}.{mb}")
        start, end = calls[i][1], calls[i][2]
        i += 1
        if kind == "F" and stage == last:  # the loss, timed on its own, belongs to this forward
            if i >= len(calls) or calls[i][0] != "F":
                raise TraceMismatch(f"rank {rank}: no loss call after F{stage}.{mb}")
            end = calls[i][2]
            i += 1
        out.append({"kind": kind, "stage": stage, "microbatch": mb, "start": start, "end": end})
    if i != len(calls):
        raise TraceMismatch(f"rank {rank}: {len(calls) - i} timed calls beyond the plan's "
                            f"{len(plan.actions[rank])} actions")
    return out


def _producer(action: tuple[str, int, int], *, last: int) -> list[tuple[str, int, int]]:
    """The actions (kind, stage, microbatch) whose output ``action`` consumes from another
    stage (none for W)."""
    kind, stage, mb = action
    if kind == "F":
        return [("F", stage - 1, mb)] if stage > 0 else []
    if kind in ("B", "BW") and stage < last:
        return [("B", stage + 1, mb), ("BW", stage + 1, mb)]
    return []


def trace_report(directory: Path, *, plan: Plan, problem: Problem, ranks: int) -> dict[str, Any]:
    """Line up the pipeline ranks' traces (``ranks``: the first replica's) with ``plan`` and its
    simulation on ``problem``; write and return the report."""
    unit = TIME_UNIT_SECONDS[problem.time_unit]
    sim = simulate(Costs.from_problem(problem), plan)
    measured: dict[int, list[dict[str, Any]]] = {}
    for r in range(min(ranks, len(plan.actions))):
        if not plan.actions[r]:
            continue  # an idle rank runs nothing
        doc = json.loads(rank_trace_path(directory, rank=r).read_text())
        measured[r] = _aligned(plan, rank=r, calls=doc["calls"])
    t0 = min(acts[0]["start"] for acts in measured.values())
    where = {(a["kind"], a["stage"], a["microbatch"]): (r, a) for r, acts in measured.items() for a in acts}
    last = len(plan.stages) - 1
    hops: list[float] = []
    report: dict[str, Any] = {"ranks": {}}
    for r, acts in measured.items():
        predicted = sim.timeline[r]
        gaps = [b["start"] - a["end"] for a, b in itertools.pairwise(acts)]
        for prev, a in zip([None, *acts], acts, strict=False):
            for key in _producer((a["kind"], a["stage"], a["microbatch"]), last=last):
                src = where.get(key)
                # Waited: the input came from another rank after this rank was free.
                if src and src[0] != r and (prev is None or src[1]["end"] > prev["end"]):
                    hops.append(a["start"] - src[1]["end"])
        rows = [dict(a, start=a["start"] - t0, end=a["end"] - t0, predicted_start=p.start * unit,
                     predicted_end=p.end * unit) for a, p in zip(acts, predicted, strict=True)]
        report["ranks"][r] = {
            "busy_s": sum(a["end"] - a["start"] for a in acts),
            "predicted_busy_s": sim.busy[r] * unit,
            "median_gap_s": statistics.median(gaps) if gaps else 0.0,
            "end_s": acts[-1]["end"] - t0,
            "actions": rows,
        }
    report["iteration_s"] = max(v["end_s"] for v in report["ranks"].values())
    report["predicted_iteration_s"] = sim.iteration_time * unit
    report["action_overhead_s"] = problem.action_overhead_s
    report["hop_latency_s"] = ({"count": len(hops), "median": statistics.median(hops), "max": max(hops)}
                               if hops else {"count": 0})
    (directory / "trace.json").write_text(json.dumps(report, indent=1))
    return report


def print_trace(report: dict[str, Any], *, directory: Path) -> None:
    ms = 1e3
    print(f"  trace           {directory / 'trace.json'}: last step {report['iteration_s'] * ms:.1f} ms "
          f"(predicted {report['predicted_iteration_s'] * ms:.1f})")
    for r, v in report["ranks"].items():
        print(f"    rank {r}: busy {v['busy_s'] * ms:.1f} ms (predicted {v['predicted_busy_s'] * ms:.1f}), "
              f"median gap between actions {v['median_gap_s'] * ms:.2f} ms "
              f"(the problem charges {report['action_overhead_s'] * ms:.2f})")
    h = report["hop_latency_s"]
    if h["count"]:
        print(f"    hop latency: median {h['median'] * ms:.2f} ms, max {h['max'] * ms:.2f} ms over {h['count']} "
              "waited messages")
