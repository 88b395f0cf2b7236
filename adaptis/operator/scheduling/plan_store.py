"""The operator's own copy of each job's plan, kept where no tenant can write: its namespace.

Sits beside :mod:`adaptis.operator.profiling.profile_store` (node profiles, kept in the same
namespace for the same reason) and under :mod:`adaptis.operator.scheduling.placement` and
:mod:`adaptis.operator.adaptation.loop`, which read and write it. The plan steers pods (their nodes
and hostnames, ranks, ports, the mesh) and the capacity ledger, and anyone who may edit ConfigMaps
in a tenant's namespace (its ``edit`` or ``admin`` role) could rewrite a copy kept there: a crafted
packed plan once OOM-killed the shared operator, a rewritten hostname pinned pods to another
tenant's node (SECURITY.md, "What the operator reads back"). So:

- ConfigMap ``<operator namespace>/adaptis-plan-<job uid>`` holds ``record.json`` (the
  :class:`~adaptis.operator.core.records.PlanRecord`, its actions packed) and ``worker-digest`` (a
  digest of the job's worker ConfigMap as the operator wrote it). It is the only copy of a plan
  the operator decodes, and it decodes it within the job's own limits
  (:class:`~adaptis.api.plan_packing.PackLimits`): a record that fails any check is re-planned
  from the spec, with a Warning Event naming it, never trusted and never fatal.
- The job's ConfigMap ``<job>-config`` (``worker.json``) stays in the job's namespace: the
  workers mount it, and the tenant reads it to see the plan. The operator writes it and never
  decodes it: each pass compares its digest (at most the API server's 1 MiB hashed) with
  ``worker-digest``, and a difference is a Warning Event naming the ConfigMap and a rewrite
  from the record (:meth:`PlanStore.check_worker_config`).
- A decoded record is kept in memory (:class:`_Decoded`) under its ConfigMap's
  resourceVersion, the job and its limits, so that a pass over an unchanged record GETs it
  but does not decode it again (0.3-0.5 s at 64 workers x 4096 microbatches); the memory is
  bounded by the records' bytes, the least recently used going first.
- Owner references cannot cross namespaces, so the operator deletes records itself: a job's on
  its last pass (:meth:`PlanStore.forget`), and those of jobs deleted while it was down at
  start-up (:meth:`PlanStore.sweep`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from adaptis.api.conditions import Reason
from adaptis.api.job import JobSpec
from adaptis.api.mesh import Mesh
from adaptis.api.model import MAX_BLOCKS
from adaptis.api.plan_packing import PackLimits
from adaptis.operator.core.labels import (
    LABEL_MANAGED_BY,
    MANAGED_BY,
)
from adaptis.operator.core.passes import PassState
from adaptis.operator.core.records import JobRef, PlanRecord
from adaptis.operator.kube.cluster import ApiError, Cluster
from adaptis.operator.resources.manifests import (
    CONFIG_MAP_LIMIT_BYTES,
    config_map_name,
    render_config_map,
)

__all__ = ["PlanStore", "StoredPlan", "data_digest", "overwriting", "parse_record", "plan_limits",
           "record_name", "render_record"]

log = logging.getLogger(__name__)

LABEL_ROLE = "adaptis.io/role"
ROLE_PLAN = "plan-record"
LABEL_JOB_KEY = "adaptis.io/job-key"  # a digest of namespace/name: names do not fit labels
ANNOTATION_JOB = "adaptis.io/job"  # namespace/name, for people and for the checks
ANNOTATION_UID = "adaptis.io/job-uid"
RECORD_KEY = "record.json"
DIGEST_KEY = "worker-digest"


def record_name(uid: str) -> str:
    """One record per job object: a job deleted and created again under its name starts anew."""
    return f"adaptis-plan-{uid}"


def _job_key(namespace: str, name: str) -> str:
    return hashlib.sha256(f"{namespace}/{name}".encode()).hexdigest()[:32]


def _selector(**extra: str) -> dict[str, str]:
    return {LABEL_MANAGED_BY: MANAGED_BY, LABEL_ROLE: ROLE_PLAN, **extra}


def data_digest(data: Mapping[str, Any] | None) -> str:
    """A digest of a ConfigMap's data, keys and values (bounded: the API server keeps a
    ConfigMap under 1 MiB)."""
    text = json.dumps(dict(data or {}), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def plan_limits(spec: JobSpec) -> PackLimits:
    """The most devices and actions a plan of this job can have: its pipeline ranks, and an
    F, B and W per microbatch of at most one stage per layer."""
    return PackLimits.of(devices=Mesh.of(spec).pipeline, stages=MAX_BLOCKS + 2,
                         microbatches=spec.training.microbatches)


def overwriting(rendered: Mapping[str, Any], *, current: Mapping[str, Any] | None
                ) -> dict[str, Any]:
    """``rendered`` as a merge patch over ``current`` that also removes the keys the operator
    did not write (as nulls): after it the ConfigMap holds exactly ``rendered``'s data."""
    stale = {k: None for k in (current or {}).get("data") or {} if k not in rendered["data"]}
    return {**rendered, "data": {**stale, **rendered["data"]}}


