"""The Kubernetes shapes of the fields an AdaPtisJob passes through to its worker pods.

Sits in the api layer under :mod:`adaptis.api.job`, whose ``WorkerTemplate`` types its
passthrough fields (env, resources, tolerations, volumeMounts, volumes' names, labels,
annotations, nodeSelector) with these, so that a wrong shape is refused where the manifest
enters: by the API server at ``kubectl apply`` (the CRD is generated from the models), by the
operator and by ``adaptis run`` (the same models), each naming the field. Before, such a spec
was accepted and the worker pod's create failed on every pass (issue 11).

They are ``TypedDict``s, not models: the values stay the plain dicts a pod manifest holds, so
the operator renders them as they are. The rules are core/v1's (``k8s.io/apimachinery``
validation): label values are at most 63 characters of ``[A-Za-z0-9_.-]`` starting and ending
alphanumeric; label and annotation keys an optional DNS-subdomain prefix and ``/`` before such a
name; a quantity an integer or a string like ``500m``, ``2Gi``, ``1e3``.

Nothing is passed on changed (issue 27): a key no core/v1 shape has is refused, not dropped,
since the API server would drop it or, for a volume left with no known source, make it an
emptyDir (a misspelt ``persistentVolumeClaim`` would send the checkpoints to scratch space). A
:class:`Volume` holds its name and exactly one of :data:`VOLUME_SOURCES`, an
:class:`EnvVarSource` exactly one of :data:`ENV_VALUE_SOURCES`, and the CRD says the same (no
other key in its schema, a CEL rule for the one). What a source holds is free-form here and the
API server's to check: the operator creates its pods with ``fieldValidation=Strict``
(:mod:`adaptis.operator.kube.client`), so an unknown key inside one fails the job naming it too.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal, NoReturn, NotRequired, Required

from pydantic import ConfigDict, Field, GetCoreSchemaHandler, PlainValidator, WithJsonSchema
from pydantic_core import CoreSchema, PydanticCustomError, core_schema
from typing_extensions import TypedDict

__all__ = [
    "ENV_VALUE_SOURCES",
    "LABEL_KEY_PATTERN",
    "LABEL_VALUE_PATTERN",
    "MAX_ENV",
    "MAX_LABEL_KEY",
    "MAX_LABEL_VALUE",
    "MAX_VOLUMES",
    "QUANTITY_PATTERN",
    "VOLUME_SOURCES",
    "EnvVar",
    "EnvVarSource",
    "LabelKey",
    "LabelValue",
    "Quantity",
    "ResourceRequirements",
    "Toleration",
    "Volume",
    "VolumeMount",
]

MAX_LABEL_VALUE = 63
_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_DNS_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
LABEL_VALUE_PATTERN = rf"^({_NAME})?$"
LABEL_KEY_PATTERN = rf"^({_DNS_SUBDOMAIN}/)?{_NAME}$"
# apimachinery's resource.Quantity, as its OpenAPI schema states it.
QUANTITY_PATTERN = (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
                    r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")

MAX_LABEL_KEY = 253 + 1 + 63
# Bounds of spec.worker.env and spec.worker.volumes (core/v1 sets none), far above any worker
# pod's needs: the API server refuses a CEL rule on the items of an unbounded list, whose
# estimated cost it multiplies by the most items a request could hold.
MAX_ENV = 1024
MAX_VOLUMES = 256


def _checker(*, pattern: str, max_length: int | None, what: str,
             integers: bool = False) -> Callable[[Any], Any]:
    """A validator with one plain message (pydantic's would quote the regex, twice for a
    union), raised as a custom error so the path stays the field's."""
    regex = re.compile(pattern)

    def check(value: Any) -> Any:
        if integers and isinstance(value, int) and not isinstance(value, bool):
            return value
        if (isinstance(value, str) and regex.match(value)
                and (max_length is None or len(value) <= max_length)):
            return value
        raise PydanticCustomError("kubernetes_format", "{what}", {"what": what})

    return check


_NAME_RULE = ("at most 63 characters of A-Z, a-z, 0-9, '-', '_', '.', starting and ending "
              "with a letter or digit")
