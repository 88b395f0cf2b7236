"""GPU check: profile the paper's three families at realistic sizes, run the executor, compare.

Run through ``bench/gpu_check.sh`` (which checks the environment first) on a machine with one
CUDA GPU; ``--cpu-dry-run`` runs the same steps at toy sizes on the CPU to test the script.

1. **Profiles** (bf16, microbatch 1, sequence 4096, one layer at a time): Gemma-like (hidden
   1536, attention decoder blocks, 256K head), DeepSeek-like (hidden 2048, dense decoder
   blocks then MoE, 128K head), Nemotron-H-like (hidden 1024, Mamba with attention every 3rd
   layer, 128K head), each as the S model of method.md on 4 devices with 32 microbatches,
   written to ``$OUT/profiles/<family>.yaml`` (``bench/profiles/`` without ``$OUT``) with the
   GPU, torch version and precision in a comment and in ``name``. Prints each kind's (F, B, W)
   as ratios to the family's base layer next to the paper's.
   Each problem carries the per-action overhead and the weight pass's graph walks measured on
   the GPU (``action_overhead_s``, ``weight_groups``, ``graph_walk``). Committed under
   ``bench/profiles/``, ``python bench/planner_bench.py`` plans them in its "Measured profiles"
   table.
2. **Stage depth** (``bench/stage_depth.py`` on the GPU): split W of 1-8 stacked Nemotron-H S
   blocks, measured against the planner with and without the graph walks, to see how much of
   that host-side cost the GPU's kernels hide.
3. **Executor**: a small model profiled in bf16 and in fp32 (each the precision it then runs),
   planned for one rank (every stage on the GPU, as one GPU allows: NCCL with one rank), trained
   a few steps through the worker's launcher; predicted vs measured iteration and whole step.

4. **CPU accuracy** (what time is left before ``--total-s``): ``bench/accuracy.py`` on the
   machine's otherwise idle CPU cores (2 gloo ranks, one thread each), its log streamed to
   ``$OUT/accuracy-cpu.log`` and its table to ``$OUT/RESULTS-accuracy-gpu-host.md``.

Every figure also goes to ``$OUT/gpu_check.json``. Sections that would start after
``--budget-s`` are skipped and say so.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import yaml
from stage_depth import report as depth_report  # bench/ is this script's directory
from stage_depth import run as depth_run

from adaptis.api.events import StepEvent
from adaptis.api.job import BlockSpec, JobSpec, ModelSpec, ParallelismSpec, TrainingSpec, WorkerConfig
from adaptis.planner.strategies import plan_strategy
from adaptis.worker.profiling.hardware import device_memory_bytes, device_name, measure_matmul_tflops
from adaptis.worker.profiling.job_problem import profile_job
from adaptis.worker.profiling.profiler import (
    ProfileSettings,
    measure_action_overhead,
    measure_graph_visit,
    problem_from_profiles,
    profile_layers,
)
from adaptis.worker.run.launcher import LocalLauncher

REPO = Path(__file__).resolve().parents[1]

# The paper's per-layer (F, B, W) at 4K sequence, as ratios to the base layer's F (method.md).
PAPER = {
    "gemma": {"attention": (1, 1.65, 0.22), "head": (5.72, 1.21, 0.58)},
    "deepseek": {"attention": (1, 2.05, 0.2), "moe": (2.28, 3.49, 0.16), "head": (6.26, 1.98, 0.82)},
    "nemotron": {"mamba": (1, 2.79, 0.02), "attention": (3.12, 4.96, 0.52), "head": (13.99, 2.13, 0.86)},
}
BASE = {"gemma": "attention", "deepseek": "attention", "nemotron": "mamba"}


def families(*, dry: bool) -> dict[str, JobSpec]:
    """The S models; ``dry``: toy sizes with the same structure."""
    def spec(hidden: int, heads: int, vocab: int, blocks: list[BlockSpec]) -> JobSpec:
        if dry:
            hidden, heads, vocab = 32, 4, 1024
        return JobSpec(
            model=ModelSpec(vocab_size=vocab, hidden=hidden, heads=heads, blocks=blocks),
            training=TrainingSpec(microbatches=32, microbatch_size=1, sequence_length=64 if dry else 4096),
            parallelism=ParallelismSpec(workers=4, gpus_per_worker=1))

    nemotron = [BlockSpec(kind="attention" if i % 3 == 2 else "mamba") for i in range(28)]
    return {
        "gemma": spec(1536, 12, 262144, [BlockSpec(kind="attention", count=32)]),
        # The first L/PP - 1 = 3 layers dense (attention + MLP), the rest MoE.
        "deepseek": spec(2048, 16, 131072, [BlockSpec(kind="attention", count=3),
                                            BlockSpec(kind="moe", count=13, experts=8, top_k=2)]),
        "nemotron": spec(1024, 16, 131072, nemotron),
    }


def _out_dir() -> Path:
    out = os.environ.get("OUT")
    return Path(out) if out else REPO / "bench"


def profile_families(*, device: torch.device, dtype: torch.dtype, dry: bool, deadline: float,
                     report: dict[str, Any]) -> None:
    out = _out_dir() / "profiles"
    out.mkdir(parents=True, exist_ok=True)
    gpu, prec = device_name(device), str(dtype).removeprefix("torch.")
    for family, spec in families(dry=dry).items():
        if time.monotonic() > deadline:
            report[family] = {"skipped": "time budget"}
            print(f"{family}: skipped (time budget)", flush=True)
            continue
        t0 = time.monotonic()
        settings = ProfileSettings(device=device, dtype=dtype, warmup=2, repeats=5)
        profiles = profile_layers(spec, settings=settings)
        problem = problem_from_profiles(
            profiles, name=f"{family}-like-S ({gpu}, torch {torch.__version__}, {prec})",
            microbatches=spec.training.microbatches, devices=4, memory_bytes=device_memory_bytes(device),
            action_overhead_s=measure_action_overhead(settings=settings),
            graph_visit_s=measure_graph_visit(settings=settings, spec=spec))
        doc = problem.model_dump(mode="json", exclude_none=True)
        doc.pop("network", None)
        header = (f"# {family}-like S model of method.md, measured by bench/gpu_check.py\n"
                  f"# device: {gpu}; torch {torch.__version__} (CUDA {torch.version.cuda}); precision {prec}; "
                  f"microbatch 1 x sequence {spec.training.sequence_length}; hidden {spec.model.hidden}; "
                  f"vocab {spec.model.vocab_size}; {time.strftime('%Y-%m-%d', time.gmtime())}\n")
        (out / f"{family}.yaml").write_text(header + yaml.safe_dump(doc, sort_keys=False, width=120))
        kinds = {p.kind: p for p in profiles}
        base = kinds[BASE[family]].forward_s
        ratios = {k: tuple(round(x / base, 2) for x in (p.forward_s, p.backward_s, p.weight_s))
                  for k, p in kinds.items()}
        report[family] = {
            "seconds": round(time.monotonic() - t0, 1),
            "ms": {k: [round(x * 1e3, 3) for x in (p.forward_s, p.backward_s, p.weight_s)] for k, p in kinds.items()},
            "activation_gb": {k: round(p.activation_bytes / 1e9, 3) for k, p in kinds.items()},
            "ratios": ratios, "paper": PAPER[family],
        }
        print(f"{family}: profiled in {report[family]['seconds']} s", flush=True)
        for k, p in kinds.items():
            paper = PAPER[family].get(k)
            print(f"  {k:<10} F {p.forward_s * 1e3:8.3f} ms  B {p.backward_s * 1e3:8.3f}  W {p.weight_s * 1e3:8.3f}"
                  f"  act {p.activation_bytes / 1e9:6.2f} GB  ratio {ratios[k]}  paper {paper}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()


def stage_depth(*, device: torch.device, dtype: torch.dtype, dry: bool, report: dict[str, Any]) -> None:
    """Split W of stacked Nemotron-H S blocks: measured vs planned (bench/stage_depth.py)."""
    spec = families(dry=dry)["nemotron"]
    t0 = time.monotonic()
    rows = depth_run(spec=spec, depths=[1, 2, 4, 8], rounds=3, device=device, dtype=dtype)
    report["stage_depth"] = [{k: round(v, 3) for k, v in r.items()} for r in rows]
    print(depth_report(rows, spec=spec, label="stage depth, Nemotron-H S blocks", device=device,
                       seconds=time.monotonic() - t0), flush=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()


def executor_check(*, device: torch.device, dry: bool, report: dict[str, Any]) -> None:
    """A small model on one rank (NCCL on a GPU, gloo on the CPU) in bf16 and in fp32, each
    profiled in the precision it runs: predicted vs measured iteration and whole step."""
    rows = []
    for precision in ("bf16", "fp32"):
        spec = JobSpec(
            model=ModelSpec(vocab_size=1024 if dry else 32768, hidden=32 if dry else 512, heads=4 if dry else 8,
                            blocks=[BlockSpec(kind="mamba", count=2), BlockSpec(kind="attention", count=2),
                                    BlockSpec(kind="moe", count=2, experts=4, top_k=2)]),
            training=TrainingSpec(microbatches=8, microbatch_size=2 if dry else 4,
                                  sequence_length=64 if dry else 1024, steps=6, grad_clip=None,
                                  precision=precision),
            parallelism=ParallelismSpec(workers=1, gpus_per_worker=0 if device.type == "cpu" else 1))
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        problem = profile_job(spec, settings=ProfileSettings(device=device, dtype=dtype, repeats=5),
                              devices=1, name=f"gpu-check-executor-{precision}")
        for strategy in ("1f1b", "adaptis"):
            outcome = plan_strategy(problem, strategy)
            if outcome.plan is None or outcome.simulation is None:
                rows.append({"precision": precision, "strategy": strategy, "error": outcome.result.reason})
                continue
            plan = outcome.plan.model_copy(update={"precision": precision})
            config = WorkerConfig(job_name="gpu-check", model=spec.model, training=spec.training,
                                  plan=plan.model_dump(mode="json", exclude_none=True))
            events: list[object] = []
            with tempfile.TemporaryDirectory() as work:
                LocalLauncher(config, world_size=1, workdir=Path(work), device=device.type).run(events.append)
            steps = [e for e in events if isinstance(e, StepEvent)]
            steady = steps[2:] or steps
            measured = statistics.median(e.iteration_seconds for e in steady) * 1e3
            measured_step = statistics.median(e.step_seconds for e in steady) * 1e3
            predicted = outcome.simulation.iteration_time
            pred = plan.predicted
            predicted_step = pred.step_time if pred is not None and pred.step_time is not None else None
            rows.append({"precision": precision, "strategy": strategy, "stages": len(plan.stages),
                         "predicted_ms": round(predicted, 3), "measured_ms": round(measured, 3),
                         "error": round((predicted - measured) / measured, 4),
                         "predicted_step_ms": predicted_step, "measured_step_ms": round(measured_step, 3),
                         "peak_memory_bytes": steady[-1].peak_memory_bytes})
            step_txt = f"{predicted_step:.2f}" if predicted_step is not None else "n/a"
            print(f"executor {precision} {strategy:<8} stages {len(plan.stages)}: iteration predicted "
                  f"{predicted:.2f} ms, measured {measured:.2f} ms, error "
                  f"{100 * (predicted - measured) / measured:+.1f}%; step predicted {step_txt} ms, "
                  f"measured {measured_step:.2f} ms", flush=True)
    report["executor"] = rows


def cpu_accuracy(*, seconds: float, report: dict[str, Any]) -> None:
    """bench/accuracy.py on this machine's CPU cores for at most ``seconds``."""
    out = _out_dir()
    with open(out / "accuracy-cpu.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "bench" / "accuracy.py"), "--rounds", "6", "--repeats", "5",
             "--strategies", "1f1b,zb-h1,i1f1b,balanced,adaptis", "--out", str(out / "RESULTS-accuracy-gpu-host.md")],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""),
            start_new_session=True)  # its own process group: its rank processes stop with it
        try:
            code = proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            report["cpu_accuracy"] = {"stopped": f"after {seconds:.0f} s (time budget)"}
            return
    report["cpu_accuracy"] = {"exit": code}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-dry-run", action="store_true", help="toy sizes on the CPU (tests the script)")
    p.add_argument("--budget-s", type=float, default=200.0, help="skip sections that start after this")
    p.add_argument("--total-s", type=float, default=270.0, help="stop the CPU accuracy section by then")
    p.add_argument("--no-accuracy", action="store_true", help="skip the CPU accuracy section")
    args = p.parse_args()
    started = time.monotonic()
    deadline = started + args.budget_s
    if args.cpu_dry_run:
        device, dtype = torch.device("cpu"), torch.float32
        torch.set_num_threads(1)
    else:
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device (use --cpu-dry-run to test the script)", file=sys.stderr)
            return 2
        device, dtype = torch.device("cuda", 0), torch.bfloat16
        torch.cuda.set_device(device)
    report: dict[str, Any] = {
        "device": device_name(device), "torch": torch.__version__, "cuda": torch.version.cuda,
        "precision": str(dtype).removeprefix("torch."),
        "matmul_tflops": round(measure_matmul_tflops(device, dtype=dtype), 1),
    }
    print(json.dumps(report), flush=True)
    failed = False
    for section, fn in (("profiles", lambda: profile_families(device=device, dtype=dtype, dry=args.cpu_dry_run,
                                                               deadline=deadline, report=report)),
                        ("stage_depth", lambda: stage_depth(device=device, dtype=dtype, dry=args.cpu_dry_run,
                                                            report=report)),
                        ("executor", lambda: executor_check(device=device, dry=args.cpu_dry_run, report=report))):
        if time.monotonic() > deadline:
            report[section] = {"skipped": "time budget"}
            continue
        try:
            fn()
        except Exception:  # noqa: BLE001 - report and go on: one section's failure must not hide the others'
            failed = True
            report[f"{section}_error"] = traceback.format_exc()[-2000:]
            print(f"{section} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        (_out_dir() / "gpu_check.json").write_text(json.dumps(report, indent=1))
    left = started + args.total_s - time.monotonic()
    if not args.no_accuracy and left > 60:
        print(f"cpu accuracy: {left:.0f} s left", flush=True)
        cpu_accuracy(seconds=left, report=report)
        print((_out_dir() / "accuracy-cpu.log").read_text()[-3000:], flush=True)
    report["seconds"] = round(time.monotonic() - started, 1)
    (_out_dir() / "gpu_check.json").write_text(json.dumps(report, indent=1))
    print(f"gpu_check: done in {report['seconds']} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
