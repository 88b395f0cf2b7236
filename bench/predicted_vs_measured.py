"""Measured vs predicted iteration time and bubble ratio of several strategies, locally.

A figure, not a test. For each strategy, ``adaptis run MANIFEST --json --strategy S`` profiles
the layers on this machine (``--profile measure``), plans, trains on local ranks (one torch
thread each) and reports the planner's prediction next to the measurement (mean over the
steps after the first).

    python bench/predicted_vs_measured.py [examples/tiny-heterogeneous.yaml] [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("manifest", nargs="?", default="examples/tiny-heterogeneous.yaml")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--strategies", default="1f1b,zb-h1,i1f1b,zb-v,balanced,adaptis")
    args = p.parse_args()
    print(f"{'strategy':<10} {'stages':>6} {'pred iter s':>11} {'meas iter s':>11} {'ratio':>6} "
          f"{'pred bubble':>11} {'meas bubble':>11}")
    for name in args.strategies.split(","):
        with tempfile.TemporaryDirectory() as work:
            out = subprocess.run(
                [sys.executable, "-m", "adaptis", "run", args.manifest, "--json", "--strategy", name,
                 "--steps", str(args.steps), "--workers", str(args.workers), "--profile", "measure",
                 "--workdir", work, "--metrics-port", "0", "--checkpoint-every", "0"],
                capture_output=True, text=True, timeout=900, check=False)
        if out.returncode != 0:
            print(f"{name:<10} failed: {out.stderr.strip().splitlines()[-1:]}")
            continue
        s = json.loads(out.stdout)
        pi, mi = s["predicted_iteration_seconds"], s["measured_iteration_seconds"]
        print(f"{name:<10} {s['stages']:>6} {pi:>11.3f} {mi:>11.3f} {mi / pi:>6.2f} "
              f"{100 * s['predicted_bubble_ratio']:>10.1f}% {100 * s['measured_bubble_ratio']:>10.1f}%",
              flush=True)


if __name__ == "__main__":
    main()
