"""The reconciler: one level-triggered pass that moves an AdaPtisJob one step toward its spec.

Sits between the kopf handlers (which only say *which* job to look at, see
:mod:`adaptis.operator.handlers`) and the pure modules below it (validation, profiling,
planning, manifests, status). Every pass re-reads the job, its pods, its ConfigMap and the nodes,
so it does not matter why it runs (create, resume, update, a pod event, a timer) or how often:

validate -> (suspend | deadline) -> plan, or reuse the plan cached in the ConfigMap while the
spec and the planned nodes are unchanged -> delete stale pods (other plan or attempt) -> create
the missing ones (deterministic names: a 409 means done) -> read the pods -> restart the gang,
finish, or report -> write status only when it changed. With ``spec.planner.profile: measure``,
planning first waits for one profiler pod per unmeasured candidate node
(:mod:`adaptis.operator.measuring`), which stores each result in the operator's namespace
(:mod:`adaptis.operator.profile_store`); every plan reads the stored profiles.

Failures of the user's making never raise: they become a condition naming the field and an
Event. Only API errors propagate, and the caller retries them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from functools import partial
from typing import Any

from pydantic import ValidationError

from adaptis.api.job import JobSpec
from adaptis.operator.errors import InvalidJob, Unsatisfiable
from adaptis.operator.kube import Cluster, create_many
from adaptis.operator.manifests import (
    LABEL_RANK,
    JobRef,
    config_map_name,
    is_current_pod,
    plan_hash,
    pod_name,
    render_config_map,
    render_pod,
    render_service,
)
from adaptis.operator.measuring import delete_job_profilers, job_profilers, measure_candidates
from adaptis.operator.passes import PassState, ReconcileSettings, Result
from adaptis.operator.plan_runner import (InlinePlanner, Planner, Planning, PlanRequest,
                                          planned_reason)
from adaptis.operator.planning import PlanRecord, record_from_config_map, spec_hash
from adaptis.operator.profile_store import measured_figures, profile_selector, read_stored_profiles
from adaptis.operator.profiler_pods import is_profiler_pod
from adaptis.operator.profiling import candidate_nodes, profile_node
from adaptis.operator.status import census, parse_status, parse_time, plan_summary, status_payload
from adaptis.operator.validation import validate_job
from adaptis.planner.errors import PlannerError

__all__ = ["ReconcileSettings", "Reconciler", "Result"]  # settings and result re-exported

log = logging.getLogger(__name__)

_TERMINAL = frozenset({"Succeeded", "Failed"})
# How soon to look again when nothing else will wake the job (no pod or node event).
_RETRY_UNSATISFIABLE_S = 30.0
_RETRY_TERMINATING_S = 2.0
_CREATE_PARALLELISM = 8


class Reconciler:
    """Reconciles AdaPtisJobs through a :class:`~adaptis.operator.kube.Cluster`."""

    def __init__(
        self,
        cluster: Cluster,
        *,
        settings: ReconcileSettings | None = None,
        clock: Callable[[], datetime] | None = None,
        planner: Planner | None = None,
    ) -> None:
        self._cluster = cluster
        # Where plans are made: in this thread by default, off it in the operator (plan_runner).
        self._planner = planner or InlinePlanner()
        self._settings = settings or ReconcileSettings()
        self._clock = clock or (lambda: datetime.now(UTC))
        # (namespace, name) -> (planning inputs, reason, message) of the last failed plan, so
        # that retries on unchanged inputs (every resync) do not search again. Memory only: a
        # restarted operator tries once more, which is what a user would want anyway.
        self._failed: dict[tuple[str, str], tuple[str, str, str]] = {}
        # (namespace, name) -> {node: why its profiler pod gave no profile}: those nodes keep
        # the label-based estimate instead of getting a new profiler pod on every pass.
        self._given_up: dict[tuple[str, str], dict[str, str]] = {}

    def reconcile(self, namespace: str, name: str) -> Result:
        body = self._cluster.get_job(namespace, name)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            self._failed.pop((namespace, name), None)
            self._given_up.pop((namespace, name), None)
            self._planner.forget((namespace, name))
            # Gone or going: owner references clean the children up, except the profiler
            # pods, which live in the operator's namespace and so cannot be owned by the job.
            delete_job_profilers(self._cluster, JobRef(name=name, namespace=namespace, uid=""),
                                 settings=self._settings)
            return Result()
        meta = body["metadata"]
        p = PassState(job=JobRef(name=name, namespace=namespace, uid=meta["uid"]),
                      status=parse_status(body.get("status")), now=self._clock())
        p.written = dict(body.get("status") or {})
        generation = meta.get("generation")
        try:
            self._step(p, spec_raw=body.get("spec") or {}, generation=generation)
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
                         and any(c.type == "Failed" and c.reason == "InvalidSpec"
                                 for c in st.conditions))
        if st.phase in _TERMINAL and not retry_invalid:
            self._finished(p, spec_raw=spec_raw)
            return
        try:
            spec = validate_job(name=p.job.name, spec_raw=spec_raw)
        except InvalidJob as err:
            # An update that breaks a running job stops its pods too.
            self._fail(p, reason="InvalidSpec", message=str(err),
                       pods=self._cluster.list_pods(p.job.namespace, p.job.name))
            return
        if retry_invalid:
            p.update(phase="Pending", completion_time=None, message=None)
            p.condition("Failed", "False", reason="SpecChanged",
                        message="the spec was corrected")
        pods = self._cluster.list_pods(p.job.namespace, p.job.name)
        profilers = job_profilers(self._cluster, p.job, settings=self._settings)
        # A pod in the job's namespace with the profiler's labels is not the operator's (its
        # profilers run in the operator's namespace): neither a worker nor a profile source.
        workers = [pod for pod in pods if not is_profiler_pod(pod)]

        if spec.suspend:
            self._delete_pods(p, [*workers, *profilers])
            p.update(phase="Suspended", start_time=None, message="spec.suspend is true",
                     workers_ready=f"0/{spec.parallelism.workers}")
            p.condition("Suspended", "True", reason="Suspended",
                        message="worker pods removed", event="Normal")
            p.condition("Running", "False", reason="Suspended")
            return
        if any(c.type == "Suspended" and c.status == "True" for c in st.conditions):
            p.condition("Suspended", "False", reason="Resumed",
                        message="worker pods recreated", event="Normal")

        deadline = spec.active_deadline_seconds
        started = parse_time(st.start_time)
        if deadline and started:
            left = deadline - (p.now - started).total_seconds()
            if left <= 0:
                self._fail(p, reason="DeadlineExceeded", pods=pods,
                           message=f"spec.activeDeadlineSeconds: ran longer than {deadline}s")
                return
            p.requeue.append(left)

        record = self._plan(p, spec=spec, profilers=profilers)
        if record is None:
            return
        # Profiler pods are done with once a plan exists (also those an earlier pass left).
        self._delete_pods(p, profilers)
        self._run(p, spec=spec, record=record, pods=workers)

    def _plan(self, p: PassState, *, spec: JobSpec,
              profilers: Sequence[Mapping[str, Any]]) -> PlanRecord | None:
        """The cached plan while valid, else a new one written to the ConfigMap."""
        ns, name = p.job.namespace, p.job.name
        raw_nodes = {str((n.get("metadata") or {}).get("name", "")): n
                     for n in self._cluster.list_nodes()}
        stored = read_stored_profiles(self._cluster.list_config_maps(
            self._settings.profile_namespace, selector=profile_selector()))
        nodes = [profile_node(n, topology_keys=self._settings.topology_keys,
                              measured=measured_figures(stored, n))
                 for n in raw_nodes.values()]
        p.live_nodes = frozenset(n.name for n in nodes)
        candidates = candidate_nodes(nodes, node_selector=spec.worker.node_selector,
                                     tolerations=spec.worker.tolerations,
                                     gpus_per_worker=spec.parallelism.gpus_per_worker)
        by_name = {c.name: c for c in candidates}
        cm = self._cluster.get_config_map(ns, config_map_name(name))
        cached = record_from_config_map(cm)
        shash = spec_hash(spec)
        if cached is not None and cached.still_valid(spec_hash_now=shash, candidates=by_name):
            return cached

        notes: list[str] = []
        if spec.planner.profile == "measure":
            measured_now = measure_candidates(
                self._cluster, p, spec=spec, candidates=candidates, profilers=profilers,
                raw_nodes=raw_nodes, given_up=self._given_up.setdefault((ns, name), {}),
                settings=self._settings, create_all=partial(create_many, self._cluster,
                                                            parallelism=_CREATE_PARALLELISM))
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
        inputs = shash + "|" + "|".join(c.fingerprint() for c in candidates)
        failed = self._failed.get((ns, name))
        record: PlanRecord | None = None
        if failed is None or failed[0] != inputs:
            p.update(phase="Profiling")
            p.condition("Profiling", "True", reason="ProfilingNodes", message=profile_msg)
            self._write_now(p)
            try:
                made = self._planner.request((ns, name), inputs=inputs, request=PlanRequest(
                    spec=spec, candidates=tuple(candidates), name=f"{ns}/{name}",
                    inter_node=self._settings.inter_node))
            except (Unsatisfiable, PlannerError, ValidationError) as err:
                reason = err.reason if isinstance(err, Unsatisfiable) else "PlannerError"
                message = str(err) if isinstance(err, Unsatisfiable) else f"planner: {err}"
                failed = (inputs, reason, message)
                self._failed[(ns, name)] = failed
            else:
                if isinstance(made, Planning):  # the planner wakes the job when it is done
                    p.condition("Planned", "False", reason="Planning", message=made.message,
                                event="Normal")
                    return None
                record = made
                self._failed.pop((ns, name), None)
        if failed is not None and failed[0] == inputs:
            p.update(phase="Pending", message=failed[2])
            p.condition("Profiling", "False", reason="Profiled", message=profile_msg)
            p.condition("Planned", "False", reason=failed[1], message=failed[2], event="Warning")
            p.requeue.append(_RETRY_UNSATISFIABLE_S)
            return None
        if record is None:
            return None
        p.condition("Profiling", "False", reason="Profiled", message=profile_msg)
        rendered = render_config_map(p.job, spec, record)
        if cm is None:
            self._cluster.create(rendered)
        else:
            self._cluster.replace_config_map(rendered)
        if cached is not None and cached.spec_hash == shash:
            lost = sorted(n for n, fp in cached.node_fingerprints.items()
                          if n not in by_name or by_name[n].fingerprint() != fp)
            p.update(replans=p.status.replans + 1)
            p.condition("Restarting", "True", reason="NodesChanged",
                        message=f"re-planned without or around node(s) {', '.join(lost)}",
                        event="Warning")
        summary = plan_summary(record)
        p.update(**summary)
        speedup = record.predicted_speedup_over_i1f1b
        reason, note, event = planned_reason(record)
        p.condition("Planned", "True", reason=reason,
                    message=f"{record.strategy}: {summary['stages']} stages on "
                    f"{len(record.nodes)} ranks over {len(set(record.nodes))} node(s); "
                    f"predicted bubble {record.predicted_bubble_ratio:.3f}, speedup over i1f1b "
                    f"{'n/a' if speedup is None else f'{speedup:.2f}x'}{note}", event=event)
        if p.status.phase == "Profiling":
            p.update(phase="Planned", message=None)
        return record

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
            p.update(**plan_summary(record))
        c = census(current, total=workers)

        if c.failed:
            if p.status.restarts < spec.backoff_limit:
                # Count the restart before deleting: a crash in between never loses it.
                p.update(restarts=p.status.restarts + 1, phase="Restarting",
                         message="; ".join(c.failures[:3]))
                p.condition("Restarting", "True", reason="PodFailed",
                            message=f"gang restart {p.status.restarts}/{spec.backoff_limit}: "
                            + "; ".join(c.failures[:3]), event="Warning")
                p.condition("Running", "False", reason="Restarting")
                self._write_now(p)
                self._delete_pods(p, current)
                p.requeue.append(_RETRY_TERMINATING_S)
            else:
                self._fail(p, reason="BackoffLimitExceeded", pods=current,
                           message=f"spec.backoffLimit: {spec.backoff_limit} restart(s) used; "
                           + "; ".join(c.failures[:3]))
            return
        p.update(workers_ready=f"{c.ready + c.succeeded}/{workers}")
        if c.observed_bubble_ratio is not None:
            p.update(observed_bubble_ratio=c.observed_bubble_ratio)
        if c.succeeded == workers:
            p.update(phase="Succeeded", completion_time=p.stamp, message=None)
            p.condition("Running", "False", reason="Completed")
            p.condition("Succeeded", "True", reason="Completed",
                        message=f"all {workers} ranks finished", event="Normal")
            self._schedule_ttl(p, spec.ttl_seconds_after_finished)
            return

        have = {str(((pod.get("metadata") or {}).get("labels") or {}).get(LABEL_RANK))
                for pod in current}
        taken = {(pod.get("metadata") or {}).get("name") for pod in pods}
        missing = [r for r in range(workers) if str(r) not in have]
        blocked = [r for r in missing if pod_name(p.job.name, r) in taken]
        if missing:
            self._cluster.create(render_service(p.job, spec))
        # A rank whose previous pod is still terminating waits; that deletion wakes us.
        pods_to_create = [render_pod(p.job, spec, record, rank=rank, attempt=attempt,
                                     settings=self._settings.manifests)
                          for rank in missing if rank not in blocked]
        created, refused = create_many(self._cluster, pods_to_create,
                                       parallelism=_CREATE_PARALLELISM)
        if blocked:
            p.requeue.append(_RETRY_TERMINATING_S)
        if created and not p.status.start_time:
            p.update(start_time=p.stamp)
            if spec.active_deadline_seconds:
                p.requeue.append(float(spec.active_deadline_seconds))
        if created:
            p.events.append(("Normal", "CreatedPods", f"created {created} worker pod(s)"))
        if refused:  # retried: the admin may relax the namespace's policy, the user the spec
            msg = f"the API server refused worker pod(s): {next(iter(refused.values()))}"[:1024]
            p.update(message=msg)
            p.condition("Running", "False", reason="PodsRejected", message=msg, event="Warning")
            p.requeue.append(_RETRY_UNSATISFIABLE_S)
            return

        if c.running + c.succeeded == workers:
            p.update(phase="Running", message=None)
            p.condition("Running", "True", reason="AllRanksRunning",
                        message=f"{c.running} running, {c.succeeded} finished", event="Normal")
            if any(x.type == "Restarting" and x.status == "True" for x in p.status.conditions):
                p.condition("Restarting", "False", reason="Recovered",
                            message="the gang runs again")
        elif c.unschedulable:
            msg = "; ".join(c.unschedulable[:3])
            p.update(message=f"unschedulable: {msg}")
            p.condition("Running", "False", reason="Unschedulable", message=msg, event="Warning")
        elif c.gated:
            # Kueue (or another admission controller) holds the gang until it fits a quota.
            p.update(phase="Planned", message=None)
            p.condition("Running", "False", reason="WaitingForAdmission",
                        message="; ".join(c.gated[:3]), event="Normal")
        elif p.status.phase not in {"Restarting"}:
            p.update(phase="Planned")
            p.condition("Running", "False", reason="Starting",
                        message=f"{c.running}/{workers} ranks running, "
                        f"{c.pending + created} pending")

    # --- endings ----------------------------------------------------------------------------
    def _fail(self, p: PassState, *, reason: str, message: str,
              pods: Sequence[Mapping[str, Any]]) -> None:
        self._delete_pods(p, [pod for pod in pods
                           if (pod.get("status") or {}).get("phase") not in _TERMINAL])
        p.update(phase="Failed", message=message, completion_time=p.stamp)
        p.condition("Running", "False", reason=reason)
        p.condition("Failed", "True", reason=reason, message=message, event="Warning")
        log.info("%s/%s failed: %s: %s", p.job.namespace, p.job.name, reason, message)

    def _finished(self, p: PassState, *, spec_raw: Mapping[str, Any]) -> None:
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

    def _write_now(self, p: PassState) -> None:
        """Publish the status mid-pass (before a slow or destructive step)."""
        self._write(p)

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

