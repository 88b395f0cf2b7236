"""The soak (issue 31, item 3): faults arriving together while jobs come and go, on the real
control plane, with the invariants of ``soak_invariants.py`` checked all along and at the end.

For ``--minutes`` the harness does, in a random order and overlapping, one thing a tick: creates
a job (2-4 ranks of 1-2 GPUs, a fake run of 6-20 s, backoffLimit 1-3), deletes one, suspends or
resumes one, and injects a fault: ``kill -9`` of the operator (started again, as its Deployment
would), a restart of kube-apiserver or of etcd (the same data, ports and flags), an eviction of
a worker pod through the Eviction API, the deletion of a node that holds workers (added back
under a new name; its jobs re-plan, not counted against backoffLimit), a preemption (a plain pod
of PriorityClass ``soak-high`` asking for all GPUs of a node with workers: kube-scheduler
preempts them; it goes after 8-15 s), and a window of 6-12 s in which API Priority and Fairness
rejects the operator's requests with HTTP 429 (``soak_faults.py``; the operator runs as the
chart's ServiceAccount with the chart's RBAC, since system:masters is exempt from APF). Between
ticks it checks that no GPU is double-booked (the preemptors' GPUs included) and that at most
one attempt's pods of a job are alive. At the end it stops injecting, waits for the windows to
close and until every job left is terminal, and checks each against the faults it counted (a
job's restarts equal the distinct attempts the harness broke after every rank had its pod,
which is when the operator counts a lost pod: an eviction or a preemption alike,
docs/shared-cluster.md "Gang semantics"), that a deleted job left no pod, and that the
operator's reconcile passes per job and minute stay bounded (no hot loop). Its figures count
the operator's requests the API server rejected (``apiserver_flowcontrol_rejected_requests_total``
of the operator's FlowSchema) and the preemptors the scheduler bound.

    python bench/soak.py --minutes 2 --seed 1      # the short form (tests/integration/test_soak.py)
    python bench/soak.py --minutes 30 --nodes 16   # the long form, by hand

Not injected yet (see bench/RESULTS.md): a TCP proxy's latency and resets on the operator's
connection, and NotReady nodes. A preemption hits exactly the workers the harness read on the
node: a plain filler pod takes the node's free GPUs first and the node is read again, so no
worker can land there unseen before the preemptor comes (the harness picks only nodes whose
every worker is of a launched gang, as for node deletion).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchkit import ControlPlane, Operator, bin_dir, create_nodes, fake_node, install_crd
from soak_faults import operator_kubeconfig
from soak_harness import NS, PASSES_PER_JOB_MINUTE, Soak, passes
from soak_invariants import no_hot_loop

from adaptis.operator.core.settings import ReconcileSettings

FAULTS: dict[str, Callable[[Soak], bool]] = {
    "operator kill -9": Soak.kill_operator, "kube-apiserver restart": Soak.restart_apiserver,
    "etcd restart": Soak.restart_etcd, "pod eviction": Soak.evict_pod, "node deletion": Soak.delete_node,
    "preemption": Soak.preempt, "APF 429 window": Soak.starve,
}
ACTIONS: dict[str, Callable[[Soak], bool]] = {
    "job created": Soak.create_job, "job deleted": Soak.delete_job, "suspend/resume": Soak.suspend_or_resume,
}
#: How often each is drawn: jobs come more often than they go, and faults are a third of ticks.
WEIGHTS = {"job created": 6, "job deleted": 1, "suspend/resume": 1, "operator kill -9": 1,
           "kube-apiserver restart": 0.5, "etcd restart": 0.5, "pod eviction": 2, "node deletion": 1,
           "preemption": 1.5, "APF 429 window": 1}


def _draw(rng: random.Random, *, done: Counter[str], late: bool) -> str:
    """The next action or fault; in the second half of the soak a fault not yet injected comes
    every other tick, so even a short soak injects every kind (the ticks between keep creating
    the jobs that a fault needs: a node deletion or a preemption needs a launched gang)."""
    missing = [kind for kind in FAULTS if not done[kind]]
    if late and missing and rng.random() < 0.5:
        return rng.choice(missing)
    return rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0]


def soak(*, binaries: Path, minutes: float, nodes: int, gpus: int, seed: int, work: Path,
         settle_s: float = 600) -> dict[str, Any]:
    """Run the soak on a control plane of its own (it restarts the API server and etcd); its
    figures, the violations among them."""
    rng = random.Random(seed)
    with ControlPlane(binaries, work / "cluster") as cp:
        install_crd(cp)
        cp.create_namespace(NS)
        # The operator keeps its plan records in its own namespace, as the chart's release one.
        cp.create_namespace(ReconcileSettings().profile_namespace)
        create_nodes(cp, [fake_node(i, gpus=gpus, prefix="soak") for i in range(nodes)])
        # As the chart's ServiceAccount, with the chart's RBAC: a FlowSchema can match it.
        op = Operator(cp=cp, namespace=NS, log_path=work / "operator.log",
                      kubeconfig=operator_kubeconfig(cp, namespace=NS))
        op.start()
        harness = Soak(cp=cp, op=op, rng=rng, nodes=nodes, gpus=gpus)
        started = last = time.monotonic()
        job_minutes = 0.0  # jobs alive x minutes, for the hot-loop bound
        try:
            while time.monotonic() - started < 60 * minutes:
                late = time.monotonic() - started > 30 * minutes
                kind = _draw(rng, done=harness.record.actions, late=late)
                if {**FAULTS, **ACTIONS}[kind](harness):
                    harness.record.actions[kind] += 1
                harness.check()
                time.sleep(rng.uniform(0.5, 3.0))
                job_minutes += len(harness.record.jobs) * (time.monotonic() - last) / 60
                last = time.monotonic()
            soaked = (last - started) / 60
            harness.finish(timeout=settle_s)
            job_minutes += len(harness.record.jobs) * (time.monotonic() - last) / 60
            total_passes = harness.record.passes + passes(op)
        finally:
            op.stop()
        record = harness.record
        record.violations.extend(no_hot_loop(total_passes, jobs=1, minutes=job_minutes,
                                             per_job_minute=PASSES_PER_JOB_MINUTE))
        return {"minutes soaked": round(soaked, 2), "seed": seed, **dict(sorted(record.actions.items())),
                "jobs finished": len(record.jobs), "jobs deleted": len(record.deleted),
                "attempts broken": sum(len(g) for g in record.broken.values()),
                "operator requests rejected 429": harness.windows.rejected_429,
                "preemptors bound": harness.windows.preemptors_bound,
                "passes per job-minute": round(total_passes / max(job_minutes, 1e-9), 1),
                "invariant violations": len(record.violations), "violations": record.violations}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=2.0)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--gpus", type=int, default=8, help="GPUs per node")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    with tempfile.TemporaryDirectory(prefix="adaptis-soak-") as tmp:
        figures = soak(binaries=bin_dir(), minutes=args.minutes, nodes=args.nodes, gpus=args.gpus, seed=args.seed,
                       work=Path(tmp))
    if args.json:
        print(json.dumps(figures))
    else:
        for key, value in figures.items():
            print(f"{key:>36}: {value}")
    sys.exit(1 if figures["invariant violations"] else 0)


if __name__ == "__main__":
    main()
