"""The children of an AdaPtisJob as plain dicts: ConfigMap, headless Service, worker pods.

Sits between :mod:`adaptis.operator.scheduling.planning` (what to run where) and the Kubernetes
client (which creates whatever these functions return). Pure functions: the same job and plan always
render the same objects with the same names, which is what makes the reconciler idempotent and an
operator restart harmless (a create that meets an existing name is a 409, i.e. done).

- ConfigMap ``<job>-config``: ``worker.json`` (:class:`~adaptis.api.job.WorkerConfig`, read by
  ``adaptis worker``; the operator never reads it back, see
  :mod:`adaptis.operator.scheduling.plan_store`), the plan's actions packed
  (:meth:`adaptis.api.plan.Plan.packed`) so that large plans fit the API server's 1 MiB
  (:data:`CONFIG_MAP_LIMIT_BYTES`); one that still does not raises
  :class:`~adaptis.operator.core.errors.PlanTooLarge` (docs/plan-storage.md).
- Service ``<job>-workers``: headless; gives rank 0 the stable DNS name that ``MASTER_ADDR``
  holds (``<job>-worker-0.<job>-workers.<ns>.svc``).
- Pod ``<job>-worker-<w>``: required node affinity to the node the plan gives pod w; restricted as
  :mod:`adaptis.operator.resources.pod_security` renders it (Pod Security ``restricted``). A pod of
  N > 1 GPUs runs N ranks (global ranks w*N .. w*N + N - 1) under torch's launcher, ``python -m
  torch.distributed.run`` (static rendezvous at rank 0's pod, no restarts: one failing rank fails
  the pod and the operator restarts the gang); it sets RANK, LOCAL_RANK (the rank's GPU) and
  WORLD_SIZE for each. A pod of one GPU, or a CPU pod, runs ``adaptis worker`` itself with that
  environment. Rank ``LOCAL_RANK`` serves metrics on ``spec.metrics.port + LOCAL_RANK``; every such
  port is declared (``metrics``, ``metrics-1``, ...) for the PodMonitor. A Hugging Face model named
  by ConfigMap mounts that ConfigMap's key read-only (:mod:`adaptis.operator.resources.hf_config`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from adaptis.api.hf_model import worker_spec
from adaptis.api.job import JobSpec, WorkerConfig
from adaptis.api.model import HuggingFaceModel

# The names live in the api layer, whose rules check that they fit DNS labels; re-exported.
from adaptis.api.rules import config_map_name, pod_name, service_name
from adaptis.operator.core.errors import PlanTooLarge
from adaptis.operator.core.labels import (
    LABEL_ATTEMPT,
    LABEL_JOB,
    LABEL_MANAGED_BY,
    LABEL_PLAN,
    LABEL_RANK,
    MANAGED_BY,
    NODE_ANNOTATION,
)
from adaptis.operator.core.records import JobRef, PlanRecord
from adaptis.operator.core.settings import ManifestSettings
from adaptis.operator.resources.hf_config import hf_config_volume
from adaptis.operator.resources.kueue import kueue_annotations, kueue_labels
from adaptis.operator.resources.pod_security import (
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
    "RESERVED_ENV",
    "RESERVED_ENV_PREFIXES",
    "SHM_MOUNT",
    "SHM_VOLUME",
    "config_map_name",
    "is_reserved_env",
    "metrics_ports",
    "plan_hash",
    "ranks_per_pod",
    "pod_name",
    "render_config_map",
    "render_pod",
    "render_service",
    "service_name",
    "worker_command",
]


CONFIG_VOLUME = "adaptis-config"
CHECKPOINT_VOLUME = "checkpoints"
CONFIG_MOUNT = "/etc/adaptis"
# Shared memory: the container runtime's default /dev/shm is 64 MiB, which NCCL's
# intra-node transport and torch's DataLoader workers overrun (bus errors). A memory-backed
# emptyDir replaces it; its pages count against the container's memory limit, so its size
# limit is that limit when the job sets one, else none (bounded by the pod's memory).
SHM_VOLUME = "dshm"
SHM_MOUNT = "/dev/shm"  # noqa: S108  # the mount point, not a temp file
DIST_PORT = 29500
# The API server refuses a ConfigMap whose data and binaryData (keys and values) exceed 1 MiB.
CONFIG_MAP_LIMIT_BYTES = 1024 * 1024
RESERVED_ENV = frozenset(
    {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "ADAPTIS_JOB",
     "ADAPTIS_NAMESPACE",
     # What torch's launcher sets for each of a multi-GPU pod's ranks.
     "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE",
     "ROLE_NAME", "NODE_RANK"}
)
#: Prefixes of the launcher's own settings: PET_<FLAG> is the default of each flag of
#: torch.distributed.run (PET_RDZV_ENDPOINT would move the gang's rendezvous), TORCHELASTIC_*
#: its agent's. NCCL_*, GLOO_* and the rest pass through as the job sets them.
RESERVED_ENV_PREFIXES = ("PET_", "TORCHELASTIC_")


def is_reserved_env(name: str) -> bool:
    """Whether an env var is the operator's or torch's launcher's, so a job may not set it."""
    return name in RESERVED_ENV or name.startswith(RESERVED_ENV_PREFIXES)


