"""The search scored by the step against the search scored by the iteration, with R replicas
(issue 30 item 3).

A figure, not a test. For each of the paper's 18 end-to-end workloads (bench/workloads.py) at
R = 2 and 4 data-parallel replicas (the all-reduce over the workload's inter-node link, the
default ``network.data_parallel``), ``adaptis`` plans the problem twice, ``objective:
iteration`` and ``objective: step`` (the default with replicas), and the row gives each plan's
predicted iteration and step and ``gain``: the iteration objective's step over the step
objective's (above 1: the step objective's plan trains faster). Both plans replay in the
simulator at the figures shown (they are the simulator's).

    python bench/step_objective.py [--replicas 2,4] [--workloads gemma-S,deepseek-M] [--time-limit 60]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workloads import end_to_end

from adaptis.api.problem import parse_problem
from adaptis.planner.strategies import plan_strategy


def _plan(doc: dict[str, Any], *, objective: str, limit: float) -> tuple[float, float, float]:
    """(iteration, step, seconds) of adaptis's plan of ``doc`` under ``objective``."""
    t0 = time.perf_counter()
    out = plan_strategy(parse_problem({**doc, "objective": objective}), "adaptis", time_limit_s=limit)
    took = time.perf_counter() - t0
    if out.simulation is None or not out.result.feasible:
        raise SystemExit(f"{doc['name']}: no plan fits ({out.result.reason})")
    return out.simulation.iteration_time, out.simulation.step_time, took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", default="2,4", help="data-parallel degrees, comma-separated")
    ap.add_argument("--workloads", default="", help="name prefixes, comma-separated (default all 18)")
    ap.add_argument("--time-limit", type=float, default=60.0, help="seconds a plan (as adaptis plan)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    prefixes = [p for p in args.workloads.split(",") if p]
    docs = [d for d in end_to_end() if not prefixes or any(d["name"].startswith(p) for p in prefixes)]
    load = os.getloadavg()[0]
    print(f"load average at start {load:.1f} ({os.cpu_count()} CPUs); times in ms, search s wall")
    print("| workload | R | iteration obj.: iteration / step | step obj.: iteration / step | gain | search s |")
    print("|---|---|---|---|---|---|")
    gains: dict[int, list[float]] = {}
    for replicas in [int(r) for r in args.replicas.split(",")]:
        for doc in docs:
            prob = {**doc, "data_parallel": replicas}
            it_i, it_s, t_i = _plan(prob, objective="iteration", limit=args.time_limit)
            st_i, st_s, t_s = _plan(prob, objective="step", limit=args.time_limit)
            gain = it_s / st_s
            gains.setdefault(replicas, []).append(gain)
            print(f"| {doc['name']} | {replicas} | {it_i:,.1f} / {it_s:,.1f} | {st_i:,.1f} / {st_s:,.1f} "
                  f"| {gain:.4f} | {t_i:.1f} / {t_s:.1f} |", flush=True)
    for replicas, g in gains.items():
        print(f"R = {replicas}: gain geomean {statistics.geometric_mean(g):.4f}, min {min(g):.4f}, "
              f"max {max(g):.4f}, {sum(x > 1 + 1e-9 for x in g)}/{len(g)} workloads shorter")
    print(f"load average at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