@dataclass(frozen=True, slots=True)
class StoredPlan:
    """A job's record and the digest of the worker ConfigMap written with it."""

    record: PlanRecord
    worker_digest: str


def render_record(job: JobRef, *, record: PlanRecord, namespace: str,
                  worker_data: Mapping[str, Any]) -> dict[str, Any]:
    """The record ConfigMap of ``job`` in ``namespace`` (the operator's), beside the digest of
    the worker ConfigMap ``worker_data`` written with it."""
    doc = record.model_dump(mode="json", exclude_none=True, exclude={"plan"})
    doc["plan"] = record.plan.packed()
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": record_name(job.uid),
            "namespace": namespace,
            "labels": _selector(**{LABEL_JOB_KEY: _job_key(job.namespace, job.name)}),
            "annotations": {ANNOTATION_JOB: f"{job.namespace}/{job.name}",
                            ANNOTATION_UID: job.uid},
        },
        "data": {RECORD_KEY: json.dumps(doc, separators=(",", ":")),
                 DIGEST_KEY: data_digest(worker_data)},
    }


def parse_record(cm: Mapping[str, Any], *, job: JobRef, spec: JobSpec) -> StoredPlan:
    """The record of ``job`` in ``cm``, decoded within ``spec``'s limits; ValueError (or
    pydantic's ValidationError) when it names another job or fails a check."""
    meta = cm.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    if (annotations.get(ANNOTATION_JOB) != f"{job.namespace}/{job.name}"
            or annotations.get(ANNOTATION_UID) != job.uid):
        raise ValueError("it names another job")
    data = cm.get("data") or {}
    raw, digest = data.get(RECORD_KEY), data.get(DIGEST_KEY)
    if not isinstance(raw, str) or not isinstance(digest, str):
        raise ValueError(f"no {RECORD_KEY} or {DIGEST_KEY}")
    if len(raw) > CONFIG_MAP_LIMIT_BYTES:
        raise ValueError(f"{RECORD_KEY} of {len(raw)} bytes, over a ConfigMap's")
    record = PlanRecord.model_validate_json(raw, context={"pack_limits": plan_limits(spec)})
    return StoredPlan(record=record, worker_digest=digest)


# What the decoded records kept in memory may weigh, counted in the bytes of their JSON (their
# objects weigh a few times more): a few hundred jobs' plans at the CRD's largest sizes.
DECODED_BYTES_MAX = 64 * 1024 * 1024

# record name, resourceVersion, the job's namespace, name and uid, its limits
_DecodedKey = tuple[str, str, str, str, str, PackLimits]


