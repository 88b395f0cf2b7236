"""The planner benchmark: every strategy on the paper's workloads, against the issue's targets.

Sits outside the package, on top of :func:`adaptis.planner.strategies.compare` (the same code
``adaptis plan --compare`` runs) and :mod:`bench.workloads` (the paper's configurations as
planning problems). For each configuration it reports each strategy's iteration time, bubble
ratio and largest peak memory, the speedup of ``adaptis`` over every baseline, the lower
bound and how close ``adaptis`` gets to it, and the search time; then the means and a
PASS/MISS line per target of issue 2. The same markdown goes to stdout and to
``bench/RESULTS.md``.

    python bench/planner_bench.py            # the 18 end-to-end configurations
    python bench/planner_bench.py --all      # plus the sequence sweep, the scaling series and
                                             # the memory sweep (the M configurations)

Timings are wall-clock on whatever else the machine runs; the timed targets take the best of
``--repeat`` runs (the usual way to read a timing on a shared machine) and show CPU time too.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
#: The section bench/accuracy.py writes into RESULTS.md; it and the sections after it (the
#: mutation score, the shared-cluster figures) are kept when this script rewrites the file.
ACCURACY_HEADING = "## Accuracy of the performance model"
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: `bench` and `adaptis` import

from adaptis.api.plan import STRATEGY_NAMES, Comparison  # noqa: E402
from adaptis.api.problem import parse_problem  # noqa: E402
from adaptis.planner.bounds import pipeline_bound  # noqa: E402
from adaptis.planner.costs import Costs  # noqa: E402
from adaptis.planner.feasibility import memory_partition  # noqa: E402
from adaptis.planner.strategies import compare  # noqa: E402
from bench import workloads  # noqa: E402

BASELINES = tuple(n for n in STRATEGY_NAMES if n != "adaptis")
LARGEST = ("nemotron-h", "L")  # 16 devices, 128 microbatches at the default 8 per device
TARGETS = {"i1f1b": 1.5, "balanced": 1.2}
LB_GAP = 0.12
SEARCH_LIMIT_S = 2.0
COMMAND_LIMIT_S = 3.0


@dataclass(frozen=True)
class Row:
    """One configuration's comparison plus how long it took to produce."""

    name: str
    comparison: Comparison
    wall_s: float
    cpu_s: float
    pipeline_lb: float  # the bound without granularity (bounds.pipeline_bound), for comparison

    def time(self, strategy: str) -> float | None:
        r = self.comparison.strategies[strategy]
        return r.iteration_time if r.feasible else None

    def speedup(self, baseline: str) -> float | None:
        ours, theirs = self.time("adaptis"), self.time(baseline)
        return None if ours is None or theirs is None or ours <= 0 else theirs / ours

    @property
    def gap(self) -> float | None:
        ours = self.time("adaptis")
        lb = self.comparison.lower_bound
        return None if ours is None or lb <= 0 else ours / lb

    @property
    def pipeline_gap(self) -> float | None:
        ours = self.time("adaptis")
        return None if ours is None or self.pipeline_lb <= 0 else ours / self.pipeline_lb


def run_config(doc: dict[str, Any]) -> Row:
    problem = parse_problem(doc)
    wall, cpu = time.perf_counter(), time.process_time()
    comparison, _ = compare(problem)
    elapsed = time.perf_counter() - wall, time.process_time() - cpu
    return Row(doc["name"], comparison, *elapsed, pipeline_bound(Costs.from_problem(problem)))


def run_suite(title: str, docs: list[dict[str, Any]]) -> list[Row]:
    rows = []
    for i, doc in enumerate(docs, 1):
        print(f"[{title} {i}/{len(docs)}] {doc['name']} ...", end="", file=sys.stderr, flush=True)
        row = run_config(doc)
        print(f" {row.wall_s:.1f} s", file=sys.stderr, flush=True)
        rows.append(row)
    return rows


# --- tables -------------------------------------------------------------------------------------
def _fmt(x: float | None, spec: str = ".1f", *, missing: str = "-") -> str:
    return missing if x is None else format(x, spec)


