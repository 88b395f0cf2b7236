"""Planner scale (issue 13 item 4): time and peak memory of the whole ``adaptis plan`` command
as devices and microbatches grow, and how close its plan gets to the lower bound.

Sits outside the package: it runs ``python -m adaptis plan FILE --json`` as a fresh process
per size (what a user runs, imports and the final simulation included) on
:func:`bench.workloads.planner_scale` (Nemotron-H L's layers and head, 6 blocks a device,
80 GB devices), reads the child's wall time, CPU time and peak RSS from ``os.wait4``, and the
plan's iteration time and the lower bound from the JSON. Sizes run interleaved, round by
round (``--repeat``), so load that comes and goes touches every size alike; the table keeps
the best wall time, the median and the CPU time of the best run.

    python bench/planner_scale.py                       # table + bench/planner-scale.png
    python bench/planner_scale.py --repeat 3 --sizes 8x64,16x128,32x256,64x512
    python bench/planner_scale.py --code /path/to/old/checkout --sizes 16x128,32x256
    python bench/planner_scale.py --workload memory --time-limit 30   # issue 32: memory binds

``--workload memory`` is :func:`bench.workloads.memory_scale` instead (Nemotron-H M at 8K
sequence, where every seed is over memory: issue 32), with its goals and its own plot
(bench/planner-scale-memory.png); ``--time-limit`` is passed to ``adaptis plan`` (the
operator's default budget is 30 s).

``--code`` plans with another checkout's ``adaptis`` (an earlier commit), for a before/after.
Wall time on a shared machine is as much the neighbours' as ours: the load average is
printed with the figures, and the CPU time (user + system of the child) is the steadier one.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import workloads  # noqa: E402

SIZES = "8x64,8x256,16x128,32x128,32x256,64x256,64x512"
# Issue 13's goals for the whole command on a 2-core machine: (devices, microbatches) -> seconds.
GOALS = {(32, 256): 3.0, (64, 512): 10.0}
GOAL_LB = 1.15
# The workloads: the problem per size, the default sizes, the goals (issue 32 adds the CRD's
# 128 workers at the operator's default budget) and the plot.
WORKLOADS = {
    "scale": (workloads.planner_scale, SIZES, GOALS, "planner-scale.png"),
    "memory": (workloads.memory_scale, "16x128,32x256,64x512,128x1024",
               {**GOALS, (128, 1024): 30.0}, "planner-scale-memory.png"),
}


@dataclass(frozen=True)
class Run:
    wall_s: float
    cpu_s: float
    rss_mb: float
    adaptis: float | None
    lower_bound: float
    load: float  # the 1-minute load average when the run ended


def plan_once(path: Path, *, code: Path, time_limit: float | None = None) -> Run:
    """One ``adaptis plan --json`` in a fresh process, measured by ``os.wait4``."""
    env = {**os.environ, "PYTHONPATH": str(code)}
    limit = [] if time_limit is None else ["--time-limit", f"{time_limit:g}"]
    with tempfile.TemporaryFile() as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "adaptis", "plan", str(path), "--json", *limit],
                                cwd=code, env=env, stdout=out, stderr=subprocess.DEVNULL)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode not in (0, 1):
            raise RuntimeError(f"adaptis plan {path} exited {proc.returncode}")
        out.seek(0)
        doc = json.loads(out.read())
    ours = doc["strategies"]["adaptis"]
    return Run(wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024,
               ours.get("iteration_time") if ours.get("feasible") else None,
               doc["lower_bound"], os.getloadavg()[0])


def measure(sizes: list[tuple[int, int]], *, repeat: int, code: Path, workload: str = "scale",
            time_limit: float | None = None) -> dict[tuple[int, int], list[Run]]:
    runs: dict[tuple[int, int], list[Run]] = {s: [] for s in sizes}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for p, m in sizes:
            paths[p, m] = Path(tmp) / f"scale-{p}x{m}.yaml"
            paths[p, m].write_text(yaml.safe_dump(WORKLOADS[workload][0](p, m)))
        for r in range(repeat):
            for size in sizes:  # interleaved: every size sees the same mix of load
                run = plan_once(paths[size], code=code, time_limit=time_limit)
                runs[size].append(run)
                print(f"[round {r + 1}/{repeat}] {size[0]}x{size[1]}: {run.wall_s:.2f} s wall, "
                      f"{run.cpu_s:.2f} s CPU, {run.rss_mb:.0f} MB, load {run.load:.1f}",
                      file=sys.stderr, flush=True)
    return runs


def table(runs: dict[tuple[int, int], list[Run]], *, goals: dict[tuple[int, int], float] = GOALS) -> list[str]:
    out = ["| devices x microbatches | wall s (best) | wall s (median) | CPU s (best run) | peak RSS MB "
           "| adaptis / LB | goal | load (1 min) |",
           "|--:|--:|--:|--:|--:|--:|:--|--:|"]
    for (p, m), rs in runs.items():
        best = min(rs, key=lambda r: r.wall_s)
        ratio = "-" if best.adaptis is None else f"{best.adaptis / best.lower_bound:.3f}"
        goal = goals.get((p, m))
        close = best.adaptis is not None and best.adaptis <= GOAL_LB * best.lower_bound
        # Both readings: wall is what the goal says, CPU what an idle 2-core machine would show.
        verdict = "" if goal is None else (
            f"<= {goal:g} s, <= {GOAL_LB}x: wall {'PASS' if close and best.wall_s <= goal else 'MISS'}, "
            f"CPU {'PASS' if close and best.cpu_s <= goal else 'MISS'}")
        out.append(f"| {p} x {m} | {best.wall_s:.2f} | {statistics.median(r.wall_s for r in rs):.2f} | "
                   f"{best.cpu_s:.2f} | {max(r.rss_mb for r in rs):.0f} | {ratio} | {verdict} | "
                   f"{', '.join(f'{r.load:.1f}' for r in rs)} |")
    return out


def plot(runs: dict[tuple[int, int], list[Run]], path: Path, *,
         goals: dict[tuple[int, int], float] = GOALS, title: str = "issue 13's goals") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 4))
    for i, p in enumerate(sorted({p for p, _ in runs})):
        sizes = sorted((m, rs) for (q, m), rs in runs.items() if q == p)
        xs = [p * m for m, _ in sizes]
        color = f"C{i}"
        ax_t.plot(xs, [min(r.wall_s for r in rs) for _, rs in sizes], "o-", color=color,
                  label=f"{p} devices, wall")
        ax_t.plot(xs, [min(rs, key=lambda r: r.wall_s).cpu_s for _, rs in sizes], "x--", color=color,
                  label=f"{p} devices, CPU")
        ax_m.plot(xs, [max(r.rss_mb for r in rs) for _, rs in sizes], "o-", color=color, label=f"{p} devices")
    for (p, m), goal in goals.items():
        ax_t.plot([p * m], [goal], "r*", markersize=12)
    ax_t.set(xscale="log", yscale="log", xlabel="devices x microbatches", ylabel="seconds",
             title=f"adaptis plan: time (red stars: {title})")
    ax_m.set(xscale="log", yscale="log", xlabel="devices x microbatches", ylabel="peak RSS (MB)",
             title="adaptis plan: peak memory")
    ax_t.legend(fontsize=7)
    ax_m.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="scale",
                        help="scale: issue 13's (memory does not bind); memory: issue 32's (it does)")
    parser.add_argument("--sizes", default="", help=f"DEVICESxMICROBATCHES,... (default: scale {SIZES}; "
                        f"memory {WORKLOADS['memory'][1]})")
    parser.add_argument("--time-limit", type=float, help="adaptis plan's --time-limit (default: its own)")
    parser.add_argument("--repeat", type=int, default=2, help="rounds over the sizes (best and median kept)")
    parser.add_argument("--code", type=Path, default=ROOT, help="checkout whose adaptis plans")
    parser.add_argument("--plot", type=Path, help="log-log plot to write ('' for none; default "
                        "bench/planner-scale.png, with --workload memory bench/planner-scale-memory.png)")
    args = parser.parse_args(argv)
    _make, default_sizes, goals, png = WORKLOADS[args.workload]
    sizes = [(int(a), int(b)) for a, b in (s.split("x") for s in (args.sizes or default_sizes).split(","))]
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    runs = measure(sizes, repeat=args.repeat, code=args.code.resolve(), workload=args.workload,
                   time_limit=args.time_limit)
    command = " ".join(["python bench/planner_scale.py", *(argv if argv is not None else sys.argv[1:])])
    print(f"Generated by `{command}` at {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC on "
          f"{platform.node()}: {os.cpu_count()} CPUs, load average {load} at the start; code "
          f"{args.code}.\n")
    print("\n".join(table(runs, goals=goals)))
    path = ROOT / "bench" / png if args.plot is None else args.plot
    if str(path) not in ("", "."):  # Path("") is "."
        plot(runs, path, goals=goals, title="issue 32's goals" if args.workload == "memory" else "issue 13's goals")
        print(f"\nplot written to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
