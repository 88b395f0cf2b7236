"""The AdaPtisJob CustomResourceDefinition, generated from the api models.

Sits in the api layer, on top of the job models, and imports neither kopf nor the Kubernetes
client, so ``adaptis crd`` runs from the base install. The pydantic models of :mod:`adaptis.api.job` are the
single source of truth; this module converts their JSON schema into a *structural* OpenAPI v3
schema as the API server requires it:

- ``$ref`` inlined (structural schemas forbid references), ``title`` and ``$defs`` dropped;
- ``anyOf [X, null]`` becomes ``X`` with ``nullable: true``;
- JSON-schema draft-2020 ``exclusiveMinimum: n`` becomes OpenAPI 3.0's ``minimum: n`` plus
  ``exclusiveMinimum: true``;
- free-form mappings (a volume's source, an env var's valueFrom) get
  ``x-kubernetes-preserve-unknown-fields: true`` so the API server keeps them;
- ``int | str`` (a resource quantity) becomes ``x-kubernetes-int-or-string`` with the string's
  pattern, as Kubernetes' own schemas state quantities;
- maps with constrained keys (labels) keep the value's schema only: a structural schema has no
  ``patternProperties``, so their keys are checked by the models (operator, ``adaptis run``);
- defaults are kept for scalars only (the API server applies them), never ``null`` ones.

:func:`crd_manifest` is the whole object; :func:`crd_yaml` is what ``crds/`` holds, and a test
fails when that file drifts from the models.
"""

from __future__ import annotations

from typing import Any

import yaml

from adaptis.api.job import GROUP, KIND, PLURAL, SHORT_NAMES, VERSION, JobSpec, JobStatus
from adaptis.api.rules import JOB_CEL_RULES

__all__ = ["CRD_FILENAME", "crd_manifest", "crd_yaml", "structural_schema"]

CRD_FILENAME = f"{GROUP}_{PLURAL}.yaml"

# Keys of pydantic's JSON schema that carry no meaning for the API server.
_DROPPED = frozenset({"title", "$defs", "examples", "propertyNames"})



def _status_path(field: str) -> str:
    # The wire name comes from the model's alias generator (predicted_speedup_over_i1f1b is
    # predictedSpeedupOverI1F1B), so it is looked up, never spelled by hand.
    return f".status.{JobStatus.model_fields[field].alias or field}"


_PRINTER_COLUMNS: tuple[dict[str, Any], ...] = (
    {"name": "Phase", "type": "string", "jsonPath": _status_path("phase"),
     "description": "Where the job is in its lifecycle."},
    {"name": "Ready", "type": "string", "jsonPath": _status_path("workers_ready"),
     "description": "Worker pods ready / total."},
    {"name": "Stages", "type": "integer", "jsonPath": _status_path("stages"),
     "description": "Pipeline stages of the plan."},
    {"name": "Bubble", "type": "number", "jsonPath": _status_path("predicted_bubble_ratio"),
     "description": "Predicted idle fraction of device time."},
    {"name": "Observed", "type": "number", "jsonPath": _status_path("observed_bubble_ratio"),
     "description": "Idle fraction the workers reported."},
    {"name": "Speedup", "type": "number",
     "jsonPath": _status_path("predicted_speedup_over_i1f1b"),
     "description": "Predicted speedup over Megatron I-1F1B."},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
)


