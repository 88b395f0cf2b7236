"""Placement: from a job to the plan it runs, on GPUs nobody else holds.

Sits under :mod:`adaptis.operator.reconcile`, which calls :meth:`Placer.place` once a pass and
gets the plan to run or None (the job waits: for its profiler pods, for free GPUs, or because
no plan exists, each said in its status). One pass:

profile the nodes -> the job's candidate nodes (selector, tolerations, GPUs; minus nodes its
ranks stayed unschedulable on) -> keep the plan cached in the job's ConfigMap while the spec and
its nodes are unchanged and its GPUs still free -> else, with ``spec.planner.profile: measure``,
measure the candidates first (:mod:`adaptis.operator.measuring`) -> admit the job onto free GPUs
or queue it (:mod:`adaptis.operator.admitting`) -> plan on the reserved slots -> write the
ConfigMap.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from functools import partial
from typing import Any

from pydantic import ValidationError

from adaptis.api.job import JobSpec
from adaptis.operator.admitting import Waiting, admit, hold_placement
from adaptis.operator.capacity import CapacityLedger, JobKey
from adaptis.operator import children
from adaptis.operator.errors import OperatorError, PlanTooLarge, Unsatisfiable
from adaptis.operator.kube import Cluster, create_many
from adaptis.operator.manifests import config_map_name, render_config_map, render_pod
from adaptis.operator.measuring import measure_candidates
from adaptis.operator.passes import PassState, ReconcileSettings
from adaptis.operator.plan_runner import Planner, Planning, PlanRequest, planned_reason
from adaptis.operator.planning import PlanRecord, record_from_config_map, spec_hash
from adaptis.operator.profile_store import measured_figures, profile_selector, read_stored_profiles
from adaptis.operator.profiling import NodeProfile, candidate_nodes, profile_node
from adaptis.operator.status import condition_true, plan_summary
from adaptis.planner.errors import PlannerError

__all__ = ["Placer"]

log = logging.getLogger(__name__)

# How soon to look again when nothing else will wake the job (no pod or node event).
_RETRY_UNSATISFIABLE_S = 30.0
_RETRY_QUEUED_S = 15.0  # besides the wake-up a release sends: others' pods end unseen


class Placer:
    """Places jobs; keeps, per job, what a restarted operator may forget (failed inputs,
    nodes given up on or avoided)."""

    def __init__(self, cluster: Cluster, *, settings: ReconcileSettings, ledger: CapacityLedger,
                 planner: Planner, publish: Callable[[PassState], None]) -> None:
        self._cluster = cluster
        self._settings = settings
        self._ledger = ledger
        self._planner = planner  # in this thread, or off it (plan_runner.PlanRunner)
        self._publish = publish  # write the status mid-pass, before a slow step
        # key -> (planning inputs, reason, message) of the last failed plan, so that retries on
        # unchanged inputs (every resync) do not search again.
        self._failed: dict[JobKey, tuple[str, str, str]] = {}
        # key -> {node: why its profiler pod gave no profile}: those nodes keep the label-based
        # estimate instead of getting a new profiler pod on every pass.
        self._given_up: dict[JobKey, dict[str, str]] = {}
        # key -> {node: until}: nodes a rank stayed unschedulable on, left out for a while.
        self._avoid: dict[JobKey, dict[str, datetime]] = {}
        self._profiles: dict[str, tuple[tuple[str, str], NodeProfile]] = {}
        self._profiles_lock = threading.Lock()  # reconcile workers share the memo

    def _profile(self, node: Mapping[str, Any], *, stored: Mapping[str, str] | None
                 ) -> NodeProfile:
        """profile_node, memoised per node while its resourceVersion and stored profile hold:
        with hundreds of nodes and jobs, profiling every node on every pass is most of the
        operator's CPU (a heartbeat changes the version, so a memo lives ~10 s at most)."""
        meta = node.get("metadata") or {}
        version = meta.get("resourceVersion")
        key = (str(version), repr(sorted((stored or {}).items())))
        name = str(meta.get("name", ""))
        with self._profiles_lock:
            hit = self._profiles.get(name)
        if version and hit is not None and hit[0] == key:
            return hit[1]
        profile = profile_node(node, topology_keys=self._settings.topology_keys,
                               measured=measured_figures({name: dict(stored)} if stored else {},
                                                         node))
        if version:
            with self._profiles_lock:
                self._profiles[name] = (key, profile)
        return profile

    def forget(self, key: JobKey) -> None:
        """The job is gone: drop what is kept about it and its GPUs."""
        self._failed.pop(key, None)
        self._given_up.pop(key, None)
        self._avoid.pop(key, None)
        self._planner.forget(key)
        self._ledger.release(key)

    def avoid(self, key: JobKey, nodes: Sequence[str], *, until: datetime) -> None:
        """Leave ``nodes`` out of the job's plans until ``until``, and drop its GPUs."""
        bans = self._avoid.setdefault(key, {})
        for node in nodes:
            bans[node] = until
        self._ledger.release(key)

    def place(self, p: PassState, *, spec: JobSpec,
              profilers: Sequence[Mapping[str, Any]]) -> PlanRecord | None:
        """The cached plan while valid and its GPUs free, else (once admitted onto free GPUs)
        a new one written to the ConfigMap."""
        ns, name = p.job.namespace, p.job.name
        key = (ns, name)
        raw_nodes = {str((n.get("metadata") or {}).get("name", "")): n
                     for n in self._cluster.list_nodes()}
        stored = read_stored_profiles(self._cluster.list_config_maps(
            self._settings.profile_namespace, selector=profile_selector()))
        nodes = [self._profile(n, stored=stored.get(node)) for node, n in raw_nodes.items()]
        with self._profiles_lock:  # forget deleted nodes
            for gone in [n for n in self._profiles if n not in raw_nodes]:
                del self._profiles[gone]
        p.live_nodes = frozenset(n.name for n in nodes)
        p.node_profiles = {n.name: n for n in nodes}
        avoided = self._avoided(key, now=p.now)
        candidates = [c for c in candidate_nodes(
            nodes, node_selector=spec.worker.node_selector, tolerations=spec.worker.tolerations,
            gpus_per_worker=spec.parallelism.gpus_per_worker) if c.name not in avoided]
        by_name = {c.name: c for c in candidates}
        cm = self._cluster.get_config_map(ns, config_map_name(name))
        cached = record_from_config_map(cm)
        shash = spec_hash(spec)
        gpw = spec.parallelism.gpus_per_worker
        if cached is not None and cached.still_valid(spec_hash_now=shash, candidates=by_name,
                                                     ranks_per_pod=max(1, gpw)) \
                and (gpw == 0 or hold_placement(self._ledger, self._cluster, key=key,
                                                record=cached, candidates=candidates,
                                                gpus_per_worker=gpw,
                                                by_kueue=bool(spec.queue_name))):
            self._admitted(p, workers=len(cached.nodes))
            return cached

        notes: list[str] = []
        if spec.planner.profile == "measure":
            measured_now = measure_candidates(
                self._cluster, p, spec=spec, candidates=candidates, profilers=profilers,
                raw_nodes=raw_nodes, given_up=self._given_up.setdefault(key, {}),
                settings=self._settings, create_all=partial(create_many, self._cluster))
            if measured_now is None:
                return None  # profiler pods still at work: their events wake the job
            candidates, notes = measured_now
            by_name = {c.name: c for c in candidates}

        kinds = sorted({f"{c.gpu_product or 'cpu'}" for c in candidates})
        profile_msg = f"{len(candidates)} candidate node(s) of {len(nodes)}: {', '.join(kinds)}"
        measured = sum(c.measured for c in candidates)
        if spec.planner.profile == "measure" or measured:
            # Measured profiles come from the operator's profile ConfigMaps (profile_store);
            # nodes without one are estimated from the table of known GPUs.
            profile_msg += f"; {measured} with a measured profile, the rest estimated"
        if notes:
            profile_msg += "; " + "; ".join(notes)
        if avoided:
            profile_msg += f"; avoiding {', '.join(sorted(avoided))} (stayed unschedulable)"
        slots = None
        failure: tuple[str, str] | None = None
        if gpw > 0:
            try:
                admitted = admit(self._ledger, self._cluster, key=key, spec=spec,
                                 candidates=candidates, created=p.created, own=profilers)
            except Unsatisfiable as err:
                failure = ("Unsatisfiable", str(err))
            else:
                if isinstance(admitted, Waiting):
                    p.update(phase="Queued", message=admitted.message)
                    p.condition("Queued", "True", reason=admitted.reason,
                                message=admitted.message, event="Normal")
                    p.requeue.append(_RETRY_QUEUED_S)
                    return None
                slots = admitted
                self._admitted(p, workers=len(slots))
        # A plan corrected by adaptation keeps its corrected speeds while it stays on its nodes.
        correction = ((tuple(cached.nodes), tuple(cached.device_speed))
                      if cached is not None and cached.device_speed else None)
        inputs = "|".join([shash, *(c.fingerprint() for c in candidates),
                           *(s.node.name for s in slots or ()), repr(correction)])
        failed = self._failed.get(key)
        record: PlanRecord | None = None
        if failure is not None:
            failed = (inputs, *failure)
        elif failed is None or failed[0] != inputs:
            p.update(phase="Profiling")
            p.condition("Profiling", "True", reason="ProfilingNodes", message=profile_msg)
            self._publish(p)
            try:
                made = self._planner.request(key, inputs=inputs, request=PlanRequest(
                    spec=spec, candidates=tuple(candidates), name=f"{ns}/{name}",
                    inter_node=self._settings.inter_node,
                    slots=None if slots is None else tuple(slots), speed_correction=correction))
                if isinstance(made, Planning):  # the planner wakes the job when it is done
                    p.condition("Planned", "False", reason="Planning", message=made.message,
                                event="Normal")
                    return None  # the reservation is held while it plans
                record = made
                rendered = render_config_map(p.job, spec, record)
            except (Unsatisfiable, PlanTooLarge, PlannerError, ValidationError) as err:
                reason = (err.reason if isinstance(err, Unsatisfiable)
                          else type(err).__name__ if isinstance(err, OperatorError)
                          else "PlannerError")
                message = f"planner: {err}" if reason == "PlannerError" else str(err)
                failed = (inputs, reason, message)
                self._failed[key] = failed
            else:
                self._failed.pop(key, None)
        if failed is not None and failed[0] == inputs:
            self._ledger.release(key)
            p.update(phase="Pending", message=failed[2])
            p.condition("Profiling", "False", reason="Profiled", message=profile_msg)
            p.condition("Planned", "False", reason=failed[1], message=failed[2], event="Warning")
            p.requeue.append(_RETRY_UNSATISFIABLE_S)
            return None
        if record is None:
            return None
        p.condition("Profiling", "False", reason="Profiled", message=profile_msg)
        children.probe_then_store(self._cluster, rendered, replace=cm is not None, probe=render_pod(
            p.job, spec, record, rank=0, attempt=0, settings=self._settings.manifests))
        if cached is not None and cached.spec_hash == shash:
            lost = sorted(n for n, fp in cached.node_fingerprints.items()
                          if n not in by_name or by_name[n].fingerprint() != fp)
            p.update(replans=p.status.replans + 1)
            if lost and set(lost) <= avoided:
                reason, why = "Unschedulable", (f"re-planned without node(s) {', '.join(lost)}, "
                                                "where its ranks stayed unschedulable")
            elif lost:
                reason = "NodesChanged"
                why = f"re-planned without or around node(s) {', '.join(lost)}"
            else:
                reason, why = "CapacityLost", ("re-planned: GPUs of the cached placement are held "
                                               "by others now")
            p.condition("Restarting", "True", reason=reason, message=why, event="Warning")
        summary = plan_summary(record, job=name)
        p.update(**summary)
        speedup = record.predicted_speedup_over_i1f1b
        reason, note, event = planned_reason(record)
        p.condition("Planned", "True", reason=reason,
                    message=f"{record.strategy}: {summary['stages']} stages on "
                    f"{_ranks(record)} over {len(set(record.nodes))} node(s); "
                    f"predicted bubble {record.predicted_bubble_ratio:.3f}, speedup over i1f1b "
                    f"{'n/a' if speedup is None else f'{speedup:.2f}x'}{note}", event=event)
        if p.status.phase in {"Profiling", "Queued"}:
            p.update(phase="Planned", message=None)
        return record

    @staticmethod
    def _admitted(p: PassState, *, workers: int) -> None:
        if condition_true(p.status.conditions, "Queued"):
            p.condition("Queued", "False", reason="Admitted", event="Normal",
                        message=f"{workers} worker(s) admitted onto free GPUs")
            if p.status.phase == "Queued":
                p.update(phase="Planned", message=None)

    def _avoided(self, key: tuple[str, str], *, now: datetime) -> set[str]:
        """Nodes this job's ranks stayed unschedulable on, while their ban lasts."""
        bans = self._avoid.get(key, {})
        for node in [n for n, until in bans.items() if until <= now]:
            del bans[node]
        return set(bans)


def _ranks(record: PlanRecord) -> str:
    """The plan's ranks in words: "4 ranks", or "8 ranks (2 replicas x 4) in 4 pods"."""
    mesh = record.mesh
    if mesh.replicas == 1 and mesh.per_pod == 1:
        return f"{mesh.world} ranks"
    return (f"{mesh.world} ranks ({mesh.replicas} replica(s) x {mesh.pipeline}) in "
            f"{mesh.pods} pods")
