"""The soak's invariants (issue 31, item 3): pure checks over listed objects, one function each.

bench/soak.py lists nodes, pods and jobs from the real control plane and calls these continuously
and at the end; each returns a list of violation strings (empty: it holds), so the harness can
count and print them; ``counted_gang`` is the harness's rule for which of its faults count
against a job. They take plain dicts as the API returns them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

GPU = "nvidia.com/gpu"
LABEL_JOB = "adaptis.io/job"
LABEL_ATTEMPT = "adaptis.io/attempt"
_TERMINAL_PHASES = ("Succeeded", "Failed")


def _alive(pod: Mapping[str, Any]) -> bool:
    return (pod.get("status", {}).get("phase") not in _TERMINAL_PHASES
            and not pod.get("metadata", {}).get("deletionTimestamp"))


def pod_gpus(pod: Mapping[str, Any]) -> int:
    """The GPUs a pod requests, over its containers."""
    total = 0
    for container in pod.get("spec", {}).get("containers", []):
        total += int(container.get("resources", {}).get("requests", {}).get(GPU, 0))
    return total


def gpu_double_booked(nodes: Iterable[Mapping[str, Any]],
                      pods: Iterable[Mapping[str, Any]]) -> list[str]:
    """Nodes whose bound, alive pods request more GPUs than the node has allocatable. A pod
    bound to a node not in ``nodes`` (deleted, or newer than the list) books no listed node."""
    allocatable = {n["metadata"]["name"]: int(n.get("status", {}).get("allocatable", {}).get(GPU, 0))
                   for n in nodes}
    used: dict[str, int] = defaultdict(int)
    for pod in pods:
        node = pod.get("spec", {}).get("nodeName")
        if node and _alive(pod):
            used[node] += pod_gpus(pod)
    return [f"node {node}: {count} GPUs requested > {allocatable[node]} allocatable"
            for node, count in sorted(used.items()) if node in allocatable and count > allocatable[node]]


def attempts_alive(pods: Iterable[Mapping[str, Any]]) -> list[str]:
    """Jobs with alive pods of more than one attempt at once."""
    attempts: dict[tuple[str, str], set[str]] = defaultdict(set)
    for pod in pods:
        labels = pod.get("metadata", {}).get("labels", {})
        if LABEL_JOB in labels and _alive(pod):
            key = (pod["metadata"].get("namespace", ""), labels[LABEL_JOB])
            attempts[key].add(labels.get(LABEL_ATTEMPT, "?"))
    return [f"job {ns}/{job}: pods of attempts {sorted(seen)} alive together"
            for (ns, job), seen in sorted(attempts.items()) if len(seen) > 1]


def children_left(deleted_jobs: Iterable[tuple[str, str]],
                  pods: Iterable[Mapping[str, Any]]) -> list[str]:
    """Pods still alive (not being deleted) of jobs the harness deleted."""
    gone = set(deleted_jobs)
    return [f"job {pod['metadata'].get('namespace', '')}/{pod['metadata']['labels'][LABEL_JOB]}: "
            f"pod {pod['metadata']['name']} left after deletion"
            for pod in pods
            if LABEL_JOB in pod.get("metadata", {}).get("labels", {}) and _alive(pod)
            and (pod["metadata"].get("namespace", ""), pod["metadata"]["labels"][LABEL_JOB]) in gone]


def counted_gang(job: Mapping[str, Any] | None, pod: Mapping[str, Any]) -> str | None:
    """The gang (``plan/attempt``) a fault to ``pod`` counts against ``job``'s backoffLimit, or
    None when the operator would not count it: it counts a lost pod once every rank of the
    current attempt had its pod (``status.launched`` names that attempt, the pod is of it, and
    the job is not finished). Read the job after the pod, so its status is no older."""
    status = (job or {}).get("status") or {}
    launched = str(status.get("launched") or "")
    attempt = launched.rpartition("/")[2]
    labels = pod.get("metadata", {}).get("labels", {})
    current = bool(launched) and attempt == labels.get(LABEL_ATTEMPT) == str(status.get("restarts", 0))
    return launched if current and status.get("phase") not in _TERMINAL_PHASES else None


def job_consistent(job: Mapping[str, Any], *, counted_faults: int) -> list[str]:
    """A terminal job's phase and restarts agree with the faults the harness counted against it.

    counted_faults: the failures the harness caused that count against spec.backoffLimit (not a
    preemption or a lost node while not yet Running, which the operator does not count).
    Succeeded needs restarts == counted_faults <= backoffLimit; Failed needs the limit exceeded
    and a message naming spec.backoffLimit.
    """
    meta, spec, status = job.get("metadata", {}), job.get("spec", {}), job.get("status", {})
    name = f"job {meta.get('namespace', '')}/{meta.get('name', '')}"
    limit, phase = int(spec.get("backoffLimit", 3)), status.get("phase")
    restarts = int(status.get("restarts", 0))
    if phase == "Succeeded":
        if counted_faults > limit:
            return [f"{name}: Succeeded after {counted_faults} faults > backoffLimit {limit}"]
        if restarts != counted_faults:
            return [f"{name}: {restarts} restarts counted for {counted_faults} faults"]
        return []
    if phase == "Failed":
        if counted_faults <= limit:
            return [f"{name}: Failed with {counted_faults} faults <= backoffLimit {limit}: "
                    f"{status.get('message', '')}"]
        if "backoffLimit" not in str(status.get("message", "")):
            return [f"{name}: Failed without naming backoffLimit: {status.get('message', '')}"]
        return []
    return [f"{name}: not terminal ({phase})"]


def no_hot_loop(requests: int, *, jobs: int, minutes: float, per_job_minute: float) -> list[str]:
    """The operator's API requests (e.g. apiserver_request_total of its user, differenced) per
    job per minute stay within per_job_minute."""
    rate = requests / max(jobs, 1) / max(minutes, 1e-9)
    if rate > per_job_minute:
        return [f"{requests} requests for {jobs} jobs in {minutes:.1f} min: {rate:.1f} a job a "
                f"minute > {per_job_minute}"]
    return []
