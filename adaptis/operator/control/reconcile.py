"""The reconciler: one level-triggered pass that moves an AdaPtisJob one step toward its spec.

Sits between the kopf handlers (which only say *which* job to look at, see
:mod:`adaptis.operator.control.handlers`) and the pure modules below it (validation, profiling,
planning, manifests, status). Every pass re-reads the job, its pods, its ConfigMap and the nodes,
so it does not matter why it runs (create, resume, update, a pod event, a timer) or how often:

validate -> (suspend | deadline) -> plan, or reuse the plan of the job's record (kept in the
operator's namespace, :mod:`adaptis.operator.scheduling.plan_store`) while the spec and the planned
nodes are unchanged -> delete stale pods (other plan or attempt) -> create the missing ones
(deterministic names: a 409 means done) -> read the pods -> restart the gang, finish, or report ->
write status only when it changed. With ``spec.planner.profile: measure``, planning first waits for
one profiler pod per unmeasured candidate node (:mod:`adaptis.operator.profiling.measuring`), which
stores each result in the operator's namespace (:mod:`adaptis.operator.profiling.profile_store`);
every plan reads the stored profiles.

Failures of the user's making never raise: they become a condition naming the field and an
Event. Only API errors propagate, and the caller retries them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from adaptis.api.conditions import ConditionType, Reason
from adaptis.api.job import JobSpec
from adaptis.operator.adaptation.loop import AdaptationObserver, Adapter, Fetch
from adaptis.operator.adaptation.measurements import query_job
from adaptis.operator.core.conditions import parse_time
from adaptis.operator.core.errors import InvalidJob
from adaptis.operator.core.labels import LABEL_RANK
from adaptis.operator.core.passes import PassState, Result
from adaptis.operator.core.records import JobRef, PlanRecord
from adaptis.operator.core.settings import ReconcileSettings
from adaptis.operator.kube import children
from adaptis.operator.kube.cluster import Cluster, create_many
from adaptis.operator.profiling.measuring import delete_job_profilers, job_profilers
from adaptis.operator.profiling.profiler_pods import is_profiler_pod
from adaptis.operator.resources.hf_config import ConfigMapMissing, retry_after
from adaptis.operator.resources.manifests import (
    is_current_pod,
    plan_hash,
    pod_name,
    render_pod,
    render_service,
)
from adaptis.operator.resources.status import (
    PodCensus,
    census,
    parse_status,
    plan_summary,
    status_payload,
    summarize,
)
from adaptis.operator.resources.validation import absent_config_maps, validate_job
from adaptis.operator.scheduling.capacity import CapacityLedger, unschedulable_since
from adaptis.operator.scheduling.inventory import Inventory, ListedInventory
from adaptis.operator.scheduling.placement import Placer
from adaptis.operator.scheduling.plan_runner import InlinePlanner, Planner
from adaptis.operator.scheduling.plan_store import PlanStore

__all__ = ["ReconcileSettings", "Reconciler", "Result"]  # settings and result re-exported

log = logging.getLogger(__name__)

_TERMINAL = frozenset({"Succeeded", "Failed"})
# How soon to look again when nothing else will wake the job (no pod or node event).
_RETRY_TERMINATING_S = 2.0
# A node a rank stayed unschedulable on is left out for this many unschedulable timeouts.
_AVOID_FACTOR = 5


class Reconciler:
    """Reconciles AdaPtisJobs through a :class:`~adaptis.operator.kube.cluster.Cluster`."""

    def __init__(
        self,
        cluster: Cluster,
        *,
        settings: ReconcileSettings | None = None,
        clock: Callable[[], datetime] | None = None,
        ledger: CapacityLedger | None = None,
        inventory: Inventory | None = None,
        planner: Planner | None = None,
        observer: AdaptationObserver | None = None,
        fetch: Fetch = query_job,
    ) -> None:
        self._cluster = cluster
        # Shared by every reconcile worker: GPUs held by admitted jobs, and the waiting queue.
        self._ledger = ledger or CapacityLedger()
        self._settings = settings or ReconcileSettings()
        self._clock = clock or (lambda: datetime.now(UTC))
        # What it keeps per job lives in memory only: a restarted operator tries once more,
        # which is what a user would want anyway.
        # Where plans are made: in this thread by default, off it in the operator (plan_runner).
        # Every job's plan, kept where no tenant writes (the operator's namespace).
        self._plans = PlanStore(cluster, namespace=self._settings.profile_namespace)
        # The nodes, pods' GPUs and priorities: from watches in the operator; read when asked
        # by default (tests, whose in-memory cluster has no watch).
        inventory = inventory or ListedInventory(
            cluster, profile_namespace=self._settings.profile_namespace)
        self._placer = Placer(cluster, settings=self._settings, ledger=self._ledger,
                              inventory=inventory,
                              planner=planner or InlinePlanner(), plans=self._plans,
                              publish=self._write)
        # Re-plans a running job from its workers' measurements (spec.adaptation).
        self._adapter = Adapter(cluster, settings=self._settings.adaptation, publish=self._write,
                                fetch=fetch, observer=observer, plans=self._plans,
                                inter_node=self._settings.inter_node)

    def sweep(self) -> int:
        """At start-up: delete the plan records of jobs deleted while the operator was down."""
        return self._plans.sweep()

    def reconcile(self, namespace: str, name: str) -> Result:
        body = self._cluster.get_job(namespace, name)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            self._placer.forget((namespace, name))
            self._adapter.forget((namespace, name))
            # Gone or going: owner references clean the children up, except the profiler
            # pods, which live in the operator's namespace and so cannot be owned by the job.
            delete_job_profilers(self._cluster, JobRef(name=name, namespace=namespace, uid=""),
                                 settings=self._settings)
            self._plans.forget(namespace, name)  # nor its plan record, for the same reason
            return Result()
        meta = body["metadata"]
        p = PassState(job=JobRef(name=name, namespace=namespace, uid=meta["uid"]),
                      status=parse_status(body.get("status")), now=self._clock(),
                      created=str(meta.get("creationTimestamp") or ""))
        p.written = dict(body.get("status") or {})
        generation = meta.get("generation")
        try:
            self._step(p, spec_raw=body.get("spec") or {}, generation=generation)
        except children.ChildRefused as err:  # the job's content, not an API failure: no retry
            if err.refusal.invalid:
                self._fail(p, reason=Reason.INVALID_SPEC, message=str(err),
                           pods=self._cluster.list_pods(namespace, name))
            else:
                children.wait_on(p, err.refusal)
        finally:
            if generation is not None:
                p.update(observed_generation=generation)
            self._write(p)
        return Result(requeue_after=min(p.requeue) if p.requeue else None, phase=p.status.phase)

    # --- the pass ---------------------------------------------------------------------------
    def _step(self, p: PassState, *, spec_raw: Mapping[str, Any], generation: int | None) -> None:
        st = p.status
        # A spec fixed after an InvalidSpec failure is a new start; other failures are final.
        retry_invalid = (st.phase == "Failed" and generation != st.observed_generation
                         and any(c.type == ConditionType.FAILED and c.reason == Reason.INVALID_SPEC
                                 for c in st.conditions))
        if st.phase in _TERMINAL and not retry_invalid:
            self._finished(p, spec_raw=spec_raw)
            return
        try:
            spec = validate_job(
                name=p.job.name, spec_raw=spec_raw, namespace=p.job.namespace,
                read_config_map=lambda cm: self._cluster.get_config_map(p.job.namespace, cm))
        except ConfigMapMissing as err:
            self._wait_for_config_map(p, err)
            return
        except InvalidJob as err:  # a broken update stops the pods too (a bad name had none)
            self._fail(p, reason=Reason.INVALID_SPEC, message=str(err), pods=[] if "metadata.name"
                       in err.fields else self._cluster.list_pods(p.job.namespace, p.job.name))
            return
        if retry_invalid:
            # A new start: the pods the failure stopped are not lost ranks of a running gang
            # (a restart counted against spec.backoffLimit), nor does the deadline run on.
            p.update(phase="Pending", completion_time=None, message=None, launched=None,
                     start_time=None)
            p.condition(ConditionType.FAILED, "False", reason=Reason.SPEC_CHANGED,
                        message="the spec was corrected")
        pods = self._cluster.list_pods(p.job.namespace, p.job.name)
        profilers = job_profilers(self._cluster, p.job, settings=self._settings)
        # A pod in the job's namespace with the profiler's labels is not the operator's (its
        # profilers run in the operator's namespace): neither a worker nor a profile source.
        workers = [pod for pod in pods if not is_profiler_pod(pod)]

        if spec.suspend:
            self._suspend(p, spec=spec, pods=[*workers, *profilers])
            return
        if any(c.type == ConditionType.SUSPENDED and c.status == "True" for c in st.conditions):
            p.condition(ConditionType.SUSPENDED, "False", reason=Reason.RESUMED,
                        message="worker pods recreated", event="Normal")

        if self._past_deadline(p, spec=spec, pods=pods):
            return
        record = self._placer.place(p, spec=spec, profilers=profilers)
        if record is None:
            return
        # Profiler pods are done with once a plan exists (also those an earlier pass left).
        self._delete_pods(p, profilers)
        # A re-plan from measured drift (policy auto) returns the new plan: _run replaces the
        # old plan's pods with its pods, as after any re-plan.
        record = self._adapter.adapt(p, spec=spec, record=record)
        self._run(p, spec=spec, record=record, pods=workers)

    def _suspend(self, p: PassState, *, spec: JobSpec, pods: Sequence[Mapping[str, Any]]) -> None:
        """spec.suspend: give back the job's capacity and remove its pods (workers and profilers)."""
        self._ledger.release((p.job.namespace, p.job.name))
        self._delete_pods(p, pods)
        p.update(phase="Suspended", start_time=None, message="spec.suspend is true", launched=None,
                 workers_ready=f"0/{spec.parallelism.workers}")
        p.condition(ConditionType.SUSPENDED, "True", reason=Reason.SUSPENDED,
                    message="worker pods removed", event="Normal")
        p.condition(ConditionType.RUNNING, "False", reason=Reason.SUSPENDED)

    def _past_deadline(self, p: PassState, *, spec: JobSpec, pods: Sequence[Mapping[str, Any]]) -> bool:
        """Fail the job once spec.activeDeadlineSeconds has run out since its start (True);
        until then, come back when it will."""
        deadline = spec.active_deadline_seconds
        # p.status: a corrected spec's new start cleared start_time.
        started = parse_time(p.status.start_time)
        if not (deadline and started):
            return False
        left = deadline - (p.now - started).total_seconds()
        if left <= 0:
            self._fail(p, reason=Reason.DEADLINE_EXCEEDED, pods=pods,
                       message=f"spec.activeDeadlineSeconds: ran longer than {deadline}s")
            return True
        p.requeue.append(left)
        return False

    def _run(self, p: PassState, *, spec: JobSpec, record: PlanRecord,
             pods: Sequence[Mapping[str, Any]]) -> None:
        """Keep one pod per rank of the current plan and attempt; read how they are doing."""
        workers = len(record.nodes)
        phash = plan_hash(record)
        attempt = p.status.restarts
        current = [pod for pod in pods if is_current_pod(pod, plan=phash, attempt=attempt)]
        stale = [pod for pod in pods if not is_current_pod(pod, plan=phash, attempt=attempt)]
        self._delete_pods(p, stale)
        if not p.status.placement:
            p.update(**plan_summary(record, job=p.job.name))
        c = census(current)
        have = {str(((pod.get("metadata") or {}).get("labels") or {}).get(LABEL_RANK))
                for pod in current if not (pod.get("metadata") or {}).get("deletionTimestamp")}
        missing = [r for r in range(workers) if str(r) not in have]
        gang = f"{phash}/{attempt}"
        # Once every rank of this attempt had its pod, a rank whose pod is gone or going (a
        # delete, an eviction, a preemption: never ours, ours change plan or attempt first)
        # leaves the others waiting in a collective: the whole gang restarts, as on a failure.
        lost = [f"rank {r} ({pod_name(p.job.name, r)}): pod deleted or evicted"
                for r in missing] if p.status.launched == gang else []
        if c.failed or lost:
            self._restart_gang(p, spec=spec, pods=current, reason=Reason.POD_FAILED if c.failed
                               else Reason.POD_LOST, failures=[*c.failures, *lost])
            return
        if c.unschedulable and self._replan_unschedulable(p, pods=current):
            return
        p.update(workers_ready=f"{c.ready + c.succeeded}/{workers}")
        if c.observed_bubble_ratio is not None:
            p.update(observed_bubble_ratio=c.observed_bubble_ratio)
        absent = absent_config_maps(
            spec, namespace=p.job.namespace,
            read=lambda cm: self._cluster.get_config_map(p.job.namespace, cm)) if missing else []
        _report_containers(p, c=c, workers=workers, absent=absent)
        if c.succeeded == workers:
            self._succeed(p, spec=spec, workers=workers)
            return
        if absent:  # pods created now would hang in the kubelet: wait, as for the HF config
            _wait_for_worker_config_maps(p, absent=absent)
            return
        created = self._create_missing(p, spec=spec, record=record, pods=pods, missing=missing,
                                       attempt=attempt, gang=gang)
        if created is not None:
            _report_start(p, c=c, workers=workers, created=created)

    def _succeed(self, p: PassState, *, spec: JobSpec, workers: int) -> None:
        self._ledger.release((p.job.namespace, p.job.name))
        p.update(phase="Succeeded", completion_time=p.stamp, message=None)
        p.condition(ConditionType.RUNNING, "False", reason=Reason.COMPLETED)
        p.condition(ConditionType.SUCCEEDED, "True", reason=Reason.COMPLETED,
                    message=f"all {workers} ranks finished", event="Normal")
        self._schedule_ttl(p, spec.ttl_seconds_after_finished)

    def _create_missing(self, p: PassState, *, spec: JobSpec, record: PlanRecord,
                        pods: Sequence[Mapping[str, Any]], missing: list[int], attempt: int,
                        gang: str) -> int | None:
        """Create the pods of the ranks ``missing`` (attempt ``attempt``, gang ``gang``); how
        many were created, None if a policy refused one (the job then waits for the admin)."""
        taken = {(pod.get("metadata") or {}).get("name") for pod in pods}
        blocked = [r for r in missing if pod_name(p.job.name, r) in taken]
        if missing:
            children.create_child(self._cluster, render_service(p.job, spec))
        # A rank whose previous pod is still terminating waits; that deletion wakes us.
        pods_to_create = [render_pod(p.job, spec, record=record, rank=rank, attempt=attempt,
                                     settings=self._settings.manifests)
                          for rank in missing if rank not in blocked]
        created, refused = create_many(self._cluster, pods_to_create)
        if blocked:
            p.requeue.append(_RETRY_TERMINATING_S)
        if len(missing) == len(pods_to_create) == created:
            p.update(launched=gang)  # every rank of this attempt has its pod now
        if created and not p.status.start_time:
            p.update(start_time=p.stamp)
            if spec.active_deadline_seconds:
                p.requeue.append(float(spec.active_deadline_seconds))
        if created:
            p.events.append(("Normal", Reason.CREATED_PODS, f"created {created} worker pod(s)"))
        if refused:  # invalid pods raise ChildRefused; a policy's refusal waits for the admin
            children.wait_on(p, children.first_refusal(refused, pods_to_create))
            return None
        return created

    def _restart_gang(self, p: PassState, *, spec: JobSpec, pods: Sequence[Mapping[str, Any]],
                      reason: str, failures: Sequence[str]) -> None:
        """A new attempt of every rank, counted against spec.backoffLimit, or the end."""
        detail = "; ".join(failures[:3])
        if p.status.restarts >= spec.backoff_limit:
            self._fail(p, reason=Reason.BACKOFF_LIMIT_EXCEEDED, pods=pods,
                       message=f"spec.backoffLimit: {spec.backoff_limit} restart(s) used; {detail}")
            return
        # Count the restart before deleting: a crash in between never loses it.
        p.update(restarts=p.status.restarts + 1, phase="Restarting", message=detail)
        p.condition(ConditionType.RESTARTING, "True", reason=reason, event="Warning",
                    message=f"gang restart {p.status.restarts}/{spec.backoff_limit}: {detail}")
        p.condition(ConditionType.RUNNING, "False", reason=Reason.RESTARTING)
        self._write(p)  # the status first: what follows is destructive
        self._delete_pods(p, pods)
        p.requeue.append(_RETRY_TERMINATING_S)

    def _replan_unschedulable(self, p: PassState, *, pods: Sequence[Mapping[str, Any]]) -> bool:
        """Re-plan a placement whose ranks stayed unschedulable too long; True if it did."""
        since, nodes = unschedulable_since(pods)
        limit = self._settings.unschedulable_replan_s
        if since is None:
            return False
        waited = (p.now - since).total_seconds()
        if waited < limit:
            p.requeue.append(limit - waited + 1.0)
            return False
        self._placer.avoid((p.job.namespace, p.job.name), sorted(nodes),
                           until=p.now + timedelta(seconds=_AVOID_FACTOR * limit))
        p.update(phase="Restarting")
        p.condition(ConditionType.RESTARTING, "True", reason=Reason.UNSCHEDULABLE, event="Warning",
                    message=f"unschedulable for {waited:.0f}s on {', '.join(sorted(nodes))}: "
                    "re-planning on the GPUs free now, without those nodes for a while")
        self._write(p)  # the status first: what follows is destructive
        self._delete_pods(p, pods)  # the next pass's plan leaves the avoided nodes out
        p.requeue.append(_RETRY_TERMINATING_S)
        return True

    def _wait_for_config_map(self, p: PassState, err: ConfigMapMissing) -> None:
        """The Hugging Face config's ConfigMap or key is missing: wait for it, saying which,
        and look again after about as long as the job has waited (nothing watches
        ConfigMaps). Pods a plan already runs are left alone: their volume was mounted."""
        before = next((c for c in p.status.conditions if c.type == ConditionType.PLANNED), None)
        since = (parse_time(before.last_transition_time)
                 if before is not None and before.reason == ConfigMapMissing.reason else None)
        if p.status.phase == "Pending":  # a running gang keeps its phase; the condition says
            p.update(message=str(err))
        p.condition(ConditionType.PLANNED, "False", reason=ConfigMapMissing.reason, message=str(err),
                    event="Warning")
        waited = (p.now - since).total_seconds() if since is not None else 0.0
        p.requeue.append(retry_after(waited))

    # --- endings ----------------------------------------------------------------------------
    def _fail(self, p: PassState, *, reason: str, message: str,
              pods: Sequence[Mapping[str, Any]]) -> None:
        self._ledger.release((p.job.namespace, p.job.name))
        self._delete_pods(p, [pod for pod in pods
                           if (pod.get("status") or {}).get("phase") not in _TERMINAL])
        p.update(phase="Failed", message=message, completion_time=p.stamp)
        p.condition(ConditionType.RUNNING, "False", reason=reason)
        p.condition(ConditionType.FAILED, "True", reason=reason, message=message, event="Warning")
        log.info("%s/%s failed: %s: %s", p.job.namespace, p.job.name, reason, message)

    def _finished(self, p: PassState, *, spec_raw: Mapping[str, Any]) -> None:
        self._ledger.release((p.job.namespace, p.job.name))
        ttl = spec_raw.get("ttlSecondsAfterFinished")
        self._schedule_ttl(p, ttl if isinstance(ttl, int) else None)

    def _schedule_ttl(self, p: PassState, ttl: int | None) -> None:
        done = parse_time(p.status.completion_time)
        if ttl is None or done is None:
            return
        left = ttl - (p.now - done).total_seconds()
        if left > 0:
            p.requeue.append(left)
            return
        log.info("%s/%s: ttlSecondsAfterFinished passed; deleting", p.job.namespace, p.job.name)
        self._cluster.delete_job(p.job.namespace, p.job.name)

    # --- effects ----------------------------------------------------------------------------
    def _delete_pods(self, p: PassState, pods: Sequence[Mapping[str, Any]]) -> None:
        """Delete pods; those bound to a node that is gone are force-deleted, as the pod
        garbage collector would do much later, so their names free up for the new plan."""
        for pod in pods:
            meta = pod.get("metadata") or {}
            node = (pod.get("spec") or {}).get("nodeName")
            lost = bool(node) and p.live_nodes is not None and node not in p.live_nodes
            if lost or not meta.get("deletionTimestamp"):
                self._cluster.delete_pod(meta["namespace"], meta["name"], force=lost)

    def _write(self, p: PassState) -> None:
        """Patch what changed since the last write (a null removes a key) and post events."""
        old, new = p.written, status_payload(p.status)
        patch = {k: new.get(k) for k in set(old) | set(new) if old.get(k) != new.get(k)}
        if patch:
            self._cluster.patch_job_status(p.job.namespace, p.job.name, status=patch)
            p.written = new
        for type_, reason, message in p.events:
            self._cluster.event(p.job, type_=type_, reason=reason, message=message)
        p.events.clear()


