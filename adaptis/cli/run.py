"""``adaptis run JOB.yaml``: train an AdaPtisJob manifest locally (the embedded default).

Takes the manifest a user would apply to a cluster, builds the planning problem (a profile
file with ``--problem``, else a quick profile of this machine, or the analytic estimate),
plans with the job's strategy, launches one local process per worker, shows progress (step,
loss, tokens/s, measured vs predicted bubble ratio) and a final summary (``--json``: the
summary as one JSON document, nothing else on stdout). Ctrl-C stops every rank; a crashed
rank stops the others and the error names it. Checkpoints are never lost silently: a rerun
resumes from ``<workdir>/checkpoints`` when they fit the job (same model spec), refuses those
that do not, and only ``--fresh`` deletes them (``--resume``: fail when there is nothing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from adaptis.api.job import AdaPtisJob, ModelSpec, WorkerConfig, load_job
from adaptis.api.plan import STRATEGY_NAMES, Plan
from adaptis.api.problem import TIME_UNIT_SECONDS, Problem, load_problem
from adaptis.api.rules import check_job


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser("run", help="train an AdaPtisJob manifest locally",
                              description=__doc__.splitlines()[0])
    p.add_argument("manifest", help="AdaPtisJob YAML/JSON (e.g. examples/tiny-heterogeneous.yaml)")
    p.add_argument("--json", action="store_true", help="print only the final summary, as JSON")
    p.add_argument("--strategy", choices=STRATEGY_NAMES, help="override spec.planner.strategy")
    p.add_argument("--workers", type=int, help="override spec.parallelism.workers")
    p.add_argument("--steps", type=int, help="override spec.training.steps")
    p.add_argument("--problem", help="planning problem (profile) file instead of profiling here")
    p.add_argument("--profile", choices=("measure", "estimate"),
                   help="how to get layer costs without --problem (default: spec.planner.profile)")
    p.add_argument("--workdir", help="logs, worker.json and checkpoints (default .adaptis/<job>)")
    p.add_argument("--checkpoint-every", type=int, help="override spec.checkpoint.everySteps")
    again = p.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true",
                       help="insist on resuming: fail if the workdir has no checkpoint of this job "
                            "(without either flag a run resumes when it can, else starts fresh)")
    again.add_argument("--fresh", action="store_true",
                       help="delete the workdir's checkpoints and start over (the only thing that "
                            "deletes them)")
    p.add_argument("--metrics-port", type=int,
                   help="first rank's metrics port (rank r: +r); default: spec.metrics.port, 0: off")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--dry-run", action="store_true",
                   help="plan the job's pipeline ranks (estimate unless --problem or --profile "
                        "measure) and print the plan; start nothing (adaptis.cli.dry_run)")
    p.add_argument("--timeline", metavar="OUT.png|OUT.svg", type=Path,
                   help="with --dry-run: draw the plan's timeline")
    p.set_defaults(func=run)


def _problem(args: argparse.Namespace, job: AdaPtisJob, *, workers: int) -> Problem:
    from adaptis.worker.problem import estimate_problem, measure_problem

    from adaptis.cli import CLIError
    from adaptis.api.rules import layer_count

    if args.problem:
        problem = load_problem(args.problem)
        want, got = layer_count(job.spec.model), len(problem.expanded_layers())
        if want != got:
            raise CLIError(f"{args.problem} profiles {got} layers; the job's model has {want} "
                           f"(embedding, {want - 2} blocks, head)")
        if problem.device_count != workers:
            raise CLIError(f"{args.problem} describes {problem.device_count} devices; the run has "
                           f"{workers} workers (set --workers or spec.parallelism.workers)")
        doc = problem.model_dump(mode="json", exclude_none=True)
        return Problem.model_validate({**doc, "microbatches": job.spec.training.microbatches})
    if (args.profile or job.spec.planner.profile) == "estimate":
        return estimate_problem(job.spec, devices=workers)
    from adaptis.worker.hardware import configure_host

    configure_host(threads=args.threads)  # profile as the ranks will run
    return measure_problem(job.spec, devices=workers)


def _plan(problem: Problem, strategy: str, *, time_limit_s: float | None = None) -> Plan:
    from adaptis.cli import CLIError
    from adaptis.planner.strategies import plan_strategy

    # The spec's planner.timeLimitSeconds, as the operator plans it.
    outcome = plan_strategy(problem, strategy, time_limit_s=time_limit_s)
    if outcome.result.cut_short:
        print(f"adaptis run: planning cut short by spec.planner.timeLimitSeconds: "
              f"{outcome.result.cut_short}", file=sys.stderr)
    if outcome.plan is None:
        raise CLIError(f"strategy {strategy} has no feasible plan: {outcome.result.reason}")
    return outcome.plan


def _say(args: argparse.Namespace, text: str) -> None:
    print(text, file=sys.stderr if args.json else sys.stdout, flush=True)


def run(args: argparse.Namespace) -> int:
    from adaptis.cli import CLIError
    from adaptis.worker.errors import RankFailedError
    from adaptis.worker.launcher import LocalLauncher

    job = load_job(args.manifest)
    spec = job.spec
    workers = args.workers or spec.parallelism.workers
    training = spec.training
    if args.steps:
        training = training.model_copy(update={"steps": args.steps})
    strategy = args.strategy or spec.planner.strategy
    workdir = Path(args.workdir or Path(".adaptis") / job.metadata.name)
    ckpt_every = spec.checkpoint.every_steps if args.checkpoint_every is None else args.checkpoint_every
    # The cluster's rules (adaptis.api.rules), on the spec as the flags change it, before any
    # checkpoint is cleared, profile taken or rank started; a SpecError exits 2 naming the field.
    check_job(name=job.metadata.name, spec=spec.model_copy(update={
        "parallelism": spec.parallelism.model_copy(update={"workers": workers}),
        "training": training, "planner": spec.planner.model_copy(update={"strategy": strategy}),
        "checkpoint": spec.checkpoint.model_copy(update={"every_steps": ckpt_every})}))
    if args.dry_run:
        from adaptis.cli.dry_run import dry_run

        return dry_run(args, job, strategy=strategy)
    ckpt_dir = workdir / "checkpoints"
    resume_from = _checkpoints(args, ckpt_dir, model=spec.model, workers=workers)
    if resume_from is not None and resume_from >= training.steps:
        # Nothing left to train: say so at once rather than profile, plan and start ranks.
        _say(args, f"the checkpoint of step {resume_from} in {ckpt_dir} already completes the "
                   f"{training.steps} steps: nothing to train; raise --steps to train on, or --fresh "
                   "to train again")
        if args.json:
            print(json.dumps({"job": job.metadata.name, "steps": resume_from, "trained_steps": 0,
                              "workdir": str(workdir), "checkpoint_dir": str(ckpt_dir),
                              "resumed_from_step": resume_from}, indent=2))
        return 0
    if resume_from is not None:
        _say(args, f"resuming from the checkpoint of step {resume_from} in {ckpt_dir} (--fresh to start over)")

    t0 = time.perf_counter()
    problem = _problem(args, job, workers=workers)
    plan = _plan(problem, strategy, time_limit_s=float(spec.planner.time_limit_seconds))
    pred = plan.predicted
    pred_bubble = pred.bubble_ratio if pred else None
    pred_iter = pred.iteration_time * TIME_UNIT_SECONDS[pred.time_unit] if pred else None
    _say(args, f"planned {strategy}: {len(plan.stages)} stages on {workers} workers, placement "
               f"{plan.placement}; predicted iteration {_fmt(pred_iter, 's')}, bubble {_pct(pred_bubble)} "
               f"({time.perf_counter() - t0:.1f} s to profile and plan)")
    port = spec.metrics.port if args.metrics_port is None else args.metrics_port
    # The directory goes to the ranks even when this run saves none: they resume from it.
    config = WorkerConfig(
        job_name=job.metadata.name, model=spec.model, training=training,
        plan=plan.model_dump(mode="json", exclude_none=True),
        metrics_port=None if port == 0 else port, checkpoint_dir=str(ckpt_dir.resolve()),
        checkpoint_every=ckpt_every,
    )
    steps: list[dict[str, Any]] = []
    starts: dict[int, dict[str, Any]] = {}

    def on_event(event: dict[str, Any]) -> None:
        if event["event"] == "start":
            starts[event["rank"]] = event
        elif event["event"] == "step" and event["rank"] == 0:
            steps.append(event)
            _say(args, f"step {event['step']:>4}/{training.steps}  loss {event['loss']:.4f}  "
                       f"{event['tokens_per_second']:>8.0f} tokens/s  bubble {_pct(event['bubble_ratio'])} "
                       f"(predicted {_pct(pred_bubble)})")

    # Local ranks share one host: rank r serves metrics on port + r (pods all use the port).
    launcher = LocalLauncher(config, world_size=workers, workdir=workdir, threads=args.threads,
                             metrics_base=None if port == 0 else port,
                             device=_device(spec.parallelism.gpus_per_worker, workers=workers))
    started = time.perf_counter()
    try:
        launcher.run(on_event)
    except RankFailedError as err:
        raise CLIError(str(err)) from None
    except KeyboardInterrupt:
        print("adaptis run: interrupted; all ranks stopped", file=sys.stderr)
        return 130
    summary = _summary(job.metadata.name, strategy=strategy, plan=plan, workers=workers, steps=steps,
                       pred=(pred_bubble, pred_iter), seconds=time.perf_counter() - started,
                       workdir=workdir, ports=[starts[r].get("metrics_port") for r in sorted(starts)],
                       checkpoints=(ckpt_dir, ckpt_every, starts[0]["resumed_step"] if 0 in starts else 0))
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        _print_summary(summary)
    return 0


def _checkpoints(args: argparse.Namespace, ckpt_dir: Path, *, model: ModelSpec, workers: int) -> int | None:
    """Fresh or resumed, decided before anything runs; the step to resume from (None: fresh).

    Rerunning after Ctrl-C must not lose the training: a run resumes by default when the
    checkpoints fit this job (same model spec, a file of every rank; see scan_checkpoints),
    refuses rather than deletes those that do not, and only ``--fresh`` deletes (and says so).
    """
    from adaptis.cli import CLIError
    from adaptis.worker.checkpoint import clear_checkpoints, scan_checkpoints

    if args.fresh:
        gone = clear_checkpoints(ckpt_dir)
        what = (f"removed {gone.files} checkpoint files (steps {_steps(gone.steps)}) from {ckpt_dir}"
                if gone.files else f"no checkpoints in {ckpt_dir} to remove")
        print(f"adaptis run: --fresh: {what}; starting fresh", file=sys.stderr, flush=True)
        return None
    scan = scan_checkpoints(ckpt_dir, model=model, workers=workers)
    if scan.incompatible:
        raise CLIError(f"{ckpt_dir} holds checkpoints (steps {_steps(scan.steps)}) this job cannot resume: "
                       f"{scan.incompatible}. Nothing was deleted: run with --fresh to delete them and "
                       f"start over, or choose another --workdir")
    if scan.resume_step is None and args.resume:
        raise CLIError(f"--resume: no checkpoint in {ckpt_dir}; run without --resume to start fresh")
    return scan.resume_step


def _steps(steps: tuple[int, ...]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 4 else f"{steps[0]}-{steps[-1]}"


def _device(gpus_per_worker: int, *, workers: int) -> str:
    """GPUs only when the job asks for them and every local rank gets its own (NCCL)."""
    if gpus_per_worker == 0:
        return "cpu"
    import torch

    return "cuda" if torch.cuda.device_count() >= workers else "cpu"


def _summary(name: str, *, strategy: str, plan: Plan, workers: int, steps: list[dict[str, Any]],
             pred: tuple[float | None, float | None], seconds: float, workdir: Path,
             ports: list[Any], checkpoints: tuple[Path, int, int]) -> dict[str, Any]:
    steady = steps[1:] or steps  # the first step pays one-off costs (allocator, threads)
    return {
        "job": name, "strategy": strategy, "workers": workers,
        "stages": len(plan.stages), "placement": plan.placement,
        "steps": steps[-1]["step"] if steps else 0,
        "first_loss": steps[0]["loss"] if steps else None,
        "final_loss": steps[-1]["loss"] if steps else None,
        "tokens_per_second": statistics.mean(s["tokens_per_second"] for s in steady) if steady else None,
        "measured_bubble_ratio": statistics.mean(s["bubble_ratio"] for s in steady) if steady else None,
        "predicted_bubble_ratio": pred[0],
        "measured_iteration_seconds": statistics.mean(s["iteration_seconds"] for s in steady) if steady else None,
        "predicted_iteration_seconds": pred[1],
        "train_seconds": seconds,
        "metrics_ports": ports,
        "workdir": str(workdir),
        "checkpoint_dir": str(checkpoints[0]),
        "checkpoint_every": checkpoints[1],
        "resumed_from_step": checkpoints[2] or None,  # None: started fresh
    }


def _print_summary(s: dict[str, Any]) -> None:
    print(f"done: {s['steps']} steps of {s['job']} with {s['strategy']} on {s['workers']} workers "
          f"in {s['train_seconds']:.1f} s")
    print(f"  loss            {s['first_loss']:.4f} -> {s['final_loss']:.4f}" if s["steps"] else "  no steps run")
    print(f"  tokens/s        {s['tokens_per_second'] or 0:.0f}")
    print(f"  bubble ratio    measured {_pct(s['measured_bubble_ratio'])}, predicted {_pct(s['predicted_bubble_ratio'])}")
    print(f"  iteration       measured {_fmt(s['measured_iteration_seconds'], 's')}, "
          f"predicted {_fmt(s['predicted_iteration_seconds'], 's')}")
    print(f"  logs            {s['workdir']}/rank-*.log")
    every = f"every {s['checkpoint_every']} steps" if s["checkpoint_every"] else "none saved (--checkpoint-every 0)"
    began = "started fresh" if s["resumed_from_step"] is None else f"resumed from step {s['resumed_from_step']}"
    print(f"  checkpoints     {s['checkpoint_dir']} ({every}); {began}")


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _fmt(x: float | None, unit: str) -> str:
    if x is None:
        return "n/a"
    return f"{x * 1e3:.1f} m{unit}" if abs(x) < 1 else f"{x:.3f} {unit}"
