"""``adaptis run JOB.yaml --dry-run``: plan the job as it would run, and start nothing.

Sits beside :mod:`adaptis.cli.run`, which calls :func:`dry_run` after the job's rules passed.
It plans one pipeline replica over the job's pipeline ranks (``workers x max(1, gpusPerWorker)
/ dataParallel``, what the operator plans), from the analytic estimate unless ``--problem`` or
``--profile measure`` says otherwise: a manifest for a GPU cluster (an 8B Llama on 16 GPUs) is
planned on a laptop without measuring a layer there. It prints the stages with the layers and
layer kinds each holds, the placement and the predicted iteration time and bubble, and with
``--timeline`` draws the plan's timeline.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from adaptis.api.job import AdaPtisJob
from adaptis.api.plan import predicted_seconds
from adaptis.api.problem import Problem

__all__ = ["dry_run"]


def _problem(args: argparse.Namespace, job: AdaPtisJob, *, devices: int) -> Problem:
    from adaptis.cli.run_problem import local_problem

    if args.problem or args.profile == "measure":
        return local_problem(args, job, workers=devices)
    from adaptis.worker.profiling.job_problem import estimate_problem

    return estimate_problem(job.spec, devices=devices)


def dry_run(args: argparse.Namespace, job: AdaPtisJob, *, strategy: str) -> int:
    """Plan and report; 0 when the strategy found a plan, else a CLIError."""
    from adaptis.cli import CLIError
    from adaptis.planner.strategies import plan_strategy

    spec = job.spec
    devices = spec.parallelism.pipeline_ranks
    t0 = time.perf_counter()
    problem = _problem(args, job, devices=devices)
    outcome = plan_strategy(problem, strategy,
                            time_limit_s=float(spec.planner.time_limit_seconds))
    if outcome.plan is None:
        raise CLIError(f"strategy {strategy} has no feasible plan: {outcome.result.reason}")
    plan, seconds = outcome.plan, time.perf_counter() - t0
    layers = problem.expanded_layers()
    pred = predicted_seconds(plan.predicted)
    stages: list[dict[str, Any]] = []
    owner = plan.stage_device()
    for s, (lo, hi) in enumerate(plan.stages):
        kinds = Counter(layer.kind or "layer" for layer in layers[lo:hi])
        stages.append({"stage": s, "device": owner[s], "layers": [lo, hi],
                       "kinds": dict(sorted(kinds.items()))})
    summary = {
        "job": job.metadata.name, "strategy": strategy, "devices": devices,
        "data_parallel": spec.parallelism.data_parallel, "layers": len(layers),
        "microbatches": problem.microbatches, "stages": stages,
        "placement": [list(p) for p in plan.placement],
        "predicted_iteration_seconds": pred["iteration_seconds"],
        "predicted_bubble_ratio": pred["bubble_ratio"],
        "planning_seconds": seconds, "problem": problem.name,
    }
    if args.timeline is not None:
        _timeline(args.timeline, outcome=outcome, problem=problem,
                  title=f"{job.metadata.name}: {strategy} on {devices} devices")
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    out = sys.stdout
    out.write(f"dry run: {job.metadata.name} ({problem.name}), {len(layers)} layers, "
              f"{problem.microbatches} microbatches, planned {strategy} on {devices} pipeline "
              f"ranks x {spec.parallelism.data_parallel} replicas in {seconds:.1f} s\n")
    for st in stages:
        kinds = ", ".join(f"{k} x{n}" for k, n in st["kinds"].items())
        out.write(f"  stage {st['stage']:>3} on device {st['device']:>3}: layers "
                  f"[{st['layers'][0]}, {st['layers'][1]})  {kinds}\n")
    if pred["iteration_seconds"] is not None:
        out.write(f"predicted iteration {pred['iteration_seconds']:.4g} s, bubble "
                  f"{pred['bubble_ratio']:.1%}; nothing was started\n")
    return 0


def _timeline(path: Path, *, outcome: Any, problem: Problem, title: str) -> None:
    from adaptis.cli import CLIError
    from adaptis.planner.errors import PlannerError
    from adaptis.planner.timeline import draw_timeline

    try:
        draw_timeline(outcome.simulation, path=path, title=title, time_unit=problem.time_unit,
                      plan=outcome.plan, problem=problem)
    except PlannerError as err:
        raise CLIError(str(err)) from None
    except OSError as err:
        raise CLIError(f"--timeline: cannot write {path}: {err.strerror}") from None