def _report_start(p: PassState, *, c: PodCensus, workers: int, created: int) -> None:
    """The phase and Running condition of a gang that is not done: running, unschedulable,
    held by an admission controller, or starting."""
    if c.running + c.succeeded == workers:
        p.update(phase="Running", message=None)
        p.condition(ConditionType.RUNNING, "True", reason=Reason.ALL_RANKS_RUNNING,
                    message=f"{c.running} running, {c.succeeded} finished", event="Normal")
        if any(x.type == ConditionType.RESTARTING and x.status == "True" for x in p.status.conditions):
            p.condition(ConditionType.RESTARTING, "False", reason=Reason.RECOVERED,
                        message="the gang runs again")
    elif c.unschedulable:
        msg = "; ".join(c.unschedulable[:3])
        p.update(message=f"unschedulable: {msg}")
        p.condition(ConditionType.RUNNING, "False", reason=Reason.UNSCHEDULABLE, message=msg,
                    event="Warning")
    elif c.gated:
        # Kueue (or another admission controller) holds the gang until it fits a quota.
        p.update(phase="Planned", message=None)
        p.condition(ConditionType.RUNNING, "False", reason=Reason.WAITING_FOR_ADMISSION,
                    message="; ".join(c.gated[:3]), event="Normal")
    elif p.status.phase not in {"Restarting"}:
        # Starting clears what held the gang back before (a policy's refusal, unschedulable).
        p.update(phase="Planned", message=None)
        p.condition(ConditionType.RUNNING, "False", reason=Reason.STARTING,
                    message=f"{c.running}/{workers} ranks running, "
                    f"{c.pending + created} pending")
    if c.stuck and p.status.phase != "Running":  # the ContainersCreated condition says more
        p.update(message=f"{_CANNOT_START}{summarize(c.stuck, limit=1)}")
    elif not c.stuck and (p.status.message or "").startswith(_CANNOT_START):
        p.update(message=None)  # a restarting gang keeps its message otherwise


