"""Accuracy of the performance model: profile -> plan -> run, predicted vs measured, on 2 ranks.

A figure, not a test. Two gloo ranks (one process per core, one torch thread each) do the
whole loop for each model family (small sizes that run on CPU):

1. the ranks take turns to profile the layers
   (:func:`adaptis.worker.profiling.profiler.profile_layers`; one at a time, so the profile does not
   compete with itself for the 2 cores) and measure their link
   (:func:`adaptis.worker.profiling.hardware.measure_links`), which goes into the problem's network;
2. rank 0 plans every strategy for 2 devices (:func:`adaptis.planner.strategies.plan_strategy`);
3. each rank builds one worker :class:`~adaptis.worker.runtime.executor.Executor` per plan, and the
   plans take turns, one training step each, for ``--rounds`` rounds, so slow drifts of a
   shared machine hit every plan alike; the layers are profiled again after every few rounds
   and the prediction uses the mean profile of the whole window (profiles, never the runs).

``--estimator min`` (the default) takes the minimum over the profiler's repeats and over the
steps of a plan: on a host shared with other work every disturbance only adds time, so the
minimum is the least disturbed figure on both sides; ``median`` is the usual statistic.

It prints predicted vs measured iteration time and bubble ratio per plan, the errors, their
mean and max, and whether the predicted ranking of strategies is the measured one. Columns:

- ``planner``: the project's simulator on the profiled problem, as ``adaptis profile`` writes
  it and ``adaptis plan`` scores it: torch's split B and W, the profiler's
  ``action_overhead_s``; the planner itself moves the first stage's B into its W.
- ``model+``: the simulator after :func:`executor_costs`: each action pays the runtime
  overhead fitted on the overhead probe instead of the profiler's (a model with next to no
  compute, run first: what its plans cost is the runtime's own cost per action;
  ``--families overhead``).
- ``replay`` (a diagnostic, not a prediction): the simulator with each rank's speed set from
  the run's own measured busy time; what is left is the schedule model's error alone.

    python bench/accuracy.py [--rounds 8] [--strategies 1f1b,zb-h1,i1f1b,balanced,adaptis] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from planner_bench import ACCURACY_HEADING  # bench/ is this script's directory

from adaptis.api.job import BlockSpec, JobSpec, ModelSpec, OptimizerSpec, ParallelismSpec, TrainingSpec, WorkerConfig
from adaptis.api.plan import Plan
from adaptis.api.problem import Link, Network
from adaptis.planner.costs import Costs
from adaptis.planner.simulator import simulate
from adaptis.planner.strategies import plan_strategy
from adaptis.worker.data.sources import SyntheticTokens
from adaptis.worker.profiling.hardware import configure_host, measure_links
from adaptis.worker.profiling.profiler import (
    LayerProfile,
    ProfileSettings,
    measure_action_overhead,
    measure_graph_visit,
    problem_from_profiles,
    profile_layers,
)
from adaptis.worker.run.launcher import free_port
from adaptis.worker.runtime.executor import Executor

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "bench" / "RESULTS-accuracy.md"
_ANALYSIS = "## Analysis"

FAMILIES: dict[str, JobSpec] = {
    # Nemotron-H-like: Mamba blocks with an attention block every third, a 16K head.
    "hybrid": JobSpec(
        model=ModelSpec(vocab_size=16384, hidden=96, heads=4, blocks=[
            BlockSpec(kind="mamba", count=2), BlockSpec(kind="attention"),
            BlockSpec(kind="mamba", count=2), BlockSpec(kind="attention"),
            BlockSpec(kind="mamba", count=2)]),
        training=TrainingSpec(microbatches=8, microbatch_size=2, sequence_length=128,
                              optimizer=OptimizerSpec(name="adamw", lr=1e-3)),
        parallelism=ParallelismSpec(workers=2, gpus_per_worker=0)),
    # DeepSeek-like: dense first, then MoE, a 16K head.
    "moe": JobSpec(
        model=ModelSpec(vocab_size=16384, hidden=96, heads=4, blocks=[
            BlockSpec(kind="dense", count=2), BlockSpec(kind="moe", count=6, experts=4, top_k=2)]),
        training=TrainingSpec(microbatches=8, microbatch_size=2, sequence_length=128,
                              optimizer=OptimizerSpec(name="adamw", lr=1e-3)),
        parallelism=ParallelismSpec(workers=2, gpus_per_worker=0)),
}
#: Not in the default run: compute next to nothing, so what a plan costs is the runtime's own
#: per-action and per-message overhead (``--families overhead``).
OVERHEAD_PROBE = JobSpec(
    model=ModelSpec(vocab_size=64, hidden=8, heads=2, blocks=[BlockSpec(kind="dense", count=6)]),
    training=TrainingSpec(microbatches=8, microbatch_size=1, sequence_length=4),
    parallelism=ParallelismSpec(workers=2, gpus_per_worker=0))


def family_spec(family: str, *, sequence: int | None) -> JobSpec:
    spec = OVERHEAD_PROBE if family == "overhead" else FAMILIES[family]
    if sequence is None:
        return spec
    return spec.model_copy(update={"training": spec.training.model_copy(update={"sequence_length": sequence})})


# --- the proposed model change (a wrapper here: planner files are not edited) -----------------
def executor_costs(costs: Costs, *, action_overhead: float | None) -> Costs:
    """Costs with the runtime's per-action overhead fitted on the probe (time unit of the
    costs) in place of the profiler's (None: keep the profiler's). Fused backwards need no
    change here: the problem carries the profiled ``backward_fused`` and the planner charges
    it to BW actions and to the first stage's W."""
    if action_overhead is None:
        return costs
    return dataclasses.replace(costs, overhead=action_overhead)


