"""Cost of the graceful-stop agreement (adaptis.worker.run.preemption): one all-reduce of one
integer per step, on real gloo ranks. A benchmark, not a test: prints figures with the load.

    PYTHONPATH=$PWD python bench/stop_agreement.py [--calls 1000] [--repeat 2]

Figures and the load they were taken at: docs/checkpoints.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "worker"))


def _ranks(rank: int, world: int, port: int, calls: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from worker_harness import init_gloo

    from adaptis.worker.run.preemption import StopRequest

    init_gloo(rank, world, port)
    stop = StopRequest(device=torch.device("cpu"))
    for _ in range(50):  # warm-up: gloo's first collectives pay connection set-up
        stop.agreed()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        stop.agreed()
        times.append(time.perf_counter() - t)
    if rank == 0:
        times.sort()
        Path(out).write_text(json.dumps({"median_ms": statistics.median(times) * 1e3,
                                         "p90_ms": times[int(0.9 * len(times))] * 1e3}))
    dist.destroy_process_group()


def main() -> None:
    from worker_harness import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp()) / "agreement.json"
    for rep in range(args.repeat):
        for world in (2, 4):  # interleaved, so a load change hits both sizes alike
            run_ranks(_ranks, world=world, args=(args.calls, str(out)), timeout_s=600)
            got = json.loads(out.read_text())
            print(f"run {rep + 1}  {world} ranks  median {got['median_ms']:.3f} ms  p90 {got['p90_ms']:.3f} ms  "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
