"""The measuring step of a reconcile pass (``spec.planner.profile: measure``).

Sits between :mod:`adaptis.operator.reconcile` (which calls :func:`measure_candidates` before
planning) and :mod:`adaptis.operator.profiler_pods` (the pure rendering and reading of the
profiler pods). One call looks at the candidate nodes once: it creates the missing profiler
pods, caches each finished profile on its node (annotation
:data:`~adaptis.operator.profiling.PROFILE_ANNOTATION`, so the next job needs no pod), gives up
on nodes whose profiler failed, wrote nothing usable or outlived the timeout (they keep the
label-based estimate), and says whether planning must wait. Deleting the pods is the caller's
business: it happens once a plan exists, whatever made it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

from adaptis.api.job import JobSpec
from adaptis.operator.kube import Cluster
from adaptis.operator.passes import PassState, ReconcileSettings
from adaptis.operator.profiler_pods import (
    nodes_to_profile,
    profiler_node,
    read_profiler_pod,
    render_profiler_pod,
    seconds_left,
)
from adaptis.operator.profiling import PROFILE_ANNOTATION, NodeProfile, profile_node

__all__ = ["Measured", "measure_candidates"]

#: The candidates with the new measurements applied, and one note per node that keeps the
#: label-based estimate because its profiler gave nothing usable.
Measured = tuple[list[NodeProfile], list[str]]


def _with_profile(raw: Mapping[str, Any], profile: str, *,
                  settings: ReconcileSettings) -> NodeProfile:
    """The node as it reads once the annotation just written is there."""
    node = copy.deepcopy(dict(raw))
    meta = node.setdefault("metadata", {})
    meta["annotations"] = {**(meta.get("annotations") or {}), PROFILE_ANNOTATION: profile}
    return profile_node(node, topology_keys=settings.topology_keys)


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
    create_all: Callable[[Sequence[Mapping[str, Any]]], int],
) -> Measured | None:
    """Profile the unmeasured candidates with one pod each; None while any is at work.

    ``given_up`` (node -> why) is the caller's memory of failed profilers across passes; it is
    updated here. ``create_all`` creates objects and counts the new ones.
    """
    timeout = settings.profile_timeout_s
    by_node = {profiler_node(pod): pod for pod in profilers}
    measured: dict[str, NodeProfile] = {}
    waiting: list[str] = []
    to_create: list[dict[str, Any]] = []
    for node in nodes_to_profile(candidates, given_up=given_up):
        pod = by_node.get(node.name)
        if pod is None:
            to_create.append(render_profiler_pod(
                p.job, node, image=spec.worker.image or settings.manifests.image,
                image_pull_policy=(spec.worker.image_pull_policy
                                   or settings.manifests.image_pull_policy),
                tolerations=spec.worker.tolerations, timeout_s=max(1, int(timeout)),
                run_as_user=settings.manifests.run_as_user,
                run_as_group=settings.manifests.run_as_group))
            waiting.append(node.name)
            p.requeue.append(timeout)
            continue
        outcome = read_profiler_pod(pod, now=p.now, timeout_s=timeout)
        if outcome.state == "measured" and outcome.profile is not None:
            # Cached at once, before planning: a crash in between loses no measurement.
            cluster.annotate_node(node.name, annotations={PROFILE_ANNOTATION: outcome.profile})
            measured[node.name] = _with_profile(raw_nodes[node.name], outcome.profile,
                                                settings=settings)
            p.events.append(("Normal", "NodeProfiled", f"node {node.name}: measured hardware "
                             f"profile cached in annotation {PROFILE_ANNOTATION}"))
        elif outcome.state == "failed":
            given_up[node.name] = outcome.reason
            p.events.append(("Warning", "ProfilingFailed", f"node {node.name}: "
                             f"{outcome.reason}; using the label-based estimate"))
        else:
            waiting.append(node.name)
            p.requeue.append(seconds_left(pod, now=p.now, timeout_s=timeout))
    created = create_all(to_create)
    if created:
        p.events.append(("Normal", "CreatedProfilerPods",
                         f"created {created} profiler pod(s) (spec.planner.profile: measure)"))
    if waiting:
        shown = ", ".join(waiting[:5]) + (", ..." if len(waiting) > 5 else "")
        p.update(phase="Profiling")
        p.condition("Profiling", "True", reason="MeasuringNodes",
                    message=f"waiting for {len(waiting)} profiler pod(s) on node(s) {shown} "
                    f"(timeout {timeout:g}s)")
        return None
    notes = [f"node {c.name}: {given_up[c.name]}; using the label-based estimate"
             for c in candidates if c.name in given_up and not c.measured]
    return [measured.get(c.name, c) for c in candidates], notes
