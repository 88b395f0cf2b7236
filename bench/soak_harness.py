"""The soak's harness (issue 31, item 3): what it does to the cluster a tick (the tenants'
actions and the faults), what it counts against each job, and the invariants it checks between
ticks and at the end. bench/soak.py drives it; its faults that last a window are
soak_faults.py's, its invariants soak_invariants.py's.
"""

from __future__ import annotations

import json
import logging
import random
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from benchkit import ControlPlane, ControlPlaneError, Operator, fake_job, fake_node, wait_until
from soak_faults import Windows
from soak_invariants import (
    LABEL_JOB,
    attempts_alive,
    children_left,
    counted_gang,
    gpu_double_booked,
    job_consistent,
    pod_gpus,
)

log = logging.getLogger("soak")
NS = "soak"
_TERMINAL = ("Succeeded", "Failed")
#: Reconcile passes a job may cost a minute (the operator resyncs a job every few seconds and
#: each event wakes it; a loop would be thousands).
PASSES_PER_JOB_MINUTE = 120.0


def job_manifest(name: str, rng: random.Random) -> dict[str, Any]:
    """2-4 ranks of 1-2 GPUs, a fake run of 6-20 s, backoffLimit 1-3."""
    return fake_job(name, namespace=NS, workers=rng.randint(2, 4), gpus=rng.randint(1, 2),
                    run_s=rng.randint(6, 20), backoffLimit=rng.randint(1, 3))


@dataclass
class Record:
    """What the harness did, by which it judges the cluster."""

    jobs: dict[str, dict[str, Any]] = field(default_factory=dict)  # live jobs' last status seen
    deleted: set[str] = field(default_factory=set)
    broken: dict[str, set[str]] = field(default_factory=dict)  # job -> gangs ("plan/attempt")
    replanned: set[str] = field(default_factory=set)  # jobs that lost a node
    actions: Counter[str] = field(default_factory=Counter)
    passes: int = 0  # reconcile passes of the operators killed so far
    violations: list[str] = field(default_factory=list)


