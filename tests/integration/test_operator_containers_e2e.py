"""Worker containers the kubelet cannot start, on a real control plane (issue 27).

A job whose workers read a Secret that does not exist: a real kubelet keeps their container
waiting with ``CreateContainerConfigError`` and the message ``secret "..." not found``. kwok
plays no such kubelet, so the worker pods are annotated ``adaptis.io/fake-kubelet`` (kwok's
pod-ready stage leaves them Pending, ``kwok-stages.yaml``) and the test writes that status
itself through the pods' status subresource, as the kubelet does. The operator (a subprocess,
as in test_operator_e2e.py) must show it on the job: the condition ``ContainersCreated=False``
reason ``ContainerConfigError`` and a Warning Event naming the pod and the Secret, the job
still waiting, not failed. The Secret created and the annotation removed (kwok runs the pods
then), the condition turns True. A ConfigMap the workers reference is checked by the operator
itself: the job waits for it by name and creates no pod until it exists.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from operator_process import OperatorProcess, install_crd

NS = "operator-containers"
POOL = {"adaptis.io/test-pool": "operator-containers"}
SECRET = "hf-token"


def _job(name: str, *, env: list[dict[str, Any]], annotations: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "adaptis.io/v1alpha1", "kind": "AdaPtisJob",
            "metadata": {"name": name, "namespace": NS},
            "spec": {
                "model": {"vocabSize": 512, "hidden": 32, "heads": 2,
                          "blocks": [{"kind": "attention", "count": 4}]},
                "training": {"steps": 2, "microbatches": 4, "sequenceLength": 16},
                "parallelism": {"workers": 2, "gpusPerWorker": 1},
                "worker": {"nodeSelector": dict(POOL), "env": env,
                           "annotations": {"adaptis.io/fake-run-seconds": "3", **annotations}},
            }}


@pytest.fixture(scope="module")
def operator(control_plane: Any, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[OperatorProcess]:
    cp = control_plane
    install_crd(cp)
    cp.create_namespace(NS)
    for i in range(2):
        cp.add_fake_gpu_node(f"containers-h100-{i}", gpu_count=2, zone="containers-zone",
                             rack="rack-c", labels=POOL)
    op = OperatorProcess(cp, tmp_path_factory.mktemp("operator") / "operator.log", namespace=NS)
    op.start()
    try:
        yield op
    finally:
        op.stop()


def _play_kubelet_waiting(op: OperatorProcess, pod: str, *, reason: str, message: str) -> None:
    """What a kubelet writes for a container it cannot create: the pod stays Pending."""
    status = {"status": {
        "phase": "Pending",
        "conditions": [{"type": "PodScheduled", "status": "True"},
                       {"type": "Initialized", "status": "True"},
                       {"type": "Ready", "status": "False", "reason": "ContainersNotReady"},
                       {"type": "ContainersReady", "status": "False",
                        "reason": "ContainersNotReady"}],
        "containerStatuses": [{"name": "worker", "image": "adaptis:test", "imageID": "",
                               "ready": False, "restartCount": 0, "started": False,
                               "state": {"waiting": {"reason": reason, "message": message}}}],
    }}
    op.cp.kubectl("patch", "pod", pod, "-n", NS, "--subresource=status", "--type=merge",
                  "-p", json.dumps(status))


def test_a_missing_secret_is_a_condition_and_a_warning_then_the_job_starts(
        operator: OperatorProcess) -> None:
    name = "no-secret"
    env = [{"name": "HF_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": SECRET, "key": "token"}}}]
    operator.cp.apply(_job(name, env=env, annotations={"adaptis.io/fake-kubelet": "test"}))
    pods = operator.wait("two bound worker pods", lambda: (
        found if len(found := operator.pods(name)) == 2
        and all(p["spec"].get("nodeName") for p in found) else None), timeout=90)
    pod = pods[1]["metadata"]["name"]
    kubelet = f'secret "{SECRET}" not found'
    _play_kubelet_waiting(operator, pod, reason="CreateContainerConfigError", message=kubelet)

    def stuck() -> dict[str, Any] | None:
        cond = operator.condition(name, "ContainersCreated")
        return cond if cond and cond["reason"] == "ContainerConfigError" else None

    cond = operator.wait("ContainersCreated=False reason ContainerConfigError", stuck)
    assert cond["status"] == "False"
    assert cond["message"] == f"{pod}: worker: CreateContainerConfigError: {kubelet}"

    def warning() -> list[dict[str, Any]]:
        return [e for e in operator.events(name)
                if e["type"] == "Warning" and e["reason"] == "ContainerConfigError"]

    (event,) = operator.wait("a Warning Event ContainerConfigError", warning)
    assert pod in event["message"] and f'secret "{SECRET}"' in event["message"]
    status = operator.status(name)
    assert status["phase"] == "Planned", status  # waiting, not failed
    assert status["message"] == f"worker containers cannot start: {cond['message']}"
    assert operator.condition(name, "Failed") is None

    # The user creates the Secret; the kubelet (kwok again) then starts the containers.
    operator.cp.kubectl("create", "secret", "generic", SECRET, "-n", NS,
                        "--from-literal=token=t0ken")
    for p in pods:
        operator.cp.kubectl("annotate", "pod", p["metadata"]["name"], "-n", NS,
                            "adaptis.io/fake-kubelet-")

    def started() -> dict[str, Any] | None:
        c = operator.condition(name, "ContainersCreated")
        return c if c and c["status"] == "True" else None

    assert operator.wait("ContainersCreated=True", started, timeout=90)["reason"] == (
        "ContainersStarted")
    operator.wait("phase Succeeded", operator.phase_is(name, "Succeeded"), timeout=90)
    assert len(warning()) == 1  # once, not on every pass
    operator.cp.kubectl("delete", "adaptisjob", name, "-n", NS, "--wait=false")


def test_a_missing_config_map_holds_the_pods_back_by_name(operator: OperatorProcess) -> None:
    name = "no-config-map"
    env = [{"name": "DATA_URL",
            "valueFrom": {"configMapKeyRef": {"name": "data-source", "key": "url"}}}]
    operator.cp.apply(_job(name, env=env, annotations={}))

    def waiting() -> dict[str, Any] | None:
        cond = operator.condition(name, "ContainersCreated")
        return cond if cond and cond["reason"] == "ConfigMapNotFound" else None

    cond = operator.wait("ContainersCreated=False reason ConfigMapNotFound", waiting)
    assert cond["message"].startswith(
        f"spec.worker.env[0].valueFrom.configMapKeyRef.name: ConfigMap {NS}/data-source does "
        "not exist")
    assert operator.pods(name) == []
    operator.cp.kubectl("create", "configmap", "data-source", "-n", NS,
                        "--from-literal=url=s3://bucket/set")
    # Nothing watches ConfigMaps: the operator looks again after a growing delay (2 s, ...).
    def started() -> dict[str, Any] | None:
        c = operator.condition(name, "ContainersCreated")
        return c if c and c["status"] == "True" else None

    operator.wait("ContainersCreated=True once the ConfigMap exists", started, timeout=90)
    assert len(operator.pods(name)) == 2
    operator.cp.kubectl("delete", "adaptisjob", name, "-n", NS, "--wait=false")
