"""Placement: from a job to the plan it runs, on GPUs nobody else holds.

Sits under :mod:`adaptis.operator.control.reconcile`, which calls :meth:`Placer.place` once a pass
and gets the plan to run or None (the job waits: for its profiler pods, for free GPUs, or because no
plan exists, each said in its status). One pass:

profile the nodes -> the job's candidate nodes (selector, tolerations, GPUs; minus nodes its ranks
stayed unschedulable on) -> keep the plan of the job's record (in the operator's namespace,
:mod:`adaptis.operator.scheduling.plan_store`) while the spec and its nodes are unchanged and its
GPUs still free, and the job's ConfigMap as the record says -> else, with ``spec.planner.profile:
measure``, measure the candidates first (:mod:`adaptis.operator.profiling.measuring`) -> admit the
job onto free GPUs or queue it (:mod:`adaptis.operator.scheduling.admitting`) -> plan on the
reserved slots -> write the job's ConfigMap, then its record.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import Any

from pydantic import ValidationError

from adaptis.api.conditions import ConditionType, Reason
from adaptis.api.job import JobSpec
from adaptis.operator.core.conditions import condition_true
from adaptis.operator.core.errors import PlanTooLarge, Unsatisfiable
from adaptis.operator.core.passes import PassState
from adaptis.operator.core.records import NodeProfile, PlanRecord
from adaptis.operator.core.settings import ReconcileSettings
from adaptis.operator.kube import children
from adaptis.operator.kube.cluster import Cluster, create_many
from adaptis.operator.profiling.measuring import measure_candidates
from adaptis.operator.profiling.nodes import candidate_nodes, profile_node
from adaptis.operator.profiling.profile_store import measured_figures
from adaptis.operator.resources.manifests import config_map_name, plan_hash, render_config_map, render_pod
from adaptis.operator.resources.status import plan_summary
from adaptis.operator.scheduling.admitting import Waiting, admit, hold_placement
from adaptis.operator.scheduling.capacity import CapacityLedger, JobKey
from adaptis.operator.scheduling.inventory import Inventory
from adaptis.operator.scheduling.plan_runner import Planner, Planning, PlanRequest, planned_reason
from adaptis.operator.scheduling.plan_store import PlanStore, StoredPlan, overwriting
from adaptis.operator.scheduling.planning import Slot, spec_hash
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
                 inventory: Inventory, planner: Planner, plans: PlanStore,
                 publish: Callable[[PassState], None]) -> None:
        self._cluster = cluster
        self._inventory = inventory  # the nodes, pods' GPUs and priorities: never listed here
        self._plans = plans  # the trusted copy of every job's plan
        self._settings = settings
        self._ledger = ledger
        self._planner = planner  # in this thread, or off it (plan_runner.PlanRunner)
        self._publish = publish  # write the status mid-pass, before a slow step
        # key -> (planning inputs, reason, message) of the last failed plan, so that retries on
        # unchanged inputs (every resync) do not search again.
        self._failed: dict[JobKey, tuple[str, Reason, str]] = {}
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
        key = (p.job.namespace, p.job.name)
        scene = self._survey(p, spec=spec, key=key)
        if self._keeps_cached(p, spec=spec, key=key, scene=scene):
            return scene.cached
        candidates, notes = scene.candidates, []
        if spec.planner.profile == "measure":
            measured_now = measure_candidates(
                self._cluster, p, spec=spec, candidates=candidates, profilers=profilers,
                raw_nodes=scene.raw_nodes, given_up=self._given_up.setdefault(key, {}),
                settings=self._settings, create_all=partial(create_many, self._cluster))
            if measured_now is None:
                return None  # profiler pods still at work: their events wake the job
            candidates, notes = measured_now
        profile_msg = _profile_message(candidates, nodes=scene.nodes, notes=notes, avoided=scene.avoided,
                                       measuring=spec.planner.profile == "measure")
        slots: list[Slot] | None = None
        failure: tuple[Reason, str] | None = None
        if spec.parallelism.gpus_per_worker > 0:
            try:
                admitted = admit(self._ledger, self._inventory, key=key, spec=spec,
                                 candidates=candidates, created=p.created, own=profilers)
            except Unsatisfiable as err:
                failure = (Reason.UNSATISFIABLE, str(err))
            else:
                if isinstance(admitted, Waiting):
                    p.update(phase="Queued", message=admitted.message)
                    p.condition(ConditionType.QUEUED, "True", reason=admitted.reason,
                                message=admitted.message, event="Normal")
                    p.requeue.append(_RETRY_QUEUED_S)
                    return None
                slots = admitted
                self._admitted(p, workers=len(slots))
        made = self._plan(p, spec=spec, key=key, scene=scene, candidates=candidates, slots=slots,
                          failure=failure, profile_msg=profile_msg)
        if made is None:
            return None
        record, rendered = made
        p.condition(ConditionType.PROFILING, "False", reason=Reason.PROFILED, message=profile_msg)
        children.probe_then_store(self._cluster, overwriting(rendered, current=scene.config_map),
                                  replace=scene.config_map is not None,
                                  probe=render_pod(p.job, spec, record=record, rank=0, attempt=0,
                                                   settings=self._settings.manifests))
        self._plans.write(p.job, record=record, worker_data=rendered["data"])
        self._announce(p, record=record, scene=scene, candidates=candidates)
        return record

    def _survey(self, p: PassState, *, spec: JobSpec, key: JobKey) -> _Scene:
        """The nodes as they are now (profiled, the pass told which are alive), the job's
        candidates among them, its ConfigMap (never decoded) and its plan record."""
        raw_nodes = self._inventory.nodes()
        stored = self._inventory.stored_profiles()
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
        cm = self._cluster.get_config_map(key[0], config_map_name(key[1]))
        stored = self._plans.read(p, spec=spec)
        return _Scene(raw_nodes=raw_nodes, nodes=len(nodes), avoided=avoided, candidates=candidates,
                      config_map=cm, stored=stored, spec_hash=spec_hash(spec))

    def _keeps_cached(self, p: PassState, *, spec: JobSpec, key: JobKey, scene: _Scene) -> bool:
        """The cached plan still holds: same spec, its nodes unchanged, and its GPUs held (or
        taken again) for the job; the job's ConfigMap is then made to match it."""
        stored, gpw = scene.stored, spec.parallelism.gpus_per_worker
        if stored is None or not stored.record.still_valid(
                spec_hash_now=scene.spec_hash, candidates={c.name: c for c in scene.candidates},
                ranks_per_pod=spec.parallelism.ranks_per_worker):
            return False
        if gpw > 0 and not hold_placement(self._ledger, self._inventory, key=key, record=stored.record,
                                          candidates=scene.candidates, gpus_per_worker=gpw,
                                          by_kueue=bool(spec.queue_name)) and not _launched_on(p, stored.record):
            return False
        self._admitted(p, workers=len(stored.record.nodes))
        self._plans.check_worker_config(p, spec=spec, stored=stored, current=scene.config_map)
        return True

    def _plan(self, p: PassState, *, spec: JobSpec, key: JobKey, scene: _Scene,
              candidates: list[NodeProfile], slots: list[Slot] | None, failure: tuple[Reason, str] | None,
              profile_msg: str) -> tuple[PlanRecord, dict[str, Any]] | None:
        """A new plan and its ConfigMap, or None: planning in the background, or it failed (now,
        or before on the same inputs: not searched again), which the job's status says."""
        ns, name = key
        # A plan corrected by adaptation keeps its corrected speeds while it stays on its nodes.
        cached = scene.cached
        correction = ((tuple(cached.nodes), tuple(cached.device_speed))
                      if cached is not None and cached.device_speed else None)
        inputs = "|".join([scene.spec_hash, *(c.fingerprint() for c in candidates),
                           *(s.node.name for s in slots or ()), repr(correction)])
        failed = (inputs, *failure) if failure is not None else self._failed.get(key)
        if failed is None or failed[0] != inputs:
            p.update(phase="Profiling")
            p.condition(ConditionType.PROFILING, "True", reason=Reason.PROFILING_NODES,
                        message=profile_msg)
            self._publish(p)
            try:
                made = self._planner.request(key, inputs=inputs, request=PlanRequest(
                    spec=spec, candidates=tuple(candidates), name=f"{ns}/{name}",
                    inter_node=self._settings.inter_node,
                    slots=None if slots is None else tuple(slots), speed_correction=correction))
                if isinstance(made, Planning):  # the planner wakes the job when it is done
                    p.condition(ConditionType.PLANNED, "False", reason=Reason.PLANNING,
                                message=made.message,
                                event="Normal")
                    return None  # the reservation is held while it plans
                rendered = render_config_map(p.job, spec, record=made)
            except (Unsatisfiable, PlanTooLarge, PlannerError, ValidationError) as err:
                reason = (err.reason if isinstance(err, Unsatisfiable)
                          else Reason.PLAN_TOO_LARGE if isinstance(err, PlanTooLarge)
                          else Reason.PLANNER_ERROR)
                message = f"planner: {err}" if reason == Reason.PLANNER_ERROR else str(err)
                failed = self._failed[key] = (inputs, reason, message)
            else:
                self._failed.pop(key, None)
                return made, rendered
        self._ledger.release(key)
        p.update(phase="Pending", message=failed[2])
        p.condition(ConditionType.PROFILING, "False", reason=Reason.PROFILED, message=profile_msg)
        p.condition(ConditionType.PLANNED, "False", reason=failed[1], message=failed[2],
                    event="Warning")
        p.requeue.append(_RETRY_UNSATISFIABLE_S)
        return None

    def _announce(self, p: PassState, *, record: PlanRecord, scene: _Scene,
                  candidates: list[NodeProfile]) -> None:
        """The status of a new plan: why the job re-planned (if it did) and what it planned."""
        cached = scene.cached
        if cached is not None and cached.spec_hash == scene.spec_hash:
            by_name = {c.name: c for c in candidates}
            lost = sorted(n for n, fp in cached.node_fingerprints.items()
                          if n not in by_name or by_name[n].fingerprint() != fp)
            p.update(replans=p.status.replans + 1)
            if lost and set(lost) <= scene.avoided:
                reason = Reason.UNSCHEDULABLE
                why = f"re-planned without node(s) {', '.join(lost)}, where its ranks stayed unschedulable"
            elif lost:
                reason = Reason.NODES_CHANGED
                why = f"re-planned without or around node(s) {', '.join(lost)}"
            else:
                reason = Reason.CAPACITY_LOST
                why = "re-planned: GPUs of the cached placement are held by others now"
            p.condition(ConditionType.RESTARTING, "True", reason=reason, message=why, event="Warning")
        summary = plan_summary(record, job=p.job.name)
        p.update(**summary)
        speedup = record.predicted_speedup_over_i1f1b
        planned, note, event = planned_reason(record)
        p.condition(ConditionType.PLANNED, "True", reason=planned,
                    message=f"{record.strategy}: {summary['stages']} stages on "
                    f"{_ranks(record)} over {len(set(record.nodes))} node(s); "
                    f"predicted bubble {record.predicted_bubble_ratio:.3f}, speedup over i1f1b "
                    f"{'n/a' if speedup is None else f'{speedup:.2f}x'}{note}", event=event)
        if p.status.phase in {"Profiling", "Queued"}:
            p.update(phase="Planned", message=None)

    @staticmethod
    def _admitted(p: PassState, *, workers: int) -> None:
        if condition_true(p.status.conditions, ConditionType.QUEUED):
            p.condition(ConditionType.QUEUED, "False", reason=Reason.ADMITTED, event="Normal",
                        message=f"{workers} worker(s) admitted onto free GPUs")
            if p.status.phase == "Queued":
                p.update(phase="Planned", message=None)

    def _avoided(self, key: tuple[str, str], *, now: datetime) -> set[str]:
        """Nodes this job's ranks stayed unschedulable on, while their ban lasts."""
        bans = self._avoid.get(key, {})
        for node in [n for n, until in bans.items() if until <= now]:
            del bans[node]
        return set(bans)