class _Decoded:
    """Decoded records by (ConfigMap name, resourceVersion, job, limits); least recently used
    out first once their JSON passes ``max_bytes``. Reconcile workers share it."""

    def __init__(self, *, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._bytes = 0
        self._entries: OrderedDict[_DecodedKey, tuple[StoredPlan, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: _DecodedKey) -> StoredPlan | None:
        with self._lock:
            hit = self._entries.get(key)
            if hit is None:
                return None
            self._entries.move_to_end(key)
            return hit[0]

    def put(self, key: _DecodedKey, stored: StoredPlan, *, size: int) -> None:
        if size > self._max_bytes:
            return
        with self._lock:
            before = self._entries.pop(key, None)
            self._bytes -= before[1] if before is not None else 0
            # One record a job: its older versions go at once, not only when memory is short.
            for old in [k for k in self._entries if k[0] == key[0]]:
                self._bytes -= self._entries.pop(old)[1]
            self._entries[key] = (stored, size)
            self._bytes += size
            while self._bytes > self._max_bytes:
                _, (_, dropped) = self._entries.popitem(last=False)
                self._bytes -= dropped

    def drop(self, name: str) -> None:
        with self._lock:
            for old in [k for k in self._entries if k[0] == name]:
                self._bytes -= self._entries.pop(old)[1]

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


class PlanStore:
    """The plan records of one operator, in ``namespace`` (its own)."""

    def __init__(self, cluster: Cluster, *, namespace: str,
                 decoded_bytes_max: int = DECODED_BYTES_MAX) -> None:
        self._cluster = cluster
        self._namespace = namespace
        self._decoded = _Decoded(max_bytes=decoded_bytes_max)
        self.decodes = 0  # records decoded (not found in memory), for tests and benchmarks

    def read(self, p: PassState, *, spec: JobSpec) -> StoredPlan | None:
        """The job's record, or None (plan afresh): none yet, or one that fails a check, which
        a Warning Event names."""
        name = record_name(p.job.uid)
        cm = self._cluster.get_config_map(self._namespace, name)
        if cm is None:
            self._decoded.drop(name)
            return None
        version = str((cm.get("metadata") or {}).get("resourceVersion") or "")
        limits = plan_limits(spec)
        key = (name, version, p.job.namespace, p.job.name, p.job.uid, limits)
        if version:
            hit = self._decoded.get(key)
            if hit is not None:
                return hit
        try:
            self.decodes += 1
            stored = parse_record(cm, job=p.job, spec=spec)
            if version:
                self._decoded.put(key, stored, size=len(str((cm.get("data") or {}).get(
                    RECORD_KEY, ""))))
            return stored
        except (ValueError, ValidationError, TypeError) as err:
            why = str(err).splitlines()[0][:300]
            log.warning("%s/%s: ignoring its plan record %s/%s: %s", p.job.namespace, p.job.name,
                        self._namespace, name, why)
            p.events.append(("Warning", Reason.PLAN_RECORD_REJECTED,
                             f"ConfigMap {self._namespace}/{name} failed its checks ({why}); "
                             "re-planning from the spec"))
            return None

    def write(self, job: JobRef, *, record: PlanRecord, worker_data: Mapping[str, Any]) -> None:
        """Create or overwrite the job's record (a merge of its two keys)."""
        obj = render_record(job, record=record, namespace=self._namespace, worker_data=worker_data)
        if not self._cluster.create(obj):
            self._cluster.replace_config_map(obj)

    def check_worker_config(self, p: PassState, *, spec: JobSpec, stored: StoredPlan,
                            current: Mapping[str, Any] | None) -> None:
        """Rewrite the job's ConfigMap (``current``, as read this pass) from the record when it
        is missing or differs from what the operator wrote (a Warning Event names it). Its
        content is hashed, never decoded."""
        name = config_map_name(p.job.name)
        if current is not None and data_digest(current.get("data")) == stored.worker_digest:
            return
        rendered = render_config_map(p.job, spec, record=stored.record)
        if current is None:
            self._cluster.create(rendered)
            p.events.append(("Warning", Reason.CONFIG_MAP_RESTORED,
                             f"ConfigMap {p.job.namespace}/{name} was deleted; written again "
                             "from the operator's plan record"))
        elif data_digest(current.get("data")) != data_digest(rendered["data"]):
            self._cluster.replace_config_map(overwriting(rendered, current=current))
            p.events.append(("Warning", Reason.CONFIG_MAP_RESTORED,
                             f"ConfigMap {p.job.namespace}/{name} was changed since the "
                             "operator wrote it; written again from the operator's plan record "
                             "(pods read it when they start)"))
        self.write(p.job, record=stored.record, worker_data=rendered["data"])

    def forget(self, namespace: str, name: str) -> None:
        """Delete the records of the job ``namespace/name`` (it is gone)."""
        for cm in self._cluster.list_config_maps(
                self._namespace, selector=_selector(**{LABEL_JOB_KEY: _job_key(namespace, name)})):
            meta = cm.get("metadata") or {}
            if (meta.get("annotations") or {}).get(ANNOTATION_JOB) == f"{namespace}/{name}":
                self._decoded.drop(str(meta.get("name", "")))
                self._cluster.delete_config_map(self._namespace, str(meta.get("name", "")))

    def sweep(self) -> int:
        """Delete the records whose job no longer exists (deleted while the operator was down);
        how many. API failures are logged and left to the next start."""
        gone = 0
        try:
            for cm in self._cluster.list_config_maps(self._namespace, selector=_selector()):
                meta = cm.get("metadata") or {}
                annotations = meta.get("annotations") or {}
                ns, _, name = str(annotations.get(ANNOTATION_JOB, "")).partition("/")
                job = self._cluster.get_job(ns, name) if ns and name else None
                if job is None or (job.get("metadata") or {}).get("uid") != annotations.get(
                        ANNOTATION_UID):
                    self._cluster.delete_config_map(self._namespace, str(meta.get("name", "")))
                    gone += 1
        except ApiError as err:
            log.warning("plan records: sweep of %s stopped: %s", self._namespace, err)
        return gone