def structural_schema(model: type[Any]) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of a pydantic model (camelCase, refs inlined)."""
    raw = model.model_json_schema(by_alias=True)
    defs = raw.get("$defs", {})
    return _convert(raw, defs=defs, path=model.__name__)


def _resolve(node: dict[str, Any], *, defs: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref")
    if ref is None:
        return node
    target = defs[ref.rsplit("/", 1)[-1]]
    # Sibling keys of a $ref (a field's description, default) override the definition's.
    merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
    return _resolve(merged, defs=defs)


def _convert(
    node: dict[str, Any], *, defs: dict[str, Any], path: str, field: bool = True
) -> dict[str, Any]:
    node = _resolve(node, defs=defs)
    nullable = False
    if "anyOf" in node:
        options = [_resolve(o, defs=defs) for o in node["anyOf"]]
        concrete = [o for o in options if o.get("type") != "null"]
        nullable = len(concrete) < len(options)
        if sorted(str(o.get("type")) for o in concrete) == ["integer", "string"]:
            # The structural form of int-or-string: no type, the string's pattern beside.
            text = next(o for o in concrete if o["type"] == "string")
            concrete = [{**{k: v for k, v in text.items() if k != "type"},
                         "x-kubernetes-int-or-string": True}]
        if len(concrete) != 1:
            raise ValueError(f"{path}: unions other than X | None cannot be structural")
        node = {**concrete[0], **{k: v for k, v in node.items() if k != "anyOf"}}
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROPPED or key in {"properties", "items", "additionalProperties", "required",
                                      "patternProperties"}:
            continue
        if key == "exclusiveMinimum":
            out["minimum"], out["exclusiveMinimum"] = value, True
        elif key == "exclusiveMaximum":
            out["maximum"], out["exclusiveMaximum"] = value, True
        elif key == "default":
            if value is not None and not isinstance(value, (dict, list)):
                out["default"] = value
        else:
            out[key] = value
    kind = node.get("type")
    if kind == "object":
        props = node.get("properties")
        extra = node.get("additionalProperties")
        if extra is None and len(node.get("patternProperties") or {}) == 1:
            extra = next(iter(node["patternProperties"].values()))
        if props:
            out["properties"] = {
                name: _convert(sub, defs=defs, path=f"{path}.{name}") for name, sub in props.items()
            }
            if node.get("required"):
                out["required"] = list(node["required"])
            if extra is True:  # named fields plus any others (a Volume's source): kept
                out["x-kubernetes-preserve-unknown-fields"] = True
        elif isinstance(extra, dict) and extra:
            out["additionalProperties"] = _convert(
                extra, defs=defs, path=f"{path}.*", field=False
            )
        else:
            # A free-form Kubernetes object (resources, a Volume, a Toleration): kept as is.
            out["x-kubernetes-preserve-unknown-fields"] = True
    elif kind == "array":
        out["items"] = _convert(
            node.get("items", {}), defs=defs, path=f"{path}[]", field=False
        )
    elif kind is None and not node.get("enum") and not node.get("x-kubernetes-int-or-string"):
        out["x-kubernetes-preserve-unknown-fields"] = True
    if nullable:
        out["nullable"] = True
    if field and "description" not in out:
        raise ValueError(f"{path}: every CRD field needs a description (kubectl explain shows it)")
    return out


def crd_manifest() -> dict[str, Any]:
    """The CustomResourceDefinition object (apiextensions.k8s.io/v1)."""
    spec = structural_schema(JobSpec)
    status = structural_schema(JobStatus)
    root = {
        "type": "object",
        "description": "AdaPtisJob trains a model with an adaptive pipeline over worker pods.",
        "properties": {
            "apiVersion": {"type": "string", "description": "adaptis.io/v1alpha1"},
            "kind": {"type": "string", "description": "AdaPtisJob"},
            # The API server owns metadata's schema and refuses anything but its type here.
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
        "required": ["spec"],
        # Only the root may read metadata.name; the name rule is the api layer's.
        "x-kubernetes-validations": [dict(r) for r in JOB_CEL_RULES],
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": KIND.lower(),
                "shortNames": list(SHORT_NAMES),
                "categories": ["all", "adaptis"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [dict(c) for c in _PRINTER_COLUMNS],
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }


def crd_yaml() -> str:
    """The CRD as YAML, keys in schema order, as stored in ``crds/``."""
    header = "# Generated by `adaptis crd` from adaptis/api/job.py. Do not edit.\n"
    return header + yaml.safe_dump(crd_manifest(), sort_keys=False, width=100)
