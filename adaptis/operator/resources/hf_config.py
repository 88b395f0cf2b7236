"""A Hugging Face model's config.json from a ConfigMap: read to plan, mounted for the workers.

Sits between :mod:`adaptis.operator.resources.validation` (which resolves a ``configMap`` spec
through :func:`read_hf_config` before the job's rules run, so that the rules and the planner see the
config, and the spec hash changes with it: an edited ConfigMap re-plans) and
:mod:`adaptis.operator.resources.manifests` (whose worker pods mount the same key read-only at
:data:`adaptis.api.hf_model.CONFIG_MAP_MOUNT` through :func:`hf_config_volume`, where the worker
reads it; the worker's configuration names the ConfigMap, never a copy of it).

What goes wrong, and what the job does (docs/huggingface.md):

- the ConfigMap or its key is missing: it may be created next (``kubectl apply`` of a
  directory applies in name order), so the job waits: :class:`ConfigMapMissing`, a
  ``Planned=False`` condition with reason ``ConfigMapNotFound`` naming the field, looked at
  again with a growing delay (:func:`retry_after`), pods already running left alone;
- the key holds something that is not a config.json of a supported model: the spec's fault,
  :class:`~adaptis.operator.core.errors.InvalidJob` naming ``spec.model.huggingface.configMap``
  (the job fails ``InvalidSpec``; fix the ConfigMap, then change the job to start it again).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from adaptis.api.conditions import Reason
from adaptis.api.errors import SpecError
from adaptis.api.hf_model import (
    CONFIG_MAP_FILE,
    CONFIG_MAP_MOUNT,
    ConfigMapRef,
    parse_config_text,
    with_resolved_config,
)
from adaptis.api.job import JobSpec
from adaptis.api.model import HuggingFaceModel
from adaptis.api.rules import Violation
from adaptis.operator.core.errors import InvalidJob, OperatorError

__all__ = ["FIELD", "HF_CONFIG_VOLUME", "ConfigMapMissing", "ConfigReader", "hf_config_volume",
           "named_config_map", "read_hf_config", "resolve_spec", "retry_after", "configmap_violations"]

FIELD = "spec.model.huggingface.configMap"
#: The worker pods' volume of the ConfigMap (reserved: spec.worker.volumes may not use it).
HF_CONFIG_VOLUME = "adaptis-hf-config"
#: The shortest and longest wait before a job waiting on its ConfigMap is looked at again.
RETRY_MIN_S, RETRY_MAX_S = 2.0, 60.0

#: Reads a ConfigMap of the job's namespace: its object, or None when there is none.
ConfigReader = Callable[[str], Mapping[str, Any] | None]


class ConfigMapMissing(OperatorError):
    """The ConfigMap ``spec.model.huggingface.configMap`` names, or its key, is not there
    (yet): the job waits for it."""

    reason = Reason.CONFIG_MAP_NOT_FOUND

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field


def read_hf_config(ref: ConfigMapRef, *, namespace: str, read: ConfigReader) -> dict[str, Any]:
    """The config.json under ``ref.key`` of the ConfigMap ``ref.name``."""
    where = f"ConfigMap {namespace}/{ref.name}"
    cm = read(ref.name)
    if cm is None:
        raise ConfigMapMissing(
            f"{FIELD}.name: {where} does not exist; the job waits for it (e.g. kubectl create "
            f"configmap {ref.name} -n {namespace} --from-file={ref.key}=config.json)",
            field=f"{FIELD}.name")
    data = cm.get("data") or {}
    if ref.key not in data:
        binary = ref.key in (cm.get("binaryData") or {})
        keys = ", ".join(sorted(data)) or "none"
        raise ConfigMapMissing(
            f"{FIELD}.key: {where} has no text key {ref.key!r}"
            + (" (it is binaryData: give the config.json as text)" if binary else
               f" (its keys: {keys})") + "; the job waits for it, or set configMap.key",
            field=f"{FIELD}.key")
    try:
        return parse_config_text(str(data[ref.key]), field=FIELD, source=f"{where} key {ref.key!r}")
    except SpecError as err:
        raise InvalidJob(str(err), fields=[FIELD]) from None


def named_config_map(spec: JobSpec) -> tuple[HuggingFaceModel, ConfigMapRef] | None:
    """The job's model and the ConfigMap holding its config; None when it names none (a
    zoo model, or a config inline or by path)."""
    model = spec.model
    if isinstance(model, HuggingFaceModel) and model.huggingface.config_map is not None:
        return model, model.huggingface.config_map
    return None


def resolve_spec(spec: JobSpec, *, namespace: str, read: ConfigReader) -> JobSpec:
    """``spec`` with the ConfigMap's config carried along (:func:`with_resolved_config`);
    ``spec`` itself when it names no ConfigMap."""
    named = named_config_map(spec)
    if named is None:
        return spec
    model, ref = named
    config = read_hf_config(ref, namespace=namespace, read=read)
    model = model.with_huggingface(with_resolved_config(model.huggingface, config))
    return spec.model_copy(update={"model": model})


def configmap_violations(violations: Sequence[Violation], *, spec: JobSpec,
                         namespace: str) -> list[Violation]:
    """A rule broken by the config a ConfigMap holds names the ``configMap`` field the user
    wrote (the operator's resolved copy sits under ``config``), and the ConfigMap's key."""
    named = named_config_map(spec)
    if named is None:
        return list(violations)
    ref = named[1]
    inline = "spec.model.huggingface.config"
    out: list[Violation] = []
    for field, message in violations:
        if field == inline or field.startswith(f"{inline}."):
            key = field.removeprefix(inline).lstrip(".") or "the config"
            where = f"ConfigMap {namespace}/{ref.name} key {ref.key!r}"
            out.append((FIELD, f"{where}: {key}: {message}"))
        else:
            out.append((field, message))
    return out


def retry_after(waited_s: float) -> float:
    """The delay before looking again at a job that has waited ``waited_s`` for its
    ConfigMap: about doubling (the next look comes after as long as it has waited so far),
    from :data:`RETRY_MIN_S` to :data:`RETRY_MAX_S`. No watch on ConfigMaps wakes the job."""
    return min(RETRY_MAX_S, max(RETRY_MIN_S, waited_s))


def hf_config_volume(spec: JobSpec) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(volume, mount) of the worker pods for a ``configMap`` spec: only its key, as
    config.json at :data:`CONFIG_MAP_MOUNT`, read-only; None for any other model."""
    named = named_config_map(spec)
    if named is None:
        return None
    ref = named[1]
    volume = {"name": HF_CONFIG_VOLUME,
              "configMap": {"name": ref.name,
                            "items": [{"key": ref.key, "path": CONFIG_MAP_FILE}]}}
    mount = {"name": HF_CONFIG_VOLUME, "mountPath": CONFIG_MAP_MOUNT, "readOnly": True}
    return volume, mount
