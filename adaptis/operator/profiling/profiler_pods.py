"""Measured node profiles: the profiler pods of ``spec.planner.profile: measure``, as pure functions.

Sits beside :mod:`adaptis.operator.profiling.profile_store` (where a measured profile is kept) and
under :mod:`adaptis.operator.profiling.measuring` (which creates, reads and deletes the pods, and
stores the results). The flow, one node at a time:

1. :func:`nodes_to_profile`: a candidate node without a stored measurement (and not already
   given up on) needs a profiler pod;
2. :func:`render_profiler_pod`: one pod per such node, pinned to it by required node affinity,
   running ``adaptis profile --hardware -o /dev/termination-log`` in the image the cluster
   admin configured (``adaptis operator --profiler-image``, never the job's
   ``spec.worker.image``), in the operator's own namespace (``--profile-namespace``), not the
   job's: a tenant who may create, exec into or replace pods in its namespace can then neither
   run the profiler's code nor write its termination message;
3. :func:`read_profiler_pod`: a finished pod's termination message is the hardware profiler's JSON
   document (:mod:`adaptis.worker.profiling.hardware`), held to the strict schema of
   :mod:`adaptis.api.measured_hardware` by :func:`parse_hardware_message` and stored, so the next
   job on that node needs no pod; a failed pod, a document outside the schema or a pod that outlives
   the timeout means the node keeps the label-based estimate.

Pods in another namespace cannot be owned by the job (owner references stay in a namespace),
so they carry the job's name and namespace as labels, and the reconciler deletes them once the
job has a plan or is gone.

Nothing here talks to the API server, so every decision is unit-tested on plain dicts.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from adaptis.api.errors import SpecError
from adaptis.api.measured_hardware import parse_measured_hardware
from adaptis.operator.core.conditions import parse_time
from adaptis.operator.core.errors import OperatorError
from adaptis.operator.core.labels import GPU_RESOURCE, HOSTNAME_LABEL, LABEL_JOB, LABEL_MANAGED_BY, MANAGED_BY
from adaptis.operator.core.records import JobRef, NodeProfile
from adaptis.operator.resources.pod_security import (
    container_security_context,
    pod_security_context,
    scratch_env,
    scratch_mounts,
    scratch_volumes,
)

__all__ = [
    "LABEL_JOB_NAMESPACE",
    "LABEL_ROLE",
    "NODE_ANNOTATION",
    "PROFILER_COMMAND",
    "ProfilerOutcome",
    "ProfilerOutputError",
    "ROLE_PROFILER",
    "TERMINATION_LOG",
    "is_profiler_of",
    "is_profiler_pod",
    "nodes_to_profile",
    "parse_hardware_message",
    "profiler_node",
    "profiler_pod_name",
    "read_profiler_pod",
    "render_profiler_pod",
    "seconds_left",
]

LABEL_ROLE = "adaptis.io/role"
LABEL_JOB_NAMESPACE = "adaptis.io/job-namespace"
ROLE_PROFILER = "profiler"
NODE_ANNOTATION = "adaptis.io/node"
TERMINATION_LOG = "/dev/termination-log"
PROFILER_COMMAND: tuple[str, ...] = ("adaptis", "profile", "--hardware", "-o", TERMINATION_LOG)
_MAX_REASON = 200


class ProfilerOutputError(OperatorError):
    """A termination message that is not a usable hardware profile."""


@dataclass(frozen=True, slots=True)
class ProfilerOutcome:
    """Where the profiler pod of one node stands.

    ``waiting``: not finished yet (or still terminating); ``measured``: ``profile`` is the
    document to cache on the node; ``failed``: ``reason`` says why the estimate is used instead.
    """

    node: str
    state: Literal["waiting", "measured", "failed"]
    profile: str | None = None
    reason: str = ""


def profiler_pod_name(job: JobRef, node: str) -> str:
    """Deterministic per (job namespace, job, node), hashed: the pods of jobs of the same name
    in different namespaces share the operator's namespace, and a node name may be 253 long."""
    digest = hashlib.sha256(f"{job.namespace}/{job.name}/{node}".encode()).hexdigest()[:16]
    return f"adaptis-profiler-{digest}"


def is_profiler_pod(pod: Mapping[str, Any]) -> bool:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return labels.get(LABEL_ROLE) == ROLE_PROFILER


def is_profiler_of(pod: Mapping[str, Any], job: JobRef) -> bool:
    """A profiler pod the operator made for this job (in its namespace, found by label)."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return (is_profiler_pod(pod) and labels.get(LABEL_JOB) == job.name
            and labels.get(LABEL_JOB_NAMESPACE) == job.namespace)


def profiler_node(pod: Mapping[str, Any]) -> str | None:
    """The node a profiler pod measures (from the annotation the operator set)."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    node = annotations.get(NODE_ANNOTATION)
    return str(node) if node else None


def nodes_to_profile(candidates: Iterable[NodeProfile], *,
                     given_up: Collection[str] = ()) -> list[NodeProfile]:
    """Candidates without a cached measurement, except those whose profiler already failed."""
    return [n for n in candidates if not n.measured and n.name not in given_up]