def fit_action_overhead(rows: list[dict[str, Any]]) -> float:
    """The per-action overhead (ms) that best explains the overhead probe's runs: the grid
    value with the least mean relative error of the model+ prediction."""
    best, best_err = 0.0, math.inf
    for step in range(0, 301):
        o = step * 0.01
        errs = [abs(simulate(executor_costs(r["costs"], action_overhead=o),
                             r["plan"]).iteration_time / r["meas_ms"] - 1) for r in rows]
        if statistics.fmean(errs) < best_err:
            best, best_err = o, statistics.fmean(errs)
    return best


def mean_profiles(runs: list[list[LayerProfile]]) -> list[LayerProfile]:
    """Layer by layer mean of several profiles (times; bytes are the same in every run)."""
    return [dataclasses.replace(
        first,
        forward_s=statistics.fmean(r[i].forward_s for r in runs),
        backward_s=statistics.fmean(r[i].backward_s for r in runs),
        weight_s=statistics.fmean(r[i].weight_s for r in runs),
        fused_backward_s=statistics.fmean(r[i].fused_backward_s for r in runs),
    ) for i, first in enumerate(runs[0])]


# --- one rank ----------------------------------------------------------------------------------
def _rank(rank: int, world: int, port: int, args: dict[str, Any], out: str) -> None:
    configure_host(threads=1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    settings = ProfileSettings(warmup=2, repeats=args["repeats"], estimator=args["estimator"])

    # (action overhead, graph visit) seconds of each profile pass, measured beside the layers
    runtime: list[tuple[float, float]] = []

    def profile_in_turn(spec: JobSpec) -> list[LayerProfile]:
        mine: list[LayerProfile] = []
        for turn in range(world):
            if turn == rank:
                mine = profile_layers(spec, settings=settings)
                runtime.append((measure_action_overhead(settings=settings),
                                measure_graph_visit(settings=settings, spec=spec)))
            dist.barrier()
        return mine

    links, _ = measure_links(device=torch.device("cpu"))
    link = links["intra_node"]
    network = Network(intra_node=Link(bandwidth_bytes_per_s=link.bandwidth_bytes_per_s, latency_s=link.latency_s))
    results: dict[str, Any] = {"link": dataclasses.asdict(link), "sequence": args["sequence"], "families": {}}
    for family in args["families"]:
        spec = family_spec(family, sequence=args["sequence"])
        profiles = [profile_in_turn(spec)]
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, profiles[0])
        first = mean_profiles(gathered)
        gathered_overhead: list[Any] = [None] * world
        dist.all_gather_object(gathered_overhead, runtime[-1])
        plans: list[Any] = [None]
        if rank == 0:
            problem = problem_from_profiles(first, name=family, microbatches=spec.training.microbatches,
                                            devices=world, memory_bytes=None, network=network,
                                            action_overhead_s=statistics.fmean(o for o, _v in gathered_overhead),
                                            graph_visit_s=statistics.fmean(v for _o, v in gathered_overhead))
            plans = [{name: (o.plan.model_dump(mode="json", exclude_none=True) if o.plan else None)
                      for name in args["strategies"] for o in [plan_strategy(problem, name)]}]
        dist.broadcast_object_list(plans, src=0)
        chosen = {k: Plan.model_validate(v) for k, v in plans[0].items() if v is not None}
        executors = {
            name: Executor(WorkerConfig(job_name="accuracy", model=spec.model, training=spec.training,
                                        plan=plan.model_dump(mode="json")),
                           rank=rank, world_size=world, device=torch.device("cpu"))
            for name, plan in chosen.items()}
        t = spec.training
        batch = SyntheticTokens(vocab_size=spec.model.vocab_size, sequence_length=t.sequence_length,
                                seed=0).batch(position=0, sequences=t.microbatches * t.microbatch_size)
        steps: dict[str, list[dict[str, Any]]] = {name: [] for name in executors}
        for rnd in range(args["rounds"] + 1):
            for name, ex in executors.items():
                st = ex.step(batch)
                if rnd:  # round 0 warms every plan up (allocator, threads, first messages)
                    steps[name].append({"iteration_s": st.iteration_seconds, "bubble": st.bubble_ratio,
                                        "busy_s": list(st.busy_seconds), "rank0_by_kind": st.busy_by_kind})
            if rnd and rnd % args["profile_every"] == 0:
                profiles.append(profile_in_turn(spec))
        gathered = [None] * world
        dist.all_gather_object(gathered, (profiles, runtime))
        if rank == 0:  # progress, in case a time budget stops the run before the report
            for name, got in steps.items():
                print(f"{family} {name}: measured step ms "
                      f"{sorted(round(x['iteration_s'] * 1e3) for x in got)}", flush=True)
        results["families"][family] = {
            "profiles": [p for per_rank, _r in gathered for p in per_rank],
            "action_overhead_s": statistics.fmean(o for _p, per_rank in gathered for o, _v in per_rank),
            "graph_visit_s": statistics.fmean(v for _p, per_rank in gathered for _o, v in per_rank),
            "plans": {k: v for k, v in plans[0].items() if v is not None},
            "steps": steps,
        }
        del executors
        runtime.clear()
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(_jsonable(results), fh)
    dist.destroy_process_group()


