"""The restricted security settings of every pod the operator creates (workers and profilers).

Sits under :mod:`adaptis.operator.resources.manifests` and
:mod:`adaptis.operator.profiling.profiler_pods`, which merge what this module returns into their
pods. The pods pass the Pod Security Standard ``restricted`` as rendered: they run as the image's
numeric non-root user, never gain privileges, drop every capability, use the runtime's default
seccomp profile and cannot write their root filesystem. What Python, torch and triton write at run
time goes to two emptyDirs: ``/tmp`` and a home directory (``HOME``, ``XDG_CACHE_HOME``,
``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR`` point there), since the image's home is
``/nonexistent``.

Relaxing any of this (say, a device plugin that needs a capability) is the cluster admin's
call, not the job's: the operator renders the same restricted pods everywhere, and an admin
who allows more does so with the namespace's Pod Security level and admission policies
(see docs/pod-security.md).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "HOME_DIR",
    "HOME_VOLUME",
    "SCRATCH_ENV_NAMES",
    "TMP_DIR",
    "TMP_VOLUME",
    "container_security_context",
    "pod_security_context",
    "scratch_env",
    "scratch_mounts",
    "scratch_volumes",
]

# Prefixed so that they do not clash with the volumes a job adds (spec.worker.volumes).
TMP_VOLUME = "adaptis-tmp"
HOME_VOLUME = "adaptis-home"
TMP_DIR = "/tmp"  # noqa: S108 - where the pod's own emptyDir (TMP_VOLUME) is mounted in the container
HOME_DIR = "/home/adaptis"
# Bounded so that a runaway cache cannot fill the node's disk: the kubelet evicts the pod.
_TMP_LIMIT = "4Gi"
_HOME_LIMIT = "8Gi"
SCRATCH_ENV_NAMES = frozenset(
    {"HOME", "XDG_CACHE_HOME", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"})


def pod_security_context(*, run_as_user: int, run_as_group: int) -> dict[str, Any]:
    """Pod-level: the image's numeric user (runAsNonRoot needs a number to check) and seccomp."""
    return {
        "runAsNonRoot": True,
        "runAsUser": run_as_user,
        "runAsGroup": run_as_group,
        # Volumes (a checkpoint PVC) become writable by the group the process runs as.
        "fsGroup": run_as_group,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    """Container-level: what the ``restricted`` standard checks on each container."""
    return {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def scratch_volumes() -> list[dict[str, Any]]:
    return [
        {"name": TMP_VOLUME, "emptyDir": {"sizeLimit": _TMP_LIMIT}},
        {"name": HOME_VOLUME, "emptyDir": {"sizeLimit": _HOME_LIMIT}},
    ]


def scratch_mounts() -> list[dict[str, Any]]:
    return [
        {"name": TMP_VOLUME, "mountPath": TMP_DIR},
        {"name": HOME_VOLUME, "mountPath": HOME_DIR},
    ]


def scratch_env() -> list[dict[str, Any]]:
    """Where the libraries cache: all under the writable home, none on the read-only root."""
    cache = f"{HOME_DIR}/.cache"
    return [
        {"name": "HOME", "value": HOME_DIR},
        {"name": "XDG_CACHE_HOME", "value": cache},
        {"name": "TORCHINDUCTOR_CACHE_DIR", "value": f"{cache}/torchinductor"},
        {"name": "TRITON_CACHE_DIR", "value": f"{cache}/triton"},
    ]