def _x(speedup: float | None) -> str:
    return "-" if speedup is None else f"{speedup:.2f}x"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table; every row has one cell per column of ``head``."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths, strict=True))) + " |"

    rule = "|" + "|".join("-" * (w + 1) + ":" if i else ":" + "-" * (w + 1) for i, w in enumerate(widths)) + "|"
    return [line(head), rule, *(line(r) for r in rows)]


def _mean_rows(rows: list[Row]) -> list[list[str]]:
    geo, arith = ["geometric mean"], ["arithmetic mean"]
    for b in BASELINES:
        vals = [s for r in rows if (s := r.speedup(b)) is not None]
        geo.append(_x(statistics.geometric_mean(vals) if vals else None))
        arith.append(_x(statistics.fmean(vals) if vals else None))
    gaps = [g for r in rows if (g := r.gap) is not None]
    geo.append(_fmt(statistics.geometric_mean(gaps) if gaps else None, ".3f"))
    arith.append(_fmt(statistics.fmean(gaps) if gaps else None, ".3f"))
    return [geo, arith]


def suite_tables(title: str, rows: list[Row]) -> list[str]:
    if not rows:
        return [f"## {title}", "", "No configuration matches `--only`.", ""]
    unit = rows[0].comparison.time_unit
    out = [f"## {title}", "", f"Iteration time ({unit}; `oom`: exceeds a device's memory, `n/a`: "
           "the strategy cannot run the model) and the lower bound:", ""]

    def cell(r: Row, s: str) -> str:
        res = r.comparison.strategies[s]
        if res.feasible:
            return _fmt(res.iteration_time)
        return "oom" if res.iteration_time is not None else "n/a"

    out += _table(["configuration", *STRATEGY_NAMES, "lower bound", "adaptis / LB", "pipeline LB",
                   "adaptis / pipeline LB", "search s", "compare s"],
                  [[r.name, *(cell(r, s) for s in STRATEGY_NAMES), _fmt(r.comparison.lower_bound),
                    _fmt(r.gap, ".3f"), _fmt(r.pipeline_lb), _fmt(r.pipeline_gap, ".3f"),
                    _fmt(r.comparison.strategies["adaptis"].search_seconds, ".2f"),
                    _fmt(r.wall_s, ".2f")] for r in rows])
    pgaps = [g for r in rows if (g := r.pipeline_gap) is not None]
    gaps = [g for r in rows if (g := r.gap) is not None]
    if gaps and pgaps:
        out += ["", f"Mean adaptis / LB {statistics.fmean(gaps):.3f} (granularity-aware bound) against "
                f"{statistics.fmean(pgaps):.3f} over the pipeline-only bound (`bounds.pipeline_bound`, the "
                "bound before layers were counted as indivisible)."]
    out += ["", "Speedup of adaptis over each baseline (and adaptis / lower bound):", ""]
    body = [[r.name, *(_x(r.speedup(b)) for b in BASELINES),
             _fmt(r.gap, ".3f")] for r in rows]
    out += _table(["configuration", *BASELINES, "adaptis / LB"], body + _mean_rows(rows))
    out += ["", "Bubble ratio (%) and, after the slash, the largest peak memory of a device (GB):", ""]
    out += _table(["configuration", *STRATEGY_NAMES], [
        [r.name, *(_bubble_mem(r, s) for s in STRATEGY_NAMES)] for r in rows])
    notes = [f"- {r.name}: `{s}` infeasible: {_short(res.reason)}" for r in rows
             for s, res in r.comparison.strategies.items() if not res.feasible]
    if notes:
        out += ["", "Infeasible strategies:", "", *notes]
    return [*out, ""]


def _short(reason: str | None) -> str:
    """The first of a reason's ``; ``-separated parts (one per device short of memory)."""
    parts = (reason or "no reason given").split("; ")
    return parts[0] + (f" (and {len(parts) - 1} more)" if len(parts) > 1 else "")


def _bubble_mem(r: Row, s: str) -> str:
    res = r.comparison.strategies[s]
    bubble = _fmt(None if res.bubble_ratio is None else 100 * res.bubble_ratio)
    mem = _fmt(max(res.peak_memory_bytes) / 1e9 if res.peak_memory_bytes else None)
    return f"{bubble} / {mem}"