class Soak:
    """The harness: one action or fault a tick, invariants between."""

    def __init__(self, *, cp: ControlPlane, op: Operator, rng: random.Random, nodes: int,
                 gpus: int) -> None:
        self.cp, self.op, self.rng, self.gpus = cp, op, rng, gpus
        self.windows = Windows(cp, namespace=NS)
        self.record = Record()
        self.serial = 0
        self.next_node = nodes

    # --------------------------------------------------------------- reads, tolerant of faults

    def _get(self, *args: str) -> list[dict[str, Any]] | None:
        """``kubectl get``'s items, or None while the API server does not answer."""
        result = self.cp.kubectl("get", *args, "-o", "json", check=False, timeout=30)
        if result.returncode != 0:
            return None
        return list(json.loads(result.stdout)["items"])

    def _pods(self) -> list[dict[str, Any]] | None:
        return self._get("pods", "-n", NS, "-l", LABEL_JOB)

    def _jobs(self) -> dict[str, dict[str, Any]] | None:
        items = self._get("apj", "-n", NS)
        return None if items is None else {j["metadata"]["name"]: j for j in items}

    # --------------------------------------------------------------- what tenants do

    def create_job(self) -> bool:
        name = f"job-{self.serial:04d}"
        self.serial += 1
        manifest = job_manifest(name, self.rng)
        ok = self.cp.kubectl("create", "-f", "-", input=json.dumps(manifest), check=False).returncode == 0
        if ok:
            self.record.jobs[name] = manifest
        return ok

    def _pick_job(self, jobs: dict[str, dict[str, Any]], *, live: bool = True) -> str | None:
        names = sorted(n for n, j in jobs.items() if n in self.record.jobs
                       and ((j.get("status") or {}).get("phase") not in _TERMINAL) == live)
        return self.rng.choice(names) if names else None

    def delete_job(self) -> bool:
        jobs = self._jobs()
        name = jobs and self._pick_job(jobs)
        if not name or self.cp.kubectl("delete", "apj", name, "-n", NS, "--wait=false",
                                       check=False).returncode != 0:
            return False
        self.record.deleted.add(name)
        self.record.jobs.pop(name)
        return True

    def suspend_or_resume(self) -> bool:
        jobs = self._jobs()
        name = jobs and self._pick_job(jobs)
        if not name:
            return False
        suspend = not jobs[name]["spec"].get("suspend", False)
        patch = json.dumps({"spec": {"suspend": suspend}})
        return self.cp.kubectl("patch", "apj", name, "-n", NS, "--type=merge", "-p", patch,
                               check=False).returncode == 0

    # --------------------------------------------------------------- faults

    def kill_operator(self) -> bool:
        assert self.op.proc is not None
        self.record.passes += passes(self.op)
        self.op.proc.kill()
        self.op.proc.wait()
        self.op.start()  # what its Deployment's kubelet would do
        return True

    def restart_apiserver(self) -> bool:
        log.info("kube-apiserver back in %.1f s", self.cp.restart("kube-apiserver", kill=True))
        return True

    def restart_etcd(self) -> bool:
        log.info("etcd back in %.1f s", self.cp.restart("etcd", kill=True))
        return True

    def _launched(self, jobs: dict[str, dict[str, Any]], pod: dict[str, Any]) -> str | None:
        return counted_gang(jobs.get(pod["metadata"].get("labels", {}).get(LABEL_JOB, "")), pod)

    def _break(self, jobs: dict[str, dict[str, Any]], pods: list[dict[str, Any]], *, fault: str) -> None:
        for pod in pods:
            gang = self._launched(jobs, pod)
            job = pod["metadata"]["labels"][LABEL_JOB]
            log.info("%s: pod %s (%s) of %s, gang %s%s", fault, pod["metadata"]["name"],
                     pod["status"].get("phase"), job, gang, "" if gang else " (not counted)")
            if gang is not None:
                self.record.broken.setdefault(job, set()).add(gang)

    def _reads(self) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]] | None:
        """The pods, then the jobs: a job's status read after its pods is at least as new as
        they are, so a gang seen launched was launched before the fault."""
        pods = self._pods()
        jobs = None if pods is None else self._jobs()
        return None if jobs is None or pods is None else (jobs, pods)

    def evict_pod(self) -> bool:
        reads = self._reads()
        if reads is None:
            return False
        jobs, pods = reads
        # Only pods of launched gangs: between reading a gang not yet launched and evicting
        # its pod, the operator may launch it, and then it counts the loss.
        alive = [p for p in pods if p["status"].get("phase") in ("Pending", "Running")
                 and not p["metadata"].get("deletionTimestamp") and self._launched(jobs, p)]
        if not alive:
            return False
        pod = self.rng.choice(alive)
        name = pod["metadata"]["name"]
        body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": NS}}
        if self.cp.kubectl("create", "--raw", f"/api/v1/namespaces/{NS}/pods/{name}/eviction", "-f", "-",
                           input=json.dumps(body), check=False).returncode != 0:
            return False
        self._break(jobs, [pod], fault="eviction")
        return True

    def _clean_nodes(self, jobs: dict[str, dict[str, Any]],
                     pods: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
        """Nodes holding workers, every one of a launched gang (for the figures' sake: a gang
        not yet launched may be launched between the read and the fault), with those workers.
        Only nodes that still exist (a deleted node's pods linger until the pod GC) and have no
        preemptor on its way: a node deleted under a preemptor, or preempted while deleted,
        would make the harness count the fault the operator does not see."""
        listed = self._get("nodes")
        if listed is None:
            return {}
        alive = {n["metadata"]["name"] for n in listed} - self.windows.preempting
        on: dict[str, list[dict[str, Any]]] = {}
        for pod in pods:
            if (pod["spec"].get("nodeName") and pod["status"].get("phase") not in _TERMINAL
                    and not pod["metadata"].get("deletionTimestamp")):
                on.setdefault(pod["spec"]["nodeName"], []).append(pod)
        return {n: ps for n, ps in sorted(on.items())
                if n in alive and all(self._launched(jobs, p) for p in ps)}

    def _target(self) -> tuple[dict[str, list[dict[str, Any]]], str] | None:
        """A node for a fault, drawn among the clean ones, with those nodes' workers."""
        reads = self._reads()
        on = self._clean_nodes(*reads) if reads is not None else {}
        return (on, self.rng.choice(list(on))) if on else None

    def delete_node(self) -> bool:
        target = self._target()
        if target is None:
            return False
        on, node = target
        if self.cp.kubectl("delete", "node", node, "--wait=false", check=False).returncode != 0:
            return False
        # A lost node re-plans the jobs on it, not counted against backoffLimit (the plan no
        # longer holds: docs/shared-cluster.md, "Gang semantics"); the pod GC removes its pods.
        for job in {p["metadata"]["labels"][LABEL_JOB] for p in on[node]}:
            log.info("node %s deleted under %s: a re-plan expected", node, job)
            self.record.replanned.add(job)
        self.cp.kubectl("create", "-f", "-", check=False,
                        input=json.dumps(fake_node(self.next_node, gpus=self.gpus, prefix="soak")))
        self.next_node += 1
        return True

    def preempt(self) -> bool:
        """A higher-priority pod for all GPUs of a node with workers: kube-scheduler preempts
        them. A preempted pod of a launched gang is lost, and the operator counts the gang's
        restart against backoffLimit (docs/shared-cluster.md, "Gang semantics"), as for an
        eviction; the preemptor goes after a while, so the job can finish."""
        target = self._target()
        if target is None:
            return False
        on, node = target
        # Fill the node first, so the workers seen there are all the preemptor will displace: a
        # worker bound between this read and the preemption would be lost uncounted.
        free = self.gpus - sum(pod_gpus(p) for p in on[node])
        filler = self.windows.fill(node, gpus=free) if free > 0 else None
        if free > 0 and filler is None:
            return False
        reads = self._reads()
        now = self._clean_nodes(*reads) if reads is not None else {}
        if reads is None or sorted(p["metadata"]["uid"] for p in now.get(node, [])) != sorted(
                p["metadata"]["uid"] for p in on[node]):
            self.windows.release(filler)  # the node changed meanwhile: no fault this tick
            return False
        if self.windows.preempt(node, gpus=self.gpus, seconds=self.rng.uniform(8, 15), filler=filler) is None:
            return False
        self._break(reads[0], on[node], fault="preemption")
        return True

    def starve(self) -> bool:
        """API Priority and Fairness rejects the operator's requests (429) for some seconds."""
        return self.windows.starve(seconds=self.rng.uniform(6, 12))

    # --------------------------------------------------------------- invariants

    def check(self) -> None:
        pods = self._get("pods", "-n", NS)  # the preemptors' GPUs too
        nodes = None if pods is None else self._get("nodes")
        if nodes is None or pods is None:
            return
        found = [*gpu_double_booked(nodes, pods), *attempts_alive(pods)]
        for violation in found:
            log.error("invariant broken: %s", violation)
        self.record.violations.extend(found)

    def finish(self, *, timeout: float) -> None:
        """Stop injecting; every job left terminal and consistent; deleted jobs left nothing."""
        self.windows.end()  # the FlowSchemas and the preemptors gone
        for name in list(self.record.jobs):  # a suspended job would never end
            self.cp.kubectl("patch", "apj", name, "-n", NS, "--type=merge", "-p",
                            '{"spec": {"suspend": false}}', check=False)

        def settled() -> dict[str, dict[str, Any]] | None:
            jobs = self._jobs()
            done = jobs is not None and all((jobs.get(n, {}).get("status") or {}).get("phase")
                                            in _TERMINAL for n in self.record.jobs)
            pods = self._pods() if done else None
            return jobs if pods is not None and not children_left(
                [(NS, n) for n in self.record.deleted], pods) else None

        try:
            jobs = wait_until(settled, timeout=timeout, interval=2.0,
                              what="every job terminal and every deleted job's pods gone")
        except ControlPlaneError:
            jobs, pods = self._jobs() or {}, self._pods() or []
            stuck = {n: ((jobs.get(n, {}).get("status") or {}).get("phase"),
                         (jobs.get(n, {}).get("status") or {}).get("message"))
                     for n in self.record.jobs
                     if (jobs.get(n, {}).get("status") or {}).get("phase") not in _TERMINAL}
            left = children_left([(NS, n) for n in self.record.deleted], pods)
            raise ControlPlaneError(f"after {timeout:.0f} s, jobs not terminal: {stuck}; "
                                    f"pods of deleted jobs: {left}") from None
        for name in self.record.jobs:
            self.record.violations.extend(job_consistent(
                jobs[name], counted_faults=len(self.record.broken.get(name, ()))))
            if name in self.record.replanned and (jobs[name].get("status") or {}).get("replans"):
                self.record.actions["jobs re-planned after a lost node"] += 1


def passes(op: Operator) -> int:
    with urllib.request.urlopen(op.metrics_url, timeout=10) as resp:  # loopback
        for line in resp.read().decode().splitlines():
            if line.startswith("adaptis_operator_reconcile_seconds_count "):
                return int(float(line.split()[-1]))
    return 0