_CANNOT_START = "worker containers cannot start: "


#: The reasons of ContainersCreated (the worker containers the kubelet cannot start) by the
#: kubelet's (docs/tenancy.md, "When worker containers cannot start").
_STUCK_REASON: dict[str, str] = {
    "CreateContainerConfigError": Reason.CONTAINER_CONFIG_ERROR,  # a Secret or ConfigMap (key) missing
    "CreateContainerError": Reason.CREATE_CONTAINER_ERROR,
    "ErrImagePull": Reason.IMAGE_PULL_BACK_OFF,  # the kubelet alternates the two while it retries
    "ImagePullBackOff": Reason.IMAGE_PULL_BACK_OFF,
    "ErrImageNeverPull": Reason.IMAGE_PULL_BACK_OFF,
    "InvalidImageName": Reason.INVALID_IMAGE_NAME,
}


def _report_containers(p: PassState, *, c: PodCensus, workers: int,
                       absent: Sequence[str]) -> None:
    """ContainersCreated: False while a referenced ConfigMap is missing (``absent``; no pod is
    created then) or the kubelet keeps a container waiting (``c.stuck``), with a Warning
    Event when that starts or its reason changes (not on each new kubelet message); True
    once every rank runs again. A job never stuck has no such condition. The job waits: the
    user may still create the Secret or push the image."""
    before = next((x for x in p.status.conditions if x.type == ConditionType.CONTAINERS_CREATED), None)
    reason: str
    if absent:
        reason, message = ConfigMapMissing.reason, summarize(absent)
    elif c.stuck:
        reason = _STUCK_REASON.get(c.stuck[0].reason, c.stuck[0].reason)
        message = summarize(c.stuck)
    elif before is None or before.status == "True":
        return
    elif c.running + c.succeeded == workers:
        p.condition(ConditionType.CONTAINERS_CREATED, "True", reason=Reason.CONTAINERS_STARTED,
                    event="Normal",
                    message=f"every worker container started ({workers} ranks)")
        return
    else:  # what was missing is there now; the kubelet has yet to start the containers
        p.condition(ConditionType.CONTAINERS_CREATED, "False", reason=Reason.CONTAINER_CREATING,
                    message="nothing the workers reference is missing now; waiting for their "
                    "containers to start")
        return
    again = before is not None and (before.status, before.reason) == ("False", reason)
    p.condition(ConditionType.CONTAINERS_CREATED, "False", reason=reason, message=message,
                event=None if again else "Warning")


def _wait_for_worker_config_maps(p: PassState, *, absent: Sequence[str]) -> None:
    """The job waits for the ConfigMaps its workers reference (nothing watches ConfigMaps):
    look again after about as long as it has waited, as for the Hugging Face config."""
    if p.status.phase in {"Pending", "Planned"}:
        p.update(message=f"waiting for ConfigMaps: {summarize(absent, limit=1)}")
    cond = next((x for x in p.status.conditions if x.type == ConditionType.CONTAINERS_CREATED), None)
    since = parse_time(cond.last_transition_time) if cond is not None else None
    p.requeue.append(retry_after((p.now - since).total_seconds() if since is not None else 0.0))
