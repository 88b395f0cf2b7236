"""Executor overhead: the same 1F1B plan through AdaPtis's executor and torch's Schedule1F1B.

A figure, not a test. Two gloo ranks (one torch thread each) build the same stages of the same
model; each step runs once through our executor's pipeline runtime (the plan's action lists
via the adapter in adaptis/worker/runtime/pipelining.py, with per-action timing) and once through
torch's public ``Schedule1F1B`` on identical modules, alternating so that machine load hits
both alike. Prints the median step times and their ratio (target <= 1.05).

    python bench/executor_overhead.py [--steps 20] [--world 2] [--vocab 8192] [--hidden 64]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from adaptis.api.job import BlockSpec, JobSpec, ModelSpec, TrainingSpec, WorkerConfig
from adaptis.planner.strategies import plan_strategy
from adaptis.worker.data.sources import SyntheticTokens
from adaptis.worker.models.zoo import token_loss
from adaptis.worker.profiling.job_problem import estimate_problem
from adaptis.worker.runtime.executor import Executor


def _config(args: argparse.Namespace) -> WorkerConfig:
    model = ModelSpec(vocab_size=args.vocab, hidden=args.hidden, heads=4,
                      blocks=[BlockSpec(kind="mamba", count=2), BlockSpec(kind="attention", count=2),
                              BlockSpec(kind="moe", count=2, experts=4, top_k=2)])
    training = TrainingSpec(microbatches=args.microbatches, microbatch_size=2, sequence_length=64, seed=0)
    plan = plan_strategy(estimate_problem(JobSpec(model=model, training=training), devices=args.world), "1f1b").plan
    assert plan is not None
    return WorkerConfig(model=model, training=training, plan=plan.model_dump(mode="json"))


def _rank(rank: int, world: int, port: int, cfg_json: str, steps: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    cfg = WorkerConfig.model_validate_json(cfg_json)
    t = cfg.training
    ours = Executor(cfg, rank=rank, world_size=world, device=torch.device("cpu"))
    (module,) = ours.modules  # 1F1B: one stage per rank
    (sid,) = ours.stage_ids
    last = sid == world - 1
    b, s, h = t.microbatch_size, t.sequence_length, cfg.model.hidden
    stage = PipelineStage(
        module, sid, world, torch.device("cpu"),
        input_args=torch.zeros(b, s, dtype=torch.long) if sid == 0 else torch.zeros(b, s, h, requires_grad=True),
        output_args=torch.zeros(b, s, cfg.model.vocab_size if last else h, requires_grad=True),
    )
    m = t.microbatches
    theirs = Schedule1F1B(stage, m, loss_fn=lambda o, y: token_loss(o, y, scale=1.0 / m), scale_grads=False)
    batch = SyntheticTokens(vocab_size=cfg.model.vocab_size, sequence_length=s, seed=0).batch(
        position=0, sequences=m * b)
    inputs = batch.inputs if sid == 0 else None
    targets = batch.targets if last else None
    times: dict[str, list[float]] = {"adaptis": [], "torch": []}

    def run(which: str) -> None:
        for p in module.parameters():
            p.grad = None
        dist.barrier()
        start = time.perf_counter()
        if which == "adaptis":
            ours.timer.reset(step=0)
            ours.runtime.step(inputs=inputs, targets=targets)
        else:
            args = (inputs,) if inputs is not None else ()
            # Same work as ours: no merged output copy (return_outputs exists in 2.11 and 2.13).
            theirs.step(*args, return_outputs=False, **({"target": targets} if last else {}))
        dist.barrier()
        times[which].append(time.perf_counter() - start)

    for i in range(steps + 2):
        order = ("adaptis", "torch") if i % 2 == 0 else ("torch", "adaptis")
        for which in order:
            run(which)
    if rank == 0:
        with open(out, "w") as fh:
            json.dump({k: v[2:] for k, v in times.items()}, fh)  # drop warm-up steps
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=64)
    args = p.parse_args()
    cfg = _config(args)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = f"/tmp/adaptis-overhead-{port}.json"
    mp.start_processes(_rank, args=(args.world, port, cfg.model_dump_json(), args.steps, out),
                       nprocs=args.world, start_method="spawn")
    with open(out) as fh:
        times = json.load(fh)
    ours, theirs = statistics.median(times["adaptis"]), statistics.median(times["torch"])
    print(f"1F1B, {args.world} gloo ranks, {args.microbatches} microbatches, {args.steps} steps each, "
          f"torch {torch.__version__}")
    print(f"  adaptis executor  median {ours * 1e3:8.2f} ms/step")
    print(f"  torch Schedule1F1B median {theirs * 1e3:8.2f} ms/step")
    print(f"  ratio adaptis/torch {ours / theirs:.3f} (target <= 1.05)")


if __name__ == "__main__":
    main()
