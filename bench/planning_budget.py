"""What planning an AdaPtisJob costs: wall time, peak memory, and whether the time limit cut it.

Plans jobs of several sizes (workers x transformer blocks x microbatches, 8-GPU H100 nodes) with the
operator's own function (:func:`adaptis.operator.scheduling.planning.plan_job`, strategy adaptis),
each in a fresh process as the operator's planner runs, and reports per size: the seconds it took,
the peak resident set (``ru_maxrss``) and the peak address space (``VmPeak``, what the planner's
``RLIMIT_AS`` cap counts), and the plan's ``budget_reason``. The table of docs/planning-budget.md
comes from:

    ~/.cache/adaptis/venv/bin/python bench/planning_budget.py --time-limit 30 \\
        4x8x8 8x64x128 16x256x256 32x1024x512 64x1024x4096 64x4096x4096
    ~/.cache/adaptis/venv/bin/python bench/planning_budget.py 4x8x8 8x64x128 16x256x256

(no ``--time-limit``: the unbounded search, as before spec.planner.timeLimitSeconds).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _vm_peak_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmPeak:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _one(size: str, time_limit: float | None, *, hidden: int, vocab: int, seq: int) -> dict[str, Any]:
    """Plan one size in this process (run by the driver as a child)."""
    from adaptis.api.job import JobSpec
    from adaptis.operator.core.errors import Unsatisfiable
    from adaptis.operator.profiling.nodes import profile_node
    from adaptis.operator.scheduling.planning import plan_job

    sys.path.insert(0, str(REPO / "tests" / "operator"))
    from conftest import gpu_node  # the unit tests' GFD-labelled 8 x H100 node

    workers, blocks, microbatches = map(int, size.split("x"))
    spec = JobSpec.model_validate({
        "model": {"vocabSize": vocab, "hidden": hidden, "heads": 8,
                  "blocks": [{"kind": "attention", "count": blocks}]},
        "training": {"microbatches": microbatches, "sequenceLength": seq},
        "parallelism": {"workers": workers, "gpusPerWorker": 1},
    })
    nodes = [profile_node(gpu_node(f"node-{i}"), topology_keys=("topology.kubernetes.io/zone",))
             for i in range(-(-workers // 8))]
    before = _vm_peak_mib()
    t0 = time.perf_counter()
    try:
        record = plan_job(spec, nodes, name=size, time_limit_s=time_limit)
    except Unsatisfiable as err:
        return {"size": size, "time_limit_s": time_limit,
                "seconds": round(time.perf_counter() - t0, 2),
                "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                "vm_peak_mib": round(_vm_peak_mib()), "budget_reason": f"no plan: {err}"[:120]}
    return {
        "size": size, "time_limit_s": time_limit,
        "seconds": round(time.perf_counter() - t0, 2),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "vm_peak_mib": round(_vm_peak_mib()), "vm_before_mib": round(before),
        "budget_reason": record.budget_reason,
        "stages": len(record.plan.stages),
        "record_kib": round(len(record.model_dump_json(exclude_none=True)) / 1024),
        "bubble": round(record.predicted_bubble_ratio, 4),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sizes", nargs="+", metavar="WORKERSxBLOCKSxMICROBATCHES")
    parser.add_argument("--time-limit", type=float, default=None, metavar="S")
    parser.add_argument("--kill-after", type=float, default=900.0, metavar="S",
                        help="give up on one size after this long (reported as such)")
    parser.add_argument("--hidden", type=int, default=1024, help="the model's hidden size")
    parser.add_argument("--vocab", type=int, default=32000, help="the model's vocabulary")
    parser.add_argument("--seq", type=int, default=512, help="tokens per sequence")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(_one(args.sizes[0], args.time_limit, hidden=args.hidden, vocab=args.vocab, seq=args.seq)))
        return 0
    rows = []
    print("| workers x blocks x microbatches | time limit | seconds | peak RSS MiB | peak VM MiB "
          "| result |")
    print("|---|---|---|---|---|---|")
    for size in args.sizes:
        cmd = [sys.executable, __file__, "--one", size, "--hidden", str(args.hidden),
               "--vocab", str(args.vocab), "--seq", str(args.seq)]
        if args.time_limit is not None:
            cmd += ["--time-limit", str(args.time_limit)]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                                 timeout=args.kill_after, cwd=REPO)
            row = json.loads(out.stdout.strip().splitlines()[-1])
        except subprocess.TimeoutExpired:
            row = {"size": size, "time_limit_s": args.time_limit, "seconds": f">{args.kill_after:g}",
                   "peak_rss_mib": "-", "vm_peak_mib": "-", "budget_reason": "killed"}
        rows.append(row)
        limit = "none" if row["time_limit_s"] is None else f"{row['time_limit_s']:g} s"
        print(f"| {size} | {limit} | {row['seconds']} | {row['peak_rss_mib']} | "
              f"{row['vm_peak_mib']} | {row['budget_reason'] or 'full search'} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
