"""Operator scale benchmark: 256 fake GPU nodes, one 64-rank AdaPtisJob, on a real control plane.

Measures, with the real kube-apiserver, scheduler and kwok of tests/integration:
- the time from ``kubectl apply`` of the job to every pod bound to a node (and to phase
  Running), split into planning (status ``Planned``) and pod creation + binding;
- the operator process's resident memory (current and peak) once the job runs;
- that every pod landed on the node its plan names.

Usage (the control-plane binaries are built or reused by hack/build-control-plane.sh):

    ~/.cache/adaptis/venv/bin/python bench/operator_scale.py [--nodes 256] [--ranks 64]
        [--strategy adaptis] [--microbatches 64] [--json]
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchkit import (
    REPO,
    ControlPlane,
    bin_dir,
    create_nodes,
    epoch,
    fake_node,
    install_crd,
    rss_kib,
    wait_until,
)

NS = "bench"


def _job(*, ranks: int, strategy: str, microbatches: int) -> dict[str, Any]:
    return {
        "apiVersion": "adaptis.io/v1alpha1",
        "kind": "AdaPtisJob",
        "metadata": {"name": "scale", "namespace": NS},
        "spec": {
            "model": {"vocabSize": 128000, "hidden": 1024, "heads": 16,
                      "blocks": [{"kind": "attention", "count": max(1, 2 * ranks - 2)}]},
            "training": {"steps": 100, "microbatches": microbatches, "sequenceLength": 1024},
            "parallelism": {"workers": ranks, "gpusPerWorker": 1},
            "planner": {"strategy": strategy},
            "worker": {"annotations": {"adaptis.io/fake-run-seconds": "3600"}},
        },
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="adaptis-scale-"))
    cp = ControlPlane(bin_dir(), work)
    cp.start()
    operator: subprocess.Popen[bytes] | None = None
    try:
        install_crd(cp)
        cp.create_namespace(NS)
        nodes_s = create_nodes(cp, [fake_node(i, gpus=args.gpus_per_node)
                                    for i in range(args.nodes)], timeout=300)
        log = (work / "operator.log").open("wb")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            liveness = f"http://127.0.0.1:{s.getsockname()[1]}/healthz"
        operator = subprocess.Popen(  # our own CLI
            [sys.executable, "-m", "adaptis", "operator", "--namespace", NS,
             "--liveness", liveness],
            cwd=REPO, env=cp.env(), stdout=log, stderr=subprocess.STDOUT)

        def alive() -> bool:
            with urllib.request.urlopen(liveness, timeout=2) as resp:
                return resp.status == 200

        wait_until(alive, timeout=120, interval=0.2, what="the operator's liveness probe")
        # A one-rank warm-up job: the clock starts once the operator is known to see jobs (its
        # first watch of a just-established CRD may be refused for a few seconds).
        # It selects no node, so it ends Unsatisfiable and holds no GPU the real job could want.
        warm = _job(ranks=1, strategy="1f1b", microbatches=4)
        warm["metadata"]["name"] = "warm-up"
        warm["spec"]["worker"]["nodeSelector"] = {"adaptis.io/bench": "none"}
        cp.apply(warm)
        wait_until(lambda: (cp.get_json("apj", "warm-up", "-n", NS).get("status") or {})
                   .get("conditions"), timeout=120, interval=0.2, what="the warm-up job's status")
        cp.kubectl("delete", "apj", "warm-up", "-n", NS)
        idle_rss, _ = rss_kib(operator.pid)
        job = _job(ranks=args.ranks, strategy=args.strategy, microbatches=args.microbatches)
        t0 = time.monotonic()
        wall0 = time.time()
        cp.apply(job)

        def planned() -> bool:
            st = cp.get_json("apj", "scale", "-n", NS).get("status") or {}
            return bool(st.get("placement")) or (st.get("phase") in {"Failed", "Pending"} and \
                any(c["type"] == "Planned" for c in st.get("conditions", [])))

        wait_until(planned, timeout=900, interval=0.2, what="the plan")
        t_plan = time.monotonic() - t0

        def bound() -> list[dict[str, Any]] | None:
            pods = cp.get_json("pods", "-n", NS, "-l", "adaptis.io/job=scale")["items"]
            done = [p for p in pods if p["spec"].get("nodeName")]
            return pods if len(done) == args.ranks else None

        pods = wait_until(bound, timeout=600, interval=0.2, what="all pods bound")
        t_bound = time.monotonic() - t0
        wait_until(lambda: (cp.get_json("apj", "scale", "-n", NS).get("status") or {})
                   .get("phase") == "Running", timeout=300, interval=0.2, what="phase Running")
        t_running = time.monotonic() - t0
        rss, peak = rss_kib(operator.pid)
        created = [epoch(p["metadata"]["creationTimestamp"]) - wall0 for p in pods]
        scheduled = [epoch(c["lastTransitionTime"]) - wall0 for p in pods
                     for c in p["status"].get("conditions", []) if c["type"] == "PodScheduled"]
        status = cp.get_json("apj", "scale", "-n", NS)["status"]
        want = {p["rank"]: p["node"] for p in status["placement"]}
        got = {int(p["metadata"]["labels"]["adaptis.io/rank"]): p["spec"]["nodeName"]
               for p in pods}
        return {
            "nodes": args.nodes,
            "gpus_per_node": args.gpus_per_node,
            "ranks": args.ranks,
            "strategy": args.strategy,
            "microbatches": args.microbatches,
            "nodes_ready_seconds": round(nodes_s, 2),
            "apply_to_planned_seconds": round(t_plan, 2),
            "apply_to_all_bound_seconds": round(t_bound, 2),
            "apply_to_running_seconds": round(t_running, 2),
            # API timestamps have one-second resolution.
            "first_pod_created_after_apply_seconds": round(min(created), 1),
            "last_pod_created_after_apply_seconds": round(max(created), 1),
            "last_pod_scheduled_after_apply_seconds": round(max(scheduled), 1),
            "operator_rss_idle_mib": round(idle_rss / 1024, 1),
            "operator_rss_mib": round(rss / 1024, 1),
            "operator_rss_peak_mib": round(peak / 1024, 1),
            "pods_on_planned_nodes": sum(got[r] == want[r] for r in want),
            "nodes_used": len(set(want.values())),
            "stages": status.get("stages"),
            "predicted_bubble_ratio": status.get("predictedBubbleRatio"),
            "predicted_speedup_over_i1f1b": status.get("predictedSpeedupOverI1F1B"),
        }
    finally:
        if operator is not None:
            operator.terminate()
            operator.wait(timeout=30)
        cp.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=256)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--strategy", default="adaptis")
    parser.add_argument("--microbatches", type=int, default=64)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    figures = run(args)
    if args.json:
        print(json.dumps(figures))
    else:
        width = max(map(len, figures))
        for key, value in figures.items():
            print(f"{key:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
