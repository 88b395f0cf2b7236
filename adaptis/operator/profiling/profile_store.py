"""Where measured hardware profiles are kept: ConfigMaps in the operator's own namespace.

Sits between :mod:`adaptis.operator.profiling.measuring` (which stores what a profiler pod measured)
and :mod:`adaptis.operator.control.reconcile` (which reads every stored profile before planning, for
every job: a measured node is planned from its measurement whatever the job's ``profile``). A
measurement changes the plans of every tenant, so it lives where no tenant can write:

- one ConfigMap per node, ``adaptis-profile-<digest of the node name>``, in the operator's
  namespace (``adaptis operator --profile-namespace``; the chart's release namespace, writable
  by the operator's Role there and by no tenant), labelled ``adaptis.io/role:
  hardware-profile`` and annotated with the node's name;
- its data: one key per hardware fingerprint of the node (:func:`hardware_fingerprint`: the GPU
  labels and capacity and the machine's system UUID), the validated document as the value, so
  a node whose hardware changes under the same name is profiled again instead of planned from
  a stale figure.

Node annotations (``adaptis.io/hardware-profile``, where earlier versions cached profiles) are
ignored: anyone who may patch a node could forge them, and the operator needs no node patch. Every
document is validated (:func:`adaptis.api.measured_hardware.parse_measured_hardware`) when read as
well as when written, so an edited ConfigMap cannot smuggle a figure past the bounds.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from adaptis.api.errors import SpecError
from adaptis.api.measured_hardware import parse_measured_hardware
from adaptis.operator.core.labels import GPU_RESOURCE, LABEL_MANAGED_BY, MANAGED_BY

__all__ = [
    "NODE_ANNOTATION",
    "ROLE_PROFILE",
    "StoredProfiles",
    "hardware_fingerprint",
    "measured_figures",
    "profile_config_map_name",
    "profile_selector",
    "read_stored_profiles",
    "render_profile_config_map",
]

log = logging.getLogger(__name__)

LABEL_ROLE = "adaptis.io/role"
ROLE_PROFILE = "hardware-profile"
NODE_ANNOTATION = "adaptis.io/node"
# The labels of the node that say what hardware it has (GPU Feature Discovery's).
_HARDWARE_LABELS = ("nvidia.com/gpu.product", "nvidia.com/gpu.count", "nvidia.com/gpu.memory",
                    "nvidia.com/gpu.family")

#: node name -> {hardware fingerprint: document}
StoredProfiles = dict[str, dict[str, str]]


def profile_config_map_name(node: str) -> str:
    """Hashed: a node name may be 253 characters, a ConfigMap name too, with no room left."""
    return f"adaptis-profile-{hashlib.sha256(node.encode()).hexdigest()[:16]}"


def profile_selector() -> dict[str, str]:
    return {LABEL_MANAGED_BY: MANAGED_BY, LABEL_ROLE: ROLE_PROFILE}


def hardware_fingerprint(node: Mapping[str, Any]) -> str:
    """What the node's measurement depends on: its GPU labels and count, and the machine.

    Heartbeats, taints and topology labels are left out (they change without the hardware).
    Also a valid ConfigMap data key (hex).
    """
    meta = node.get("metadata") or {}
    status = node.get("status") or {}
    labels = meta.get("labels") or {}
    allocatable = status.get("allocatable") or status.get("capacity") or {}
    info = status.get("nodeInfo") or {}
    text = json.dumps([[labels.get(k) for k in _HARDWARE_LABELS],
                       str(allocatable.get(GPU_RESOURCE, "")), info.get("systemUUID", "")],
                      separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def render_profile_config_map(*, namespace: str, node: str, fingerprint: str,
                              document: str) -> dict[str, Any]:
    """The ConfigMap of one node holding ``document`` under ``fingerprint`` (merge to update)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": profile_config_map_name(node),
            "namespace": namespace,
            "labels": profile_selector(),
            "annotations": {NODE_ANNOTATION: node},
        },
        "data": {fingerprint: document},
    }


def read_stored_profiles(config_maps: Iterable[Mapping[str, Any]]) -> StoredProfiles:
    """node -> {fingerprint: document} from the profile ConfigMaps (others are skipped)."""
    out: StoredProfiles = {}
    for cm in config_maps:
        meta = cm.get("metadata") or {}
        node = (meta.get("annotations") or {}).get(NODE_ANNOTATION)
        labels = meta.get("labels") or {}
        if not node or any(labels.get(k) != v for k, v in profile_selector().items()):
            continue
        if meta.get("name") != profile_config_map_name(str(node)):
            continue  # one node's ConfigMap cannot speak for another node
        out[str(node)] = {str(k): str(v) for k, v in (cm.get("data") or {}).items()}
    return out


def measured_figures(stored: StoredProfiles, node: Mapping[str, Any]) -> dict[str, float]:
    """The validated figures stored for this node's current hardware; {} when none is usable."""
    name = str((node.get("metadata") or {}).get("name", ""))
    document = stored.get(name, {}).get(hardware_fingerprint(node))
    if document is None:
        return {}
    try:
        return parse_measured_hardware(document).figures()
    except SpecError as err:
        log.warning("node %s: ignoring its stored profile: %s", name, str(err).splitlines()[0])
        return {}
