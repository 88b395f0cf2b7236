"""``adaptis run JOB.yaml``: train an AdaPtisJob manifest locally (the embedded default).

Takes the manifest a user would apply to a cluster, builds the planning problem (a profile
file with ``--problem``, else a quick profile of this machine, or the analytic estimate),
plans with the job's strategy, launches one local process per rank (workers x max(1,
gpusPerWorker); with ``dataParallel`` R the plan covers one pipeline replica of ranks / R
devices and the R replicas train on shards of the batch), shows progress (step,
loss, tokens/s, measured vs predicted bubble ratio) and a final summary (``--json``: the
summary as one JSON document, nothing else on stdout). Ctrl-C stops every rank; a crashed
rank stops the others and the error names it. Checkpoints are never lost silently: a rerun
resumes from ``<workdir>/checkpoints`` when they fit the job (same model spec), refuses those
that do not, and only ``--fresh`` deletes them (``--resume``: fail when there is nothing).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from adaptis.api.events import StepEvent
from adaptis.api.job import AdaPtisJob, JobSpec, Model, WorkerConfig, load_job, resolve_precision
from adaptis.api.plan import STRATEGY_NAMES, Plan, predicted_seconds
from adaptis.api.problem import (
    DeviceList,
    IdenticalDevices,
    Link,
    Problem,
)
from adaptis.api.rules import check_job
from adaptis.cli.adapt import Trained, check_slowdown, train
from adaptis.cli.run_problem import local_problem
from adaptis.cli.run_summary import fmt, pct, print_summary, summary


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
    p.add_argument("--adaptation", choices=("off", "suggest", "auto"),
                   help="override spec.adaptation.policy: re-plan on measured drift (docs/adaptation.md)")
    p.add_argument("--trace", metavar="DIR", type=Path,
                   help="CPU: write each rank's timed actions of the last step to DIR and report them "
                        "beside the prediction: busy, gaps, message latency (DIR/trace.json; "
                        "docs/profiling.md)")
    p.add_argument("--slowdown", metavar="RANK:FACTOR@STEP[,...]",
                   help="testing knob: rank RANK computes FACTOR times slower from step STEP on "
                        "(ADAPTIS_SLOWDOWN; adaptis.worker.runtime.slowdown)")
    p.add_argument("--dry-run", action="store_true",
                   help="plan the job's pipeline ranks (estimate unless --problem or --profile "
                        "measure) and print the plan; start nothing (adaptis.cli.dry_run)")
    p.add_argument("--timeline", metavar="OUT.png|OUT.svg", type=Path,
                   help="with --dry-run: draw the plan's timeline")
    p.set_defaults(func=run)


#: Gloo between local processes over loopback, as bench/accuracy.py measured it on a 2-core
#: host (6.14 GB/s, 43 us): the replicas' all-reduce link of a local run unless the problem
#: file gives one.
_LOCAL_LINK = Link(bandwidth_bytes_per_s=6.0e9, latency_s=43e-6)


def _local_mesh(problem: Problem, *, replicas: int, tensor: int) -> Problem:
    """The problem of R local replicas of T-rank tensor groups: the planner charges each
    stage's gradient all-reduce and the layers' tensor all-reduces over loopback (a problem
    file's own data_parallel, tensor_parallel and links stand)."""
    network, update = problem.network, {}
    if replicas > 1 and problem.data_parallel == 1:
        if network.data_parallel is None:
            network = network.model_copy(update={"data_parallel": _LOCAL_LINK})
        update["data_parallel"] = replicas
    if tensor > 1:
        if network.tensor is None:
            network = network.model_copy(update={"tensor": _LOCAL_LINK})
        update["tensor_parallel"] = problem.tensor_parallel if problem.tensor_parallel > 1 else tensor
    return problem.model_copy(update={**update, "network": network}) if update else problem


def _shared_cores(problem: Problem, *, threads: int, cores: int) -> Problem:
    """Local CPU ranks with more threads than the host has cores share them: each runs at
    cores / threads of the speed its layers were profiled at (one rank alone on a core)."""
    if threads <= cores:
        return problem
    share = cores / threads
    d = problem.devices
    if isinstance(d, IdenticalDevices):
        devices: IdenticalDevices | DeviceList = d.model_copy(update={"speed": d.speed * share})
    else:
        devices = DeviceList(list=[x.model_copy(update={"speed": x.speed * share}) for x in d.list])
    return problem.model_copy(update={"devices": devices})


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
    """Profile, plan, train on local ranks (re-planning as the adaptation policy says), report."""
    job = load_job(args.manifest)
    spec = _as_flagged(args, job)
    if args.dry_run:
        from adaptis.cli.dry_run import dry_run

        return dry_run(args, job, strategy=spec.planner.strategy)
    _prepare_data(spec)
    workdir = Path(args.workdir or Path(".adaptis") / job.metadata.name)
    ckpt_dir = workdir / "checkpoints"
    # Checkpoints are keyed by parameter name: any plan, rank count, R or ZeRO stage resumes them.
    resume_from = _checkpoints(args, ckpt_dir, model=spec.model)
    if resume_from is not None and resume_from >= spec.training.steps:
        return _nothing_left(args, job.metadata.name, step=resume_from, steps=spec.training.steps,
                             workdir=workdir)
    if resume_from is not None:
        _say(args, f"resuming from the checkpoint of step {resume_from} in {ckpt_dir} (--fresh to start over)")
    device, problem, plan = _plan_here(args, job, spec=spec)
    started = time.perf_counter()
    done = _train(args, job.metadata.name, spec=spec, device=device, problem=problem, plan=plan, workdir=workdir)
    if isinstance(done, int):
        return done
    par = spec.parallelism
    starts = done.starts
    result = summary(job.metadata.name, strategy=spec.planner.strategy, plan=done.plan, workers=par.workers,
                     steps=done.steps, mesh=(par.data_parallel, par.pipeline_ranks, _zero(spec)),
                     reduce=done.reduce, seconds=time.perf_counter() - started, workdir=workdir,
                     ports=[starts[r].metrics_port for r in sorted(starts)],
                     checkpoints=(ckpt_dir, spec.checkpoint.every_steps,
                                  starts[0].resumed_step if 0 in starts else 0))
    result["adaptation"] = done.adaptation
    report = _trace(args.trace, plan=done.plan, problem=done.problem, ranks=par.pipeline_ranks) if args.trace else None
    if report is not None:
        result["trace"] = str(args.trace / "trace.json")
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_summary(result)
        if report is not None:
            from adaptis.cli.trace_report import print_trace

            print_trace(report, directory=args.trace)
    return 0


def _as_flagged(args: argparse.Namespace, job: AdaPtisJob) -> JobSpec:
    """The job's spec as the flags change it (workers, steps, strategy, checkpoints), checked by
    the cluster's rules (adaptis.api.rules) before any checkpoint is cleared, profile taken or
    rank started: a SpecError exits 2 naming the field."""
    spec = job.spec
    update: dict[str, Any] = {
        "parallelism": spec.parallelism.model_copy(update={"workers": args.workers or spec.parallelism.workers}),
        "planner": spec.planner.model_copy(update={"strategy": args.strategy or spec.planner.strategy}),
    }
    if args.steps:
        update["training"] = spec.training.model_copy(update={"steps": args.steps})
    if args.checkpoint_every is not None:
        update["checkpoint"] = spec.checkpoint.model_copy(update={"every_steps": args.checkpoint_every})
    spec = spec.model_copy(update=update)
    check_job(name=job.metadata.name, spec=spec)
    check_slowdown(args.slowdown, ranks=spec.parallelism.ranks)
    return spec


def _zero(spec: JobSpec) -> int:
    return spec.parallelism.zero_stage if spec.parallelism.data_parallel > 1 else 0


def _prepare_data(spec: JobSpec) -> None:
    """Text data is tokenized here, once: bad data exits 2 before any rank starts."""
    if spec.training.data.source != "text":
        return
    from adaptis.cli import CLIError
    from adaptis.worker.data.sources import prepare_text
    from adaptis.worker.errors import DataError

    try:
        prepare_text(spec.training, model=spec.model)
    except DataError as err:
        raise CLIError(str(err)) from None


def _nothing_left(args: argparse.Namespace, name: str, *, step: int, steps: int, workdir: Path) -> int:
    """The checkpoint already completes the steps: say so at once rather than profile, plan and
    start ranks."""
    ckpt_dir = workdir / "checkpoints"
    _say(args, f"the checkpoint of step {step} in {ckpt_dir} already completes the {steps} steps: nothing "
               "to train; raise --steps to train on, or --fresh to train again")
    if args.json:
        print(json.dumps({"job": name, "steps": step, "trained_steps": 0, "workdir": str(workdir),
                          "checkpoint_dir": str(ckpt_dir), "resumed_from_step": step}, indent=2))
    return 0


def _plan_here(args: argparse.Namespace, job: AdaPtisJob, *, spec: JobSpec) -> tuple[str, Problem, Plan]:
    """The ranks' device, the problem (profiled here, estimated or given) and its plan; the
    mesh is R replicas of a P-rank pipeline, and the plan is made for P devices."""
    t0 = time.perf_counter()
    par = spec.parallelism
    device = _device(par.gpus_per_worker, workers=par.ranks)
    # The precision the ranks will run: profiled in, and recorded in the plan (they check it).
    precision = resolve_precision(spec.training.precision, cuda=device == "cuda")
    problem = _local_mesh(local_problem(args, job, workers=par.pipeline_ranks, precision=precision),
                          replicas=par.data_parallel, tensor=par.tensor_parallel)
    if device == "cpu":
        from adaptis.worker.profiling.contention import usable_cores

        # The cores this process may use (affinity, a pod's CPU limit), which the ranks inherit.
        problem = _shared_cores(problem, threads=par.ranks * args.threads, cores=usable_cores())
    strategy = spec.planner.strategy
    plan = _plan(problem, strategy, time_limit_s=float(spec.planner.time_limit_seconds))
    plan = plan.model_copy(update={"precision": precision})
    pred = predicted_seconds(plan.predicted)
    mesh = f" x {par.data_parallel} data-parallel replicas" if par.data_parallel > 1 else ""
    mesh += f", each rank a tensor group of {par.tensor_parallel}" if par.tensor_parallel > 1 else ""
    mesh += f" ({par.ranks} ranks)" if mesh else ""
    _say(args, f"planned {strategy} ({precision}): {len(plan.stages)} stages on {par.pipeline_ranks} ranks{mesh}, "
               f"placement {plan.placement}; predicted iteration {fmt(pred['iteration_seconds'], 's')}, "
               f"bubble {pct(pred['bubble_ratio'])} ({time.perf_counter() - t0:.1f} s to profile and plan)")
    return device, problem, plan


def _train(args: argparse.Namespace, name: str, *, spec: JobSpec, device: str, problem: Problem, plan: Plan,
           workdir: Path) -> Trained | int:
    """The ranks' run, through the closed loop (adaptis.cli.adapt: one launch, or one per
    re-plan); an exit code when the run stopped early (preempted, interrupted)."""
    from adaptis.cli import CLIError
    from adaptis.worker.errors import PreemptedError, RankFailedError
    from adaptis.worker.run.launcher import LocalLauncher
    from adaptis.worker.run.preemption import EXIT_PREEMPTED
    from adaptis.worker.runtime.slowdown import ENV
    from adaptis.worker.runtime.trace import ENV as TRACE_ENV

    par, training = spec.parallelism, spec.training
    port = spec.metrics.port if args.metrics_port is None else args.metrics_port
    # The directory goes to the ranks even when this run saves none: they resume from it.
    config = WorkerConfig(
        job_name=name, model=spec.model, training=training,
        plan=plan.model_dump(mode="json", exclude_none=True),
        metrics_port=None if port == 0 else port, checkpoint_dir=str((workdir / "checkpoints").resolve()),
        checkpoint_every=spec.checkpoint.every_steps, data_parallel=par.data_parallel, zero_stage=_zero(spec),
        tensor_parallel=par.tensor_parallel, sequence_parallel=par.sequence_parallel,
    )
    env = {ENV: args.slowdown} if args.slowdown else {}
    if args.trace is not None:
        env[TRACE_ENV] = str(args.trace.resolve())

    def on_step(event: StepEvent) -> None:
        _say(args, f"step {event.step:>4}/{training.steps}  loss {event.loss:.4f}  "
                   f"{event.tokens_per_second:>8.0f} tokens/s  bubble {pct(event.bubble_ratio)} "
                   f"(predicted {pct(event.predicted_bubble_ratio)})")

    def launcher(cfg: WorkerConfig) -> LocalLauncher:
        # Local ranks share one host: rank r serves metrics on port + r (pods all use the port).
        return LocalLauncher(cfg, world_size=par.ranks, workdir=workdir, threads=args.threads,
                             metrics_base=None if port == 0 else port, device=device, env=env or None)

    adaptation = spec.adaptation
    if args.adaptation:
        adaptation = adaptation.model_copy(update={"policy": args.adaptation})
    try:
        return train(config=config, problem=problem, plan=plan, spec=adaptation, strategy=spec.planner.strategy,
                     ranks=par.ranks, replicas=par.data_parallel,
                     time_limit_s=float(spec.planner.time_limit_seconds),
                     launcher=launcher, on_step=on_step, say=lambda text: _say(args, text))
    except RankFailedError as err:
        raise CLIError(str(err)) from None
    except PreemptedError as err:  # a rank got SIGTERM: all checkpointed one step and stopped
        print(f"adaptis run: {err}", file=sys.stderr)
        return EXIT_PREEMPTED
    except KeyboardInterrupt:
        print("adaptis run: interrupted; all ranks stopped", file=sys.stderr)
        return 130


def _trace(directory: Path, *, plan: Plan, problem: Problem, ranks: int) -> dict[str, Any] | None:
    from adaptis.cli.trace_report import TraceMismatch, trace_report

    try:
        return trace_report(directory, plan=plan, problem=problem, ranks=ranks)
    except (OSError, TraceMismatch, ValueError) as err:  # the run itself succeeded: say, do not fail
        print(f"adaptis run: --trace: no report ({err})", file=sys.stderr)
        return None


def _checkpoints(args: argparse.Namespace, ckpt_dir: Path, *, model: Model) -> int | None:
    """Fresh or resumed, decided before anything runs; the step to resume from (None: fresh).

    Rerunning after Ctrl-C must not lose the training: a run resumes by default when the
    checkpoints fit this job (same model spec, under any plan; see scan_checkpoints),
    refuses rather than deletes those that do not, and only ``--fresh`` deletes (and says so).
    """
    from adaptis.cli import CLIError
    from adaptis.worker.state.checkpoint import clear_checkpoints, scan_checkpoints

    if args.fresh:
        gone = clear_checkpoints(ckpt_dir)
        what = (f"removed {gone.files} checkpoint files (steps {_steps(gone.steps)}) from {ckpt_dir}"
                if gone.files else f"no checkpoints in {ckpt_dir} to remove")
        print(f"adaptis run: --fresh: {what}; starting fresh", file=sys.stderr, flush=True)
        return None
    scan = scan_checkpoints(ckpt_dir, model=model)
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
