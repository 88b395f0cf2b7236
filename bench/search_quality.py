"""Search quality: how close ``adaptis`` gets to the lower bound, before and after a change.

Sits beside bench/planner_bench.py (which reports every strategy); this one looks only at the
joint search (:func:`adaptis.planner.search.joint_search`) and what ``adaptis`` returns (the
search or, where it loses, the best baseline) on the 18 paper workloads and on the same
workloads with mixed device speeds (seeded per workload), against
:func:`adaptis.planner.strategies.lower_bound`. It writes the figures as JSON, and with
``--before`` a table of both runs, workload by workload, flagging any that got worse.

    python bench/search_quality.py --json after.json
    python bench/search_quality.py --code /path/to/old/checkout --json before.json
    python bench/search_quality.py --before before.json      # the before/after table

``--code`` imports ``adaptis`` from another checkout (the planner of an earlier commit), so
both runs plan the same problems with the same script. Iteration times are deterministic;
seconds are wall clock on whatever else the machine runs.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SPEEDS = (0.6, 0.8, 1.0, 1.0, 1.4)  # the mixed-speed variant draws each device's from these


def mixed(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with each device's speed drawn from SPEEDS (seeded by the workload's name)."""
    rng = random.Random(doc["name"])
    count, per_node = doc["devices"]["count"], doc["devices"]["per_node"]
    devices = [{"name": f"gpu{d}", "node": f"node{d // per_node}", "speed": rng.choice(SPEEDS),
                "memory_bytes": doc["devices"]["memory_bytes"]} for d in range(count)]
    return {**doc, "name": doc["name"] + "-mixed", "devices": {"list": devices}}


def measure(doc: dict[str, Any]) -> dict[str, Any]:
    from adaptis.api.problem import parse_problem
    from adaptis.planner.costs import Costs
    from adaptis.planner.search import joint_search
    from adaptis.planner.strategies import compare, lower_bound

    problem = parse_problem(doc)
    costs = Costs.from_problem(problem)
    t0 = time.perf_counter()
    found = joint_search(costs)
    search_s = time.perf_counter() - t0
    comparison, _ = compare(problem, bound=False)
    ours = comparison.strategies["adaptis"]
    return {
        "search": found.schedule.iteration_time if found else None,
        "pattern": found.pattern if found else None,
        "evaluations": found.evaluations if found else 0,
        "adaptis": ours.iteration_time if ours.feasible else None,
        "lower_bound": lower_bound(costs),
        "search_s": search_s,
    }


def _ratio(row: dict[str, Any], key: str) -> float | None:
    return None if row.get(key) is None else row[key] / row["lower_bound"]


def table(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    out = ["| workload | before | before / LB | after | after / LB | change |",
           "|:--|--:|--:|--:|--:|--:|"]
    worse = []
    for suite in ("paper", "mixed"):
        names = [n for n in after[suite] if n in before[suite]]
        for name in names:
            b, a = before[suite][name], after[suite][name]
            change = (a["adaptis"] / b["adaptis"] - 1) * 100
            if a["adaptis"] > b["adaptis"] * (1 + 1e-9):
                worse.append(name)
            out.append(f"| {name} | {b['adaptis']:.1f} | {_ratio(b, 'adaptis'):.4f} | "
                       f"{a['adaptis']:.1f} | {_ratio(a, 'adaptis'):.4f} | {change:+.2f} % |")
        mb = statistics.fmean(_ratio(before[suite][n], "adaptis") for n in names)
        ma = statistics.fmean(_ratio(after[suite][n], "adaptis") for n in names)
        out.append(f"| **mean, {suite}** | | **{mb:.4f}** | | **{ma:.4f}** | |")
    out += ["", f"Worse than before: {', '.join(worse) if worse else 'none'}."]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--code", type=Path, default=ROOT, help="checkout whose adaptis to import")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--before", type=Path, help="figures of an earlier run: print both")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(args.code))
    sys.path.insert(1, str(ROOT))  # bench.workloads, from this checkout in both runs
    from bench import workloads

    figures: dict[str, dict[str, Any]] = {"paper": {}, "mixed": {}}
    for doc in workloads.end_to_end():
        for suite, d in (("paper", doc), ("mixed", mixed(doc))):
            row = measure(d)
            figures[suite][d["name"]] = row
            print(f"{d['name']:28s} adaptis / LB {_ratio(row, 'adaptis'):.4f} "
                  f"search {row['search_s']:.2f} s {row['pattern']}", file=sys.stderr, flush=True)
    for suite, rows in figures.items():
        mean = statistics.fmean(_ratio(r, "adaptis") for r in rows.values())
        print(f"mean adaptis / LB, {suite}: {mean:.4f}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    if args.before:
        print("\n".join(table(json.loads(args.before.read_text()), figures)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