LabelKey = Annotated[str, PlainValidator(_checker(
    pattern=LABEL_KEY_PATTERN, max_length=MAX_LABEL_KEY,
    what=f"not a label key: an optional DNS-subdomain prefix and '/', then {_NAME_RULE}")),
    WithJsonSchema({"type": "string", "maxLength": MAX_LABEL_KEY,
                    "pattern": LABEL_KEY_PATTERN})]
LabelValue = Annotated[str, PlainValidator(_checker(
    pattern=LABEL_VALUE_PATTERN, max_length=MAX_LABEL_VALUE,
    what=f"not a label value: empty or {_NAME_RULE}")),
    WithJsonSchema({"type": "string", "maxLength": MAX_LABEL_VALUE,
                    "pattern": LABEL_VALUE_PATTERN})]
Quantity = Annotated[int | str, PlainValidator(_checker(
    pattern=QUANTITY_PATTERN, max_length=None, integers=True,
    what="not a quantity: an integer or a string such as 500m, 1.5, 2Gi, 1e3")),
    WithJsonSchema({"anyOf": [{"type": "integer"},
                              {"type": "string", "pattern": QUANTITY_PATTERN}]})]
_STRICT = ConfigDict(extra="forbid")


def _unknown_key(*, what: str, keys: Callable[[], Sequence[str]]) -> Callable[[Any], NoReturn]:
    """The validator of every key a shape does not name: refused (never dropped), the key in
    the error's location and the keys there are in its message."""

    def refuse(_value: Any) -> NoReturn:
        raise PydanticCustomError("unknown_source", "not {what}; one of {keys}",
                                  {"what": what, "keys": ", ".join(keys())})

    return refuse