# --- the timed targets --------------------------------------------------------------------------
def time_search(doc: dict[str, Any], *, repeat: int) -> tuple[float, float]:
    """Best wall time of the adaptis search (baselines excluded, as ``search_seconds``) and
    the CPU time of that whole compare run."""
    best = (math.inf, math.inf)
    for _ in range(repeat):
        row = run_config(doc)
        best = min(best, (row.comparison.strategies["adaptis"].search_seconds or math.inf, row.cpu_s))
    return best


def time_command(doc: dict[str, Any], *, repeat: int) -> tuple[float, float]:
    """Best wall time of ``adaptis plan FILE`` as a fresh process, and its CPU time."""
    best = (math.inf, math.inf)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "largest.yaml"
        path.write_text(yaml.safe_dump(doc))
        for _ in range(repeat):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "adaptis", "plan", str(path)], cwd=ROOT, check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            wall = time.perf_counter() - t0
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            best = min(best, (wall, cpu))
    return best


def targets(rows: list[Row], *, search: tuple[float, float], command: tuple[float, float]) -> list[str]:
    def verdict(ok: bool) -> str:
        return "PASS" if ok else "MISS"

    out = ["## Targets (issue 2)", ""]
    for b, want in TARGETS.items():
        vals = [s for r in rows if (s := r.speedup(b)) is not None]
        geo = statistics.geometric_mean(vals) if vals else 0.0
        arith = statistics.fmean(vals) if vals else 0.0
        # No plan beats the lower bound, so baseline / LB caps the speedup any planner can show.
        ceil = [t / r.comparison.lower_bound for r in rows if (t := r.time(b)) is not None and r.speedup(b)]
        out.append(f"- {verdict(geo >= want)}: mean speedup over `{b}` >= {want}x: geometric {geo:.3f}x, "
                   f"arithmetic {arith:.3f}x over {len(vals)} configurations where `{b}` fits; ceiling "
                   f"(`{b}` / lower bound): geometric {statistics.geometric_mean(ceil) if ceil else 0:.3f}x")
    gaps = [g for r in rows if (g := r.gap) is not None]
    mean_gap = statistics.fmean(gaps) if gaps else math.inf
    out.append(f"- {verdict(mean_gap <= 1 + LB_GAP)}: mean adaptis within {LB_GAP:.0%} of the lower bound: "
               f"adaptis / LB = {mean_gap:.3f} (worst {max(gaps, default=math.inf):.3f})")
    out.append(f"- {verdict(search[0] <= SEARCH_LIMIT_S)}: search of the largest configuration "
               f"(Nemotron-H L, 16 devices, 128 microbatches) <= {SEARCH_LIMIT_S:.0f} s: {search[0]:.2f} s wall "
               f"(the whole compare: {search[1]:.2f} s CPU)")
    out.append(f"- {verdict(command[0] <= COMMAND_LIMIT_S)}: `adaptis plan` on it <= {COMMAND_LIMIT_S:.0f} s: "
               f"{command[0]:.2f} s wall, {command[1]:.2f} s CPU")
    return [*out, ""]


def _least_memory(doc: dict[str, Any]) -> float:
    """Least per-device memory (bytes, same on every device) for which a witness exists: a
    contiguous cut in device order holding parameters and one microbatch on each device."""
    costs = Costs.from_problem(parse_problem(doc))
    lo, hi = 0.0, sum(costs.param_bytes) + sum(costs.activation_bytes)
    for _ in range(50):
        mid = (lo + hi) / 2
        shrunk = dataclasses.replace(costs, memory=(mid,) * costs.devices)
        if memory_partition(shrunk, order=list(range(costs.devices))) is None:
            lo = mid
        else:
            hi = mid
    return hi


