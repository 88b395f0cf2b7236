"""Data parallel x pipeline on local CPU processes: measured vs predicted step (issue 14).

A figure, not a test. The shipped example is profiled once (2 pipeline ranks) and trained with
``adaptis run --problem`` as one replica (2 ranks), two replicas (4 ranks) and two replicas with
ZeRO-1, taking turns (A B C A B C ...) for ``--reps`` rounds. Per configuration: the measured
step (pipeline + post-pipeline: gradient all-reduce, clipping, optimizer) and the predicted
one, the share of the ranks' step time spent waiting on the replicas' all-reduce, and the job's
tokens/s. Runs during which other processes used more than ``--max-load`` cores are left out
(see bench/measured_speedup.py); four ranks on a 2-core host share cores, which the planner
does not model, so expect R=2 to be measured slower than predicted here.

    python bench/data_parallel.py [--reps 3] [--steps 8]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml
from measured_speedup import profile, timed_run, workload

CONFIGS: dict[str, dict[str, Any]] = {
    "R=1": {"workers": 2},
    "R=2": {"workers": 4, "dataParallel": 2},
    "R=2 zero1": {"workers": 4, "dataParallel": 2, "zeroStage": 1},
}


def run(manifest: Path, *, problem: Path, steps: int, workdir: Path) -> dict[str, Any]:
    summary, row = timed_run(manifest, problem=problem, steps=steps, workdir=workdir)
    if summary is not None:
        row.update(step=summary["measured_step_seconds"], predicted_step=summary["predicted_step_seconds"],
                   reduce_share=summary["reduce_wait_share"], tokens_per_second=summary["tokens_per_second"])
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=8, help="steps a run; the first is dropped")
    p.add_argument("--max-load", type=float, default=0.25)
    args = p.parse_args()
    print(f"# data parallel: {' '.join(sys.argv[1:]) or 'defaults'}", flush=True)
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory(prefix="adaptis-dp-") as tmp:
        base = workload("example")
        base_path = Path(tmp) / "base.yaml"
        base_path.write_text(yaml.safe_dump(base))
        problem = Path(tmp) / "problem.yaml"
        profile(base_path, out=problem)  # 2 devices: the pipeline of every configuration
        for rep in range(args.reps):
            for name, parallelism in CONFIGS.items():
                doc = copy.deepcopy(base)
                doc["spec"]["parallelism"].update(parallelism)
                manifest = Path(tmp) / f"{name.replace(' ', '-').replace('=', '')}.yaml"
                manifest.write_text(yaml.safe_dump(doc))
                row = run(manifest, problem=problem, steps=args.steps, workdir=Path(tmp) / "w")
                rows[name].append(row)
                shown = (f"step {1e3 * row['step']:.0f} ms (predicted {1e3 * row['predicted_step']:.0f})"
                         if "step" in row else row["error"])
                print(f"round {rep} {name:<10} {shown}  others {row['others_cores']:.2f} cores, "
                      f"load {row['load_after']:.2f}", flush=True)
    print("\n| configuration | ranks | measured step ms | predicted step ms | error | all-reduce wait "
          "share | tokens/s (job) | clean runs |\n|---|---|---|---|---|---|---|---|")
    for name, mine in rows.items():
        ok = [r for r in mine if "step" in r and r["others_cores"] <= args.max_load]
        ranks = 2 * CONFIGS[name].get("dataParallel", 1)
        if len(ok) < 2:
            why = "; ".join(r["error"] for r in mine if "error" in r) or "too busy"
            print(f"| {name} | {ranks} | {why} | | | | | {len(ok)} of {len(mine)} |")
            continue
        med = statistics.median(r["step"] for r in ok)
        pred = statistics.median(r["predicted_step"] for r in ok)
        share = statistics.median(r["reduce_share"] or 0.0 for r in ok)
        tps = statistics.median(r["tokens_per_second"] for r in ok)
        print(f"| {name} | {ranks} | {1e3 * med:.0f} | {1e3 * pred:.0f} | {100 * (pred - med) / med:+.1f} % "
              f"| {100 * share:.1f} % | {tps:.0f} | {len(ok)} of {len(mine)} |")


if __name__ == "__main__":
    main()
