"""Measured speedup of adaptis over the baselines, next to the predicted one (issue 16).

A figure, not a test. For each workload it profiles the layers ONCE (``adaptis profile``), plans
every strategy from that one profile and trains each with ``adaptis run --problem`` on local
ranks, the strategies taking turns (A B C ... A B C ...) for ``--reps`` rounds, so that a slow
minute of this shared machine hurts every strategy alike. Per run: the mean iteration time of
the steps after the first (``adaptis run``'s measured figure), the 1-minute load average
before and after, and the cores the rest of the machine used meanwhile. Runs during which other
processes used more than ``--max-load`` cores are listed but left out of the figures; a
strategy with fewer than two clean runs is reported as "too busy", not as a number.

    python bench/measured_speedup.py                      # 3 workloads x 6 strategies x 3 rounds
    python bench/measured_speedup.py --workloads example --reps 1 --steps 6   # a quick look

Workloads: ``example`` (examples/tiny-heterogeneous.yaml as shipped), ``head`` (the same with a
4x larger vocabulary: a dominant head) and ``moe`` (MoE blocks after attention blocks, no Mamba).

``--profiles`` compares ways of profiling in one run (a fix's before and after, side by side):
each named variant profiles the workload once; every strategy is planned on each variant's
profile, and each distinct plan runs once a round, its measurement standing for every variant
that planned it (fixed baselines usually plan alike, adaptis and balanced may not). Variants:
``default`` (``adaptis profile`` as it is), ``cold-alone`` (``--co-runners 0``), ``warm-alone``
(``--caches warm --co-runners 0``: how layers were profiled before issue 16's fixes).

    python bench/measured_speedup.py --workloads moe --profiles default,cold-alone,warm-alone

``--stability N`` runs nothing: it profiles each variant N times, taking turns, and reports per
strategy how far the N predictions spread (issue 16's goal: within 3 %). Before each round it
takes a reference profile (``--caches warm --co-runners 0 --estimator min``: the layers' least
disturbed time, which moves only with the host's own speed), and reports the spread of the
predictions divided by the round's reference too: what is left once the host's drift is taken
out is the profiler's own noise.

    python bench/measured_speedup.py --workloads example,moe --stability 5
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "tiny-heterogeneous.yaml"
STRATEGIES = ("adaptis", "1f1b", "i1f1b", "zb-h1", "zb-v", "balanced")
#: Profile variant -> the ``adaptis profile`` flags it adds.
PROFILES: dict[str, tuple[str, ...]] = {
    "default": (),
    "cold-alone": ("--co-runners", "0"),
    "warm-alone": ("--caches", "warm", "--co-runners", "0"),
}
#: ``--stability``'s reference: the least disturbed layer times, which follow only the host's speed.
REFERENCE = ("--caches", "warm", "--co-runners", "0", "--estimator", "min")


def workload(name: str) -> dict[str, Any]:
    """The manifest of a workload, derived from the shipped example."""
    doc: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    doc = copy.deepcopy(doc)
    model = doc["spec"]["model"]
    if name == "head":
        model["vocabSize"] = 4 * model["vocabSize"]
    elif name == "moe":
        model["blocks"] = [{"kind": "attention", "count": 3},
                           {"kind": "moe", "count": 5, "experts": 8, "topK": 2}]
    elif name != "example":
        raise SystemExit(f"unknown workload {name!r}: use example, head or moe")
    doc["metadata"]["name"] = f"speedup-{name}"
    return doc


def _adaptis(*args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "adaptis", *args], capture_output=True,
                          text=True, timeout=timeout_s, cwd=REPO, check=False)


def profile(manifest: Path, *, out: Path, flags: tuple[str, ...] = ()) -> None:
    done = _adaptis("profile", str(manifest), "-o", str(out), *flags, timeout_s=1800)
    if done.returncode != 0:
        raise SystemExit(f"adaptis profile {manifest} failed: {done.stderr.strip()[-2000:]}")


def _busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (all cores, /proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed_run(manifest: Path, *, problem: Path, steps: int, workdir: Path,
              extra: tuple[str, ...] = ()) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """One timed ``adaptis run --problem``: its JSON summary (None when it failed) and how the
    machine was meanwhile. ``others_cores`` is what the rest of the machine used, in cores: the
    machine's busy CPU time minus our run's own (its ranks are waited for, so they count as our
    children). The load average cannot tell: our own ranks load the machine by themselves."""
    load_before, busy0, ours0 = os.getloadavg()[0], _busy_cpu_seconds(), _children_cpu_seconds()
    started = time.perf_counter()
    done = _adaptis("run", str(manifest), "--problem", str(problem), *extra, "--steps", str(steps),
                    "--json", "--fresh", "--workdir", str(workdir), "--metrics-port", "0",
                    "--checkpoint-every", "0", timeout_s=1800)
    wall = time.perf_counter() - started
    others = (_busy_cpu_seconds() - busy0 - (_children_cpu_seconds() - ours0)) / wall
    row: dict[str, Any] = {"load_before": load_before, "load_after": os.getloadavg()[0],
                           "others_cores": max(0.0, others), "wall_s": wall}
    if done.returncode != 0:
        row["error"] = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return None, row
    return json.loads(done.stdout), row


def run_once(manifest: Path, *, problem: Path, strategy: str, steps: int, workdir: Path) -> dict[str, Any]:
    """One timed run of ``strategy``: its iteration and bubble, measured and predicted."""
    summary, row = timed_run(manifest, problem=problem, steps=steps, workdir=workdir,
                             extra=("--strategy", strategy))
    row["strategy"] = strategy
    if summary is not None:
        row.update(measured=summary["measured_iteration_seconds"],
                   predicted=summary["predicted_iteration_seconds"],
                   measured_bubble=summary["measured_bubble_ratio"],
                   predicted_bubble=summary["predicted_bubble_ratio"], stages=summary["stages"])
    return row


def clean(rows: list[dict[str, Any]], *, max_load: float) -> list[dict[str, Any]]:
    return [r for r in rows if "measured" in r and r["others_cores"] <= max_load]


def figures(rows: list[dict[str, Any]], *, max_load: float) -> dict[str, dict[str, Any]]:
    """Per strategy: median and spread of the clean runs, the prediction and its error."""
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r["strategy"] for r in rows):
        mine = [r for r in rows if r["strategy"] == name]
        ok = clean(mine, max_load=max_load)
        fig: dict[str, Any] = {"runs": len(mine), "clean": len(ok),
                               "errors": [r["error"] for r in mine if "error" in r]}
        if len(ok) >= 2:
            times = [r["measured"] for r in ok]
            med = statistics.median(times)
            pred = statistics.median(r["predicted"] for r in ok)
            fig.update(median=med, spread=(max(times) - min(times)) / med, predicted=pred,
                       error=(pred - med) / med, stages=ok[0]["stages"])
        out[name] = fig
    return out


def report(name: str, figs: dict[str, dict[str, Any]]) -> list[str]:
    lines = [f"### {name}", "",
             "| strategy | stages | measured ms (median, spread) | predicted ms | error | "
             "adaptis speedup measured | predicted |",
             "|---|---|---|---|---|---|---|"]
    ours = figs.get("adaptis", {})
    for strategy, f in figs.items():
        if "median" not in f:
            why = "; ".join(f["errors"]) or f"too busy ({f['clean']} clean of {f['runs']} runs)"
            lines.append(f"| {strategy} | | {why} | | | | |")
            continue
        speed = pred_speed = ""
        if strategy != "adaptis" and "median" in ours:
            speed = f"{f['median'] / ours['median']:.2f}x"
            pred_speed = f"{f['predicted'] / ours['predicted']:.2f}x"
        lines.append(f"| {strategy} | {f['stages']} | {1e3 * f['median']:.0f} ({100 * f['spread']:.0f} %) "
                     f"| {1e3 * f['predicted']:.0f} | {100 * f['error']:+.1f} % | {speed} | {pred_speed} |")
    errs = [abs(f["error"]) for f in figs.values() if "error" in f]
    if errs:
        lines += ["", f"Prediction error: mean {100 * statistics.mean(errs):.1f} %, "
                  f"max {100 * max(errs):.1f} % over {len(errs)} strategies."]
    return [*lines, ""]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="example,head,moe")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--reps", type=int, default=3, help="rounds of every strategy (default 3)")
    p.add_argument("--steps", type=int, default=12, help="steps a run; the first is dropped")
    p.add_argument("--max-load", type=float, default=0.25,
                   help="cores the rest of the machine may use during a run before the run is "
                        "left out (default 0.25: the ranks need the cores to themselves)")
    p.add_argument("--profiles", default="default",
                   help=f"profile variants to compare, comma-separated, of {', '.join(PROFILES)} "
                        "(default: default)")
    p.add_argument("--json", type=Path, help="also write every run here")
    p.add_argument("--stability", type=int, metavar="N",
                   help="run nothing: profile each variant N times and report the predictions' spread")
    args = p.parse_args()
    strategies, variants = args.strategies.split(","), args.profiles.split(",")
    if unknown := [v for v in variants if v not in PROFILES]:
        raise SystemExit(f"unknown profile variant(s) {', '.join(unknown)}: use {', '.join(PROFILES)}")
    print(f"# measured speedup: {' '.join(sys.argv[1:]) or 'defaults'}; {os.cpu_count()} cores, "
          f"runs left out when other processes used over {args.max_load:.2f} cores", flush=True)
    everything: dict[str, list[dict[str, Any]]] = {}
    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="adaptis-speedup-") as tmp:
        for name in args.workloads.split(","):
            manifest = Path(tmp) / f"{name}.yaml"
            manifest.write_text(yaml.safe_dump(workload(name)))
            if args.stability:
                lines += stability(name, manifest, variants=variants, strategies=strategies, times=args.stability,
                                   tmp=Path(tmp))
                continue
            problems = {}
            for variant in variants:  # YAML: what `adaptis profile` writes
                problems[variant] = Path(tmp) / f"{name}-{variant}-problem.yaml"
                profile(manifest, out=problems[variant], flags=PROFILES[variant])
            runs = distinct_plans(problems, strategies=strategies)
            rows = everything[name] = []
            for rep in range(args.reps):
                for (strategy, _key), predicted in runs.items():  # interleaved: each plan once a round
                    first = next(iter(predicted))
                    row = run_once(manifest, problem=problems[first], strategy=strategy, steps=args.steps,
                                   workdir=Path(tmp) / f"{name}-{strategy}")
                    shown = f"{1e3 * row['measured']:.0f} ms" if "measured" in row else row["error"]
                    print(f"{name} round {rep} {strategy:<9} {shown}  others {row['others_cores']:.2f} cores, "
                          f"load {row['load_before']:.2f}->{row['load_after']:.2f}  (plan of {', '.join(predicted)})",
                          flush=True)
                    for variant, seconds in predicted.items():  # the run stands for each variant's plan
                        rows.append(dict(row, round=rep, profile=variant,
                                         **({"predicted": seconds} if "measured" in row else {})))
            for variant in variants:
                title = name if len(variants) == 1 else f"{name}, profile {variant}"
                lines += report(title, figures([r for r in rows if r["profile"] == variant],
                                               max_load=args.max_load))
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(everything, indent=2))


def stability(name: str, manifest: Path, *, variants: list[str], strategies: list[str], times: int,
              tmp: Path) -> list[str]:
    """Each variant profiled ``times`` times, taking turns after a reference profile each round;
    per variant and strategy, the spread ((max - min) / min) of the predicted iteration, raw
    and divided by the round's reference (the sum of its layers' F and fused backward)."""
    from adaptis.api.problem import load_problem

    rows: list[tuple[str, float, dict[str, float]]] = []
    for i in range(times):
        ref_path = tmp / f"{name}-reference-{i}.yaml"
        profile(manifest, out=ref_path, flags=REFERENCE)
        reference = sum(lay.forward + (lay.backward_fused or lay.backward + lay.weight)
                        for lay in load_problem(ref_path).expanded_layers())
        for variant in variants:
            path = tmp / f"{name}-{variant}-{i}.yaml"
            profile(manifest, out=path, flags=PROFILES[variant])
            predicted = {s: next(iter(v.values())) for (s, _k), v in distinct_plans({variant: path},
                                                                                    strategies=strategies).items()}
            rows.append((variant, reference, predicted))
            print(f"{name} round {i} {variant:<10} reference {reference:.2f} ms, predicted "
                  + " ".join(f"{s} {1e3 * t:.0f} ms" for s, t in predicted.items())
                  + f", load {os.getloadavg()[0]:.2f}", flush=True)

    def spread(xs: list[float]) -> str:
        return f"{100 * (max(xs) - min(xs)) / min(xs):.1f} %"

    refs = [r for v, r, _p in rows if v == variants[0]]
    lines = [f"### {name}: {times} profiles of each variant", "",
             f"Reference (layers warm, alone, min): {min(refs):.2f}-{max(refs):.2f} ms, spread {spread(refs)}.", "",
             "| variant | strategy | predicted ms (min-max) | spread | spread / reference |", "|---|---|---|---|---|"]
    for variant in variants:
        mine = [(r, p) for v, r, p in rows if v == variant]
        for s in strategies:
            ms = [1e3 * p[s] for _r, p in mine]
            lines.append(f"| {variant} | {s} | {min(ms):.0f}-{max(ms):.0f} | {spread(ms)} | "
                         f"{spread([m / r for m, (r, _p) in zip(ms, mine, strict=True)])} |")
    return [*lines, ""]


def distinct_plans(problems: dict[str, Path], *, strategies: list[str]) -> dict[tuple[str, str], dict[str, float]]:
    """(strategy, plan) -> {variant: predicted iteration seconds} over the variants' problems:
    the plans ``adaptis run`` will make (the same planner calls), so that a plan two variants
    share runs once a round."""
    from adaptis.api.problem import TIME_UNIT_SECONDS, load_problem
    from adaptis.planner.strategies import plan_strategy

    runs: dict[tuple[str, str], dict[str, float]] = {}
    for strategy in strategies:
        for variant, path in problems.items():
            problem = load_problem(path)
            outcome = plan_strategy(problem, strategy)
            if outcome.plan is None or outcome.simulation is None:
                raise SystemExit(f"{strategy} has no plan on the {variant} profile")
            key = outcome.plan.model_dump_json(include={"stages", "placement", "actions", "recompute"})
            seconds = outcome.simulation.iteration_time * TIME_UNIT_SECONDS[problem.time_unit]
            runs.setdefault((strategy, key), {})[variant] = seconds
    return runs


if __name__ == "__main__":
    main()