@dataclass(frozen=True, slots=True)
class _Scene:
    """What one pass found: the nodes, the job's candidates, its ConfigMap and plan record."""

    raw_nodes: dict[str, Mapping[str, Any]]
    nodes: int
    avoided: set[str]
    candidates: list[NodeProfile]
    config_map: Mapping[str, Any] | None  # the job's, as its namespace holds it: never decoded
    stored: StoredPlan | None
    spec_hash: str

    @property
    def cached(self) -> PlanRecord | None:
        return None if self.stored is None else self.stored.record


def _profile_message(candidates: Sequence[NodeProfile], *, nodes: int, notes: Sequence[str],
                     avoided: set[str], measuring: bool) -> str:
    """The Profiling condition's message: the candidates, how their figures were had, and
    the nodes left out."""
    kinds = sorted({f"{c.gpu_product or 'cpu'}" for c in candidates})
    msg = f"{len(candidates)} candidate node(s) of {nodes}: {', '.join(kinds)}"
    measured = sum(c.measured for c in candidates)
    if measuring or measured:
        # Measured profiles come from the operator's profile ConfigMaps (profile_store);
        # nodes without one are estimated from the table of known GPUs.
        msg += f"; {measured} with a measured profile, the rest estimated"
    if notes:
        msg += "; " + "; ".join(notes)
    if avoided:
        msg += f"; avoiding {', '.join(sorted(avoided))} (stayed unschedulable)"
    return msg


def _ranks(record: PlanRecord) -> str:
    """The plan's ranks in words: "4 ranks", or "8 ranks (2 replicas x 4) in 4 pods"."""
    mesh = record.mesh
    if mesh.replicas == 1 and mesh.per_pod == 1:
        return f"{mesh.world} ranks"
    return (f"{mesh.world} ranks ({mesh.replicas} replica(s) x {mesh.pipeline}) in "
            f"{mesh.pods} pods")


def _launched_on(p: PassState, record: PlanRecord) -> bool:
    """The job's current attempt was launched on ``record``: its plan stands for this pass even
    when its GPUs are no longer free to it (an operator restarted with an empty ledger after a
    preemptor or another pod took the GPUs of a lost rank), so that the pass counts the lost
    ranks as a gang restart against spec.backoffLimit (docs/shared-cluster.md, "Gang
    semantics") rather than re-planning them away; the restart's next pass admits again."""
    return p.status.launched == f"{plan_hash(record)}/{p.status.restarts}"