def plan_hash(record: PlanRecord) -> str:
    """Digest of what the pods depend on: the plan, its nodes and hostnames, the mesh and the
    spec behind them."""
    text = "|".join([record.spec_hash, record.plan.to_json(), ",".join(record.nodes),
                     ",".join(record.hostnames), f"{record.ranks_per_pod}x{record.data_parallel}"
                     + (f"x{record.tensor_parallel}" if record.tensor_parallel > 1 else "")])
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


def worker_config(job: JobRef, spec: JobSpec, *, record: PlanRecord) -> WorkerConfig:
    model = spec.model
    if isinstance(model, HuggingFaceModel):
        # A ConfigMap's config reaches the worker through its volume (hf_config_volume), not
        # as the operator's resolved copy.
        model = model.with_huggingface(worker_spec(model.huggingface))
    return WorkerConfig(
        job_name=job.name,
        model=model,
        training=spec.training,
        plan=record.plan.packed(),
        metrics_port=spec.metrics.port,
        checkpoint_dir=spec.checkpoint.path,
        checkpoint_every=spec.checkpoint.every_steps,
        zero_stage=spec.parallelism.zero_stage,
        data_parallel=record.data_parallel,
        tensor_parallel=record.tensor_parallel,
        sequence_parallel=spec.parallelism.sequence_parallel,
    )


def render_config_map(job: JobRef, spec: JobSpec, *, record: PlanRecord) -> dict[str, Any]:
    """The job's ConfigMap; :class:`PlanTooLarge` when it would not fit the API server's limit."""
    config = worker_config(job, spec, record=record)
    data = {"worker.json": config.model_dump_json(by_alias=True, exclude_none=True, indent=1)}
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
                *({"name": n, "port": port, "targetPort": port}
                  for n, port in metrics_ports(spec)),
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


def ranks_per_pod(spec: JobSpec) -> int:
    """N: one rank per GPU of the pod; a CPU pod runs one."""
    return spec.parallelism.ranks_per_worker


def metrics_ports(spec: JobSpec) -> list[tuple[str, int]]:
    """(name, port) of each local rank's metrics endpoint: the base port + LOCAL_RANK."""
    base = spec.metrics.port
    return [("metrics" if i == 0 else f"metrics-{i}", base + i) for i in range(ranks_per_pod(spec))]


def _master(job: JobRef) -> str:
    """Rank 0's pod through the headless Service: stable before the pod is Ready."""
    return f"{pod_name(job.name, 0)}.{service_name(job.name)}.{job.namespace}.svc"


def _env(job: JobRef, *, pod: int, pods: int, per_pod: int) -> list[dict[str, Any]]:
    ident = [{"name": "ADAPTIS_JOB", "value": job.name},
             {"name": "ADAPTIS_NAMESPACE", "value": job.namespace}]
    if per_pod > 1:
        return ident  # torch's launcher gives each of its ranks RANK, LOCAL_RANK, WORLD_SIZE, ...
    return [
        {"name": "RANK", "value": str(pod)},
        {"name": "WORLD_SIZE", "value": str(pods)},
        {"name": "LOCAL_RANK", "value": "0"},
        {"name": "MASTER_ADDR", "value": _master(job)},
        {"name": "MASTER_PORT", "value": str(DIST_PORT)},
        *ident,
    ]


def worker_command(job: JobRef, *, pod: int, pods: int, per_pod: int) -> list[str]:
    """The container command of worker pod ``pod`` of ``pods``, each of ``per_pod`` ranks."""
    worker = ["worker", "--config", f"{CONFIG_MOUNT}/worker.json"]
    if per_pod == 1:
        return ["adaptis", *worker]
    # torch's own launcher rather than one of ours: it sets each rank's environment, forwards
    # signals, and with --max-restarts 0 ends the pod when any rank fails (the gang restart
    # is the operator's). Static rendezvous: pod 0's launcher hosts the store on DIST_PORT,
    # which the ranks' process group then shares (tcp:// init sees TORCHELASTIC_USE_AGENT_STORE).
    return ["python", "-m", "torch.distributed.run",
            "--nnodes", str(pods), "--nproc-per-node", str(per_pod), "--node-rank", str(pod),
            "--master-addr", _master(job), "--master-port", str(DIST_PORT),
            "--max-restarts", "0", "--module", "adaptis", *worker]


