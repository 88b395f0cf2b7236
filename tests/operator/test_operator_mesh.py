"""The replicas x pipeline mesh on the cluster: rank/pod arithmetic, the planning problem of N
GPUs a pod, the pods' launcher command, environment and ports, and status.placement."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest
from conftest import FakeCluster

from adaptis.api.job import JobSpec, JobStatus, WorkerConfig
from adaptis.api.mesh import Mesh
from adaptis.operator.core.passes import PassState
from adaptis.operator.core.records import JobRef, NodeProfile, PlanRecord
from adaptis.operator.core.settings import DEFAULT_TOPOLOGY_KEYS, ManifestSettings
from adaptis.operator.profiling.nodes import profile_node
from adaptis.operator.resources.manifests import (
    DIST_PORT,
    render_config_map,
    render_pod,
    render_service,
)
from adaptis.operator.resources.status import plan_summary
from adaptis.operator.scheduling.plan_store import PlanStore
from adaptis.operator.scheduling.planning import (
    build_problem,
    choose_slots,
    plan_job,
)
from adaptis.planner.estimate import device_speed

JOB = JobRef(name="demo", namespace="ns", uid="uid-1")
MASTER = "demo-worker-0.demo-workers.ns.svc"


def _spec(make_job: Any, *, workers: int = 4, gpus: int = 2, replicas: int = 2) -> JobSpec:
    return JobSpec.model_validate({**make_job()["spec"], "parallelism": {
        "workers": workers, "gpusPerWorker": gpus, "dataParallel": replicas}})


def _profiles(nodes: list[dict[str, Any]]) -> list[NodeProfile]:
    return [profile_node(n, topology_keys=DEFAULT_TOPOLOGY_KEYS) for n in nodes]


def test_rank_pod_and_replica_arithmetic() -> None:
    mesh = Mesh(pods=4, per_pod=2, replicas=2)
    assert (mesh.world, mesh.pipeline) == (8, 4)
    # Rank 5: pod 2's second GPU, pipeline rank 1 of replica 1.
    assert (mesh.pod(5), mesh.local_rank(5), mesh.replica(5), mesh.pipeline_rank(5)) == (2, 1, 1, 1)
    assert [mesh.rank(replica=1, pipeline_rank=p) for p in range(4)] == [4, 5, 6, 7]
    assert [mesh.pod(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(ValueError, match="dataParallel: 3 replicas do not divide 8 ranks"):
        Mesh(pods=4, per_pod=2, replicas=3)


def test_the_problem_has_one_replicas_ranks_of_one_gpu_each(make_node: Any,
                                                            make_job: Any) -> None:
    # Two 4-GPU nodes, 4 pods of 2 GPUs: replica 0 (ranks 0-3) fills pods 0-1 on one node,
    # replica 1 pods 2-3 on the other.
    nodes = _profiles([make_node("n0", gpus=4), make_node("n1", gpus=4)])
    spec = _spec(make_job)
    slots = choose_slots(nodes, spec=spec)
    assert [s.node.name for s in slots] == ["n0", "n0", "n1", "n1"]
    problem = build_problem(spec, slots, name="ns/demo")
    devices = problem.device_specs()
    assert len(devices) == 4 and problem.data_parallel == 2
    one_gpu = device_speed(nodes[0].gpu_tflops)
    assert all(d.speed == pytest.approx(one_gpu) for d in devices)
    headroom = 1 - spec.planner.memory_headroom
    assert all(d.memory_bytes == pytest.approx(81559 * 2**20 * headroom) for d in devices)
    # Every pipeline position sits on n0 in replica 0 and n1 in replica 1: all share the
    # intra-node link, and the replicas reduce over the inter-node one.
    assert {d.node for d in devices} == {"n0|n1"}
    assert problem.network.data_parallel == problem.network.inter_node


def test_replicas_on_one_node_reduce_over_the_intra_node_link(make_node: Any,
                                                              make_job: Any) -> None:
    nodes = _profiles([make_node("n0", gpus=8)])
    spec = _spec(make_job, workers=2, gpus=4, replicas=2)
    problem = build_problem(spec, choose_slots(nodes, spec=spec), name="ns/demo")
    assert problem.device_count == 4
    assert problem.network.data_parallel == problem.network.intra_node
    # Without replicas there is no replica link at all.
    single = _spec(make_job, workers=2, gpus=2, replicas=1)
    problem = build_problem(single, choose_slots(nodes, spec=single), name="ns/demo")
    assert problem.data_parallel == 1 and problem.network.data_parallel is None


def test_heterogeneous_replicas_plan_on_the_slowest_gpu_of_each_position(make_node: Any,
                                                                         make_job: Any) -> None:
    # Replica 0 on the faster node: planning on it alone would overrate replica 1.
    nodes = _profiles([make_node("a-h100", gpus=4),
                       make_node("b-a100", product="NVIDIA-A100-SXM4-40GB", gpus=4,
                                 memory_mib=40960)])
    spec = _spec(make_job)
    slots = choose_slots(nodes, spec=spec)
    assert [s.node.name for s in slots] == ["a-h100", "a-h100", "b-a100", "b-a100"]
    devices = build_problem(spec, slots, name="ns/demo").device_specs()
    slow = min(s.speed for s in slots)
    assert slow < max(s.speed for s in slots)
    assert [d.speed for d in devices] == pytest.approx([slow] * 4)
    assert [d.memory_bytes for d in devices] == pytest.approx(
        [min(s.memory_bytes or 0 for s in slots)] * 4)


@pytest.fixture
def mesh_record(make_node: Any, make_job: Any) -> tuple[JobSpec, PlanRecord]:
    nodes = _profiles([make_node("n0", gpus=4), make_node("n1", gpus=4)])
    spec = _spec(make_job)
    return spec, plan_job(spec, nodes, name="ns/demo")


def test_the_record_and_worker_config_carry_the_mesh(
        mesh_record: tuple[JobSpec, PlanRecord]) -> None:
    spec, record = mesh_record
    assert (len(record.nodes), record.ranks_per_pod, record.data_parallel) == (4, 2, 2)
    assert len(record.plan.placement) == 4  # the plan: one replica's 4 pipeline ranks
    assert record.predicted_step_seconds is not None
    assert record.predicted_step_seconds > record.predicted_iteration_seconds
    cm = render_config_map(JOB, spec, record=record)
    config = WorkerConfig.model_validate_json(cm["data"]["worker.json"])
    assert config.data_parallel == 2
    store = PlanStore(FakeCluster(), namespace="ops")
    store.write(JOB, record=record, worker_data=cm["data"])
    stored = store.read(PassState(job=JOB, status=JobStatus(), now=datetime.now(UTC)), spec=spec)
    assert stored is not None and stored.record == record  # the mesh survives a restart


def test_a_pod_of_two_gpus_runs_two_ranks_under_torchrun(
        mesh_record: tuple[JobSpec, PlanRecord]) -> None:
    spec, record = mesh_record
    pod = render_pod(JOB, spec, record=record, rank=3, attempt=0, settings=ManifestSettings())
    (container,) = pod["spec"]["containers"]
    assert container["command"] == [
        "python", "-m", "torch.distributed.run", "--nnodes", "4", "--nproc-per-node", "2",
        "--node-rank", "3", "--master-addr", MASTER, "--master-port", str(DIST_PORT),
        "--max-restarts", "0", "--module", "adaptis", "worker", "--config",
        "/etc/adaptis/worker.json"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    # torchrun gives each rank RANK, LOCAL_RANK and WORLD_SIZE: the pod must not pin them.
    assert not {"RANK", "LOCAL_RANK", "WORLD_SIZE"} & set(env)
    assert env["ADAPTIS_JOB"] == "demo"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"dist": DIST_PORT, "metrics": 9400, "metrics-1": 9401}
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    required = pod["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]
    assert required["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == [
        record.hostnames[3]]
    service_ports = {p["name"]: p["port"] for p in render_service(JOB, spec)["spec"]["ports"]}
    assert service_ports == {"dist": DIST_PORT, "metrics": 9400, "metrics-1": 9401}


def test_a_pod_of_one_gpu_runs_the_worker_itself(make_node: Any, make_job: Any) -> None:
    nodes = _profiles([make_node("n0", gpus=4)])
    spec = _spec(make_job, workers=4, gpus=1, replicas=2)
    record = plan_job(spec, nodes, name="ns/demo")
    pod = render_pod(JOB, spec, record=record, rank=3, attempt=0, settings=ManifestSettings())
    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["adaptis", "worker", "--config", "/etc/adaptis/worker.json"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("3", "4", "0")
    assert env["MASTER_ADDR"] == MASTER
    assert [p["name"] for p in container["ports"]] == ["dist", "metrics"]


def test_status_placement_lists_every_rank_of_every_replica(
        mesh_record: tuple[JobSpec, PlanRecord]) -> None:
    _, record = mesh_record
    placement = plan_summary(record, job="demo")["placement"]
    assert [(a.rank, a.replica, a.pod) for a in placement] == [
        (r, r // 4, f"demo-worker-{r // 2}") for r in range(8)]
    assert [a.node for a in placement] == [record.nodes[r // 2] for r in range(8)]
    # Rank r holds its pipeline rank's stages: replica 1 repeats replica 0.
    assert [a.stages for a in placement] == [list(record.plan.placement[r % 4]) for r in range(8)]
    assert json.dumps([a.model_dump() for a in placement])  # plain data for the status patch


def test_a_record_of_other_ranks_per_pod_or_hostnames_is_planned_again(
        make_node: Any, mesh_record: tuple[JobSpec, PlanRecord]) -> None:
    _, record = mesh_record
    by_name = {p.name: p for p in _profiles([make_node("n0", gpus=4), make_node("n1", gpus=4)])}
    assert record.still_valid(spec_hash_now=record.spec_hash, candidates=by_name, ranks_per_pod=2)
    assert not record.still_valid(spec_hash_now=record.spec_hash, candidates=by_name,
                                  ranks_per_pod=1)
    # A hostname the planned node does not have would pin its pod elsewhere.
    moved = record.model_copy(update={"hostnames": ["elsewhere", *record.hostnames[1:]]})
    assert not moved.still_valid(spec_hash_now=record.spec_hash, candidates=by_name,
                                 ranks_per_pod=2)


def test_a_tensor_parallel_job_plans_its_positions_and_names_each_ranks_shard(
        make_node: Any, make_job: Any) -> None:
    """4 pods of 2 GPUs with tensorParallel 2 and 2 replicas: the plan has 2 devices (each a
    pod's tensor group), the worker config and the stored record carry T, and status.placement
    gives every rank its replica, stages and tensor rank, the two ranks of a group in one pod."""
    nodes = _profiles([make_node("n0", gpus=4), make_node("n1", gpus=4)])
    spec = JobSpec.model_validate({**make_job()["spec"], "parallelism": {
        "workers": 4, "gpusPerWorker": 2, "dataParallel": 2, "tensorParallel": 2}})
    record = plan_job(spec, nodes, name="ns/demo")
    assert (record.data_parallel, record.tensor_parallel, len(record.plan.placement)) == (2, 2, 2)
    problem = build_problem(spec, choose_slots(nodes, spec=spec), name="ns/demo")
    assert (problem.tensor_parallel, problem.device_count) == (2, 2)
    config = WorkerConfig.model_validate_json(render_config_map(JOB, spec, record=record)["data"]["worker.json"])
    assert (config.data_parallel, config.tensor_parallel) == (2, 2)
    store = PlanStore(FakeCluster(), namespace="ops")
    store.write(JOB, record=record, worker_data=render_config_map(JOB, spec, record=record)["data"])
    stored = store.read(PassState(job=JOB, status=JobStatus(), now=datetime.now(UTC)), spec=spec)
    assert stored is not None and stored.record.tensor_parallel == 2
    placement = plan_summary(record, job="demo")["placement"]
    assert [(a.rank, a.replica, a.tensor_rank, a.pod) for a in placement] == [
        (r, r // 4, r % 2, f"demo-worker-{r // 2}") for r in range(8)]
    assert [a.stages for a in placement] == [list(record.plan.placement[(r // 2) % 2]) for r in range(8)]
