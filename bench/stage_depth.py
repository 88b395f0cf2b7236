"""Split weight pass of deep stages: measured vs the planner, with and without the graph walks.

A figure, not a test. torch's split weight pass (``stage_backward_weight``) makes one autograd call
per parameter group, and each call walks the graph of every earlier layer of the stage, so a stage's
W grows faster than its depth. The layer profiler counts each layer's nodes and groups and measures
the time per node walked (:func:`adaptis.worker.profiling.profiler.measure_graph_visit`); the
planner charges the walks to split W (:meth:`adaptis.planner.costs.Costs.stage_costs`).

For stacks of 1..16 of a family's blocks (its own order, repeated), one process, one thread:
the stack's W measured through the same adapter the executor uses, against the planner's W
from the per-layer profile, without the walks (the sum of the layers) and with them. Depths
take turns for ``--rounds`` rounds and the minimum is kept (noise only adds).

    python bench/stage_depth.py [--family hybrid] [--depths 1,2,4,8,16] [--device cpu]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from accuracy import FAMILIES  # the accuracy benchmark's model families

from adaptis.api.job import JobSpec
from adaptis.planner.costs import Costs
from adaptis.worker.models.zoo import build_layer, model_layers
from adaptis.worker.profiling.hardware import configure_host
from adaptis.worker.profiling.profiler import (
    ProfileSettings,
    measure_graph_visit,
    problem_from_profiles,
    profile_layers,
    profile_module,
)


def deep_spec(spec: JobSpec, *, blocks: int) -> JobSpec:
    """``spec``'s model with its block pattern repeated up to ``blocks`` blocks."""
    pattern = [b.model_copy(update={"count": 1}) for b in spec.model.blocks for _ in range(b.count)]
    chosen = [pattern[i % len(pattern)] for i in range(blocks)]
    return spec.model_copy(update={"model": dataclasses.replace(spec.model, blocks=chosen)})


def run(*, spec: JobSpec, depths: list[int], rounds: int, device: torch.device,
        dtype: torch.dtype) -> list[dict[str, float]]:
    """Measured and planned W of the stacks (ms): the rows of :func:`report`."""
    spec = deep_spec(spec, blocks=max(depths))
    settings = ProfileSettings(device=device, dtype=dtype, warmup=2, repeats=5, estimator="min", rounds=3)
    problem = problem_from_profiles(profile_layers(spec, settings=settings), name="depth",
                                    microbatches=1, devices=1, memory_bytes=None,
                                    graph_visit_s=measure_graph_visit(settings=settings, spec=spec))
    costs = Costs.from_problem(problem)
    flat = Costs.from_problem(problem.model_copy(update={"layers": [
        lay.model_copy(update={"graph_walk": None}) for lay in problem.expanded_layers()]}))
    t = spec.training
    x = torch.randn(t.microbatch_size, t.sequence_length, spec.model.hidden, device=device, dtype=dtype)
    layers = [build_layer(spec.model, index=i, seed=0).to(device=device, dtype=dtype)
              for i in range(1, 1 + max(depths))]
    once = ProfileSettings(device=device, dtype=dtype, warmup=1, repeats=3, estimator="min")
    best: dict[int, float] = {}
    for _ in range(rounds):
        for d in depths:
            w = profile_module(nn.Sequential(*layers[:d]), example=x, settings=once).weight_s * 1e3
            best[d] = min(best.get(d, w), w)
    rows = []
    for d in depths:
        stages = [(0, 1), (1, 1 + d)]  # behind the embedding's stage: a split W
        rows.append({"depth": d, "measured": best[d], "sum": flat.stage_costs(stages).weight[1],
                     "walks": costs.stage_costs(stages).weight[1]})
    return rows


def report(rows: list[dict[str, float]], *, spec: JobSpec, label: str, device: torch.device,
           seconds: float) -> str:
    blocks = [info.kind for info in model_layers(deep_spec(spec, blocks=max(int(r["depth"]) for r in rows)).model)]
    lines = [f"{label} ({device}, torch {torch.__version__}, "
             f"{seconds:.0f} s; blocks in order: {', '.join(blocks[1:-1])})", "",
             "| depth | measured W ms | layers' sum ms | err | with the walks ms | err |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['depth']} | {r['measured']:.2f} | {r['sum']:.2f} | {r['sum'] / r['measured'] - 1:+.0%} | "
                     f"{r['walks']:.2f} | {r['walks'] / r['measured'] - 1:+.0%} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=sorted(FAMILIES), default="hybrid")
    p.add_argument("--depths", default="1,2,4,8,16")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    configure_host(threads=1)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    started = time.time()
    spec = FAMILIES[args.family]
    rows = run(spec=spec, depths=[int(d) for d in args.depths.split(",")], rounds=args.rounds,
               device=device, dtype=dtype)
    print(report(rows, spec=spec, label=f"`python bench/stage_depth.py --family {args.family}`", device=device,
                 seconds=time.time() - started))


if __name__ == "__main__":
    main()