def render_pod(
    job: JobRef,
    spec: JobSpec,
    *,
    record: PlanRecord,
    rank: int,
    attempt: int,
    settings: ManifestSettings,
) -> dict[str, Any]:
    """Worker pod ``rank`` (w; it runs global ranks w*N .. w*N + N - 1): placed on
    ``record.nodes[w]`` by required node affinity."""
    pods = len(record.nodes)
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
        **kueue_annotations(world=pods, queue_name=spec.queue_name),
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(spec.metrics.port),
        "prometheus.io/path": "/metrics",
        NODE_ANNOTATION: record.nodes[rank],
    }
    tolerations = list(spec.worker.tolerations)
    if spec.parallelism.gpus_per_worker > 0:
        # GPU nodes are commonly tainted so that only GPU pods land there.
        tolerations.append({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"})
    hf_volume, hf_mounts = hf_config_volume(spec) or (None, None)
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "hostname": name,
        "subdomain": service_name(job.name),
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 30,
        "securityContext": pod_security_context(run_as_user=settings.run_as_user,
                                                run_as_group=settings.run_as_group),
        "affinity": _on_host(record.hostnames[rank]),
        "containers": [_worker_container(job, spec, rank=rank, pods=pods, settings=settings, hf_mounts=hf_mounts)],
        "volumes": _volumes(job, spec, hf_volume=hf_volume),
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


def _worker_container(job: JobRef, spec: JobSpec, *, rank: int, pods: int, settings: ManifestSettings,
                      hf_mounts: dict[str, Any] | None) -> dict[str, Any]:
    """The worker container of pod ``rank`` of ``pods``."""
    per_pod = ranks_per_pod(spec)
    return {
        "name": "worker",
        "image": spec.worker.image or settings.image,
        "imagePullPolicy": spec.worker.image_pull_policy or settings.image_pull_policy,
        "command": worker_command(job, pod=rank, pods=pods, per_pod=per_pod),
        "env": [*_env(job, pod=rank, pods=pods, per_pod=per_pod), *scratch_env(),
                *spec.worker.env],
        "ports": [
            {"name": "dist", "containerPort": DIST_PORT, "protocol": "TCP"},
            *({"name": n, "containerPort": port, "protocol": "TCP"}
              for n, port in metrics_ports(spec)),
        ],
        "resources": _resources(spec),
        "volumeMounts": [
            {"name": CONFIG_VOLUME, "mountPath": CONFIG_MOUNT, "readOnly": True},
            *([hf_mounts] if hf_mounts else []),
            {"name": CHECKPOINT_VOLUME, "mountPath": spec.checkpoint.path},
            *scratch_mounts(),
            {"name": SHM_VOLUME, "mountPath": SHM_MOUNT},
            *spec.worker.volume_mounts,
        ],
        "securityContext": container_security_context(),
        # The worker writes its observed figures (bubble ratio) here; the operator reads them.
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def _on_host(hostname: str) -> dict[str, Any]:
    """Required node affinity to the node of that ``kubernetes.io/hostname``: the plan placed
    this pod's ranks on it."""
    term = {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": [hostname]}]}
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}}


def _volumes(job: JobRef, spec: JobSpec, *, hf_volume: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The pod's volumes: the plan's ConfigMap, the Hugging Face config's, the checkpoints'
    (the job's claim, else an emptyDir), scratch, /dev/shm, then the user's."""
    checkpoint: dict[str, Any] = (
        {"persistentVolumeClaim": {"claimName": spec.checkpoint.claim_name}}
        if spec.checkpoint.claim_name else {"emptyDir": {}}
    )
    return [
        {"name": CONFIG_VOLUME, "configMap": {"name": config_map_name(job.name)}},
        *([hf_volume] if hf_volume else []),
        {"name": CHECKPOINT_VOLUME, **checkpoint},
        *scratch_volumes(),
        shm_volume(spec),
        *spec.worker.volumes,
    ]


def shm_volume(spec: JobSpec) -> dict[str, Any]:
    """The memory-backed /dev/shm of a worker pod, sized by the container's memory limit."""
    empty_dir: dict[str, Any] = {"medium": "Memory"}
    memory = ((spec.worker.resources or {}).get("limits") or {}).get("memory")
    if memory is not None:
        empty_dir["sizeLimit"] = memory
    return {"name": SHM_VOLUME, "emptyDir": empty_dir}


def is_current_pod(pod: Mapping[str, Any], *, plan: str, attempt: int) -> bool:
    """Whether a pod belongs to this plan and this attempt (else it is stale and goes)."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return labels.get(LABEL_PLAN) == plan and labels.get(LABEL_ATTEMPT) == str(attempt)
