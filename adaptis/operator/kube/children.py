"""Creating a job's children, and what a refusal by the API server means for the job.

Sits between :mod:`adaptis.operator.control.reconcile` (which renders the ConfigMap, Service and
pods) and :mod:`adaptis.operator.kube.client` (which sends them). The API server answers a create
with a 4xx for one of two reasons, and the job's fate differs:

- **invalid** (400 a field of the wrong type or one the schema does not declare, 413/422 a
  value the schema refuses): the spec's fault, the same on every retry. The job fails with
  ``InvalidSpec`` naming the field of the spec behind the pod's field
  (``spec.worker.tolerations`` for ``spec.tolerations[0].key``); a corrected spec starts it
  again, as for any InvalidSpec. The operator creates with strict field validation
  (:mod:`adaptis.operator.kube.client`), so a misspelt key deep in a passthrough object
  (``persistentVolumeClaim: {claimNme: x}``) is such a 400, not a key the API server drops:
  the message names the volume (or env var, or mount) by its name, and the key.
- **rejected** (403 Pod Security, a quota, a policy, a webhook, RBAC; 404 the namespace is
  gone; 422 from a ValidatingAdmissionPolicy or webhook, which deny with that status too):
  the admin may relax it, so the job waits (``Running=False``, ``<Kind>Rejected``) and is
  looked at again every 30 s, without an exception and without a hot loop.

409 (already there) is success, and 429, 5xx and connection errors are the API server's own
failures: they propagate and the work queue retries them with backoff.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from adaptis.api.conditions import ConditionType, Reason
from adaptis.operator.core.errors import OperatorError
from adaptis.operator.core.passes import PassState
from adaptis.operator.kube.cluster import REFUSED_STATUSES, ApiError, Cluster

__all__ = [
    "POLICY_RETRY_S",
    "ChildRefused",
    "Refusal",
    "create_child",
    "probe_then_store",
    "first_refusal",
    "refusal",
    "wait_on",
]

_MAX_MESSAGE = 900
#: How soon a job whose child a policy refused is looked at again (the admin may relax it).
POLICY_RETRY_S = 30.0
# Where the pod's fields come from in the job's spec (the first matching prefix). The pod's own
# fields (affinity, the operator's env, volumes and mounts) come before the passthrough ones
# in each list, so an index in the pod is not the index in the spec: the list is named.
_POD_FIELDS: tuple[tuple[str, str], ...] = (
    ("metadata.labels", "spec.worker.labels"),
    ("metadata.annotations", "spec.worker.annotations"),
    ("metadata.name", "metadata.name"),
    ("spec.containers[0].env", "spec.worker.env"),
    ("spec.containers[0].resources", "spec.worker.resources"),
    ("spec.containers[0].volumeMounts", "spec.worker.volumeMounts"),
    ("spec.containers[0].image", "spec.worker.image"),
    ("spec.containers.env", "spec.worker.env"),
    ("spec.containers.resources", "spec.worker.resources"),
    ("spec.containers.volumeMounts", "spec.worker.volumeMounts"),
    ("spec.tolerations", "spec.worker.tolerations"),
    ("spec.volumes", "spec.worker.volumes"),
    ("spec.nodeSelector", "spec.worker.nodeSelector"),
    ("spec.priorityClassName", "spec.worker.priorityClassName"),
    ("spec.serviceAccountName", "spec.worker.serviceAccountName"),
    ("spec.containers[0].ports", "spec.metrics.port"),
)
_CONFIG_MAP_FIELDS = "spec.training.microbatches, spec.parallelism.workers"
# "Pod "x" is invalid: spec.tolerations[0].key: Invalid value: ..." (one or a [list] of them)
_INVALID_FIELD = re.compile(r"is invalid: \[?([A-Za-z][\w.\[\]/-]*):")
# 400 from decoding: "json: cannot unmarshal number into Go struct field
# Toleration.spec.tolerations.key of type string"
_DECODE_FIELD = re.compile(r"Go struct field \w+\.([\w.\[\]]+) of type")
# 400 from strict decoding (fieldValidation=Strict): 'strict decoding error: unknown field
# "spec.volumes[5].persistentVolumeClaim.claimNme"' (a built-in kind), or
# ".spec.foo: field not declared in schema" (a schema of structured-merge-diff's).
_UNKNOWN_FIELD = re.compile(r'unknown field "([^"]+)"'
                            r"|\.?([A-Za-z][\w.\[\]/-]*): field not declared in schema")
# The pod's lists whose entries come from the spec after the operator's own: an entry is
# named by its name, as its index in the pod is not its index in the spec.
_NAMED_ENTRIES = re.compile(r"^(spec\.volumes|spec\.containers\[0\]\.env"
                            r"|spec\.containers\[0\]\.volumeMounts)\[(\d+)\]\.?(.*)$")
_ENTRY_KINDS = {"spec.volumes": "volume", "spec.containers[0].env": "env var",
                "spec.containers[0].volumeMounts": "volume mount"}
# Decoding errors that name no field but say which one they mean: spec.worker.resources is
# checked before any create (adaptis.api.pod_fields), so a bad quantity the API server still
# finds sits in a volume's source (emptyDir.sizeLimit), which passes through unchecked.
_HINTS = (("quantities must match", "spec.worker.volumes"),)
# Admission policies and webhooks deny with 422 too; those are the admin's to relax.
_POLICY = re.compile(r"ValidatingAdmissionPolicy|admission webhook|denied (the )?request",
                     re.IGNORECASE)


_REJECTED = {"Pod": Reason.PODS_REJECTED, "Service": Reason.SERVICE_REJECTED,
             "ConfigMap": Reason.CONFIG_MAP_REJECTED}


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why the API server would not create one child of the job."""

    invalid: bool  # True: the spec's fault (Failed); False: a policy's (wait and retry)
    kind: str  # Pod, Service, ConfigMap
    field: str  # the spec field behind it, as best the message tells
    message: str

    @property
    def reason(self) -> str:
        if self.invalid:
            return Reason.INVALID_SPEC
        return _REJECTED.get(self.kind, f"{self.kind}Rejected")


