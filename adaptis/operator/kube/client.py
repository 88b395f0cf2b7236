"""The client of the Kubernetes API: :class:`KubeCluster`, the :class:`Cluster` protocol over HTTPS.

Sits under :mod:`adaptis.operator.control.app`, which makes the one client of the operator
process; every other room talks to it through the protocol
(:class:`adaptis.operator.kube.cluster.Cluster`). The reconciler reads and writes plain dicts
(exactly what the API serves), so the client is a thin JSON-over-HTTPS layer on ``urllib3``:
credentials come from ``kubernetes.config`` (kubeconfig or in-cluster service account), but the
generated model classes are skipped because deserialising 256 Node objects into them on every
reconcile costs more than the reconcile itself. It also serves the informers
(:mod:`adaptis.operator.kube.informer`): a list and a streamed watch of one collection, the
watches on a connection pool of their own. A create that answers 409 means "already
there" and a delete that answers 404 means "already gone": both are success, which is what
makes repeated reconciles and operator restarts safe. Idempotent calls are retried a few times
on 429 and 502-504 (API priority and fairness, an API server restarting behind its load
balancer), waiting as Retry-After says; creates are not (a retried create could answer 409 for
itself), and what is still failing goes to the work queue's backoff as an :class:`ApiError`.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote, urlencode

import urllib3

from adaptis.api.job import GROUP, PLURAL, VERSION
from adaptis.operator.core.errors import OperatorError
from adaptis.operator.core.labels import LABEL_JOB, LABEL_MANAGED_BY, MANAGED_BY
from adaptis.operator.core.records import JobRef
from adaptis.operator.kube.cluster import ApiError

__all__ = ["RETRY_AFTER_MAX_S", "KubeCluster", "api_retry"]

log = logging.getLogger(__name__)

_JOBS = f"/apis/{GROUP}/{VERSION}/namespaces/{{ns}}/{PLURAL}"
_MERGE = "application/merge-patch+json"
# Answers of an API server that is overloaded or restarting: worth a retry after a pause.
_RETRY_STATUSES = frozenset({429, 502, 503, 504})
# Calls whose repetition changes nothing more: every one the client makes but POST (status and
# ConfigMap writes are merge patches, which are idempotent).
_IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "PATCH", "DELETE"})
# Every create (and its dry run) asks the API server to refuse a field its schema does not
# declare (400, naming it) instead of dropping it: a worker pod carries the tenant's volumes,
# env and resources as written, and a misspelt key deep in a volume source must fail the job
# (adaptis.operator.kube.children), not vanish (issue 27). The operator's own objects hold only
# fields of the Kubernetes versions the chart supports, so strictness costs them nothing and
# turns a slip of ours into an error instead of a silent difference.
_STRICT: Mapping[str, str] = {"fieldValidation": "Strict"}
# A Retry-After beyond this is cut to it: a reconcile worker must not sleep for minutes on
# one call (APF asks for 1 s); the work queue's backoff paces longer outages.
RETRY_AFTER_MAX_S = 5.0


class _ApiRetry(urllib3.Retry):
    def get_retry_after(self, response: urllib3.BaseHTTPResponse) -> float | None:
        seconds = super().get_retry_after(response)
        return None if seconds is None else min(seconds, RETRY_AFTER_MAX_S)


def api_retry() -> urllib3.Retry:
    """The client's retry policy (see the module docstring)."""
    return _ApiRetry(total=3, connect=3, read=2, status=3, backoff_factor=0.2,
                     status_forcelist=_RETRY_STATUSES, allowed_methods=_IDEMPOTENT,
                     respect_retry_after_header=True,
                     raise_on_status=False)  # the last answer becomes an ApiError


def _collection(obj: Mapping[str, Any]) -> str:
    ns = obj["metadata"]["namespace"]
    kind = obj["kind"]
    plural = {"Pod": "pods", "Service": "services", "ConfigMap": "configmaps",
              "Event": "events"}.get(kind)
    if plural is None:
        raise OperatorError(f"no collection known for kind {kind}")
    return f"/api/v1/namespaces/{quote(ns)}/{plural}"