def render_profiler_pod(
    job: JobRef,
    node: NodeProfile,
    *,
    namespace: str,
    image: str,
    image_pull_policy: str,
    tolerations: Sequence[Mapping[str, Any]],
    timeout_s: int,
    run_as_user: int,
    run_as_group: int,
) -> dict[str, Any]:
    """The profiler pod of one node, in ``namespace`` (the operator's): pinned to the node, one
    GPU if it has any, restricted like the workers.

    The pod carries the job's name and namespace as labels so that the reconciler finds and
    deletes it (and, where the operator watches ``namespace``, its events wake the job), and
    the role label so that it never counts as a worker.
    """
    tols = [dict(t) for t in tolerations]
    resources: dict[str, Any] = {}
    if node.gpus > 0:
        resources = {"limits": {GPU_RESOURCE: "1"}, "requests": {GPU_RESOURCE: "1"}}
        # GPU nodes are commonly tainted so that only GPU pods land there (as for workers).
        tols.append({"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    container: dict[str, Any] = {
        "name": "profiler",
        "image": image,
        "imagePullPolicy": image_pull_policy,
        "command": list(PROFILER_COMMAND),
        "env": scratch_env(),
        "resources": resources,
        "volumeMounts": scratch_mounts(),
        "securityContext": container_security_context(),
        "terminationMessagePath": TERMINATION_LOG,
        # The document is the message; a crash leaves the log tail there instead, which
        # parse_hardware_message rejects with the tail in the reason.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": pod_security_context(run_as_user=run_as_user,
                                                run_as_group=run_as_group),
        # The kubelet stops a profiler that hangs once started; the reconciler's own timeout
        # also covers a pod that never starts.
        "activeDeadlineSeconds": timeout_s,
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{
                "key": HOSTNAME_LABEL, "operator": "In", "values": [node.hostname],
            }]}],
        }}},
        "containers": [container],
        "volumes": scratch_volumes(),
    }
    if tols:
        pod_spec["tolerations"] = tols
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": profiler_pod_name(job, node.name),
            "namespace": namespace,
            "labels": {LABEL_MANAGED_BY: MANAGED_BY, LABEL_JOB: job.name,
                       LABEL_JOB_NAMESPACE: job.namespace, LABEL_ROLE: ROLE_PROFILER},
            "annotations": {NODE_ANNOTATION: node.name},
        },
        "spec": pod_spec,
    }


def parse_hardware_message(text: str) -> str:
    """The hardware profiler's document, compact, ready to store.

    Raises :class:`ProfilerOutputError` unless it is JSON that passes
    :class:`~adaptis.api.measured_hardware.MeasuredHardware` (no unknown key, every figure in
    bounds).
    """
    try:
        data = json.loads(text)
    except ValueError:
        raise ProfilerOutputError(f"not JSON: {_clip(text)!r}") from None
    if not isinstance(data, dict):
        raise ProfilerOutputError(f"not a JSON object: {_clip(text)!r}")
    compact = json.dumps(data, separators=(",", ":"))
    try:
        parse_measured_hardware(compact)
    except SpecError as err:
        raise ProfilerOutputError(_clip("; ".join(str(err).splitlines()))) from None
    return compact


def _clip(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MAX_REASON else text[: _MAX_REASON - 3] + "..."


def _terminated(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        terminated = (cs.get("state") or {}).get("terminated")
        if terminated:
            return dict(terminated)
    return {}


def read_profiler_pod(pod: Mapping[str, Any], *, now: datetime, timeout_s: float) -> ProfilerOutcome:
    """Where one profiler pod stands (see :class:`ProfilerOutcome`)."""
    meta = pod.get("metadata") or {}
    node = profiler_node(pod) or ""
    name = meta.get("name", "?")
    if meta.get("deletionTimestamp"):
        return ProfilerOutcome(node=node, state="waiting")  # an earlier one, on its way out
    status = pod.get("status") or {}
    phase = status.get("phase")
    terminated = _terminated(pod)
    if phase == "Succeeded":
        try:
            profile = parse_hardware_message(str(terminated.get("message") or ""))
        except ProfilerOutputError as err:
            return ProfilerOutcome(node=node, state="failed",
                                   reason=f"profiler pod {name} wrote no usable profile ({err})")
        return ProfilerOutcome(node=node, state="measured", profile=profile)
    if phase == "Failed":
        why = (terminated.get("message") or terminated.get("reason") or status.get("message")
               or status.get("reason") or "no reason given")
        code = terminated.get("exitCode")
        detail = f"exit code {code}: {why}" if code is not None else str(why)
        return ProfilerOutcome(node=node, state="failed",
                               reason=f"profiler pod {name} failed ({_clip(str(detail))})")
    created = parse_time(meta.get("creationTimestamp"))
    if created is not None and (now - created).total_seconds() >= timeout_s:
        return ProfilerOutcome(node=node, state="failed",
                               reason=f"profiler pod {name} did not finish within {timeout_s:g}s "
                               f"(phase {phase or 'unknown'})")
    return ProfilerOutcome(node=node, state="waiting")


def seconds_left(pod: Mapping[str, Any], *, now: datetime, timeout_s: float) -> float:
    """Seconds until a waiting profiler pod times out (the whole timeout if its age is unknown)."""
    created = parse_time((pod.get("metadata") or {}).get("creationTimestamp"))
    if created is None:
        return timeout_s
    return max(1.0, timeout_s - (now - created).total_seconds())