class ChildRefused(OperatorError):
    """A create the API server refused for the job's sake; carries the :class:`Refusal`."""

    def __init__(self, refused: Refusal) -> None:
        super().__init__(refused.message)
        self.refusal = refused


def _spec_field(kind: str, api_field: str | None, *, text: str, invalid: bool) -> str:
    if kind != "Pod" and not invalid:
        return "metadata.namespace"  # RBAC, a quota or a namespace gone: nothing in the spec
    if kind == "ConfigMap":
        return _CONFIG_MAP_FIELDS  # its only content of any size is the plan
    for hint, field in _HINTS:
        if api_field is None and hint in text:
            return field
    if api_field and kind == "Pod":
        for prefix, field in _POD_FIELDS:
            if api_field.startswith(prefix):
                return field
    if api_field and kind == "Service" and api_field.startswith("metadata.name"):
        return "metadata.name"
    if api_field and api_field.startswith("metadata.labels"):
        return "spec.worker.labels"
    return "spec.worker"


def _entry(obj: Mapping[str, Any], api_field: str) -> str:
    """``volume "data": persistentVolumeClaim.claimNme`` for a pod's
    ``spec.volumes[5].persistentVolumeClaim.claimNme`` when its sixth volume is ``data``; the
    field itself when it is not in such a list (or the pod does not say)."""
    found = _NAMED_ENTRIES.match(api_field)
    if found is None:
        return api_field
    items: Any = obj.get("spec") or {}
    for part in found.group(1).removeprefix("spec.").split("."):
        if part.endswith("[0]"):
            items = (items.get(part[:-3]) or [None])[0] if isinstance(items, Mapping) else None
        else:
            items = items.get(part) if isinstance(items, Mapping) else None
    index, rest = int(found.group(2)), found.group(3)
    entry = items[index] if isinstance(items, list) and index < len(items) else None
    name = entry.get("name") if isinstance(entry, Mapping) else None
    if not isinstance(name, str):
        return api_field
    return f"{_ENTRY_KINDS[found.group(1)]} {json.dumps(name)}" + (f": {rest}" if rest else "")


