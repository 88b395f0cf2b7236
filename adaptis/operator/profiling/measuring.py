"""The measuring step of a reconcile pass (``spec.planner.profile: measure``).

Sits between :mod:`adaptis.operator.control.reconcile` (which calls :func:`measure_candidates`
before planning) and :mod:`adaptis.operator.profiling.profiler_pods` (the pure rendering and reading
of the profiler pods). One call looks at the candidate nodes once: it creates the missing profiler
pods (in the operator's namespace, with the admin's profiler image), stores each finished and
validated profile in the node's ConfigMap of :mod:`adaptis.operator.profiling.profile_store` (so the
next job needs no pod), gives up on nodes whose profiler failed, wrote nothing within the schema or
outlived the timeout (they keep the label-based estimate, and the job gets a ``ProfilingFailed``
Event), and says whether planning must wait. Deleting the pods is the caller's business: it happens
once a plan exists, whatever made it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

from adaptis.api.conditions import ConditionType, Reason
from adaptis.api.job import JobSpec
from adaptis.operator.core.passes import PassState
from adaptis.operator.core.records import JobRef, NodeProfile
from adaptis.operator.core.settings import ReconcileSettings
from adaptis.operator.kube.cluster import Cluster
from adaptis.operator.profiling.nodes import profile_node
from adaptis.operator.profiling.profile_store import (
    hardware_fingerprint,
    measured_figures,
    profile_config_map_name,
    render_profile_config_map,
)
from adaptis.operator.profiling.profiler_pods import (
    NODE_ANNOTATION,
    is_profiler_of,
    nodes_to_profile,
    profiler_node,
    read_profiler_pod,
    render_profiler_pod,
    seconds_left,
)

__all__ = ["Measured", "delete_job_profilers", "job_profilers", "measure_candidates"]

# How often a job waiting for its profilers looks again: the pods live in the operator's
# namespace, whose events reach the job only where the operator watches that namespace.
_POLL_S = 5.0

#: The candidates with the new measurements applied, and one note per node that keeps the
#: label-based estimate because its profiler gave nothing usable.
Measured = tuple[list[NodeProfile], list[str]]


def job_profilers(cluster: Cluster, job: JobRef, *,
                  settings: ReconcileSettings) -> list[dict[str, Any]]:
    """The job's profiler pods, in the operator's namespace (found by label: not owned)."""
    return [pod for pod in cluster.list_pods(settings.profile_namespace, job.name)
            if is_profiler_of(pod, job)]


def delete_job_profilers(cluster: Cluster, job: JobRef, *, settings: ReconcileSettings) -> None:
    """For a job that is gone: its profiler pods cannot be garbage-collected with it."""
    for pod in job_profilers(cluster, job, settings=settings):
        meta = pod.get("metadata") or {}
        if not meta.get("deletionTimestamp"):
            cluster.delete_pod(meta["namespace"], meta["name"])


def _store(cluster: Cluster, *, settings: ReconcileSettings, raw: Mapping[str, Any],
           document: str) -> NodeProfile:
    """Keep the document under the node's hardware fingerprint; the node as it now reads."""
    name = str((raw.get("metadata") or {}).get("name", ""))
    fingerprint = hardware_fingerprint(raw)
    cm = render_profile_config_map(namespace=settings.profile_namespace, node=name,
                                   fingerprint=fingerprint, document=document)
    if not cluster.create(cm):
        cluster.replace_config_map(cm)  # a merge: the node's other fingerprints stay
    figures = measured_figures({name: {fingerprint: document}}, raw)
    return profile_node(raw, topology_keys=settings.topology_keys, measured=figures)


