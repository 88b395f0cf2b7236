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
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, PlainValidator, WithJsonSchema
from pydantic_core import PydanticCustomError
from typing_extensions import NotRequired, Required, TypedDict

__all__ = [
    "LABEL_KEY_PATTERN",
    "LABEL_VALUE_PATTERN",
    "MAX_LABEL_KEY",
    "MAX_LABEL_VALUE",
    "QUANTITY_PATTERN",
    "EnvVar",
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


class EnvVar(TypedDict):
    """core/v1 EnvVar."""

    __pydantic_config__ = _STRICT  # type: ignore[misc]

    # Any printable ASCII but '=' (Kubernetes >= 1.32 relaxed the C-identifier rule).
    name: Required[Annotated[str, Field(min_length=1, pattern=r"^[ -<>-~]+$",
                                        description="Variable name.")]]
    value: NotRequired[Annotated[str, Field(description="Value; $(VAR) expands.")]]
    valueFrom: NotRequired[Annotated[dict[str, Any], Field(
        description="Source of the value (secretKeyRef, configMapKeyRef, fieldRef, ...).")]]


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


class Volume(TypedDict):
    """core/v1 Volume: a name and one volume source (passed through as it is)."""

    # The many source types are the API server's to check (the operator asks it with a
    # dry-run create before anything else), and the chart's admission policy limits them.

    __pydantic_config__ = ConfigDict(extra="allow")  # type: ignore[misc]

    name: Required[Annotated[str, Field(min_length=1, max_length=63,
                                        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
                                        description="Volume name (a DNS label).")]]
