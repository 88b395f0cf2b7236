"""The HTTP client of the reconciler against a local HTTP server speaking the API's statuses.

What matters here is the contract the reconciler relies on: a 409 on create and a 404 on
delete are success, other errors raise, status goes as a merge patch to the subresource, and
the bearer token of the kubeconfig is sent. (tests/integration runs it against a real server.)
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest
import urllib3
import yaml

from adaptis.operator.core.records import JobRef
from adaptis.operator.kube import client as kube
from adaptis.operator.kube.client import KubeCluster
from adaptis.operator.kube.cluster import ApiError


class _Api(BaseHTTPRequestHandler):
    # Class-level on purpose: the server makes a handler per request, the tests read what all
    # of them saw (the fixture empties the requests and the script before each test).
    requests: ClassVar[list[tuple[str, str, dict[str, str], Any]]] = []
    existing: ClassVar[frozenset[str]] = frozenset({"/api/v1/namespaces/ns/pods"})
    # (method, path) -> the next answers (status, headers) before the normal one.
    script: ClassVar[dict[tuple[str, str], list[tuple[int, dict[str, str]]]]] = {}

    def _reply(self, status: int, body: dict[str, Any],
               headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.requests.append((self.command, self.path, dict(self.headers), body))
        path = self.path.split("?")[0]
        if self.script.get((self.command, path)):
            status, headers = self.script[(self.command, path)].pop(0)
            self._reply(status, {"kind": "Status", "message": f"scripted {status}"}, headers)
        elif "watch=true" in self.path:
            self._stream()
        elif self.command == "POST" and path in self.existing:
            self._reply(409, {"kind": "Status", "reason": "AlreadyExists"})
        elif self.command == "POST" and path.endswith("/services"):
            self._reply(403, {"kind": "Status", "message": "forbidden: no RBAC"})
        elif self.command in {"DELETE", "GET"} and "missing" in path:
            self._reply(404, {"kind": "Status", "reason": "NotFound"})
        elif self.command == "GET" and path.endswith("/pods"):
            self._reply(200, {"items": [{"metadata": {"name": "p0"}}]})
        else:
            self._reply(201 if self.command == "POST" else 200, {})

    def _stream(self) -> None:
        """A watch: chunked, one JSON event a line, lines split across chunks as TCP may."""
        self.protocol_version = "HTTP/1.1"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")
        self.end_headers()
        lines = b"".join(json.dumps(e).encode() + b"\n" for e in self.watch_events)
        for lo in range(0, len(lines), 7):
            chunk = lines[lo:lo + 7]
            self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        self.wfile.write(b"0\r\n\r\n")

    watch_events: ClassVar[list[dict[str, Any]]] = []

    do_GET = do_POST = do_PATCH = do_DELETE = _handle

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[KubeCluster, type[_Api]]]:
    _Api.requests = []
    _Api.script = {}
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Api)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "t",
        "clusters": [{"name": "c", "cluster": {
            "server": f"http://127.0.0.1:{server.server_address[1]}"}}],
        "users": [{"name": "u", "user": {"token": "s3cret"}}],
        "contexts": [{"name": "t", "context": {"cluster": "c", "user": "u"}}],
    }))
    try:
        yield KubeCluster(kubeconfig=str(kubeconfig), timeout_s=5), _Api
    finally:
        server.shutdown()


def test_409_on_create_and_404_on_delete_are_success(api: Any) -> None:
    cluster, handler = api
    pod = {"kind": "Pod", "metadata": {"name": "p0", "namespace": "ns"}}
    assert cluster.create(pod) is False
    cm = {"kind": "ConfigMap", "metadata": {"name": "c", "namespace": "ns"}, "data": {}}
    assert cluster.create(cm) is True
    cluster.delete_pod("ns", "missing-pod")
    assert cluster.get_job("ns", "missing-job") is None
    with pytest.raises(ApiError) as err:
        cluster.create({"kind": "Service", "metadata": {"name": "s", "namespace": "ns"}})
    assert err.value.status == 403 and "no RBAC" in str(err.value)
    assert all(h.get("Authorization") == "Bearer s3cret" for _, _, h, _ in handler.requests)


def test_status_is_merge_patched_on_the_subresource_and_pods_by_label(api: Any) -> None:
    cluster, handler = api
    cluster.patch_job_status("ns", "demo", status={"phase": "Running", "message": None})
    method, path, headers, body = handler.requests[-1]
    assert method == "PATCH"
    assert path == "/apis/adaptis.io/v1alpha1/namespaces/ns/adaptisjobs/demo/status"
    assert headers["Content-Type"] == "application/merge-patch+json"
    assert body == {"status": {"phase": "Running", "message": None}}
    assert [p["metadata"]["name"] for p in cluster.list_pods("ns", "demo")] == ["p0"]
    path = handler.requests[-1][1]
    selector = "app.kubernetes.io%2Fmanaged-by%3Dadaptis%2Cadaptis.io%2Fjob%3Ddemo"
    assert f"labelSelector={selector}" in path


def test_events_name_the_job(api: Any) -> None:
    cluster, handler = api
    cluster.event(JobRef(name="demo", namespace="ns", uid="u1"), type_="Warning",
                  reason="InvalidSpec", message="spec.parallelism.workers: too many")
    method, path, _, body = handler.requests[-1]
    assert (method, path) == ("POST", "/api/v1/namespaces/ns/events?fieldValidation=Strict")
    assert body["involvedObject"] == {"apiVersion": "adaptis.io/v1alpha1", "kind": "AdaPtisJob",
                                      "name": "demo", "namespace": "ns", "uid": "u1"}
    assert (body["type"], body["reason"]) == ("Warning", "InvalidSpec")


def test_creates_and_dry_runs_ask_for_strict_field_validation(api: Any) -> None:
    """A field the API server's schema does not declare is refused (400, naming it), never
    dropped: a tenant's misspelt key in a volume source fails the job (issue 27)."""
    cluster, handler = api
    pod = {"kind": "Pod", "metadata": {"name": "p1", "namespace": "ns"}}
    cluster.create(pod)
    cluster.dry_run_create(pod)
    cluster.create({"kind": "ConfigMap", "metadata": {"name": "c", "namespace": "ns"}})
    sent = [(m, p) for m, p, _, _ in handler.requests]
    assert sent == [("POST", "/api/v1/namespaces/ns/pods?fieldValidation=Strict"),
                    ("POST", "/api/v1/namespaces/ns/pods?dryRun=All&fieldValidation=Strict"),
                    ("POST", "/api/v1/namespaces/ns/configmaps?fieldValidation=Strict")]


