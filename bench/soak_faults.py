"""The soak's faults that last a window (issue 31, item 3): API Priority and Fairness starving
the operator, and preemption by a higher-priority pod. Used by bench/soak.py.

Both are real: the API server rejects the operator's requests with HTTP 429 because a
FlowSchema puts them in a priority level of no nominal seats whose ``limitResponse`` is
``Reject``, while another tenant's client (a ServiceAccount of its own, in a FlowSchema of its
own, so the rejections of each are told apart in ``apiserver_flowcontrol_rejected_requests_total``)
keeps that level busy; and kube-scheduler itself preempts the workers of a node for a plain pod
of PriorityClass ``soak-high`` that asks for all the node's GPUs. Each fault starts now and ends
on a timer (the objects deleted), so it overlaps the harness's next ticks and faults; ``end``
waits for every window to close.

The operator must run as an identity a FlowSchema can match (system:masters is exempt from APF):
``operator_kubeconfig`` installs the chart's own RBAC and ServiceAccount (``helm template``) and
returns a kubeconfig with that ServiceAccount's token.
"""

from __future__ import annotations

import http.client
import json
import logging
import ssl
import threading
import time
from pathlib import Path
from typing import Any

from benchkit import REPO, ControlPlane

log = logging.getLogger("soak")

RELEASE, SYSTEM_NS = "adaptis", "adaptis-system"
NOISE_SA = "soak-noise"
STARVED_LEVEL = "soak-starved"
OPERATOR_SCHEMA = "soak-starve-operator"
NOISE_SCHEMA = "soak-noise"
HIGH_PRIORITY = "soak-high"
GPU = "nvidia.com/gpu"


def operator_kubeconfig(cp: ControlPlane, *, namespace: str) -> Path:
    """The chart's RBAC and ServiceAccount for an operator watching ``namespace``, applied; a
    kubeconfig authenticating as that ServiceAccount."""
    rendered = cp.helm("template", RELEASE, str(REPO / "charts" / "adaptis"), "--namespace", SYSTEM_NS,
                       "--set-json", f"operator.watchNamespaces={json.dumps([namespace])}",
                       "--show-only", "templates/rbac.yaml", "--show-only", "templates/serviceaccount.yaml").stdout
    cp.kubectl("apply", "-f", "-", input=rendered)
    # The other tenant's client, which keeps the starved level busy: it may read pods there.
    cp.kubectl("create", "serviceaccount", NOISE_SA, "-n", SYSTEM_NS)
    cp.kubectl("create", "rolebinding", NOISE_SA, "-n", namespace, "--clusterrole=view",
               f"--serviceaccount={SYSTEM_NS}:{NOISE_SA}")
    cp.kubectl("create", "-f", "-", input=json.dumps({
        "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": HIGH_PRIORITY},
        "value": 1_000_000, "description": "the soak's preemptors"}))
    return cp.service_account_kubeconfig(SYSTEM_NS, RELEASE)


