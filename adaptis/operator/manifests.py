"""The children of an AdaPtisJob as plain dicts: ConfigMap, headless Service, worker pods.

Sits between :mod:`adaptis.operator.planning` (what to run where) and the Kubernetes client
(which creates whatever these functions return). Pure functions: the same job and plan always
render the same objects with the same names, which is what makes the reconciler idempotent and
an operator restart harmless (a create that meets an existing name is a 409, i.e. done).

- ConfigMap ``<job>-config``: ``worker.json`` (:class:`~adaptis.api.job.WorkerConfig`, read by
  ``adaptis worker``) and ``plan-record.json`` (the operator's cached plan, less the plan
  itself, which it takes from ``worker.json``), the plan's actions packed
  (:meth:`adaptis.api.plan.Plan.packed`) so that large plans fit the API server's 1 MiB
  (:data:`CONFIG_MAP_LIMIT_BYTES`); one that still does not raises
  :class:`~adaptis.operator.errors.PlanTooLarge` (docs/plan-storage.md).
- Service ``<job>-workers``: headless; gives rank 0 the stable DNS name that ``MASTER_ADDR``
  holds (``<job>-worker-0.<job>-workers.<ns>.svc``).
- Pod ``<job>-worker-<rank>``: required node affinity to the node the plan gives the rank;
  restricted as :mod:`adaptis.operator.pod_security` renders it (Pod Security ``restricted``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from adaptis.api.job import API_VERSION, KIND, JobSpec, WorkerConfig
# The names live in the api layer, whose rules check that they fit DNS labels; re-exported.
from adaptis.api.rules import config_map_name, pod_name, service_name
from adaptis.operator.errors import PlanTooLarge
from adaptis.operator.kueue import kueue_annotations, kueue_labels
from adaptis.operator.planning import PlanRecord
from adaptis.operator.pod_security import (
    container_security_context,
    pod_security_context,
    scratch_env,
    scratch_mounts,
    scratch_volumes,
)

__all__ = [
    "CHECKPOINT_VOLUME",
    "CONFIG_MAP_LIMIT_BYTES",
    "CONFIG_MOUNT",
    "CONFIG_VOLUME",
    "DIST_PORT",
    "JobRef",
    "LABEL_ATTEMPT",
    "LABEL_JOB",
    "LABEL_MANAGED_BY",
    "LABEL_PLAN",
    "LABEL_RANK",
    "ManifestSettings",
    "NODE_ANNOTATION",
    "RESERVED_ENV",
    "config_map_name",
    "plan_hash",
    "pod_name",
    "render_config_map",
    "render_pod",
    "render_service",
    "service_name",
]

LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_JOB = "adaptis.io/job"
LABEL_RANK = "adaptis.io/rank"
LABEL_PLAN = "adaptis.io/plan-hash"
LABEL_ATTEMPT = "adaptis.io/attempt"
MANAGED_BY = "adaptis"
NODE_ANNOTATION = "adaptis.io/node"  # the node the plan pins the rank to (counted before binding)

CONFIG_VOLUME = "adaptis-config"
CHECKPOINT_VOLUME = "checkpoints"
CONFIG_MOUNT = "/etc/adaptis"
DIST_PORT = 29500
# The API server refuses a ConfigMap whose data and binaryData (keys and values) exceed 1 MiB.
CONFIG_MAP_LIMIT_BYTES = 1024 * 1024
RESERVED_ENV = frozenset(
    {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "ADAPTIS_JOB",
     "ADAPTIS_NAMESPACE"}
)


@dataclass(frozen=True, slots=True)
class JobRef:
    """Who owns the children."""

    name: str
    namespace: str
    uid: str

    def owner_reference(self) -> dict[str, Any]:
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


@dataclass(frozen=True, slots=True)
class ManifestSettings:
    """Operator-wide defaults of the worker pods.

    ``run_as_user``/``run_as_group``: the numeric user of the worker image (the Dockerfile's
    ``USER 10001:10001``); the pods run as it, since runAsNonRoot can only be checked against
    a number.
    """

    image: str = "ghcr.io/adaptis/adaptis:0.1.0"
    image_pull_policy: str = "IfNotPresent"
    run_as_user: int = 10001
    run_as_group: int = 10001


def plan_hash(record: PlanRecord) -> str:
    """Digest of what the pods depend on: the plan, its nodes and the spec behind them."""
    text = record.spec_hash + record.plan.to_json() + ",".join(record.nodes)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _labels(job: JobRef) -> dict[str, str]:
    return {LABEL_MANAGED_BY: MANAGED_BY, LABEL_JOB: job.name}


def _meta(job: JobRef, name: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": job.namespace,
        "labels": _labels(job),
        "ownerReferences": [job.owner_reference()],
        **extra,
    }


def worker_config(job: JobRef, spec: JobSpec, record: PlanRecord) -> WorkerConfig:
    return WorkerConfig(
        job_name=job.name,
        model=spec.model,
        training=spec.training,
        plan=record.plan.packed(),
        metrics_port=spec.metrics.port,
        checkpoint_dir=spec.checkpoint.path,
        checkpoint_every=spec.checkpoint.every_steps,
        zero_stage=spec.parallelism.zero_stage,
    )


def render_config_map(job: JobRef, spec: JobSpec, record: PlanRecord) -> dict[str, Any]:
    """The job's ConfigMap; :class:`PlanTooLarge` when it would not fit the API server's limit."""
    config = worker_config(job, spec, record)
    # The plan is stored once, in worker.json; record_from_config_map reads it from there.
    cached = record.model_dump(mode="json", exclude_none=True, exclude={"plan"})
    data = {
        "worker.json": config.model_dump_json(by_alias=True, exclude_none=True, indent=1),
        "plan-record.json": json.dumps(cached, separators=(",", ":")),
    }
    size = sum(len(k.encode()) + len(v.encode()) for k, v in data.items())
    if size > CONFIG_MAP_LIMIT_BYTES:
        actions = sum(len(a) for a in record.plan.actions)
        raise PlanTooLarge(
            f"spec.training.microbatches, spec.parallelism.workers: the plan ({len(record.nodes)} "
            f"ranks, {actions} actions) needs a ConfigMap of {size} bytes, over the API "
            f"server's {CONFIG_MAP_LIMIT_BYTES}; use fewer microbatches or workers")
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(job, config_map_name(job.name),
                          annotations={LABEL_PLAN: plan_hash(record)}),
        "data": data,
    }


def render_service(job: JobRef, spec: JobSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(job, service_name(job.name)),
        "spec": {
            "clusterIP": "None",
            # Ranks must resolve each other before they are Ready: rendezvous comes first.
            "publishNotReadyAddresses": True,
            "selector": _labels(job),
            "ports": [
                {"name": "dist", "port": DIST_PORT, "targetPort": DIST_PORT},
                {"name": "metrics", "port": spec.metrics.port, "targetPort": spec.metrics.port},
            ],
        },
    }


def _resources(spec: JobSpec) -> dict[str, Any]:
    res: dict[str, Any] = {k: dict(v) for k, v in (spec.worker.resources or {}).items()}
    gpus = spec.parallelism.gpus_per_worker
    if gpus > 0:
        res.setdefault("limits", {})["nvidia.com/gpu"] = str(gpus)
        res.setdefault("requests", {})["nvidia.com/gpu"] = str(gpus)
    return res


def _env(job: JobRef, *, rank: int, world: int) -> list[dict[str, Any]]:
    master = f"{pod_name(job.name, 0)}.{service_name(job.name)}.{job.namespace}.svc"
    return [
        {"name": "RANK", "value": str(rank)},
        {"name": "WORLD_SIZE", "value": str(world)},
        {"name": "LOCAL_RANK", "value": "0"},
        {"name": "MASTER_ADDR", "value": master},
        {"name": "MASTER_PORT", "value": str(DIST_PORT)},
        {"name": "ADAPTIS_JOB", "value": job.name},
        {"name": "ADAPTIS_NAMESPACE", "value": job.namespace},
    ]


def render_pod(
    job: JobRef,
    spec: JobSpec,
    record: PlanRecord,
    *,
    rank: int,
    attempt: int,
    settings: ManifestSettings,
) -> dict[str, Any]:
    """The pod of one rank: placed on ``record.nodes[rank]`` by required node affinity."""
    world = len(record.nodes)
    name = pod_name(job.name, rank)
    labels = {
        **spec.worker.labels,
        **_labels(job),
        LABEL_RANK: str(rank),
        LABEL_PLAN: plan_hash(record),
        LABEL_ATTEMPT: str(attempt),
        **kueue_labels(job_name=job.name, queue_name=spec.queue_name, attempt=attempt),
    }
    annotations = {
        **spec.worker.annotations,
        **kueue_annotations(world=world, queue_name=spec.queue_name),
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(spec.metrics.port),
        "prometheus.io/path": "/metrics",
        NODE_ANNOTATION: record.nodes[rank],
    }
    checkpoint: dict[str, Any] = (
        {"persistentVolumeClaim": {"claimName": spec.checkpoint.claim_name}}
        if spec.checkpoint.claim_name else {"emptyDir": {}}
    )
    tolerations = list(spec.worker.tolerations)
    if spec.parallelism.gpus_per_worker > 0:
        # GPU nodes are commonly tainted so that only GPU pods land there.
        tolerations.append({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"})
    container: dict[str, Any] = {
        "name": "worker",
        "image": spec.worker.image or settings.image,
        "imagePullPolicy": spec.worker.image_pull_policy or settings.image_pull_policy,
        "command": ["adaptis", "worker", "--config", f"{CONFIG_MOUNT}/worker.json"],
        "env": [*_env(job, rank=rank, world=world), *scratch_env(), *spec.worker.env],
        "ports": [
            {"name": "dist", "containerPort": DIST_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": spec.metrics.port, "protocol": "TCP"},
        ],
        "resources": _resources(spec),
        "volumeMounts": [
            {"name": CONFIG_VOLUME, "mountPath": CONFIG_MOUNT, "readOnly": True},
            {"name": CHECKPOINT_VOLUME, "mountPath": spec.checkpoint.path},
            *scratch_mounts(),
            *spec.worker.volume_mounts,
        ],
        "securityContext": container_security_context(),
        # The worker writes its observed figures (bubble ratio) here; the operator reads them.
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "hostname": name,
        "subdomain": service_name(job.name),
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 30,
        "securityContext": pod_security_context(run_as_user=settings.run_as_user,
                                                run_as_group=settings.run_as_group),
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{
                        "matchExpressions": [{
                            "key": "kubernetes.io/hostname",
                            "operator": "In",
                            "values": [record.hostnames[rank]],
                        }]
                    }]
                }
            }
        },
        "containers": [container],
        "volumes": [
            {"name": CONFIG_VOLUME, "configMap": {"name": config_map_name(job.name)}},
            {"name": CHECKPOINT_VOLUME, **checkpoint},
            *scratch_volumes(),
            *spec.worker.volumes,
        ],
    }
    if spec.worker.node_selector:
        pod_spec["nodeSelector"] = dict(spec.worker.node_selector)
    if tolerations:
        pod_spec["tolerations"] = tolerations
    if spec.worker.priority_class_name:
        pod_spec["priorityClassName"] = spec.worker.priority_class_name
    if spec.worker.service_account_name:
        pod_spec["serviceAccountName"] = spec.worker.service_account_name
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": _meta(job, name, annotations=annotations) | {"labels": labels},
        "spec": pod_spec,
    }


def is_current_pod(pod: Mapping[str, Any], *, plan: str, attempt: int) -> bool:
    """Whether a pod belongs to this plan and this attempt (else it is stale and goes)."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return labels.get(LABEL_PLAN) == plan and labels.get(LABEL_ATTEMPT) == str(attempt)
