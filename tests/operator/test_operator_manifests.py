"""The rendered children: ConfigMap (worker.json), headless Service, one pod per rank."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest
from conftest import FakeCluster
from plan_kit import split_backward_plan

from adaptis.api.job import JobSpec, JobStatus, WorkerConfig
from adaptis.api.plan import Plan
from adaptis.operator.core.passes import PassState
from adaptis.operator.core.records import JobRef, PlanRecord
from adaptis.operator.core.settings import DEFAULT_TOPOLOGY_KEYS, ManifestSettings
from adaptis.operator.profiling.nodes import profile_node
from adaptis.operator.resources.manifests import (
    is_current_pod,
    plan_hash,
    render_config_map,
    render_pod,
    render_service,
)
from adaptis.operator.scheduling.plan_store import PlanStore
from adaptis.operator.scheduling.planning import plan_job

JOB = JobRef(name="demo", namespace="ns", uid="uid-1")


def _pass() -> PassState:
    return PassState(job=JOB, status=JobStatus(), now=datetime.now(UTC))


@pytest.fixture
def planned(make_node: Any, make_job: Any) -> tuple[JobSpec, PlanRecord]:
    spec = JobSpec.model_validate({
        **make_job()["spec"],
        "worker": {"image": "img:1", "env": [{"name": "FOO", "value": "bar"}],
                   "annotations": {"adaptis.io/fake-run-seconds": "2"},
                   "tolerations": [{"key": "x", "operator": "Exists"}],
                   "volumes": [{"name": "data", "emptyDir": {}}],
                   "volumeMounts": [{"name": "data", "mountPath": "/data"}]},
        "queueName": "team-a",
    })
    nodes = [profile_node(make_node(n, gpus=2), topology_keys=DEFAULT_TOPOLOGY_KEYS)
             for n in ("gpu-a", "gpu-b")]
    return spec, plan_job(spec, nodes, name="ns/demo")


def test_config_map_carries_the_worker_config_and_the_plan(
        planned: tuple[JobSpec, PlanRecord]) -> None:
    spec, record = planned
    cm = render_config_map(JOB, spec, record=record)
    assert cm["metadata"]["name"] == "demo-config"
    assert cm["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    config = WorkerConfig.model_validate_json(cm["data"]["worker.json"])
    assert config.job_name == "demo" and config.model == spec.model
    plan = Plan.model_validate(config.plan)
    assert plan.stages == record.plan.stages and config.metrics_port == 9400
    # The job's ConfigMap is the workers' only: the operator's record lives in its own
    # namespace (plan_store), the plan is packed.
    assert set(cm["data"]) == {"worker.json"}
    assert "actionsPacked" in json.loads(cm["data"]["worker.json"])["plan"]


def test_headless_service_selects_the_gang(planned: tuple[JobSpec, PlanRecord]) -> None:
    spec, _ = planned
    svc = render_service(JOB, spec)
    assert svc["metadata"]["name"] == "demo-workers"
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    assert svc["spec"]["selector"] == {"app.kubernetes.io/managed-by": "adaptis",
                                       "adaptis.io/job": "demo"}


def test_pod_of_a_rank(planned: tuple[JobSpec, PlanRecord]) -> None:
    spec, record = planned
    pod = render_pod(JOB, spec, record=record, rank=3, attempt=2, settings=ManifestSettings())
    meta, ps = pod["metadata"], pod["spec"]
    assert meta["name"] == "demo-worker-3"
    assert meta["labels"]["app.kubernetes.io/managed-by"] == "adaptis"
    assert meta["labels"]["adaptis.io/rank"] == "3"
    assert meta["labels"]["kueue.x-k8s.io/pod-group-name"] == "demo-a2"  # attempt 2
    assert meta["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert meta["annotations"]["kueue.x-k8s.io/pod-group-total-count"] == "4"
    assert meta["annotations"]["prometheus.io/scrape"] == "true"
    assert meta["annotations"]["adaptis.io/fake-run-seconds"] == "2"
    assert meta["ownerReferences"][0]["controller"] is True
    term = ps["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    expr = term["nodeSelectorTerms"][0]["matchExpressions"][0]
    assert expr == {"key": "kubernetes.io/hostname", "operator": "In",
                    "values": [record.hostnames[3]]}
    assert ps["automountServiceAccountToken"] is False and ps["restartPolicy"] == "Never"
    assert (ps["hostname"], ps["subdomain"]) == ("demo-worker-3", "demo-workers")
    (c,) = ps["containers"]
    assert c["image"] == "img:1"
    assert c["command"] == ["adaptis", "worker", "--config", "/etc/adaptis/worker.json"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["RANK"] == "3" and env["WORLD_SIZE"] == "4" and env["FOO"] == "bar"
    assert env["MASTER_ADDR"] == "demo-worker-0.demo-workers.ns.svc"
    assert env["MASTER_PORT"] == "29500"
    assert {"name": "metrics", "containerPort": 9400, "protocol": "TCP"} in c["ports"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts == {"adaptis-config": "/etc/adaptis", "checkpoints": "/checkpoints",
                      "adaptis-tmp": "/tmp", "adaptis-home": "/home/adaptis", "dshm": "/dev/shm",
                      "data": "/data"}
    tolerations = [t["key"] for t in ps["tolerations"]]
    assert tolerations == ["x", "nvidia.com/gpu"]
    assert is_current_pod(pod, plan=plan_hash(record), attempt=2)
    assert not is_current_pod(pod, plan=plan_hash(record), attempt=3)
    # Rendering is deterministic: the same inputs give byte-identical pods.
    again = render_pod(JOB, spec, record=record, rank=3, attempt=2, settings=ManifestSettings())
    assert json.dumps(again, sort_keys=True) == json.dumps(pod, sort_keys=True)


def test_cpu_workers_request_no_gpu(planned: tuple[JobSpec, PlanRecord]) -> None:
    spec, record = planned
    cpu = spec.model_copy(update={"parallelism": spec.parallelism.model_copy(
        update={"gpus_per_worker": 0})})
    pod = render_pod(JOB, cpu, record=record, rank=0, attempt=0,
                     settings=ManifestSettings(image="default:2"))
    c = pod["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in json.dumps(c["resources"])
    assert c["image"] == "img:1"


def _large_record() -> tuple[JobSpec, PlanRecord]:
    """A 64-rank x 4096-microbatch split-backward plan (786,432 actions) and its job."""
    spec = JobSpec.model_validate({
        "model": {"vocabSize": 32000, "hidden": 256, "heads": 4,
                  "blocks": [{"kind": "attention", "count": 62}]},
        "training": {"steps": 4, "microbatches": 4096},
        "parallelism": {"workers": 64, "gpusPerWorker": 1},
        "planner": {"strategy": "zb-h1"},
    })
    nodes = [f"gpu-{r // 8}" for r in range(64)]
    record = PlanRecord(spec_hash="0" * 16, plan=split_backward_plan(devices=64, microbatches=4096),
                        nodes=nodes, hostnames=nodes, gpus=["NVIDIA-H100-80GB-HBM3"] * 64,
                        node_fingerprints=dict.fromkeys(nodes, "fp"), strategy="zb-h1",
                        predicted_iteration_seconds=1.0, predicted_bubble_ratio=0.01)
    return spec, record


def test_a_64_rank_4096_microbatch_plan_fits_its_config_map_and_round_trips() -> None:
    from adaptis.operator.resources.manifests import CONFIG_MAP_LIMIT_BYTES
    from adaptis.worker.runtime.executor import parse_plan

    spec, record = _large_record()
    cm = render_config_map(JOB, spec, record=record)
    size = sum(len(k) + len(v.encode()) for k, v in cm["data"].items())
    # Plain JSON the plan alone is ~11 MB; packed the whole ConfigMap is a small share of 1 MiB.
    assert size < CONFIG_MAP_LIMIT_BYTES // 8, size
    store = PlanStore(FakeCluster(), namespace="ops")
    store.write(JOB, record=record, worker_data=cm["data"])
    stored = store.read(_pass(), spec=spec)  # the operator's record, within the job's limits
    assert stored is not None and stored.record == record
    config = WorkerConfig.model_validate_json(cm["data"]["worker.json"])  # the worker's read
    assert parse_plan(config, world_size=64) == record.plan


def test_a_plan_too_large_even_packed_names_the_fields_to_shrink(
        monkeypatch: pytest.MonkeyPatch, planned: tuple[JobSpec, PlanRecord]) -> None:
    from adaptis.operator.core.errors import PlanTooLarge
    from adaptis.operator.resources import manifests

    spec, record = planned
    monkeypatch.setattr(manifests, "CONFIG_MAP_LIMIT_BYTES", 1000)
    with pytest.raises(PlanTooLarge, match=r"^spec\.training\.microbatches, "
                       r"spec\.parallelism\.workers: .* over the API server's 1000"):
        render_config_map(JOB, spec, record=record)


def _shm(pod: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    volumes = [v for v in pod["spec"]["volumes"] if v["name"] == "dshm"]
    mounts = [m for m in pod["spec"]["containers"][0]["volumeMounts"]
              if m["mountPath"] == "/dev/shm"]
    assert len(volumes) == 1, pod["spec"]["volumes"]
    return volumes[0], mounts


def test_every_worker_pod_has_a_memory_backed_dev_shm(
        planned: tuple[JobSpec, PlanRecord]) -> None:
    # The runtime's 64 MiB /dev/shm breaks NCCL's shared-memory transport and DataLoader
    # workers; with no memory limit the tmpfs is bounded by the pod's memory, not a size.
    spec, record = planned
    pod = render_pod(JOB, spec, record=record, rank=0, attempt=0, settings=ManifestSettings())
    volume, mounts = _shm(pod)
    assert volume["emptyDir"] == {"medium": "Memory"}
    assert mounts == [{"name": "dshm", "mountPath": "/dev/shm"}]


def test_dev_shm_is_sized_by_the_containers_memory_limit(
        planned: tuple[JobSpec, PlanRecord]) -> None:
    spec, record = planned
    sized = spec.model_copy(update={"worker": spec.worker.model_copy(
        update={"resources": {"limits": {"memory": "48Gi"}}})})
    pod = render_pod(JOB, sized, record=record, rank=1, attempt=0, settings=ManifestSettings())
    volume, _ = _shm(pod)
    assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": "48Gi"}


def test_nccl_settings_reach_the_worker_container_unchanged(
        planned: tuple[JobSpec, PlanRecord]) -> None:
    spec, record = planned
    nccl = [{"name": "NCCL_SOCKET_IFNAME", "value": "eth0"},
            {"name": "NCCL_IB_HCA", "value": "mlx5_0,mlx5_1"},
            {"name": "NCCL_DEBUG", "value": "WARN"}]
    tuned = spec.model_copy(update={"worker": spec.worker.model_copy(update={"env": nccl})})
    pod = render_pod(JOB, tuned, record=record, rank=0, attempt=0, settings=ManifestSettings())
    assert pod["spec"]["containers"][0]["env"][-3:] == nccl


def test_rdma_resources_reach_the_worker_container_beside_the_gpus(
        planned: tuple[JobSpec, PlanRecord]) -> None:
    spec, record = planned
    rdma = spec.model_copy(update={"worker": spec.worker.model_copy(
        update={"resources": {"limits": {"rdma/hca": 1}, "requests": {"rdma/hca": 1}}})})
    pod = render_pod(JOB, rdma, record=record, rank=0, attempt=0, settings=ManifestSettings())
    limits = pod["spec"]["containers"][0]["resources"]["limits"]
    assert limits["rdma/hca"] == 1 and limits["nvidia.com/gpu"] == "1"
