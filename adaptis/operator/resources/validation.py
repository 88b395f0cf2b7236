"""Semantic validation: the rules of an AdaPtisJob that the CRD's schema cannot express.

Sits at the start of every reconcile. The API server already enforces types, bounds, enums and
the CEL rules of the CRD; the job-level rules every entry point shares (DNS-label child names,
no more ranks than layers, two layers per rank for the two-chunk schedules, checkpoints within
the run) come from :func:`adaptis.api.rules.job_violations`, the same function ``adaptis run``
applies. Added here are only the operator's own choices: its environment, rendezvous port,
volumes and GPU request must not be overridden; and a Hugging Face config named by ConfigMap
is read first (:mod:`adaptis.operator.resources.hf_config`), so the rules check what it holds. Each
violation names its field (``spec.parallelism.workers: ...``) because it becomes a condition
and an Event the user reads.

:func:`absent_config_maps` is not a rule of the spec but of the cluster: the ConfigMaps (and
keys) that ``spec.worker.env`` and ``spec.worker.volumes`` reference without ``optional: true``
and that do not exist. The reconciler asks it before creating pods, which wait until they do
(a pod created now would only hang in the kubelet). Secrets are not looked at: the operator
may not read them (SECURITY.md); the kubelet's CreateContainerConfigError says so instead
(docs/tenancy.md, "When worker containers cannot start").
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from pydantic import ValidationError

from adaptis.api.errors import from_validation_error
from adaptis.api.job import JobSpec
from adaptis.api.rules import Violation, format_violations, job_violations
from adaptis.operator.core.errors import InvalidJob
from adaptis.operator.core.labels import GPU_RESOURCE
from adaptis.operator.resources.hf_config import (
    HF_CONFIG_VOLUME,
    ConfigReader,
    configmap_violations,
    named_config_map,
    resolve_spec,
)
from adaptis.operator.resources.manifests import (
    CHECKPOINT_VOLUME,
    CONFIG_VOLUME,
    DIST_PORT,
    SHM_MOUNT,
    SHM_VOLUME,
    is_reserved_env,
)

__all__ = ["absent_config_maps", "validate_job"]

#: The resource names of the NVIDIA device plugin's MIG slices (mixed strategy).
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"

#: How many of a ConfigMap's keys a message lists (they are the tenant's text).
_KEYS_SHOWN = 5


def _parse_spec(raw: Mapping[str, Any]) -> JobSpec:
    try:
        return JobSpec.model_validate(dict(raw))
    except ValidationError as err:
        spec_err = from_validation_error(err, what="spec")
        fields = [f"spec.{f}" for f in spec_err.fields]
        lines = [line.replace("spec: ", "spec.", 1) for line in str(spec_err).splitlines()]
        raise InvalidJob("\n".join(lines), fields=fields) from None


def _operator_violations(spec: JobSpec) -> list[Violation]:
    """What the operator sets on every worker pod and a spec must therefore leave alone."""
    problems: list[Violation] = []
    for i, env in enumerate(spec.worker.env):
        if is_reserved_env(env["name"]):
            problems.append((f"spec.worker.env[{i}].name",
                             f"{env['name']} is set by the operator for each rank"))
    if spec.metrics.port == DIST_PORT:
        problems.append(("spec.metrics.port", f"{DIST_PORT} is the rendezvous port of the gang"))
    limits = (spec.worker.resources or {}).get("limits") or {}
    requests = (spec.worker.resources or {}).get("requests") or {}
    for where, values in (("limits", limits), ("requests", requests)):
        if GPU_RESOURCE in values:
            problems.append((f"spec.worker.resources.{where}", f"{GPU_RESOURCE} comes from "
                             "spec.parallelism.gpusPerWorker; remove it here"))
        # MIG slices: the capacity ledger and the planner count and profile whole GPUs, so a
        # slice would be neither reserved nor planned for. Refused, not counted as a GPU.
        # Other device-plugin resources (rdma/hca, ...) pass through: the scheduler counts them.
        for key in values:
            if key.startswith(MIG_RESOURCE_PREFIX):
                problems.append((f"spec.worker.resources.{where}", f"{key} is a MIG slice; the "
                                 "operator plans and reserves whole GPUs only: use "
                                 "spec.parallelism.gpusPerWorker"))

    volume_names = [v["name"] for v in spec.worker.volumes]  # the schema requires one, non-empty
    for i, vol in enumerate(volume_names):
        if vol in {CONFIG_VOLUME, CHECKPOINT_VOLUME, HF_CONFIG_VOLUME, SHM_VOLUME}:
            problems.append((f"spec.worker.volumes[{i}].name", f"{vol!r} is reserved"))
    known = set(volume_names) | {CHECKPOINT_VOLUME}
    for i, mount in enumerate(spec.worker.volume_mounts):
        if mount.get("name") not in known:
            problems.append((f"spec.worker.volumeMounts[{i}].name",
                             f"{mount.get('name')!r} is not in spec.worker.volumes"))
        if mount.get("mountPath", "").rstrip("/") == SHM_MOUNT:
            problems.append((f"spec.worker.volumeMounts[{i}].mountPath",
                             f"{SHM_MOUNT} is the operator's memory-backed shared memory, sized "
                             "by resources.limits.memory"))
    return problems


def validate_job(*, name: str, spec_raw: Mapping[str, Any], namespace: str = "",
                 read_config_map: ConfigReader | None = None) -> JobSpec:
    """The parsed spec; raise :class:`InvalidJob` listing every violated rule with its field.

    A spec naming its Hugging Face config by ConfigMap is resolved first with
    ``read_config_map`` (:func:`adaptis.operator.resources.hf_config.resolve_spec`; it raises
    :class:`~adaptis.operator.resources.hf_config.ConfigMapMissing` while the ConfigMap or key is
    missing), so the rules check the config it holds and the spec returned carries it."""
    spec = _parse_spec(spec_raw)
    if named_config_map(spec) is not None:
        if read_config_map is None:
            raise InvalidJob("spec.model.huggingface.configMap: no ConfigMap can be read here; "
                             "give config inline", fields=["spec.model.huggingface.configMap"])
        spec = resolve_spec(spec, namespace=namespace, read=read_config_map)
    rules = configmap_violations(job_violations(name=name, spec=spec), spec=spec,
                                 namespace=namespace)
    problems = rules + _operator_violations(spec)
    if problems:
        raise InvalidJob(format_violations(problems), fields=[f for f, _ in problems])
    return spec


def _config_map_refs(spec: JobSpec) -> Iterator[tuple[str, str, list[tuple[str, str]]]]:
    """(field of the name, ConfigMap name, [(field of a key, key)]) of every reference of the
    worker pods to a ConfigMap that is not ``optional: true``."""
    for i, env in enumerate(spec.worker.env):
        ref = (env.get("valueFrom") or {}).get("configMapKeyRef")
        if isinstance(ref, Mapping) and ref.get("name") and not ref.get("optional"):
            where = f"spec.worker.env[{i}].valueFrom.configMapKeyRef"
            keys = [(f"{where}.key", str(ref["key"]))] if ref.get("key") else []
            yield f"{where}.name", str(ref["name"]), keys
    for i, vol in enumerate(spec.worker.volumes):
        sources = [(f"spec.worker.volumes[{i}].configMap", vol.get("configMap"))]
        projected = vol.get("projected")
        if isinstance(projected, Mapping):
            sources += [(f"spec.worker.volumes[{i}].projected.sources[{j}].configMap",
                         src.get("configMap"))
                        for j, src in enumerate(projected.get("sources") or [])
                        if isinstance(src, Mapping)]
        for where, ref in sources:
            if not (isinstance(ref, Mapping) and ref.get("name")) or ref.get("optional"):
                continue
            keys = [(f"{where}.items[{k}].key", str(item["key"]))
                    for k, item in enumerate(ref.get("items") or [])
                    if isinstance(item, Mapping) and item.get("key")]
            yield f"{where}.name", str(ref["name"]), keys


def absent_config_maps(spec: JobSpec, *, namespace: str, read: ConfigReader) -> list[str]:
    """What the worker pods reference and the namespace lacks: one message per missing
    ConfigMap or key, naming the field and the fix; [] when the pods can start. Each
    ConfigMap is read once."""
    seen: dict[str, Mapping[str, Any] | None] = {}
    out: list[str] = []
    for field, name, keys in _config_map_refs(spec):
        if name not in seen:
            seen[name] = read(name)
        cm = seen[name]
        where = f"ConfigMap {namespace}/{name}"
        if cm is None:
            out.append(f"{field}: {where} does not exist; the job waits for it (create it, or "
                       "set optional: true on the reference)")
            continue
        present = {*(cm.get("data") or {}), *(cm.get("binaryData") or {})}
        for key_field, key in keys:
            if key not in present:
                shown = ", ".join(sorted(present)[:_KEYS_SHOWN]) or "none"
                more = f" and {len(present) - _KEYS_SHOWN} more" if len(present) > _KEYS_SHOWN else ""
                out.append(f"{key_field}: {where} has no key {key!r} (its keys: {shown}{more}); "
                           "the job waits for it")
    return out
