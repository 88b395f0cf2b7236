"""A data-parallel job of several GPUs a pod on the real control plane (kwok fake nodes: the
pods are scheduled and bound, no container runs).

dataParallel 2 x gpusPerWorker 2 x workers 4: 8 ranks, 2 replicas of a 4-rank pipeline, in 4
pods of 2 GPUs. Checks the pods the operator creates (torchrun command, environment, ports,
the node the plan pins each to), the GPUs they hold, the ConfigMap's data_parallel and
status.placement listing all 8 ranks with replica and pod.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from operator_process import OperatorProcess, install_crd

NS = "mesh"
POOL = {"adaptis.io/test-pool": "mesh"}


@pytest.fixture(scope="module")
def operator(control_plane: Any, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[OperatorProcess]:
    cp = control_plane
    install_crd(cp)
    cp.create_namespace(NS)
    op = OperatorProcess(cp, tmp_path_factory.mktemp("mesh") / "operator.log", namespace=NS)
    op.start()
    try:
        yield op
    finally:
        op.stop()


def test_two_replicas_of_two_gpu_pods_get_the_right_pods_env_and_placement(
        operator: OperatorProcess) -> None:
    cp = operator.cp
    for i in range(2):
        cp.add_fake_gpu_node(f"mesh-{i}", gpu_count=4, zone="mesh-zone", labels=POOL)
    name = "dp"
    cp.apply({"apiVersion": "adaptis.io/v1alpha1", "kind": "AdaPtisJob",
              "metadata": {"name": name, "namespace": NS},
              "spec": {"model": {"vocabSize": 512, "hidden": 32, "heads": 2,
                                 "blocks": [{"kind": "attention", "count": 4}]},
                       "training": {"steps": 2, "microbatches": 4, "sequenceLength": 16},
                       "parallelism": {"workers": 4, "gpusPerWorker": 2, "dataParallel": 2},
                       "planner": {"strategy": "1f1b"},
                       "worker": {"nodeSelector": POOL,
                                  "annotations": {"adaptis.io/fake-run-seconds": "600"}}}})
    operator.wait("phase Running", operator.phase_is(name, "Running"), timeout=120)
    pods = sorted(operator.pods(name),
                  key=lambda p: int(p["metadata"]["labels"]["adaptis.io/rank"]))
    assert [p["metadata"]["name"] for p in pods] == [f"{name}-worker-{w}" for w in range(4)]
    master = f"{name}-worker-0.{name}-workers.{NS}.svc"
    for w, pod in enumerate(pods):
        (container,) = pod["spec"]["containers"]
        cmd = container["command"]
        assert cmd[:3] == ["python", "-m", "torch.distributed.run"], cmd
        args = dict(zip(cmd[3:15:2], cmd[4:16:2], strict=True))
        assert args == {"--nnodes": "4", "--nproc-per-node": "2", "--node-rank": str(w),
                        "--master-addr": master, "--master-port": "29500",
                        "--max-restarts": "0"}, cmd
        assert cmd[15:] == ["--module", "adaptis", "worker", "--config",
                            "/etc/adaptis/worker.json"]
        env = {e["name"] for e in container["env"]}
        assert not {"RANK", "LOCAL_RANK", "WORLD_SIZE"} & env
        assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
            "dist": 29500, "metrics": 9400, "metrics-1": 9401}
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    # Pods 0-1 on one node, 2-3 on the other: each 4-GPU node is full.
    bound = [p["spec"]["nodeName"] for p in pods]
    assert bound[0] == bound[1] != bound[2] == bound[3], bound
    config = json.loads(cp.kubectl("get", "configmap", f"{name}-config", "-n", NS, "-o",
                                   "jsonpath={.data.worker\\.json}").stdout)
    assert config["dataParallel"] == 2
    status = operator.status(name)
    placement = status["placement"]
    assert [(a["rank"], a["replica"], a["pod"]) for a in placement] == [
        (r, r // 4, f"{name}-worker-{r // 2}") for r in range(8)]
    assert [a["node"] for a in placement] == [bound[r // 2] for r in range(8)]
    assert status["predictedStepSeconds"] >= status["predictedIterationSeconds"]
    cp.kubectl("delete", "apj", name, "-n", NS, "--wait=false")