class KubeCluster:
    """:class:`Cluster` over HTTPS with the credentials of a kubeconfig or service account."""

    def __init__(self, *, kubeconfig: str | None = None, timeout_s: float = 30.0) -> None:
        import kubernetes.config  # the credential loaders only; kept out of module import
        from kubernetes.client import Configuration

        config = Configuration()
        try:
            if kubeconfig is not None:
                kubernetes.config.load_kube_config(config_file=kubeconfig,
                                                   client_configuration=config)
            else:
                try:
                    kubernetes.config.load_incluster_config(client_configuration=config)
                except kubernetes.config.ConfigException:
                    kubernetes.config.load_kube_config(client_configuration=config)
        except (kubernetes.config.ConfigException, OSError) as err:
            raise OperatorError(
                f"no Kubernetes credentials: not in a pod with a service account, and the "
                f"kubeconfig cannot be used ({err})") from None
        self._config = config
        self._host = config.host.rstrip("/")
        def pool(**options: Any) -> urllib3.PoolManager:
            return urllib3.PoolManager(
                cert_reqs="CERT_REQUIRED" if config.verify_ssl else "CERT_NONE",
                ca_certs=config.ssl_ca_cert, cert_file=config.cert_file,
                key_file=config.key_file, **options)

        # Two reconcile workers each creating a gang eight pods at a time (create_many) use 16
        # connections: a smaller pool drops the extra ones after each burst ("Connection pool
        # is full") and pays a TLS handshake for each the next time.
        self._pool = pool(num_pools=4, maxsize=16, timeout=urllib3.Timeout(total=timeout_s),
                          retries=api_retry())
        # Watches hold their connection for minutes: a pool of their own, so that they never
        # take the connections of the reconcile workers' calls.
        self._streams = pool(num_pools=1, maxsize=8)
        self._lock = threading.Lock()

    # --- transport ---------------------------------------------------------------------------
    def _headers(self, content_type: str | None) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": "adaptis-operator"}
        if content_type:
            headers["Content-Type"] = content_type
        with self._lock:  # the refresh hook of in-cluster tokens is not thread-safe
            token = (self._config.get_api_key_with_prefix("BearerToken")
                     or self._config.get_api_key_with_prefix("authorization"))
        if token:
            headers["Authorization"] = token if " " in token else f"Bearer {token}"
        return headers

    def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        query: Mapping[str, str] | None = None,
        content_type: str = "application/json",
        ok: frozenset[int] = frozenset(),
    ) -> tuple[int, dict[str, Any]]:
        """One call; statuses in ``ok`` (besides 2xx) are returned, the rest raise ApiError."""
        url = self._host + path + (f"?{urlencode(query)}" if query else "")
        data = None if body is None else json.dumps(body).encode()
        resp = self._pool.request(method, url, body=data,
                                  headers=self._headers(content_type if data else None))
        status = resp.status
        try:
            payload = json.loads(resp.data) if resp.data else {}
        except ValueError:
            payload = {"message": resp.data[:200].decode(errors="replace")}
        if 200 <= status < 300 or status in ok:
            return status, payload
        raise ApiError(f"{method} {path}: {status} {payload.get('message', '')}", status=status)

    # --- WatchSource (adaptis.operator.kube.informer) -----------------------------------------
    def list_collection(self, path: str, *, query: Mapping[str, str]
                        ) -> tuple[list[dict[str, Any]], str]:
        # resourceVersion=0: from the API server's watch cache, cheap at any size.
        _, body = self.request("GET", path, query={**query, "resourceVersion": "0"})
        version = str((body.get("metadata") or {}).get("resourceVersion", ""))
        return list(body.get("items") or []), version

    def watch_collection(self, path: str, *, query: Mapping[str, str], resource_version: str,
                         timeout_s: float) -> Iterator[dict[str, Any]]:
        """The events of one watch stream, one JSON document a line, as they arrive."""
        params = {**query, "watch": "true", "allowWatchBookmarks": "true",
                  "resourceVersion": resource_version, "timeoutSeconds": str(int(timeout_s))}
        url = f"{self._host}{path}?{urlencode(params)}"
        try:
            resp = self._streams.request(
                "GET", url, headers=self._headers(None), preload_content=False, retries=False,
                # the server ends the stream after timeoutSeconds; a silent one is dead
                timeout=urllib3.Timeout(connect=10.0, read=timeout_s + 30.0))
        except urllib3.exceptions.HTTPError as err:
            raise ApiError(f"watch {path}: {err}", status=0) from None
        try:
            if resp.status != 200:
                message = resp.data[:300].decode(errors="replace")
                raise ApiError(f"watch {path}: {resp.status} {message}", status=resp.status)
            pending = b""
            for chunk in resp.stream(amt=None):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.strip():
                        yield json.loads(line)
        except urllib3.exceptions.HTTPError as err:
            raise ApiError(f"watch {path}: {err}", status=0) from None
        finally:  # a stream left mid-way cannot serve another request: close it
            resp.close()
            resp.release_conn()

    # --- Cluster ----------------------------------------------------------------------------
    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        status, body = self.request("GET", f"{_JOBS.format(ns=quote(namespace))}/{quote(name)}",
                                    ok=frozenset({404}))
        return None if status == 404 else body

    def patch_job_status(self, namespace: str, name: str, *,
                         status: Mapping[str, Any]) -> None:
        self.request("PATCH", f"{_JOBS.format(ns=quote(namespace))}/{quote(name)}/status",
                     body={"status": dict(status)}, content_type=_MERGE, ok=frozenset({404}))

    def delete_job(self, namespace: str, name: str) -> None:
        self.request("DELETE", f"{_JOBS.format(ns=quote(namespace))}/{quote(name)}",
                     body={"propagationPolicy": "Background"}, ok=frozenset({404}))

    def list_nodes(self) -> list[dict[str, Any]]:
        # resourceVersion=0: served from the API server's watch cache, cheap at any size.
        return list(self.request("GET", "/api/v1/nodes",
                                 query={"resourceVersion": "0"})[1].get("items") or [])

    def list_pods(self, namespace: str, job: str) -> list[dict[str, Any]]:
        selector = f"{LABEL_MANAGED_BY}={MANAGED_BY},{LABEL_JOB}={job}"
        return list(self.request("GET", f"/api/v1/namespaces/{quote(namespace)}/pods",
                                 query={"labelSelector": selector})[1].get("items") or [])

    def list_active_pods(self) -> list[dict[str, Any]]:
        # Every namespace, terminated pods excluded: what holds a node's GPUs now. From the
        # watch cache (resourceVersion=0). The operator keeps them from a watch instead
        # (scheduling.inventory); this list serves ListedInventory.
        query = {"resourceVersion": "0",
                 "fieldSelector": "status.phase!=Succeeded,status.phase!=Failed"}
        return list(self.request("GET", "/api/v1/pods", query=query)[1].get("items") or [])

    def priority_of(self, priority_class: str | None) -> int:
        """The value of a PriorityClass (0 for none or an unknown name, as for pods)."""
        if not priority_class:
            return 0
        status, body = self.request(
            "GET", f"/apis/scheduling.k8s.io/v1/priorityclasses/{quote(priority_class)}",
            ok=frozenset({404}))
        value = body.get("value") if status != 404 else 0
        return int(value) if isinstance(value, int) else 0

    def get_config_map(self, namespace: str, name: str) -> dict[str, Any] | None:
        status, body = self.request(
            "GET", f"/api/v1/namespaces/{quote(namespace)}/configmaps/{quote(name)}",
            ok=frozenset({404}))
        return None if status == 404 else body

    def list_config_maps(self, namespace: str, *,
                         selector: Mapping[str, str]) -> list[dict[str, Any]]:
        query = {"labelSelector": ",".join(f"{k}={v}" for k, v in sorted(selector.items()))}
        return list(self.request("GET", f"/api/v1/namespaces/{quote(namespace)}/configmaps",
                                 query=query)[1].get("items") or [])

    def create(self, obj: Mapping[str, Any]) -> bool:
        status, _ = self.request("POST", _collection(obj), body=obj, query=_STRICT,
                                 ok=frozenset({409}))
        return status != 409

    def dry_run_create(self, obj: Mapping[str, Any]) -> None:
        # dryRun=All: validation and admission run, nothing is stored; a 409 (the name is
        # taken) says nothing about the content, so it counts as passed.
        self.request("POST", _collection(obj), body=obj, query={"dryRun": "All", **_STRICT},
                     ok=frozenset({409}))

    def replace_config_map(self, obj: Mapping[str, Any]) -> None:
        name = obj["metadata"]["name"]
        # A merge patch of data and annotations: no resourceVersion races with ourselves.
        self.request("PATCH", f"{_collection(obj)}/{quote(name)}",
                     body={"metadata": {"annotations": obj["metadata"].get("annotations", {})},
                           "data": obj["data"]}, content_type=_MERGE)

    def delete_pod(self, namespace: str, name: str, *, force: bool = False) -> None:
        body: dict[str, Any] = {"propagationPolicy": "Background"}
        if force:  # no kubelet is left to confirm the deletion (its node is gone)
            body["gracePeriodSeconds"] = 0
        self.request("DELETE", f"/api/v1/namespaces/{quote(namespace)}/pods/{quote(name)}",
                     body=body, ok=frozenset({404}))

    def delete_config_map(self, namespace: str, name: str) -> None:
        self.request("DELETE", f"/api/v1/namespaces/{quote(namespace)}/configmaps/{quote(name)}",
                     ok=frozenset({404}))

    def event(self, job: JobRef, *, type_: str, reason: str, message: str) -> None:
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        stamp = datetime.now(UTC).strftime("%Y%m%d%H%M%S%f")
        # The random part: two events of one job in the same microsecond (or a clock stepped
        # back) must not share a name, as a taken name would drop the second one.
        name = f"{job.name}.{stamp}.{secrets.token_hex(4)}"
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": name, "namespace": job.namespace},
            "involvedObject": {"apiVersion": f"{GROUP}/{VERSION}", "kind": "AdaPtisJob",
                               "name": job.name, "namespace": job.namespace, "uid": job.uid},
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": "adaptis-operator"},
            "firstTimestamp": now[:19] + "Z",
            "lastTimestamp": now[:19] + "Z",
            "count": 1,
            "reportingComponent": "adaptis-operator",
        }
        try:
            if not self.create(body):
                log.warning("event %s for %s/%s not recorded: the name %s is taken", reason,
                            job.namespace, job.name, name)
        except ApiError as err:  # an event is best effort: never fail a reconcile over it
            log.warning("event %s for %s/%s not recorded: %s", reason, job.namespace, job.name, err)