def _sent(handler: type[_Api], method: str, path: str) -> int:
    return sum(1 for m, p, _, _ in handler.requests if m == method and p.split("?")[0] == path)


def test_idempotent_calls_retry_429_and_5xx_honouring_retry_after(api: Any) -> None:
    cluster, handler = api
    cm = "/api/v1/namespaces/ns/configmaps/c"
    # API priority and fairness answers 429 with Retry-After; an apiserver restart 502-504.
    handler.script[("GET", cm)] = [(429, {"Retry-After": "1"})]
    start = time.monotonic()
    assert cluster.get_config_map("ns", "c") == {}
    # The first retry's backoff is 0 s: only the header makes it wait.
    assert time.monotonic() - start >= 1.0, "Retry-After: 1 was not waited for"
    assert _sent(handler, "GET", cm) == 2
    handler.script[("GET", cm)] = [(503, {}), (502, {}), (504, {})]
    assert cluster.get_config_map("ns", "c") == {}
    assert _sent(handler, "GET", cm) == 2 + 4
    status = "/apis/adaptis.io/v1alpha1/namespaces/ns/adaptisjobs/demo/status"
    handler.script[("PATCH", status)] = [(504, {})]  # a merge patch is idempotent
    cluster.patch_job_status("ns", "demo", status={"phase": "Running"})
    assert _sent(handler, "PATCH", status) == 2
    pod = "/api/v1/namespaces/ns/pods/p1"
    handler.script[("DELETE", pod)] = [(503, {})]
    cluster.delete_pod("ns", "p1")
    assert _sent(handler, "DELETE", pod) == 2