def refusal(err: ApiError, *, obj: Mapping[str, Any]) -> Refusal | None:
    """What a failed create means for the job; None when it is the API server's own failure."""
    if err.status not in REFUSED_STATUSES:
        return None
    text = str(err)
    kind = str(obj.get("kind", "object"))
    name = str((obj.get("metadata") or {}).get("name", ""))
    unknown = _UNKNOWN_FIELD.search(text)
    found = _INVALID_FIELD.search(text) or _DECODE_FIELD.search(text)
    api_field = (unknown.group(1) or unknown.group(2) if unknown
                 else found.group(1) if found else None)
    invalid = err.status in {400, 413} or (err.status == 422 and not _POLICY.search(text))
    field = _spec_field(kind, api_field, text=text, invalid=invalid)
    where = f" (the {kind}'s {api_field})" if api_field else ""
    verb = "refused" if invalid else "rejected"
    # A key no schema declares: what to fix first, the API server's words after.
    what = (f"{_entry(obj, api_field)} is not a field Kubernetes knows (check its spelling); "
            if unknown and api_field else "")
    message = f"{field}: {what}the API server {verb} {kind} {name}{where}: {text}"
    return Refusal(invalid=invalid, kind=kind, field=field, message=message[:_MAX_MESSAGE])


def create_child(cluster: Cluster, obj: Mapping[str, Any], *, replace: bool = False) -> bool:
    """``cluster.create`` (or, ``replace``, ``cluster.replace_config_map``); a refusal of the
    job's making raises :class:`ChildRefused`, anything else propagates."""
    try:
        if replace:
            cluster.replace_config_map(obj)
            return False
        return cluster.create(obj)
    except ApiError as err:
        found = refusal(err, obj=obj)
        if found is None:
            raise
        raise ChildRefused(found) from None


def probe_then_store(cluster: Cluster, config_map: Mapping[str, Any], *,
                     probe: Mapping[str, Any], replace: bool) -> None:
    """Before a new plan's ConfigMap is written (so before anything of the job exists), ask the
    API server to validate a worker pod (``dryRun=All``): the parts of the spec no model
    checks (a volume's source) fail the job here, with nothing created. A policy's refusal of
    the probe is not acted on: the real creates report it (``PodsRejected``), and the plan is
    stored so that waiting does not mean planning again."""
    try:
        cluster.dry_run_create(probe)
    except ApiError as err:
        found = refusal(err, obj=probe)
        if found is None:
            raise
        if found.invalid:
            raise ChildRefused(found) from None
    create_child(cluster, config_map, replace=replace)


def first_refusal(refused: Mapping[str, ApiError],
                  objects: Sequence[Mapping[str, Any]]) -> Refusal:
    """The policy's refusal to wait on among a batch's; :class:`ChildRefused` if any is invalid
    (the job fails). ``refused`` comes from :func:`~adaptis.operator.kube.cluster.create_many`."""
    by_name = {str(o["metadata"]["name"]): o for o in objects}
    found = [r for name, err in sorted(refused.items())
             if (r := refusal(err, obj=by_name.get(name, {"kind": "Pod",
                                                          "metadata": {"name": name}})))]
    if not found:
        raise OperatorError("first_refusal needs at least one refusal")
    first = min(found, key=lambda r: not r.invalid)
    if first.invalid:
        raise ChildRefused(first)
    return first


def wait_on(p: PassState, why: Refusal, *, retry_s: float = POLICY_RETRY_S) -> None:
    """A policy's refusal: the job waits, says why, and is looked at again in ``retry_s``."""
    p.update(message=why.message)
    p.condition(ConditionType.RUNNING, "False", reason=why.reason, message=why.message, event="Warning")
    p.requeue.append(retry_s)
