"""The layout search on the paper's workloads: pruned against exhaustive, and against a
Megatron-style fixed recipe (issue 30 item 4).

A figure, not a test. For each workload (bench/workloads.py, sequence 4K, 80 GB GPUs, 8 a node)
and GPU count, the global batch is ``--batch-per-gpu`` sequences a GPU. Per row:

- layouts: how many R x P x T x microbatch-size layouts the budget has, how many the memory
  floor refused unsearched, how many the pruned search ran the joint search on, its time;
- exhaustive: the joint search on every layout that passes its memory floor (the same
  per-layout time limit), and its time; ``chosen/best`` is the pruned search's first choice's
  predicted step over the exhaustive best's (1.000: the same step);
- megatron: the fixed recipe T = GPUs a node, P = the fewest stages whose plan fits, R = the
  rest, microbatch size 1, planned with the same joint search (so the ratio is the layout's
  choice alone, not the schedule's); ``megatron/chosen`` above 1 means the chosen layout is
  faster; ``best recipe``: the same recipe at every T dividing a node's GPUs, the fastest.

    python bench/layout_search.py [--gpus 8,16,32,64] [--workloads gemma-M,deepseek-M,nemotron-h-M,gemma-L]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workloads import problem as workload

from adaptis.api.problem import Problem, parse_problem
from adaptis.planner.costs import Costs
from adaptis.planner.layout import LayoutSearch, search_layouts
from adaptis.planner.layout_space import Layout, layout_problem, memory_floor
from adaptis.planner.strategies import plan_strategy

PER_NODE = 8


def megatron(problem: Problem, *, gpus: int, batch: int, per_layout_s: float,
             tensor: int = PER_NODE) -> tuple[Layout, float] | None:
    """The recipe's layout and its predicted step: T (default a node's GPUs), the fewest
    stages whose plan fits, R the rest, microbatch size 1."""
    tensor = min(tensor, gpus)
    rest = gpus // tensor
    layers = len(problem.expanded_layers())
    for pipe in [p for p in range(1, rest + 1) if rest % p == 0 and p <= layers]:
        reps = rest // pipe
        if batch % reps:
            continue
        lay = Layout(reps, pipe, tensor, 1, batch // reps)
        prob = layout_problem(problem, lay)
        if memory_floor(Costs.from_problem(prob))[1] is not None:
            continue
        out = plan_strategy(prob, "adaptis", time_limit_s=per_layout_s)
        if out.simulation is not None and out.result.feasible:
            return lay, out.simulation.step_time
    return None


def best_recipe(problem: Problem, *, gpus: int, batch: int, per_layout_s: float) -> tuple[Layout, float] | None:
    """The best of the recipe over every T dividing a node's GPUs (the fewest stages at each)."""
    found = [r for t in range(1, PER_NODE + 1) if PER_NODE % t == 0 and gpus % t == 0
             for r in [megatron(problem, gpus=gpus, batch=batch, per_layout_s=per_layout_s, tensor=t)]
             if r is not None]
    return min(found, key=lambda r: r[1], default=None)


def _recipe(recipe: tuple[Layout, float] | None, *, chosen: float) -> str:
    return "-" if recipe is None else f"{recipe[0].label()} | {recipe[1] / chosen:.3f}"


def _row(name: str, gpus: int, batch: int, pruned: LayoutSearch, full: LayoutSearch | None, *,
         recipe: tuple[Layout, float] | None, best_of: tuple[Layout, float] | None) -> str:
    chosen = pruned.ranked[0]
    floor = sum(not r.searched for r in pruned.refused)
    ex = ("- | - | - | -" if full is None else
          f"{full.searched} | {full.seconds:.1f} | {full.ranked[0].layout.label()} | "
          f"{chosen.step_time / full.ranked[0].step_time:.3f}")
    return (f"| {name} | {gpus} | {batch} | {pruned.enumerated} | {floor} | {pruned.searched} | "
            f"{pruned.seconds:.1f} | {chosen.layout.label()} | {ex} | "
            f"{_recipe(recipe, chosen=chosen.step_time)} | {_recipe(best_of, chosen=chosen.step_time)} |")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", default="8,16,32,64")
    p.add_argument("--workloads", default="gemma-M,deepseek-M,nemotron-h-M,gemma-L")
    p.add_argument("--batch-per-gpu", type=int, default=2)
    p.add_argument("--microbatch-sizes", default="1,2,4")
    p.add_argument("--per-layout-s", type=float, default=5.0)
    p.add_argument("--no-exhaustive", action="store_true",
                   help="leave the exhaustive search out (its columns print -): for 128 GPUs and up")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    sizes = tuple(int(x) for x in args.microbatch_sizes.split(","))
    print(f"# layout search: {' '.join(sys.argv[1:] if argv is None else argv) or 'defaults'}", flush=True)
    print("| workload | GPUs | batch | layouts | refused by floor | searched (pruned) | pruned s | "
          "chosen | searched (exhaustive) | exhaustive s | exhaustive best | chosen/best | "
          "megatron (T=8) | megatron/chosen | best recipe (any T) | best recipe/chosen |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    t0 = time.perf_counter()
    for spec in args.workloads.split(","):
        family, size = spec.rsplit("-", 1)
        for gpus in (int(x) for x in args.gpus.split(",")):
            doc = workload(family, size, seq=4096)
            prob = parse_problem(doc)
            batch = args.batch_per_gpu * gpus
            kw = {"gpus": gpus, "global_batch": batch, "microbatch_sizes": sizes, "sequence_length": 4096,
                  "per_layout_s": args.per_layout_s}
            pruned = search_layouts(prob, **kw)  # type: ignore[arg-type]
            full = None if args.no_exhaustive else search_layouts(prob, exhaustive=True, **kw)  # type: ignore[arg-type]
            if not pruned.ranked or (full is not None and not full.ranked):
                print(f"| {spec} | {gpus} | {batch} | no layout fits |", flush=True)
                continue
            recipe = megatron(prob, gpus=gpus, batch=batch, per_layout_s=args.per_layout_s)
            best_of = best_recipe(prob, gpus=gpus, batch=batch, per_layout_s=args.per_layout_s)
            print(_row(spec, gpus, batch, pruned, full, recipe=recipe, best_of=best_of), flush=True)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