def measure_candidates(
    cluster: Cluster,
    p: PassState,
    *,
    spec: JobSpec,
    candidates: Sequence[NodeProfile],
    profilers: Sequence[Mapping[str, Any]],
    raw_nodes: Mapping[str, Mapping[str, Any]],
    given_up: MutableMapping[str, str],
    settings: ReconcileSettings,
    create_all: Callable[[Sequence[Mapping[str, Any]]], tuple[int, Mapping[str, object]]],
) -> Measured | None:
    """Profile the unmeasured candidates with one pod each; None while any is at work.

    ``given_up`` (node -> why) is the caller's memory of failed profilers across passes; it is
    updated here. ``create_all`` creates objects and returns how many are new and, by name,
    the refusals of admission (a profiler pod the operator's namespace does not admit: its node
    keeps the estimate, as for a failed profiler).
    """
    timeout = settings.profile_timeout_s
    by_node = {profiler_node(pod): pod for pod in profilers}
    measured: dict[str, NodeProfile] = {}
    waiting: list[str] = []
    to_create: list[dict[str, Any]] = []
    for node in nodes_to_profile(candidates, given_up=given_up):
        pod = by_node.get(node.name)
        if pod is None:
            to_create.append(_profiler_pod(p.job, node, spec=spec, settings=settings))
            waiting.append(node.name)
            p.requeue.append(min(timeout, _POLL_S))
            continue
        outcome = read_profiler_pod(pod, now=p.now, timeout_s=timeout)
        if outcome.state == "measured" and outcome.profile is not None:
            # Stored at once, before planning: a crash in between loses no measurement.
            measured[node.name] = _store(cluster, settings=settings, raw=raw_nodes[node.name],
                                         document=outcome.profile)
            p.events.append(("Normal", Reason.NODE_PROFILED, f"node {node.name}: measured hardware "
                             f"profile stored in ConfigMap {settings.profile_namespace}/"
                             f"{profile_config_map_name(node.name)}"))
        elif outcome.state == "failed":
            given_up[node.name] = outcome.reason
            p.events.append(("Warning", Reason.PROFILING_FAILED, f"node {node.name}: "
                             f"{outcome.reason}; using the label-based estimate"))
        else:
            waiting.append(node.name)
            p.requeue.append(min(_POLL_S, seconds_left(pod, now=p.now, timeout_s=timeout)))
    created, refused = create_all(to_create)
    for node_name in _give_up_refused(p, pods=to_create, refused=refused, given_up=given_up):
        waiting.remove(node_name)
    if created:
        p.events.append(("Normal", Reason.CREATED_PROFILER_PODS,
                         f"created {created} profiler pod(s) (spec.planner.profile: measure)"))
    if waiting:
        shown = ", ".join(waiting[:5]) + (", ..." if len(waiting) > 5 else "")
        p.update(phase="Profiling")
        p.condition(ConditionType.PROFILING, "True", reason=Reason.MEASURING_NODES,
                    message=f"waiting for {len(waiting)} profiler pod(s) on node(s) {shown} "
                    f"(timeout {timeout:g}s)")
        return None
    notes = [f"node {c.name}: {given_up[c.name]}; using the label-based estimate"
             for c in candidates if c.name in given_up and not c.measured]
    return [measured.get(c.name, c) for c in candidates], notes


def _profiler_pod(job: JobRef, node: NodeProfile, *, spec: JobSpec,
                  settings: ReconcileSettings) -> dict[str, Any]:
    """The profiler pod for ``node``: the admin's image and pull policy, never the job's (see
    :mod:`adaptis.operator.profiling.profiler_pods`), the job's tolerations to reach its nodes."""
    return render_profiler_pod(
        job, node, namespace=settings.profile_namespace,
        image=settings.profiler_image or settings.manifests.image,
        image_pull_policy=settings.manifests.image_pull_policy,
        tolerations=spec.worker.tolerations, timeout_s=max(1, int(settings.profile_timeout_s)),
        run_as_user=settings.manifests.run_as_user,
        run_as_group=settings.manifests.run_as_group)


def _give_up_refused(p: PassState, *, pods: Sequence[Mapping[str, Any]], refused: Mapping[str, object],
                     given_up: MutableMapping[str, str]) -> list[str]:
    """Give up the nodes whose profiler pod the API server refused (each keeps its estimate,
    with a warning event); their names."""
    names = []
    for pod in pods:
        why = refused.get(pod["metadata"]["name"])
        if why is None:
            continue
        node_name = str(pod["metadata"]["annotations"][NODE_ANNOTATION])
        given_up[node_name] = f"profiler pod refused by the API server ({why})"
        p.events.append(("Warning", Reason.PROFILING_FAILED, f"node {node_name}: "
                         f"{given_up[node_name]}; using the label-based estimate"))
        names.append(node_name)
    return names
