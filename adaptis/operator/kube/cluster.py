"""What the operator needs from the Kubernetes API: the :class:`Cluster` protocol and its errors.

Sits under every room that talks to the API server (the reconciler, placement, measuring, the
plan store, adaptation): they depend on this protocol, never on the client, so that they stay
plain code over dicts that tests drive with an in-memory cluster. The client that speaks HTTP
to a real API server is :class:`adaptis.operator.kube.client.KubeCluster`, made once by the
operator process (:mod:`adaptis.operator.control.app`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from adaptis.operator.core.errors import OperatorError
from adaptis.operator.core.records import JobRef

__all__ = ["REFUSED_STATUSES", "ApiError", "Cluster", "create_many"]


# Statuses of a create refused for what it asks (validation 400/413/422, admission 403/422,
# a namespace gone 404), as opposed to a failure of the API server (429, 5xx): the former
# become the job's condition (adaptis.operator.kube.children), the latter are retried.
REFUSED_STATUSES = frozenset({400, 403, 404, 413, 422})


class ApiError(OperatorError):
    """An API call that failed with a status other than the benign 404/409."""

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message)
        self.status = status


class Cluster(Protocol):
    """What the reconciler needs from the API server."""

    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None: ...
    def patch_job_status(self, namespace: str, name: str, *,
                         status: Mapping[str, Any]) -> None: ...
    def delete_job(self, namespace: str, name: str) -> None: ...
    def list_nodes(self) -> list[dict[str, Any]]: ...
    def list_pods(self, namespace: str, job: str) -> list[dict[str, Any]]: ...
    def list_active_pods(self) -> list[dict[str, Any]]: ...
    def priority_of(self, priority_class: str | None) -> int: ...
    def get_config_map(self, namespace: str, name: str) -> dict[str, Any] | None: ...
    def list_config_maps(self, namespace: str, *,
                         selector: Mapping[str, str]) -> list[dict[str, Any]]: ...
    def create(self, obj: Mapping[str, Any]) -> bool: ...
    def dry_run_create(self, obj: Mapping[str, Any]) -> None: ...
    def replace_config_map(self, obj: Mapping[str, Any]) -> None: ...
    def delete_pod(self, namespace: str, name: str, *, force: bool = False) -> None: ...
    def delete_config_map(self, namespace: str, name: str) -> None: ...
    def event(self, job: JobRef, *, type_: str, reason: str, message: str) -> None: ...


def create_many(cluster: Cluster, objects: Sequence[Mapping[str, Any]], *,
                parallelism: int = 8) -> tuple[int, dict[str, ApiError]]:
    """Create objects a few at a time (a 64-rank gang is 64 round trips): how many are new,
    and by name the ones the API server refused (:data:`REFUSED_STATUSES`), with its error."""
    refused: dict[str, ApiError] = {}

    def create(obj: Mapping[str, Any]) -> bool:
        try:
            return cluster.create(obj)
        except ApiError as err:
            if err.status not in REFUSED_STATUSES:
                raise
            refused[obj["metadata"]["name"]] = err
            return False

    if len(objects) <= 1:
        return sum(int(create(o)) for o in objects), refused
    with ThreadPoolExecutor(max_workers=min(parallelism, len(objects))) as pool:
        return sum(int(done) for done in pool.map(create, objects)), refused
