"""Shared-cluster benchmark: many AdaPtisJobs competing for fake GPU nodes (issue 11).

On the real control plane of tests/integration (kube-apiserver, scheduler, controller-manager,
kwok), with the operator as the subprocess a user runs. Scenarios:

- ``static``: ``--jobs`` jobs (2-8 workers, 1-2 GPUs each, seeded) applied at once onto
  ``--nodes`` eight-GPU nodes; figures: seconds from apply to every job Running (all pods
  bound), jobs stuck at the deadline although their GPUs were free, operator CPU seconds and
  peak memory (the operator process, and the sampled peak of it plus its children); reconcile
  passes, how many took over 1 s and their mean (the operator's own histogram).
- ``churn``: a small cluster (``--churn-nodes``) that cannot hold all jobs at once; jobs run
  5-20 s (kwok completes them), ``--jobs`` arrive at once and as many again arrive one every
  ``--arrival-seconds``; figures: makespan, jobs finished per minute, queue wait (pods created
  minus job created) median and max, GPU busy share, jobs never started (starved).
- ``large``: the largest spec the CRD allows one asks for (64 workers, 4096 blocks, 4096
  microbatches, ``timeLimitSeconds`` 30) is applied, and while it plans ``--jobs`` small jobs;
  figures: each small job's apply -> Running, the large job's apply -> Planned and how its
  plan ended, operator (and planner process) peak memory against the chart's limit.

Usage (builds or reuses the control-plane binaries):

    ~/.cache/adaptis/venv/bin/python bench/operator_shared.py static --nodes 128 --jobs 40
    ~/.cache/adaptis/venv/bin/python bench/operator_shared.py static --nodes 512 --jobs 100
    ~/.cache/adaptis/venv/bin/python bench/operator_shared.py churn --jobs 40
    ~/.cache/adaptis/venv/bin/python bench/operator_shared.py large --nodes 16 --jobs 5

Prints one table; the machine's load average is printed with it (figures taken while the
load is above the core count are marked as not to be trusted).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchkit import (
    ControlPlane,
    ControlPlaneError,
    Operator,
    bin_dir,
    create_nodes,
    epoch,
    fake_job,
    fake_node,
    install_crd,
    wait_until,
)

from adaptis.operator.core.settings import ReconcileSettings

NS = "bench"
CHART_MEMORY_LIMIT_MIB = 2048  # charts/adaptis/values.yaml operator.resources.limits.memory


def job(name: str, *, workers: int, gpus: int, run_s: int) -> dict[str, Any]:
    return fake_job(name, namespace=NS, workers=workers, gpus=gpus, run_s=run_s)


def random_jobs(count: int, *, seed: int, prefix: str, run_s: Callable[[random.Random], int]
                ) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [job(f"{prefix}-{i:03d}", workers=rng.randint(2, 8), gpus=rng.randint(1, 2),
                run_s=run_s(rng)) for i in range(count)]


def statuses(cp: ControlPlane) -> dict[str, dict[str, Any]]:
    items = cp.get_json("apj", "-n", NS)["items"]
    return {j["metadata"]["name"]: {**(j.get("status") or {}),
                                    "created": j["metadata"]["creationTimestamp"]}
            for j in items}


def gpus_of(spec: dict[str, Any]) -> int:
    p = spec["spec"]["parallelism"]
    return int(p["workers"]) * int(p["gpusPerWorker"])


def _apply(cp: ControlPlane, jobs: list[dict[str, Any]]) -> None:
    for lo in range(0, len(jobs), 50):
        cp.kubectl("apply", "-f", "-", input=json.dumps(
            {"apiVersion": "v1", "kind": "List", "items": jobs[lo:lo + 50]}))


def pass_figures(op: Operator) -> dict[str, Any]:
    """Reconcile passes so far and how many took over a second (the operator's histogram)."""
    with urllib.request.urlopen(op.metrics_url, timeout=10) as resp:  # loopback
        text = resp.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        for name in ('adaptis_operator_reconcile_seconds_count',
                     'adaptis_operator_reconcile_seconds_bucket{le="1.0"}',
                     'adaptis_operator_reconcile_seconds_sum'):
            if line.startswith(name + " "):
                values[name] = float(line.split()[-1])
    count = values.get("adaptis_operator_reconcile_seconds_count", 0.0)
    under = values.get('adaptis_operator_reconcile_seconds_bucket{le="1.0"}', 0.0)
    total = values.get("adaptis_operator_reconcile_seconds_sum", 0.0)
    return {"reconcile passes": int(count), "passes over 1 s": int(count - under),
            "mean pass (ms)": round(1000 * total / count, 1) if count else "n/a"}


def static(cp: ControlPlane, op: Operator, args: argparse.Namespace) -> dict[str, Any]:
    jobs = random_jobs(args.jobs, seed=args.seed, prefix="job", run_s=lambda _: 3600)
    cpu0 = op.cpu_seconds()
    t0 = time.monotonic()
    _apply(cp, jobs)
    last: dict[str, dict[str, Any]] = {}

    def all_running() -> bool:
        nonlocal last
        op.sample()
        last = statuses(cp)
        return sum(s.get("phase") == "Running" for s in last.values()) == len(jobs)

    try:
        wait_until(all_running, timeout=args.timeout, interval=1.0, what="every job Running")
        finished = True
    except Exception:  # noqa: BLE001 - report what was stuck instead
        finished = False
    elapsed = time.monotonic() - t0
    pods = cp.get_json("pods", "-n", NS)["items"]
    unbound = [p["metadata"]["name"] for p in pods if not p["spec"].get("nodeName")]
    requested = sum(gpus_of(j) for j in jobs)
    return {
        "scenario": f"static: {len(jobs)} jobs on {args.nodes} nodes x 8 GPUs",
        "GPUs requested / in cluster": f"{requested} / {8 * args.nodes}",
        "apply -> every job Running (s)": round(elapsed, 1) if finished else "not reached",
        "jobs not Running at the end": sum(s.get("phase") != "Running" for s in last.values()),
        "pods unbound at the end": len(unbound),
        "operator CPU (s)": round(op.cpu_seconds() - cpu0, 1),
        "operator peak RSS (MiB)": round(op.peak_rss_mib(), 1),
        "operator + children sampled peak (MiB)": round(op.peak_tree_rss_kib / 1024, 1),
        **pass_figures(op),
    }


def churn(cp: ControlPlane, op: Operator, args: argparse.Namespace) -> dict[str, Any]:
    def run_s(rng: random.Random) -> int:
        return rng.randint(5, 20)

    first = random_jobs(args.jobs, seed=args.seed, prefix="first", run_s=run_s)
    later = random_jobs(args.jobs, seed=args.seed + 1, prefix="later", run_s=run_s)
    everything = first + later
    cpu0 = op.cpu_seconds()
    t0 = time.monotonic()
    _apply(cp, first)
    for spec in later:
        time.sleep(args.arrival_seconds)  # the arrival process itself, not a wait for a result
        _apply(cp, [spec])
        op.sample()
    last: dict[str, dict[str, Any]] = {}

    def all_done() -> bool:
        nonlocal last
        op.sample()
        last = statuses(cp)
        return sum(s.get("phase") in {"Succeeded", "Failed"} for s in last.values()) == len(
            everything)

    # Timed out (wait_until's ControlPlaneError): report the starved ones instead.
    with contextlib.suppress(ControlPlaneError):
        wait_until(all_done, timeout=args.timeout, interval=1.0, what="every job finished")
    makespan = time.monotonic() - t0
    waits = [epoch(s["startTime"]) - epoch(s["created"]) for s in last.values()
             if s.get("startTime")]
    busy = sum(gpus_of(j) * int(j["spec"]["worker"]["annotations"]["adaptis.io/fake-run-seconds"])
               for j in everything if last.get(j["metadata"]["name"], {}).get("phase")
               == "Succeeded")
    done = sum(s.get("phase") == "Succeeded" for s in last.values())
    return {
        "scenario": f"churn: {len(everything)} jobs (5-20 s each) on {args.churn_nodes} nodes "
                    f"x 8 GPUs, {args.jobs} at once then one every {args.arrival_seconds} s",
        "jobs Succeeded / Failed / never started": f"{done} / "
        f"{sum(s.get('phase') == 'Failed' for s in last.values())} / "
        f"{sum(not s.get('startTime') for s in last.values())}",
        "makespan (s)": round(makespan, 1),
        "jobs finished per minute": round(60 * done / makespan, 1),
        "queue wait median / max (s)": f"{statistics.median(waits):.0f} / {max(waits):.0f}"
        if waits else "n/a",
        "GPU busy share (fake run time x GPUs / capacity x makespan)":
            round(busy / (8 * args.churn_nodes * makespan), 2),
        "operator CPU (s)": round(op.cpu_seconds() - cpu0, 1),
        "operator peak RSS (MiB)": round(op.peak_rss_mib(), 1),
        "operator + children sampled peak (MiB)": round(op.peak_tree_rss_kib / 1024, 1),
    }


def large(cp: ControlPlane, op: Operator, args: argparse.Namespace) -> dict[str, Any]:
    big = job("large", workers=64, gpus=1, run_s=3600)
    big["spec"]["model"]["blocks"] = [{"kind": "attention", "count": 4096}]
    big["spec"]["training"]["microbatches"] = 4096
    big["spec"]["planner"] = {"timeLimitSeconds": 30}
    smalls = [job(f"small-{i}", workers=2, gpus=1, run_s=3600) for i in range(args.jobs)]
    cpu0 = op.cpu_seconds()
    t0 = time.monotonic()
    _apply(cp, [big])

    def planning() -> bool:
        op.sample()
        cond = {c["type"]: c for c in statuses(cp)["large"].get("conditions", [])}
        return cond.get("Planned", {}).get("reason") == "Planning"

    wait_until(planning, timeout=120, interval=0.5, what="the large job planning")
    t_small = time.monotonic()
    _apply(cp, smalls)
    started: dict[str, float] = {}
    big_planned: float | None = None
    last: dict[str, dict[str, Any]] = {}

    def settled() -> bool:
        nonlocal big_planned, last
        op.sample()
        last = statuses(cp)
        now = time.monotonic()
        for spec in smalls:
            name = spec["metadata"]["name"]
            if name not in started and last.get(name, {}).get("phase") == "Running":
                started[name] = now - t_small
        planned = {c["type"]: c for c in last["large"].get("conditions", [])}.get("Planned", {})
        if big_planned is None and planned.get("reason") not in {None, "Planning"}:
            big_planned = now - t0  # planned, cut short, fallen back, or refused
        return len(started) == len(smalls) and big_planned is not None

    wait_until(settled, timeout=args.timeout, interval=0.5,
               what="the small jobs Running and the large one planned")
    planned = {c["type"]: c for c in last["large"].get("conditions", [])}["Planned"]
    return {
        "scenario": f"large: 64 workers x 4096 blocks x 4096 microbatches (timeLimitSeconds 30), "
                    f"then {len(smalls)} small jobs while it plans, {args.nodes} nodes x 8 GPUs",
        "small jobs apply -> Running, max (s)": round(max(started.values()), 1),
        "small jobs Running before the large plan ended": sum(
            t + (t_small - t0) < (big_planned or 0) for t in started.values()),
        "large apply -> plan ended (s)": round(big_planned or 0, 1),
        "large plan": f"{planned['status']} {planned['reason']}",
        "operator CPU (s)": round(op.cpu_seconds() - cpu0, 1),
        "operator peak RSS (MiB)": round(op.peak_rss_mib(), 1),
        "operator + children sampled peak (MiB)": round(op.peak_tree_rss_kib / 1024, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", choices=["static", "churn", "large"])
    parser.add_argument("--nodes", type=int, default=128)
    parser.add_argument("--churn-nodes", type=int, default=16)
    parser.add_argument("--jobs", type=int, default=40)
    parser.add_argument("--arrival-seconds", type=float, default=1.5)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="adaptis-shared-"))
    cp = ControlPlane(bin_dir(), work)
    cp.start()
    op = Operator(cp, NS, work / "operator.log", extra_args=["--resync-seconds", "30"])
    try:
        install_crd(cp)
        cp.create_namespace(NS)
        # The operator keeps its plan records (and measured profiles) in its own namespace.
        cp.create_namespace(ReconcileSettings().profile_namespace)
        nodes = args.churn_nodes if args.scenario == "churn" else args.nodes
        ready_s = create_nodes(cp, [fake_node(i, gpus=8) for i in range(nodes)])
        op.start()
        figures = {"static": static, "churn": churn, "large": large}[args.scenario](cp, op, args)
        figures["nodes Ready after (s)"] = round(ready_s, 1)
        load = os.getloadavg()
        figures["load average 1/5/15 min"] = " / ".join(f"{x:.1f}" for x in load)
        figures["trust"] = ("busy machine: not to be trusted" if load[0] > (os.cpu_count() or 1)
                            else "ok")
        figures["chart memory limit (MiB)"] = CHART_MEMORY_LIMIT_MIB
    finally:
        op.stop()
        cp.stop()
    if args.json:
        print(json.dumps(figures))
    else:
        print("| figure | value |\n|---|---|")
        for key, value in figures.items():
            print(f"| {key} | {value} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