def test_creates_are_not_retried_and_spent_retries_raise_the_status(api: Any) -> None:
    cluster, handler = api
    cms = "/api/v1/namespaces/ns/configmaps"
    handler.script[("POST", cms)] = [(503, {})]
    with pytest.raises(ApiError) as err:  # a retried create could answer 409 for itself
        cluster.create({"kind": "ConfigMap", "metadata": {"name": "c", "namespace": "ns"}})
    assert err.value.status == 503 and _sent(handler, "POST", cms) == 1
    nodes = "/api/v1/nodes"
    handler.script[("GET", nodes)] = [(503, {})] * 10
    with pytest.raises(ApiError) as err:  # the queue's backoff takes over from here
        cluster.list_nodes()
    assert err.value.status == 503 and 2 <= _sent(handler, "GET", nodes) <= 5


def test_a_long_retry_after_is_capped() -> None:
    retry = kube.api_retry()
    answer = urllib3.HTTPResponse(status=429, headers={"Retry-After": "3600"})
    assert retry.get_retry_after(answer) == kube.RETRY_AFTER_MAX_S


def test_two_events_in_the_same_microsecond_both_land(monkeypatch: Any) -> None:
    frozen = datetime(2026, 1, 1, 12, 0, 0, 123456, tzinfo=UTC)

    class Frozen(datetime):
        @classmethod
        def now(cls, tz: Any = None) -> datetime:  # type: ignore[override]
            return frozen

    monkeypatch.setattr(kube, "datetime", Frozen)
    stored: dict[str, dict[str, Any]] = {}

    def request(method: str, path: str, *, body: Any = None,
                ok: frozenset[int] = frozenset(), **_: Any) -> tuple[int, dict[str, Any]]:
        name = body["metadata"]["name"]
        if name in stored:  # what the API server answers for a taken name
            assert 409 in ok
            return 409, {}
        stored[name] = body
        return 201, body

    client = KubeCluster.__new__(KubeCluster)  # no credentials: the transport is replaced
    client.request = request  # type: ignore[method-assign]
    job = JobRef(name="demo", namespace="ns", uid="u1")
    client.event(job, type_="Normal", reason="Planned", message="planned")
    client.event(job, type_="Normal", reason="CreatedPods", message="created 4 worker pod(s)")
    assert sorted(e["reason"] for e in stored.values()) == ["CreatedPods", "Planned"]
    assert all(len(name) <= 253 and name.startswith("demo.") for name in stored)


def test_a_watch_streams_events_as_lines_whatever_the_chunks_and_a_list_its_version(
        api: Any) -> None:
    cluster, handler = api
    handler.watch_events = [
        {"type": "ADDED", "object": {"metadata": {"name": "n0", "resourceVersion": "7"}}},
        {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "9"}}},
    ]
    events = list(cluster.watch_collection("/api/v1/nodes", query={"labelSelector": "a=b"},
                                           resource_version="5", timeout_s=30))
    assert events == handler.watch_events
    path = handler.requests[-1][1]
    for part in ("watch=true", "allowWatchBookmarks=true", "resourceVersion=5",
                 "timeoutSeconds=30", "labelSelector=a%3Db"):
        assert part in path
    items, version = cluster.list_collection("/api/v1/namespaces/ns/pods", query={})
    assert [i["metadata"]["name"] for i in items] == ["p0"] and version == ""
    assert "resourceVersion=0" in handler.requests[-1][1]  # from the watch cache
    handler.script[("GET", "/api/v1/nodes")] = [(403, {})]
    with pytest.raises(ApiError, match="watch /api/v1/nodes: 403"):
        list(cluster.watch_collection("/api/v1/nodes", query={}, resource_version="5",
                                      timeout_s=30))
