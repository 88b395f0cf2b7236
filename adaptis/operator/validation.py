"""Semantic validation: the rules of an AdaPtisJob that the CRD's schema cannot express.

Sits at the start of every reconcile. The API server already enforces types, bounds, enums and
the CEL rules of the CRD; the job-level rules every entry point shares (DNS-label child names,
no more ranks than layers, two layers per rank for the two-chunk schedules, checkpoints within
the run) come from :func:`adaptis.api.rules.job_violations`, the same function ``adaptis run``
applies. Added here are only the operator's own choices: its environment, rendezvous port,
volumes and GPU request must not be overridden; and a Hugging Face config named by ConfigMap
is read first (:mod:`adaptis.operator.hf_config`), so the rules check what it holds. Each
violation names its field (``spec.parallelism.workers: ...``) because it becomes a condition
and an Event the user reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from adaptis.api.errors import from_validation_error
from adaptis.api.job import JobSpec
from adaptis.api.rules import Violation, format_violations, job_violations
from adaptis.operator.errors import InvalidJob
from adaptis.operator.hf_config import (
    HF_CONFIG_VOLUME,
    ConfigReader,
    configmap_violations,
    resolve_spec,
)
from adaptis.operator.manifests import (
    CONFIG_VOLUME,
    CHECKPOINT_VOLUME,
    DIST_PORT,
    RESERVED_ENV,
)
from adaptis.operator.profiling import GPU_RESOURCE

__all__ = ["validate_job"]


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
        if env.get("name") in RESERVED_ENV:
            problems.append((f"spec.worker.env[{i}].name",
                             f"{env.get('name')} is set by the operator for each rank"))
    if spec.metrics.port == DIST_PORT:
        problems.append(("spec.metrics.port", f"{DIST_PORT} is the rendezvous port of the gang"))
    limits = (spec.worker.resources or {}).get("limits") or {}
    requests = (spec.worker.resources or {}).get("requests") or {}
    for where, values in (("limits", limits), ("requests", requests)):
        if GPU_RESOURCE in values:
            problems.append((f"spec.worker.resources.{where}", f"{GPU_RESOURCE} comes from "
                             "spec.parallelism.gpusPerWorker; remove it here"))

    volume_names = [v["name"] for v in spec.worker.volumes]  # the schema requires one, non-empty
    for i, vol in enumerate(volume_names):
        if vol in {CONFIG_VOLUME, CHECKPOINT_VOLUME, HF_CONFIG_VOLUME}:
            problems.append((f"spec.worker.volumes[{i}].name", f"{vol!r} is reserved"))
    known = set(volume_names) | {CHECKPOINT_VOLUME}
    for i, mount in enumerate(spec.worker.volume_mounts):
        if mount.get("name") not in known:
            problems.append((f"spec.worker.volumeMounts[{i}].name",
                             f"{mount.get('name')!r} is not in spec.worker.volumes"))
    return problems


def validate_job(*, name: str, spec_raw: Mapping[str, Any], namespace: str = "",
                 read_config_map: ConfigReader | None = None) -> JobSpec:
    """The parsed spec; raise :class:`InvalidJob` listing every violated rule with its field.

    A spec naming its Hugging Face config by ConfigMap is resolved first with
    ``read_config_map`` (:func:`adaptis.operator.hf_config.resolve_spec`; it raises
    :class:`~adaptis.operator.hf_config.ConfigMapMissing` while the ConfigMap or key is
    missing), so the rules check the config it holds and the spec returned carries it."""
    spec = _parse_spec(spec_raw)
    hf = spec.model.huggingface
    if hf is not None and hf.config_map is not None:
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