def _jsonable(x: Any) -> Any:
    if isinstance(x, LayerProfile):
        return {"__layer__": dataclasses.asdict(x)}
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    return x


def _layers(x: Any) -> Any:
    if isinstance(x, dict) and "__layer__" in x:
        return LayerProfile(**x["__layer__"])
    if isinstance(x, list):
        return [_layers(v) for v in x]
    return x


# --- the report --------------------------------------------------------------------------------
def evaluate(data: dict[str, Any], *, estimator: str, action_overhead_ms: float | None) -> list[dict[str, Any]]:
    link = data["link"]
    network = Network(intra_node=Link(**link))
    rows = []
    for family, fam in data["families"].items():
        spec = family_spec(family, sequence=data.get("sequence"))
        profile = mean_profiles(_layers(fam["profiles"]))
        problem = problem_from_profiles(profile, name=family, microbatches=spec.training.microbatches,
                                        devices=2, memory_bytes=None, network=network,
                                        action_overhead_s=fam.get("action_overhead_s", 0.0),
                                        graph_visit_s=fam.get("graph_visit_s", 0.0))
        costs = Costs.from_problem(problem)
        for name, plan_doc in fam["plans"].items():
            plan = Plan.model_validate(plan_doc)
            steps = fam["steps"][name]
            order = sorted(range(len(steps)), key=lambda i: steps[i]["iteration_s"])
            pick = order[0] if estimator == "min" else order[len(steps) // 2]  # that step's bubble and busy too
            meas_ms = steps[pick]["iteration_s"] * 1e3
            meas_bubble = steps[pick]["bubble"]
            meas_busy = [steps[pick]["busy_s"][d] * 1e3 for d in (0, 1)]
            sim = simulate(costs, plan)
            plus_costs = executor_costs(costs, action_overhead=action_overhead_ms)
            plus = simulate(plus_costs, plan)
            replay = simulate(dataclasses.replace(plus_costs, speed=tuple(
                plus.busy[d] / meas_busy[d] for d in (0, 1))), plan)
            spread = (max(s["iteration_s"] for s in steps) - min(s["iteration_s"] for s in steps)) * 1e3
            rows.append({"family": family, "strategy": name, "stages": len(plan.stages), "plan": plan, "costs": costs,
                         "profiled_overhead_ms": costs.overhead, "graph_visit_s": fam.get("graph_visit_s", 0.0),
                         "meas_ms": meas_ms, "meas_bubble": meas_bubble, "meas_busy": meas_busy,
                         "spread_ms": spread,
                         "planner_ms": sim.iteration_time, "planner_bubble": sim.bubble_ratio,
                         "plus_ms": plus.iteration_time, "plus_bubble": plus.bubble_ratio, "plus_busy": plus.busy,
                         "replay_ms": replay.iteration_time, "replay_bubble": replay.bubble_ratio})
    return rows


#: Two plans measured closer than this are a tie on this host (the same plan's best step moves
#: by more from run to run), so their order is not held against the model.
PAIR_GAP = 0.05


def ordered_pairs(rows: list[dict[str, Any]], *, key: str) -> tuple[int, int]:
    """(pairs the prediction orders as measured, pairs measured more than PAIR_GAP apart)."""
    agree = pairs = 0
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            if abs(a["meas_ms"] - b["meas_ms"]) <= PAIR_GAP * min(a["meas_ms"], b["meas_ms"]):
                continue
            pairs += 1
            agree += (a["meas_ms"] < b["meas_ms"]) == (a[key] < b[key])
    return agree, pairs


def _err(pred: float, meas: float) -> float:
    return (pred - meas) / meas


def format_report(rows: list[dict[str, Any]], *, link: dict[str, float], rounds: int, estimator: str,
                  seconds: float, sequence: int | None = None, overhead_ms: float = 0.0, load: str = "") -> str:
    seq = f" --sequence {sequence}" if sequence else ""
    profiled_us = ", ".join(dict.fromkeys(
        f"{r['family']} {r['profiled_overhead_ms'] * 1e3:.0f} us, graph walk {r['graph_visit_s'] * 1e9:.0f} ns a node"
        for r in rows))
    lines = [
        "# Accuracy of the performance model (CPU, 2 local gloo ranks, one torch thread each)",
        "",
        f"`python bench/accuracy.py --rounds {rounds} --estimator {estimator}{seq}` on {os.cpu_count()} CPU cores, "
        f"torch {torch.__version__}, {seconds:.0f} s{load}. Link measured between the 2 ranks: "
        f"{link['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s, {link['latency_s'] * 1e6:.0f} us latency. Measured: the "
        f"{estimator} step of {rounds} per plan, plans taking turns (spread: slowest - fastest step); predicted: "
        f"from the mean of the layer profiles ({estimator} of the repeats) taken by both ranks between rounds. "
        f"planner charges the profiler's action_overhead_s ({profiled_us}); model+ charges "
        f"{overhead_ms * 1e3:.0f} us per action (fitted on the overhead probe) and fused backwards at their "
        f"fused cost.",
        "",
        "| family | strategy | stages | measured ms (spread) | planner ms | err | model+ ms | err | replay err | "
        "measured bubble | planner | model+ | replay |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['family']} | {r['strategy']} | {r['stages']} | {r['meas_ms']:.1f} ({r['spread_ms']:.0f}) | "
            f"{r['planner_ms']:.1f} | {100 * _err(r['planner_ms'], r['meas_ms']):+.1f}% | {r['plus_ms']:.1f} | "
            f"{100 * _err(r['plus_ms'], r['meas_ms']):+.1f}% | {100 * _err(r['replay_ms'], r['meas_ms']):+.1f}% | "
            f"{100 * r['meas_bubble']:.1f}% | {100 * r['planner_bubble']:.1f}% | {100 * r['plus_bubble']:.1f}% | "
            f"{100 * r['replay_bubble']:.1f}% |")
    lines.append("")
    for label, key in (("planner", "planner"), ("model+", "plus"), ("replay", "replay")):
        errs = [abs(_err(r[f"{key}_ms"], r["meas_ms"])) for r in rows]
        bub = [abs(r[f"{key}_bubble"] - r["meas_bubble"]) for r in rows]
        lines.append(f"- {label}: iteration time error mean {100 * statistics.fmean(errs):.1f}%, max "
                     f"{100 * max(errs):.1f}%; bubble ratio error mean {100 * statistics.fmean(bub):.1f} points, "
                     f"max {100 * max(bub):.1f} points (targets: mean <= 5 %, max <= 10 %)")
    for family in dict.fromkeys(r["family"] for r in rows):
        fam = [r for r in rows if r["family"] == family]
        measured = sorted(fam, key=lambda r: r["meas_ms"])
        for label, key in (("planner", "planner_ms"), ("model+", "plus_ms")):
            predicted = sorted(fam, key=lambda r: r[key])
            same = [r["strategy"] for r in predicted] == [r["strategy"] for r in measured]
            agree, pairs = ordered_pairs(fam, key=key)
            lines.append(f"- {family}, {label} ranking {' < '.join(r['strategy'] for r in predicted)} "
                         f"{'matches' if same else 'differs from'} the measured "
                         f"{' < '.join(r['strategy'] for r in measured)}; pairs measured more than "
                         f"{PAIR_GAP:.0%} apart ordered as measured: {agree} of {pairs}")
    lines.append("- busy per rank, ms, measured vs model+: " + "; ".join(
        f"{r['family']}/{r['strategy']} {r['meas_busy'][0]:.0f}/{r['meas_busy'][1]:.0f} vs "
        f"{r['plus_busy'][0]:.0f}/{r['plus_busy'][1]:.0f}" for r in rows))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default=",".join(["overhead", *FAMILIES]),
                   help="comma-separated; overhead: the probe that measures the per-action overhead")
    p.add_argument("--strategies", default="1f1b,zb-h1,i1f1b,balanced,adaptis")
    p.add_argument("--rounds", type=int, default=8, help="steps per plan, plans taking turns")
    p.add_argument("--profile-every", type=int, default=2, help="profile again after this many rounds")
    p.add_argument("--repeats", type=int, default=5, help="profiler repeats per pass")
    p.add_argument("--estimator", choices=("min", "median"), default="min",
                   help="statistic of profiler repeats and of steps (default min: see above)")
    p.add_argument("--sequence", type=int, help="override the families' sequence length (default 128)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help="the report (default bench/RESULTS-accuracy.md, which also updates the accuracy "
                        "section of bench/RESULTS.md)")
    p.add_argument("--raw", type=Path, help="also keep the raw measurements (JSON) here")
    p.add_argument("--from-raw", type=Path, help="report on raw measurements kept earlier; run nothing")
    p.add_argument("--action-overhead-ms", type=float,
                   help="per-action overhead of model+ (default: fitted on the overhead probe's runs)")
    args = p.parse_args()
    started = time.time()
    load_start = os.getloadavg()[0]
    if args.from_raw:
        data = json.loads(args.from_raw.read_text())
    else:
        with tempfile.TemporaryDirectory() as work:
            raw = Path(work) / "raw.json"
            opts = {"families": args.families.split(","), "strategies": args.strategies.split(","),
                    "rounds": args.rounds, "profile_every": args.profile_every, "repeats": args.repeats,
                    "estimator": args.estimator, "sequence": args.sequence}
            mp.start_processes(_rank, args=(2, free_port(), opts, str(raw)), nprocs=2, start_method="spawn")
            data = json.loads(raw.read_text())
    if args.raw:
        args.raw.write_text(json.dumps(data))
    overhead = args.action_overhead_ms
    if overhead is None:
        probe = [r for r in evaluate(data, estimator=args.estimator, action_overhead_ms=None)
                 if r["family"] == "overhead"]
        overhead = fit_action_overhead(probe) if probe else 0.0
    rows = [r for r in evaluate(data, estimator=args.estimator, action_overhead_ms=overhead)
            if r["family"] != "overhead"]
    report = format_report(rows, link=data["link"], rounds=args.rounds, estimator=args.estimator,
                           seconds=time.time() - started, sequence=args.sequence, overhead_ms=overhead,
                           load="" if args.from_raw else
                           f", 1-min load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
    print(report)
    # A hand-written analysis below the table survives a rerun.
    kept = args.out.read_text().partition(_ANALYSIS)[2] if args.out.exists() else ""
    args.out.write_text(report + "\n" + (f"\n{_ANALYSIS}{kept}" if kept else ""))
    print(f"written to {args.out}")
    if args.out == DEFAULT_OUT and not args.from_raw:
        write_summary(REPO / "bench" / "RESULTS.md", report=report)


def write_summary(results: Path, *, report: str) -> None:
    """The accuracy section at the end of bench/RESULTS.md: this run's table and figures, and
    the pointer to the full report and its analysis (planner_bench.py keeps the section)."""
    body = report.split("\n", 2)[2]  # without the report's own title
    section = (f"{ACCURACY_HEADING} (issue 4)\n\nThe last `python bench/accuracy.py` run; the analysis (what "
               f"is off, why, and the runs before) is in `bench/RESULTS-accuracy.md`.\n\n{body}\n")
    text = results.read_text() if results.exists() else ""
    head, _, rest = text.partition(ACCURACY_HEADING)
    # Sections other scripts own follow this one (the mutation score, the shared-cluster
    # figures): keep every one of them.
    _, found, later = rest.partition("\n## ")
    tail = f"\n## {later}" if found else ""
    head = head.rstrip()
    results.write_text((head + "\n\n" if head else "") + section + tail)
    print(f"summary written to {results}")


if __name__ == "__main__":
    main()