def _exactly_one(*, what: str, keys: Callable[[], Sequence[str]], beside: str,
                 ) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The validator of a shape of which exactly one of ``keys`` must be given."""

    def check(value: dict[str, Any]) -> dict[str, Any]:
        given = [key for key in keys() if key in value]
        if len(given) == 1:
            return value
        if not given:
            raise PydanticCustomError(
                "one_source", "no {what}{beside}: give exactly one of {keys}",
                {"what": what, "keys": ", ".join(keys()), "beside": beside})
        raise PydanticCustomError("one_source", "{count} {what}s ({given}): keep exactly one",
                                  {"what": what, "count": len(given), "given": ", ".join(given)})

    return check


def _one_of_rule(*, keys: Sequence[str], message: str) -> dict[str, str]:
    """The CEL twin of :func:`_exactly_one` for the CRD (unknown keys are not in its schema)."""
    given = ", ".join(f"has(self.{key})" for key in keys)
    return {"rule": f"[{given}].exists_one(x, x)", "message": message}


def _one_source_config(*, keys: Callable[[], Sequence[str]], message: str) -> ConfigDict:
    """The schema of a shape of sources: no other keys, and the CEL rule of exactly one."""

    def extra(schema: dict[str, Any]) -> None:
        schema["additionalProperties"] = False
        schema["x-kubernetes-validations"] = [_one_of_rule(keys=keys(), message=message)]

    return ConfigDict(json_schema_extra=extra)


def _sources(shape: type, *, besides: frozenset[str] = frozenset()) -> tuple[str, ...]:
    # Its annotations, not __optional_keys__: with postponed annotations, Python cannot tell
    # NotRequired keys from the others.
    return tuple(key for key in shape.__annotations__ if key not in besides)


# What a volume source or an env value source holds: the API server's to check.
_Object = dict[str, Any]


class EnvVarSource(TypedDict, total=False,  # type: ignore[call-arg]  # mypy lacks PEP 728's extra_items
                   extra_items=Annotated[Any, PlainValidator(_unknown_key(
                       what="a value source", keys=lambda: ENV_VALUE_SOURCES))]):
    """core/v1 EnvVarSource: exactly one source of the value, whose keys the API server checks."""

    __pydantic_config__ = _one_source_config(  # type: ignore[misc]
        keys=lambda: ENV_VALUE_SOURCES,
        message="valueFrom needs exactly one of configMapKeyRef, fieldRef, fileKeyRef, "
                "resourceFieldRef, secretKeyRef; keep one")

    configMapKeyRef: Annotated[_Object, Field(
        description="A key of a ConfigMap (name, key, optional).")]
    fieldRef: Annotated[_Object, Field(description="A field of the pod (fieldPath, apiVersion).")]
    fileKeyRef: Annotated[_Object, Field(
        description="A key of an env file in a volume (volumeName, path, key, optional).")]
    resourceFieldRef: Annotated[_Object, Field(
        description="A resource of the container (resource, containerName, divisor).")]
    secretKeyRef: Annotated[_Object, Field(description="A key of a Secret (name, key, optional).")]

    @classmethod  # type: ignore[misc]  # mypy: a TypedDict holds keys only; pydantic reads this hook
    def __get_pydantic_core_schema__(
            cls, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.no_info_after_validator_function(
            _exactly_one(what="value source", keys=lambda: ENV_VALUE_SOURCES, beside=""),
            handler(source))


#: The keys of core/v1 EnvVarSource: an env var's valueFrom holds exactly one.
ENV_VALUE_SOURCES: tuple[str, ...] = _sources(EnvVarSource)


class EnvVar(TypedDict):
    """core/v1 EnvVar."""

    __pydantic_config__ = _STRICT  # type: ignore[misc]

    # Any printable ASCII but '=' (Kubernetes >= 1.32 relaxed the C-identifier rule).
    name: Required[Annotated[str, Field(min_length=1, pattern=r"^[ -<>-~]+$",
                                        description="Variable name.")]]
    value: NotRequired[Annotated[str, Field(description="Value; $(VAR) expands.")]]
    valueFrom: NotRequired[Annotated[EnvVarSource, Field(
        description="Source of the value: exactly one of configMapKeyRef, fieldRef, fileKeyRef, "
        "resourceFieldRef, secretKeyRef.")]]


class Toleration(TypedDict, total=False):
    """core/v1 Toleration."""

    __pydantic_config__ = _STRICT  # type: ignore[misc]

    key: Annotated[str, Field(max_length=MAX_LABEL_KEY,
                              description="Taint key; empty with Exists: every taint.")]
    operator: Annotated[Literal["Exists", "Equal"], Field(description="Exists or Equal.")]
    value: Annotated[str, Field(max_length=MAX_LABEL_VALUE, description="Taint value (Equal).")]
    effect: Annotated[Literal["", "NoSchedule", "PreferNoSchedule", "NoExecute"], Field(
        description="Effect to tolerate; empty: all.")]
    tolerationSeconds: Annotated[int, Field(description="NoExecute only: how long it stays.")]


class VolumeMount(TypedDict):
    """core/v1 VolumeMount."""

    __pydantic_config__ = _STRICT  # type: ignore[misc]

    name: Required[Annotated[str, Field(min_length=1, max_length=63,
                                        description="A volume of spec.worker.volumes.")]]
    mountPath: Required[Annotated[str, Field(min_length=1, description="Path in the container.")]]
    readOnly: NotRequired[Annotated[bool, Field(description="Mount read-only.")]]
    subPath: NotRequired[Annotated[str, Field(description="Sub-path of the volume.")]]
    subPathExpr: NotRequired[Annotated[str, Field(description="subPath with $(VAR) expansion.")]]
    mountPropagation: NotRequired[Annotated[
        Literal["None", "HostToContainer", "Bidirectional"],
        Field(description="None, HostToContainer or Bidirectional.")]]
    recursiveReadOnly: NotRequired[Annotated[
        Literal["Disabled", "IfPossible", "Enabled"],
        Field(description="Disabled, IfPossible or Enabled.")]]


class ResourceRequirements(TypedDict, total=False):
    """core/v1 ResourceRequirements."""

    __pydantic_config__ = _STRICT  # type: ignore[misc]

    limits: Annotated[dict[str, Quantity], Field(description="Most of each resource.")]
    requests: Annotated[dict[str, Quantity], Field(description="Least of each resource.")]
    claims: Annotated[list[dict[str, Any]], Field(description="Dynamic resource claims.")]


class Volume(TypedDict,  # type: ignore[call-arg]  # mypy lacks PEP 728's extra_items
             extra_items=Annotated[Any, PlainValidator(_unknown_key(
                 what="a volume source", keys=lambda: VOLUME_SOURCES))]):
    """core/v1 Volume: a name and exactly one volume source, whose keys the API server checks."""

    # What a source holds is the API server's to check, strictly (the module docstring).

    __pydantic_config__ = _one_source_config(  # type: ignore[misc]
        keys=lambda: VOLUME_SOURCES,
        message="a volume needs exactly one source beside its name (emptyDir, "
                "persistentVolumeClaim, configMap, secret, ...: a key of core/v1 VolumeSource); "
                "keep one")

    name: Required[Annotated[str, Field(min_length=1, max_length=63,
                                        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
                                        description="Volume name (a DNS label).")]]
    awsElasticBlockStore: NotRequired[Annotated[_Object, Field(
        description="An AWS EBS disk (deprecated).")]]
    azureDisk: NotRequired[Annotated[_Object, Field(
        description="An Azure data disk (deprecated).")]]
    azureFile: NotRequired[Annotated[_Object, Field(
        description="An Azure File share (deprecated).")]]
    cephfs: NotRequired[Annotated[_Object, Field(description="A CephFS mount (deprecated).")]]
    cinder: NotRequired[Annotated[_Object, Field(
        description="An OpenStack Cinder volume (deprecated).")]]
    configMap: NotRequired[Annotated[_Object, Field(description="A ConfigMap's keys as files.")]]
    csi: NotRequired[Annotated[_Object, Field(description="An ephemeral volume of a CSI driver.")]]
    downwardAPI: NotRequired[Annotated[_Object, Field(description="Fields of the pod as files.")]]
    emptyDir: NotRequired[Annotated[_Object, Field(
        description="A scratch directory that lives as long as the pod.")]]
    ephemeral: NotRequired[Annotated[_Object, Field(
        description="A PersistentVolumeClaim made for the pod and deleted with it.")]]
    fc: NotRequired[Annotated[_Object, Field(description="A Fibre Channel disk.")]]
    flexVolume: NotRequired[Annotated[_Object, Field(
        description="A FlexVolume driver's volume (deprecated).")]]
    flocker: NotRequired[Annotated[_Object, Field(description="A Flocker dataset (deprecated).")]]
    gcePersistentDisk: NotRequired[Annotated[_Object, Field(
        description="A GCE persistent disk (deprecated).")]]
    gitRepo: NotRequired[Annotated[_Object, Field(
        description="A git repository cloned into an emptyDir (deprecated).")]]
    glusterfs: NotRequired[Annotated[_Object, Field(
        description="A GlusterFS mount (deprecated).")]]
    hostPath: NotRequired[Annotated[_Object, Field(description="A path on the node.")]]
    image: NotRequired[Annotated[_Object, Field(
        description="An OCI image or artifact, read-only.")]]
    iscsi: NotRequired[Annotated[_Object, Field(description="An iSCSI disk.")]]
    nfs: NotRequired[Annotated[_Object, Field(description="An NFS export.")]]
    persistentVolumeClaim: NotRequired[Annotated[_Object, Field(
        description="A PersistentVolumeClaim of the job's namespace (claimName, readOnly).")]]
    photonPersistentDisk: NotRequired[Annotated[_Object, Field(
        description="A Photon Controller disk (deprecated).")]]
    portworxVolume: NotRequired[Annotated[_Object, Field(
        description="A Portworx volume (deprecated).")]]
    projected: NotRequired[Annotated[_Object, Field(
        description="Several sources (secret, configMap, downwardAPI, serviceAccountToken, "
        "...) in one directory.")]]
    quobyte: NotRequired[Annotated[_Object, Field(description="A Quobyte mount (deprecated).")]]
    rbd: NotRequired[Annotated[_Object, Field(description="A Ceph RBD image (deprecated).")]]
    scaleIO: NotRequired[Annotated[_Object, Field(description="A ScaleIO volume (deprecated).")]]
    secret: NotRequired[Annotated[_Object, Field(description="A Secret's keys as files.")]]
    storageos: NotRequired[Annotated[_Object, Field(
        description="A StorageOS volume (deprecated).")]]
    vsphereVolume: NotRequired[Annotated[_Object, Field(
        description="A vSphere VMDK volume (deprecated).")]]

    @classmethod  # type: ignore[misc]  # mypy: a TypedDict holds keys only; pydantic reads this hook
    def __get_pydantic_core_schema__(
            cls, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.no_info_after_validator_function(
            _exactly_one(what="volume source", keys=lambda: VOLUME_SOURCES, beside=" beside name"),
            handler(source))


#: The keys of core/v1 VolumeSource (k8s.io/api v0.37): a volume holds exactly one.
VOLUME_SOURCES: tuple[str, ...] = _sources(Volume, besides=frozenset({"name"}))