def memory_sweep(docs: list[dict[str, Any]]) -> list[str]:
    """Each configuration with device memory from 3x down to 1x the witness's least need."""
    out = ["## Memory sweep (issue 13)", "",
           "Device memory as a multiple of the least that a witness needs (a contiguous cut, devices in "
           "order, parameters + one microbatch's activations each; `feasibility.memory_partition`). "
           "Iteration time (ms) of adaptis and of the fastest baseline that fits (`oom`: none fits):", ""]
    factors = (3.0, 2.0, 1.5, 1.2, 1.0)
    rows = []
    for doc in docs:
        need = _least_memory(doc)
        cells = [doc["name"], f"{need / 1e9:.2f}"]
        for f in factors:
            sized = {**doc, "devices": {**doc["devices"], "memory_bytes": need * f * (1 + 1e-9)}}
            print(f"[memory] {doc['name']} x{f} ...", file=sys.stderr, flush=True)
            comparison, _ = compare(parse_problem(sized))
            ours = comparison.strategies["adaptis"]
            base = [r.iteration_time for n, r in comparison.strategies.items()
                    if n != "adaptis" and r.feasible and r.iteration_time is not None]
            cells.append(f"{_fmt(ours.iteration_time) if ours.feasible else 'oom'} / "
                         f"{_fmt(min(base)) if base else 'oom'}")
        rows.append(cells)
    out += _table(["configuration", "witness GB", *(f"x{f:g}: adaptis / best baseline" for f in factors)], rows)
    return [*out, ""]


def _machine() -> str:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC on {platform.node() or 'unknown'}: "
            f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average {load}, "
            f"Python {platform.python_version()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="also the sequence sweep and the scaling series")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each timed target (best is kept)")
    parser.add_argument("--only", default="", help="configurations whose name contains this (a quick look; "
                        "written only with an explicit --out)")
    parser.add_argument("--out", type=Path, help="markdown output (default bench/RESULTS.md)")
    parser.add_argument("--profiles", type=Path, default=workloads.PROFILES,
                        help="measured profiles to plan too (default bench/profiles/, from bench/gpu_check.sh)")
    args = parser.parse_args(argv)
    out = args.out or (None if args.only else ROOT / "bench" / "RESULTS.md")

    def pick(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [d for d in docs if args.only in d["name"]]

    command = " ".join(["python bench/planner_bench.py", *(argv if argv is not None else sys.argv[1:])])
    lines = ["# Planner benchmark", "", f"Generated by `{command}` at {_machine()}.", "",
             "Workloads: `bench/workloads.py` (the paper's configurations, method.md). Lower bound: "
             "`adaptis.planner.strategies.lower_bound` (its module docstring says how it is computed); no "
             "plan beats it, so baseline / lower bound is the most any planner can gain over a baseline "
             "(the targets' *ceiling*); `pipeline LB` is the same bound without its granularity term (layers are "
             "indivisible: `adaptis.planner.bounds.assignment_bound`). Means over the configurations where the "
             "baseline fits in memory. "
             "`search s`: the joint search alone; `compare s`: every strategy, wall clock.", ""]
    e2e = run_suite("end-to-end", pick(workloads.end_to_end()))
    lines += suite_tables("End-to-end: 3 families x 3 sizes x sequence 2K and 4K", e2e)
    if args.all:
        lines += suite_tables("Sequence sweep: Nemotron-H S, 4 devices",
                              run_suite("sequence", pick(workloads.sequence_sweep())))
        lines += suite_tables("Scaling series: Gemma L on 4 to 32 devices",
                              run_suite("scaling", pick(workloads.scaling_series())))
        lines += memory_sweep([d for d in pick(workloads.end_to_end()) if "-M-" in d["name"]])
    measured = pick(workloads.measured(args.profiles))
    shown = args.profiles.relative_to(ROOT) if args.profiles.is_relative_to(ROOT) else args.profiles
    title = f"Measured profiles ({shown})"
    if measured:
        lines += suite_tables(title, run_suite("measured", measured))
    else:
        lines += [f"## {title}", "", "None yet: `bench/gpu_check.sh` writes them on a GPU machine.", ""]
    largest = workloads.problem(*LARGEST)
    print(f"[timing] {largest['name']}: search and `adaptis plan`, best of {args.repeat} ...",
          file=sys.stderr, flush=True)
    lines += targets(e2e, search=time_search(largest, repeat=args.repeat),
                     command=time_command(largest, repeat=args.repeat))
    text = "\n".join(lines)
    print(text)
    if out is not None:
        # bench/accuracy.py owns the accuracy section at the end: keep it.
        kept = out.read_text().partition(ACCURACY_HEADING)[2] if out.exists() else ""
        out.write_text(text + (f"\n\n{ACCURACY_HEADING}{kept}" if kept else ""))
        print(f"written to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
