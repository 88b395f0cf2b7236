"""Semantic validation: the rules of an AdaPtisJob that the CRD's schema cannot express.

Sits at the start of every reconcile. The API server already enforces types, bounds, enums and
the CEL rules of the CRD; what remains needs the whole object or the operator's own choices:
the child names must fit DNS labels, a pipeline cannot have more ranks than layers, the baseline
schedules need enough layers for their chunks, the operator's own environment, ports, volumes
and GPU request must not be overridden. Each violation names its field
(``spec.parallelism.workers: ...``) because it becomes a condition and an Event the user reads.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from adaptis.api.errors import from_validation_error
from adaptis.api.job import JobSpec
from adaptis.operator.errors import InvalidJob
from adaptis.operator.manifests import (
    CONFIG_VOLUME,
    CHECKPOINT_VOLUME,
    DIST_PORT,
    RESERVED_ENV,
    pod_name,
    service_name,
)
from adaptis.operator.profiling import GPU_RESOURCE

__all__ = ["validate_job"]

_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_MAX_LABEL = 63


def _parse_spec(raw: Mapping[str, Any]) -> JobSpec:
    try:
        return JobSpec.model_validate(dict(raw))
    except ValidationError as err:
        spec_err = from_validation_error(err, what="spec")
        fields = [f"spec.{f}" for f in spec_err.fields]
        lines = [line.replace("spec: ", "spec.", 1) for line in str(spec_err).splitlines()]
        raise InvalidJob("\n".join(lines), fields=fields) from None


def validate_job(*, name: str, spec_raw: Mapping[str, Any]) -> JobSpec:
    """The parsed spec; raise :class:`InvalidJob` listing every violated rule with its field."""
    spec = _parse_spec(spec_raw)
    problems: list[tuple[str, str]] = []
    workers = spec.parallelism.workers

    if not _DNS_1035.match(name):
        problems.append(("metadata.name", f"{name!r} must be a DNS-1035 label (a-z, 0-9, '-', "
                         "starting with a letter): it names the headless Service"))
    longest = max(pod_name(name, workers - 1), service_name(name), key=len)
    if len(longest) > _MAX_LABEL:
        problems.append(("metadata.name", f"{name!r} is too long: child name {longest!r} "
                         f"exceeds {_MAX_LABEL} characters"))

    layers = 2 + sum(b.count for b in spec.model.blocks)
    if workers > layers:
        problems.append(("spec.parallelism.workers", f"{workers} ranks but the model has only "
                         f"{layers} layers (embedding, blocks, head); each rank needs one"))
    chunks = {"i1f1b": 2, "zb-v": 2}.get(spec.planner.strategy)
    if chunks and layers < chunks * workers:
        problems.append(("spec.planner.strategy", f"{spec.planner.strategy} needs at least "
                         f"{chunks} layers per rank ({chunks * workers}); the model has {layers}"))
    for i, block in enumerate(spec.model.blocks):
        if block.kind == "moe" and block.top_k > block.experts:
            problems.append((f"spec.model.blocks[{i}].topK",
                             f"{block.top_k} exceeds experts ({block.experts})"))

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

    volume_names = [str(v.get("name", "")) for v in spec.worker.volumes]
    for i, vol in enumerate(volume_names):
        if vol in {CONFIG_VOLUME, CHECKPOINT_VOLUME}:
            problems.append((f"spec.worker.volumes[{i}].name", f"{vol!r} is reserved"))
        if not vol:
            problems.append((f"spec.worker.volumes[{i}].name", "a volume needs a name"))
    known = set(volume_names) | {CHECKPOINT_VOLUME}
    for i, mount in enumerate(spec.worker.volume_mounts):
        if mount.get("name") not in known:
            problems.append((f"spec.worker.volumeMounts[{i}].name",
                             f"{mount.get('name')!r} is not in spec.worker.volumes"))
    if spec.checkpoint.every_steps > spec.training.steps:
        problems.append(("spec.checkpoint.everySteps", f"{spec.checkpoint.every_steps} exceeds "
                         f"spec.training.steps ({spec.training.steps}): no checkpoint would be "
                         "written"))
    if problems:
        raise InvalidJob("\n".join(f"{f}: {m}" for f, m in problems),
                         fields=[f for f, _ in problems])
    return spec
