"""``adaptis profile``: measure a job's layers into a planning problem, or measure the hardware.

Two modes, one verb:

- ``adaptis profile JOB.yaml -o problem.yaml [--devices N] [--repeats R] [--rounds K]
  [--hardware-file hw.json]`` times each distinct layer of the job's model on this machine
  (:mod:`adaptis.worker.profiling.profiler`: F, torch's split B and W, the per-action overhead) and
  writes the planning problem ``adaptis plan`` reads (stdout without ``-o``).
- ``adaptis profile --hardware [-o hw.json]`` measures this device and, when started with the
  torch.distributed environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; 2 or more ranks), the
  links between ranks (:mod:`adaptis.worker.profiling.hardware`). It prints one small JSON document
  (what a pod's termination message carries: ``-o /dev/termination-log``) and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import yaml

from adaptis.api.job import load_job, resolve_precision

__all__ = ["register", "run"]

_MAX_DOC_BYTES = 4096


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser("profile", help="profile layers or hardware into a planning problem",
                              description=__doc__.splitlines()[0])
    p.add_argument("job", nargs="?", metavar="JOB.yaml", help="AdaPtisJob manifest whose model to profile")
    p.add_argument("-o", "--output", type=Path, help="write here (default: stdout)")
    p.add_argument("--hardware", action="store_true", help="profile the device and links instead of layers")
    p.add_argument("--hardware-file", type=Path, metavar="HW.json",
                   help="merge this hardware profile into the problem's devices and network")
    p.add_argument("--devices", type=int, help="devices of the problem (default: spec.parallelism.workers)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per pass (default 5)")
    p.add_argument("--rounds", type=int, default=3,
                   help="passes over every layer kind, the statistic taken across them (default 3)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs before them (default 2)")
    p.add_argument("--estimator", choices=("median", "min"), default="median",
                   help="statistic of the repeats (min: least disturbed, for hosts shared with other work)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads on CPU (default 1, as the local ranks of `adaptis run`)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where to measure (auto: CUDA when available)")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16", "float32", "bfloat16"),
                   default="auto",
                   help="layer precision (auto: the job's spec.training.precision as the ranks "
                        "resolve it on --device: bf16 on CUDA, fp32 on CPU, unless the spec says)")
    p.add_argument("--caches", choices=("cold", "warm"), default="cold",
                   help="evict the device's caches before every timed run (cold, default: as a layer "
                        "runs in a pipeline) or not (warm: back to back)")
    p.add_argument("--co-runners", default="auto", metavar="N|auto",
                   help="processes kept busy with the model while layers are timed, standing for the "
                        "host's other ranks (auto: on CPU one per other local rank, up to the cores; "
                        "on a GPU none)")
    p.set_defaults(func=run)


def _device(choice: str) -> Any:
    import torch

    from adaptis.cli import CLIError

    if choice == "cuda" and not torch.cuda.is_available():
        raise CLIError("--device cuda: no CUDA device here")
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _co_runners(value: str) -> int | None:
    from adaptis.cli import CLIError

    if value == "auto":
        return None
    if not value.isdigit():
        raise CLIError(f"--co-runners must be a number >= 0 or auto, got {value!r}")
    return int(value)


def _write(text: str, output: Path | None) -> None:
    from adaptis.cli import CLIError

    if output is None:
        print(text)
        return
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text + "\n")
    except OSError as err:
        raise CLIError(f"cannot write {output}: {err.strerror}") from None


def _hardware(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from adaptis.worker.profiling.hardware import configure_host, measure_hardware

    configure_host(threads=args.threads)
    device = _device(args.device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    grouped = world >= 2 and "MASTER_ADDR" in os.environ
    if grouped:
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ.get('MASTER_PORT', '29500')}",
            rank=int(os.environ["RANK"]), world_size=world, timeout=timedelta(seconds=120),
        )
    try:
        profile = measure_hardware(device=device, repeats=args.repeats)
    finally:
        if grouped:
            dist.destroy_process_group()
    text = profile.to_json()
    if len(text.encode()) > _MAX_DOC_BYTES:  # a termination message holds 4 KiB
        from adaptis.cli import CLIError

        raise CLIError(f"hardware document of {len(text)} bytes exceeds {_MAX_DOC_BYTES}")
    _write(text, args.output)
    if args.output is not None:
        print(text)
    return 0


def _layers(args: argparse.Namespace) -> int:
    import torch

    from adaptis.cli import CLIError
    from adaptis.worker.errors import WorkerError
    from adaptis.worker.profiling.hardware import configure_host, load_hardware
    from adaptis.worker.profiling.job_problem import profile_job
    from adaptis.worker.profiling.profiler import ProfileSettings

    if not args.job:
        raise CLIError("give a job manifest (JOB.yaml), or --hardware")
    job = load_job(args.job)
    devices = args.devices or job.spec.parallelism.workers
    if devices < 1:
        raise CLIError(f"--devices must be >= 1, got {devices}")
    configure_host(threads=args.threads)
    device = _device(args.device)
    precision = {"bfloat16": "bf16", "float32": "fp32"}.get(args.precision, args.precision)
    if precision == "auto":  # what the workers will run: profile in it (docs/precision.md)
        precision = resolve_precision(job.spec.training.precision, cuda=device.type == "cuda")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    try:
        hardware = load_hardware(args.hardware_file) if args.hardware_file else None
        settings = ProfileSettings(device=device, dtype=dtype, warmup=args.warmup, repeats=args.repeats,
                                   estimator=args.estimator, rounds=args.rounds,
                                   cold_caches=args.caches == "cold", co_runners=_co_runners(args.co_runners))
        problem = profile_job(job.spec, settings=settings, devices=devices, name=job.metadata.name,
                              hardware=hardware)
    except WorkerError as err:
        raise CLIError(str(err)) from None
    doc = problem.model_dump(mode="json", exclude_none=True)
    if not doc["network"]:
        del doc["network"]
    text = yaml.safe_dump(doc, sort_keys=False, width=120).rstrip()
    _write(f"# measured by `adaptis profile` on {problem.name}\n{text}", args.output)
    if args.output is not None:
        print(f"problem of {len(problem.expanded_layers())} layers (action overhead "
              f"{problem.action_overhead_s * 1e6:.0f} us) written to {args.output}", file=sys.stderr)
    return 0


def run(args: argparse.Namespace) -> int:
    return _hardware(args) if args.hardware else _layers(args)
