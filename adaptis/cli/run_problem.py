"""The planning problem of a local run: a problem file, an estimate, or a measurement here.

Sits under ``adaptis run`` (:mod:`adaptis.cli.run`) and its dry run (:mod:`adaptis.cli.dry_run`),
which both plan a job's pipeline ranks from what :func:`local_problem` returns: the
``--problem`` file (checked against the job's layers and ranks), else the analytic estimate
(``--profile estimate``, or the job's ``spec.planner.profile``), else each layer kind timed on
this host with the threads the ranks will have.
"""

from __future__ import annotations

import argparse

from adaptis.api.job import AdaPtisJob
from adaptis.api.problem import Problem, load_problem

__all__ = ["local_problem"]


def local_problem(args: argparse.Namespace, job: AdaPtisJob, *, workers: int, precision: str) -> Problem:
    from adaptis.api.rules import layer_count
    from adaptis.cli import CLIError
    from adaptis.worker.profiling.job_problem import estimate_problem, measure_problem

    if args.problem:
        problem = load_problem(args.problem)
        want, got = layer_count(job.spec.model), len(problem.expanded_layers())
        if want != got:
            raise CLIError(f"{args.problem} profiles {got} layers; the job's model has {want} "
                           f"(embedding, {want - 2} blocks, head)")
        if problem.device_count != workers:
            raise CLIError(f"{args.problem} describes {problem.device_count} devices; a pipeline "
                           f"replica of the run has {workers} ranks (set --workers, "
                           "spec.parallelism.workers or dataParallel)")
        doc = problem.model_dump(mode="json", exclude_none=True)
        return Problem.model_validate({**doc, "microbatches": job.spec.training.microbatches})
    if (args.profile or job.spec.planner.profile) == "estimate":
        return estimate_problem(job.spec, devices=workers, precision=precision)
    from adaptis.worker.profiling.hardware import configure_host

    configure_host(threads=args.threads)  # profile as the ranks will run
    return measure_problem(job.spec, devices=workers, precision=precision)