def _schema(name: str, sa: str) -> dict[str, Any]:
    return {"apiVersion": "flowcontrol.apiserver.k8s.io/v1", "kind": "FlowSchema", "metadata": {"name": name},
            "spec": {"priorityLevelConfiguration": {"name": STARVED_LEVEL}, "matchingPrecedence": 100,
                     "distinguisherMethod": {"type": "ByUser"},
                     "rules": [{"subjects": [{"kind": "ServiceAccount",
                                              "serviceAccount": {"namespace": SYSTEM_NS, "name": sa}}],
                                "resourceRules": [{"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"],
                                                   "namespaces": ["*"], "clusterScope": True}],
                                "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}]}]}}


STARVATION = [
    {"apiVersion": "flowcontrol.apiserver.k8s.io/v1", "kind": "PriorityLevelConfiguration",
     "metadata": {"name": STARVED_LEVEL},
     "spec": {"type": "Limited", "limited": {"nominalConcurrencyShares": 0, "lendablePercent": 0,
                                             "borrowingLimitPercent": 0, "limitResponse": {"type": "Reject"}}}},
    _schema(OPERATOR_SCHEMA, RELEASE), _schema(NOISE_SCHEMA, NOISE_SA)]


def rejected(cp: ControlPlane, *, schema: str = OPERATOR_SCHEMA) -> int | None:
    """The API server's count of requests of ``schema`` it rejected (429), None while it does not
    answer; restarts reset it."""
    result = cp.kubectl("get", "--raw", "/metrics", check=False, timeout=30)
    if result.returncode != 0:
        return None
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in result.stdout.splitlines()
               if line.startswith("apiserver_flowcontrol_rejected_requests_total{")
               and f'flow_schema="{schema}"' in line)


class Windows:
    """The faults open now, each closed by its own thread after ``seconds``."""

    def __init__(self, cp: ControlPlane, *, namespace: str) -> None:
        self.cp, self.namespace = cp, namespace
        self.threads: list[threading.Thread] = []
        self.starving = threading.Event()
        self.rejected_429 = 0  # the operator's requests the API server rejected, all windows
        self.preemptors_bound = 0  # preemptors kube-scheduler bound (so it preempted the workers)
        self._preempting: set[str] = set()  # nodes with a preemptor on them or on its way
        self._lock = threading.Lock()
        self.serial = 0

    def _delete(self, *args: str, deadline_s: float = 120) -> None:
        """Delete until the API server answers (it may be restarting)."""
        deadline = time.monotonic() + deadline_s
        while self.cp.kubectl("delete", *args, "--ignore-not-found", "--wait=false",
                              check=False).returncode != 0 and time.monotonic() < deadline:
            time.sleep(1.0)

    # --------------------------------------------------------------- API Priority and Fairness

    def _noise(self, token: str, until: float) -> None:
        """Another tenant's client reading pods as fast as it can, 429s and all."""
        server = self.cp.server.removeprefix("https://")
        host, _, port = server.rpartition(":")
        context = ssl.create_default_context(cafile=str(self.cp.pki_dir / "ca.crt"))
        conn: http.client.HTTPSConnection | None = None
        while time.monotonic() < until:
            try:
                conn = conn or http.client.HTTPSConnection(host, int(port), context=context, timeout=5)
                conn.request("GET", f"/api/v1/namespaces/{self.namespace}/pods",
                             headers={"Authorization": f"Bearer {token}"})
                conn.getresponse().read()
            except (OSError, http.client.HTTPException):
                conn = None
                time.sleep(0.2)  # the API server restarting

    def starve(self, *, seconds: float, threads: int = 4) -> bool:
        """Put the operator's requests in a level of no seats, kept busy, for ``seconds``."""
        if self.starving.is_set():
            return False
        before = rejected(self.cp)
        token = self.cp.service_account_token(SYSTEM_NS, NOISE_SA, duration_seconds=600)
        if before is None or self.cp.kubectl("apply", "-f", "-", check=False, input=json.dumps(
                {"apiVersion": "v1", "kind": "List", "items": STARVATION})).returncode != 0:
            return False
        self.starving.set()
        until = time.monotonic() + seconds
        noise = [threading.Thread(target=self._noise, args=(token, until), daemon=True) for _ in range(threads)]
        for thread in noise:
            thread.start()

        def close() -> None:
            for thread in noise:
                thread.join()
            after = rejected(self.cp)
            # A restart of the API server in the window resets its counter: count from zero.
            count = 0 if after is None else after - before if after >= before else after
            self.rejected_429 += count
            log.info("APF window closed: %d of the operator's requests rejected with 429", count)
            for item in STARVATION[::-1]:
                self._delete(item["kind"].lower() + ".flowcontrol.apiserver.k8s.io", item["metadata"]["name"])
            self.starving.clear()

        self._start(close)
        return True

    # --------------------------------------------------------------- preemption

    def _pod(self, kind: str, *, node: str, gpus: int, priority: str | None) -> tuple[str, dict[str, Any]]:
        name = f"{kind}-{self.serial:03d}"
        self.serial += 1
        spec: dict[str, Any] = {
            "nodeSelector": {"kubernetes.io/hostname": node}, "tolerations": [{"operator": "Exists"}],
            "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
                            "resources": {"requests": {GPU: str(gpus)}, "limits": {GPU: str(gpus)}}}]}
        if priority:
            spec["priorityClassName"] = priority
        return name, {"apiVersion": "v1", "kind": "Pod", "spec": spec, "metadata": {
            "name": name, "namespace": self.namespace, "labels": {"app": f"soak-{kind}"}}}

    def fill(self, node: str, *, gpus: int, timeout: float = 10.0) -> str | None:
        """A plain pod of the workers' priority taking the ``gpus`` left free on ``node``, once
        kube-scheduler bound it (its name): the node is full, so no worker lands there before a
        preemptor comes, and the workers the harness saw there are all it will preempt. None
        (and no pod) if it was not bound in time: a pod the harness did not see took them."""
        name, pod = self._pod("filler", node=node, gpus=gpus, priority=None)
        if self.cp.kubectl("create", "-f", "-", input=json.dumps(pod), check=False).returncode != 0:
            return None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.cp.kubectl("get", "pod", name, "-n", self.namespace, "-o", "jsonpath={.spec.nodeName}",
                                  check=False)
            if got.returncode == 0 and got.stdout.strip() == node:
                return name
            time.sleep(0.3)
        self._delete("pod", name, "-n", self.namespace)
        return None

    def release(self, filler: str | None) -> None:
        if filler:
            self._delete("pod", filler, "-n", self.namespace)

    def preempt(self, node: str, *, gpus: int, seconds: float, filler: str | None = None) -> str | None:
        """A plain pod of priority ``soak-high`` asking for all ``gpus`` of ``node``, deleted
        after ``seconds`` with the ``filler``; its name, None if it could not be created."""
        name, pod = self._pod("preemptor", node=node, gpus=gpus, priority=HIGH_PRIORITY)
        if self.cp.kubectl("create", "-f", "-", input=json.dumps(pod), check=False).returncode != 0:
            self.release(filler)
            return None
        with self._lock:
            self._preempting.add(node)

        def close() -> None:
            time.sleep(seconds)
            got = self.cp.kubectl("get", "pod", name, "-n", self.namespace, "-o", "jsonpath={.spec.nodeName}",
                                  check=False)
            bound = got.returncode == 0 and got.stdout.strip() == node
            self.preemptors_bound += bound
            self._delete("pod", name, "-n", self.namespace)
            self.release(filler)
            with self._lock:
                self._preempting.discard(node)
            log.info("preemptor %s on %s deleted (%s)", name, node, "bound" if bound else "not bound")

        self._start(close)
        return name

    @property
    def preempting(self) -> frozenset[str]:
        """The nodes a preemptor is on or on its way to."""
        with self._lock:
            return frozenset(self._preempting)

    def _start(self, body: Any) -> None:
        thread = threading.Thread(target=body, daemon=True)
        thread.start()
        self.threads.append(thread)

    def end(self) -> None:
        """Wait for every window to close."""
        for thread in self.threads:
            thread.join()
