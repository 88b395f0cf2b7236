"""Profiler pods of ``spec.planner.profile: measure``: rendering, reading, and the reconciler's use.

The pure functions first (which nodes need a pod, what the pod looks like, what a termination
message means), then the reconciler on the in-memory API: profile, cache on the node, plan
with the measured figures, clean up; a failed or stuck profiler, or a document outside the
schema, falls back to the estimate; what a tenant can write changes no plan. The real API
server, scheduler and kwok run the same flow in
tests/integration/test_operator_measured_profiling.py.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest
from plan_kit import stored_record

from adaptis.operator.control.reconcile import Reconciler
from adaptis.operator.core.conditions import now_rfc3339
from adaptis.operator.core.labels import LABEL_JOB, LABEL_MANAGED_BY
from adaptis.operator.core.records import JobRef
from adaptis.operator.core.settings import DEFAULT_TOPOLOGY_KEYS, ReconcileSettings
from adaptis.operator.profiling.nodes import PROFILE_ANNOTATION, profile_node
from adaptis.operator.profiling.profile_store import (
    hardware_fingerprint,
    measured_figures,
    profile_config_map_name,
    profile_selector,
    read_stored_profiles,
    render_profile_config_map,
)
from adaptis.operator.profiling.profiler_pods import (
    LABEL_JOB_NAMESPACE,
    LABEL_ROLE,
    PROFILER_COMMAND,
    ProfilerOutputError,
    nodes_to_profile,
    parse_hardware_message,
    profiler_pod_name,
    read_profiler_pod,
    render_profiler_pod,
)

JOB = JobRef(name="demo", namespace="ns", uid="uid-demo")
# What `adaptis profile --hardware` prints (adaptis/worker/profiling/hardware.py), trimmed.
DOC = {"device": {"name": "NVIDIA H100", "speed": 0.81, "memory_bytes": 85899345920.0,
                  "matmul_tflops": 800.0, "precision": "bfloat16",
                  "speed_reference_tflops": 989.0},
       "links": {}, "tflops": 800.0, "memory_bytes": 85899345920.0,
       "intra_node_bandwidth": 4.0e11}
PROFILE_NS = ReconcileSettings().profile_namespace
T0 = datetime(2026, 1, 1, tzinfo=UTC)
UID = {"run_as_user": 10001, "run_as_group": 10001}


def _profile(node: dict[str, Any]) -> Any:
    return profile_node(node, topology_keys=DEFAULT_TOPOLOGY_KEYS)


def _pod(phase: str, *, message: str | None = None, created: datetime = T0,
         exit_code: int | None = None, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "demo-profiler-x", "creationTimestamp": now_rfc3339(created),
                            "annotations": {"adaptis.io/node": "h100-0"}}
    if deleting:
        meta["deletionTimestamp"] = now_rfc3339(created)
    status: dict[str, Any] = {"phase": phase}
    if message is not None or exit_code is not None:
        term: dict[str, Any] = {"reason": "Completed" if phase == "Succeeded" else "Error"}
        if message is not None:
            term["message"] = message
        if exit_code is not None:
            term["exitCode"] = exit_code
        status["containerStatuses"] = [{"name": "profiler", "state": {"terminated": term}}]
    return {"metadata": meta, "status": status}


# --- pure functions ------------------------------------------------------------------------

def test_only_unmeasured_nodes_not_given_up_need_a_profiler(make_node: Any) -> None:
    cached = profile_node(make_node("cached"), topology_keys=DEFAULT_TOPOLOGY_KEYS,
                          measured={"tflops": 800.0, "memory_bytes": 8e10})
    nodes = [_profile(make_node("fresh")), cached, _profile(make_node("broken"))]
    need = nodes_to_profile(nodes, given_up={"broken"})
    assert [n.name for n in need] == ["fresh"]


def test_profiler_pod_is_pinned_owned_and_runs_the_hardware_profiler(make_node: Any) -> None:
    node = _profile(make_node("gpu-node-with-a-long-name", gpus=8))
    tol = {"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}
    pod = render_profiler_pod(JOB, node, namespace="ops", image="img:1",
                              image_pull_policy="Always", tolerations=[tol], timeout_s=120, **UID)
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["name"] == profiler_pod_name(JOB, "gpu-node-with-a-long-name")
    assert meta["name"] == render_profiler_pod(
        JOB, node, namespace="ops", image="other", image_pull_policy="Never", tolerations=[],
        timeout_s=1, **UID)["metadata"]["name"]
    assert meta["name"] != profiler_pod_name(JOB, "another-node")
    # The same job name in another namespace gets its own pod in the operator's namespace.
    assert meta["name"] != profiler_pod_name(JobRef(name="demo", namespace="other", uid="u"),
                                             "gpu-node-with-a-long-name")
    # In the operator's namespace, found by labels (an owner cannot be in another namespace).
    assert meta["namespace"] == "ops" and "ownerReferences" not in meta
    assert meta["labels"] == {LABEL_MANAGED_BY: "adaptis", LABEL_JOB: "demo",
                              LABEL_JOB_NAMESPACE: "ns", LABEL_ROLE: "profiler"}
    assert meta["annotations"]["adaptis.io/node"] == "gpu-node-with-a-long-name"
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"] == [{"matchExpressions": [{
        "key": "kubernetes.io/hostname", "operator": "In",
        "values": ["gpu-node-with-a-long-name"]}]}]
    assert spec["restartPolicy"] == "Never"
    assert spec["automountServiceAccountToken"] is False
    assert spec["activeDeadlineSeconds"] == 120
    assert tol in spec["tolerations"]
    (container,) = spec["containers"]
    assert container["command"] == list(PROFILER_COMMAND)
    assert container["command"][-2:] == ["-o", container["terminationMessagePath"]]
    assert container["terminationMessagePath"] == "/dev/termination-log"
    assert container["image"] == "img:1" and container["imagePullPolicy"] == "Always"
    assert container["resources"]["requests"] == {"nvidia.com/gpu": "1"}
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "1"}


def test_profiler_pod_of_a_cpu_node_asks_for_no_gpu(make_node: Any) -> None:
    raw = make_node("cpu-node", gpus=0)
    raw["status"]["allocatable"].pop("nvidia.com/gpu")
    raw["metadata"]["labels"]["nvidia.com/gpu.count"] = "0"
    pod = render_profiler_pod(JOB, _profile(raw), namespace="ops", image="img",
                              image_pull_policy="IfNotPresent", tolerations=[], timeout_s=60,
                              **UID)
    assert pod["spec"]["containers"][0]["resources"] == {}
    assert "tolerations" not in pod["spec"]


def test_hardware_message_is_kept_whole_and_compact() -> None:
    text = json.dumps(DOC, indent=2) + "\n"
    assert json.loads(parse_hardware_message(text)) == DOC
    assert "\n" not in parse_hardware_message(text)


@pytest.mark.parametrize(("text", "needle"), [
    ("Traceback (most recent call last): boom", "not JSON"),
    ("[1, 2]", "not a JSON object"),
    (json.dumps({"memory_bytes": 1e9}), "tflops"),
    (json.dumps({"tflops": 0, "memory_bytes": 1e9}), "tflops"),
    (json.dumps({"tflops": True, "memory_bytes": 1e9}), "tflops"),
    (json.dumps({"tflops": 5.0, "memory_bytes": "80Gi"}), "memory_bytes"),
    (json.dumps({"tflops": 5.0, "memory_bytes": 1e9, "intra_node_bandwidth": -1}),
     "intra_node_bandwidth"),
    # The strict schema: no unknown key at any level, every figure within bounds.
    (json.dumps({**DOC, "nodeSelector": {"x": "y"}}), "nodeSelector: unknown key"),
    (json.dumps({**DOC, "device": {**DOC["device"], "vendor": "x"}}), "device.vendor"),
    (json.dumps({**DOC, "tflops": 1e9}), "tflops: Input should be less than or equal"),
    (json.dumps({**DOC, "memory_bytes": 1e18}), "memory_bytes"),
    (json.dumps({**DOC, "intra_node_bandwidth": 1e15}), "intra_node_bandwidth"),
    (json.dumps({**DOC, "links": {"cross_tenant": {"bandwidth_bytes_per_s": 1.0,
                                                   "latency_s": 0.0}}}), "links"),
    ('{"tflops": NaN, "memory_bytes": 1e9}', "tflops"),
    (json.dumps({**DOC, "device": {**DOC["device"], "name": "x" * 5000}}), "characters"),
])
def test_unusable_messages_are_refused_with_the_reason(text: str, needle: str) -> None:
    with pytest.raises(ProfilerOutputError, match=needle):
        parse_hardware_message(text)


def test_reading_profiler_pods() -> None:
    done = read_profiler_pod(_pod("Succeeded", message=json.dumps(DOC)), now=T0, timeout_s=60)
    assert done.state == "measured" and done.node == "h100-0"
    assert json.loads(done.profile or "") == DOC
    garbled = read_profiler_pod(_pod("Succeeded", message="oops"), now=T0, timeout_s=60)
    assert garbled.state == "failed" and "no usable profile" in garbled.reason
    crashed = read_profiler_pod(_pod("Failed", message="CUDA error: no device", exit_code=1),
                                now=T0, timeout_s=60)
    assert crashed.state == "failed"
    assert "exit code 1" in crashed.reason and "CUDA error" in crashed.reason
    running = read_profiler_pod(_pod("Running"), now=T0.replace(second=59), timeout_s=60)
    assert running.state == "waiting"
    late = read_profiler_pod(_pod("Pending"), now=T0.replace(minute=1), timeout_s=60)
    assert late.state == "failed" and "within 60s" in late.reason and "Pending" in late.reason
    leaving = read_profiler_pod(_pod("Failed", deleting=True), now=T0, timeout_s=60)
    assert leaving.state == "waiting"


# --- the reconciler --------------------------------------------------------------------------

class MeasuringCluster:
    """The conftest's in-memory API plus the creationTimestamp the API server stamps on every
    object (the profiler timeout counts from it)."""

    def __init__(self, inner: Any, clock: Any) -> None:
        self._inner = inner
        self._clock = clock

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def create(self, obj: Any) -> bool:
        stamped = {**obj, "metadata": {**obj["metadata"],
                                       "creationTimestamp": now_rfc3339(self._clock())}}
        return bool(self._inner.create(stamped))


def _measure_job(make_job: Any, name: str = "demo") -> dict[str, Any]:
    return make_job(name, spec={"planner": {"strategy": "1f1b", "profile": "measure"},
                                "worker": {"image": "tenant/own:1", "imagePullPolicy": "Never",
                                           "nodeSelector": {"topology.kubernetes.io/zone":
                                                            "zone-a"}}})


def _profilers(cluster: Any) -> list[dict[str, Any]]:
    return [p for p in cluster.pods() if p["metadata"]["labels"].get(LABEL_ROLE) == "profiler"]


def _cond(job: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in job["status"]["conditions"] if c["type"] == type_)


def _finish(cluster: Any, pod: dict[str, Any], *, message: str) -> None:
    cluster.set_pod_phase(pod["metadata"]["name"], "Succeeded", ready=False, message=message,
                          ns=pod["metadata"]["namespace"])


def _node_of(pod: dict[str, Any]) -> str:
    return str(pod["metadata"]["annotations"]["adaptis.io/node"])


def _stored(cluster: Any, node: str) -> dict[str, Any]:
    cm = cluster.objects[("ConfigMap", PROFILE_NS, profile_config_map_name(node))]
    return {k: json.loads(v) for k, v in cm["data"].items()}


def _profile_config_maps(cluster: Any) -> list[str]:
    return [cm["metadata"]["name"]
            for cm in cluster.list_config_maps(PROFILE_NS, selector=profile_selector())]


def _planned_tflops(cluster: Any, job: str, ns: str = "ns") -> dict[str, float]:
    record = stored_record(cluster, job=job, namespace=ns, operator_namespace=PROFILE_NS)
    assert record is not None
    return {n: json.loads(fp)[5] for n, fp in record.node_fingerprints.items()}


def test_measure_profiles_stores_plans_and_cleans_up(cluster: Any, clock: Any,
                                                     make_job: Any) -> None:
    api = MeasuringCluster(cluster, clock)
    cluster.add_job(_measure_job(make_job))
    rec = Reconciler(api, clock=clock, settings=ReconcileSettings(profiler_image="admin/prof:1"))
    result = rec.reconcile("ns", "demo")
    assert result.requeue_after is not None and result.requeue_after <= 5  # polls its pods
    job = cluster.job()
    assert job["status"]["phase"] == "Profiling"
    assert _cond(job, "Profiling")["reason"] == "MeasuringNodes"
    pods = _profilers(cluster)
    assert sorted(_node_of(p) for p in pods) == ["h100-0", "h100-1"]  # the candidates of zone-a
    for pod in pods:  # in the operator's namespace, running the admin's image, not the job's
        assert pod["metadata"]["namespace"] == PROFILE_NS
        (container,) = pod["spec"]["containers"]
        assert (container["image"], container["imagePullPolicy"]) == ("admin/prof:1",
                                                                      "IfNotPresent")
    assert not [p for p in cluster.pods() if p not in pods]  # no worker before a plan
    rec.reconcile("ns", "demo")  # nothing finished: still waiting, nothing duplicated
    assert cluster.job()["status"]["phase"] == "Profiling"
    assert len(_profilers(cluster)) == 2

    _finish(cluster, pods[0], message=json.dumps(DOC))
    rec.reconcile("ns", "demo")  # one done: stored at once, still waiting
    assert cluster.job()["status"]["phase"] == "Profiling"
    first = _node_of(pods[0])
    fingerprint = hardware_fingerprint(cluster.nodes[first])
    assert _stored(cluster, first) == {fingerprint: DOC}
    assert PROFILE_ANNOTATION not in cluster.nodes[first]["metadata"]["annotations"]

    _finish(cluster, pods[1], message=json.dumps({**DOC, "tflops": 700.0}))
    rec.reconcile("ns", "demo")
    job = cluster.job()
    assert job["status"]["phase"] == "Planned"
    assert "2 with a measured profile" in _cond(job, "Profiling")["message"]
    # The plan was made from the measured figures.
    assert sorted(_planned_tflops(cluster, "demo").values()) == [700.0, 800.0]
    assert all(p["metadata"].get("deletionTimestamp") for p in _profilers(cluster))
    cluster.finish_deletions()
    assert not _profilers(cluster)
    assert len(cluster.pods()) == 4  # the workers

    # The next job on the same nodes (free again once the first is done) reuses the stored
    # profiles: no profiler pod at all.
    for pod in cluster.pods():
        cluster.set_pod_phase(pod["metadata"]["name"], "Succeeded")
    rec.reconcile("ns", "demo")
    assert cluster.job()["status"]["phase"] == "Succeeded"
    cluster.add_job(_measure_job(make_job, "again"))
    rec.reconcile("ns", "again")
    assert cluster.job("again")["status"]["phase"] == "Planned"
    assert not _profilers(cluster)

    # New hardware under the same node name (another fingerprint) is profiled again.
    cluster.nodes[first]["metadata"]["labels"]["nvidia.com/gpu.memory"] = "40960"
    cluster.add_job(_measure_job(make_job, "third"))
    rec.reconcile("ns", "third")
    assert [_node_of(p) for p in _profilers(cluster)] == [first]


def test_failed_or_stuck_profiler_falls_back_to_the_estimate(cluster: Any, clock: Any,
                                                             make_job: Any) -> None:
    api = MeasuringCluster(cluster, clock)
    cluster.add_job(_measure_job(make_job))
    rec = Reconciler(api, clock=clock, settings=ReconcileSettings(profile_timeout_s=120))
    result = rec.reconcile("ns", "demo")
    assert result.requeue_after is not None and result.requeue_after <= 120  # never blocks
    crashed, _stuck = _profilers(cluster)
    cluster.set_pod_phase(crashed["metadata"]["name"], "Failed", ready=False,
                          message="RuntimeError: CUDA unavailable", ns=PROFILE_NS)
    rec.reconcile("ns", "demo")
    assert cluster.job()["status"]["phase"] == "Profiling"  # the other one may still finish
    clock.advance(121)
    rec.reconcile("ns", "demo")
    job = cluster.job()
    assert job["status"]["phase"] == "Planned"
    message = _cond(job, "Profiling")["message"]
    assert "CUDA unavailable" in message and "did not finish within 120s" in message
    assert message.count("using the label-based estimate") == 2
    assert "ProfilingFailed" in [e[2] for e in cluster.events]
    assert not _profile_config_maps(cluster)
    # The failed nodes are not profiled again on the next passes.
    cluster.finish_deletions()
    rec.reconcile("ns", "demo")
    assert not _profilers(cluster)


def test_a_profile_outside_the_schema_is_refused_with_an_event(cluster: Any, clock: Any,
                                                               make_job: Any) -> None:
    api = MeasuringCluster(cluster, clock)
    cluster.add_job(_measure_job(make_job))
    rec = Reconciler(api, clock=clock)
    rec.reconcile("ns", "demo")
    for pod in _profilers(cluster):
        _finish(cluster, pod, message=json.dumps({**DOC, "tflops": 1e7, "extra": 1}))
    rec.reconcile("ns", "demo")
    assert cluster.job()["status"]["phase"] == "Planned"
    warnings = [e[3] for e in cluster.events if e[2] == "ProfilingFailed"]
    assert len(warnings) == 2 and all("tflops" in w and "extra" in w for w in warnings)
    assert not _profile_config_maps(cluster)
    assert set(_planned_tflops(cluster, "demo").values()) == {989.0}  # the table's H100


def test_the_job_being_deleted_takes_its_profiler_pods(cluster: Any, clock: Any,
                                                       make_job: Any) -> None:
    cluster.add_job(_measure_job(make_job))
    rec = Reconciler(MeasuringCluster(cluster, clock), clock=clock)
    rec.reconcile("ns", "demo")
    assert len(_profilers(cluster)) == 2
    cluster.delete_job("ns", "demo")
    rec.reconcile("ns", "demo")
    assert all(p["metadata"].get("deletionTimestamp") for p in _profilers(cluster))


def test_what_a_tenant_can_write_changes_no_plan(cluster: Any, clock: Any,
                                                 make_job: Any) -> None:
    """Tenant A forges a fast profile every way open to it; tenant B's plan stays estimated."""
    fake = json.dumps({**DOC, "tflops": 20000.0})
    node = "h100-0"
    fingerprint = hardware_fingerprint(cluster.nodes[node])
    # 1. A pod in its own namespace that looks like a finished profiler of node h100-0.
    cluster.create({"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "demo-profiler-fake", "namespace": "ns",
        "labels": {LABEL_MANAGED_BY: "adaptis", LABEL_JOB: "demo", LABEL_JOB_NAMESPACE: "ns",
                   LABEL_ROLE: "profiler"},
        "annotations": {"adaptis.io/node": node}}, "spec": {}})
    cluster.set_pod_phase("demo-profiler-fake", "Succeeded", ready=False, message=fake)
    # 2. A ConfigMap just like the store's, in its own namespace.
    cluster.create(render_profile_config_map(namespace="ns", node=node,
                                             fingerprint=fingerprint, document=fake))
    # 3. The node annotation earlier versions read (with node patch, which tenants lack).
    cluster.nodes[node]["metadata"]["annotations"][PROFILE_ANNOTATION] = fake
    cluster.add_job(_measure_job(make_job))  # tenant A's own job, in namespace ns
    tenant_b = make_job("b", spec={"planner": {"strategy": "1f1b"},
                                   "worker": {"nodeSelector": {"topology.kubernetes.io/zone":
                                                               "zone-a"}}})
    tenant_b["metadata"]["namespace"] = "team-b"
    cluster.add_job(tenant_b)
    rec = Reconciler(MeasuringCluster(cluster, clock), clock=clock)
    # B first: A's profiler pods would hold the GPUs B is to be planned on.
    rec.reconcile("team-b", "b")
    rec.reconcile("ns", "demo")  # A's job profiles in the operator's namespace, reads none
    tflops = _planned_tflops(cluster, "b", ns="team-b")
    assert tflops and set(tflops.values()) == {989.0}  # planned, from the table's H100 figure
    assert not _profile_config_maps(cluster)


def test_a_stored_profile_is_checked_again_when_read(cluster: Any, make_job: Any) -> None:
    """An edited store (out of bounds, or one node's ConfigMap naming another) is ignored."""
    nodes = cluster.nodes

    def stored(node: str, tflops: float, *, named_for: str | None = None) -> dict[str, Any]:
        cm = render_profile_config_map(namespace=PROFILE_NS, node=node,
                                       fingerprint=hardware_fingerprint(nodes[node]),
                                       document=json.dumps({**DOC, "tflops": tflops}))
        cm["metadata"]["name"] = profile_config_map_name(named_for or node)
        return cm

    store = read_stored_profiles([stored("h100-0", 900.0), stored("h100-1", 1e9),
                                  stored("a100-0", 900.0, named_for="a100-1")])
    assert measured_figures(store, nodes["h100-0"])["tflops"] == 900.0
    assert measured_figures(store, nodes["h100-1"]) == {}  # out of bounds
    assert measured_figures(store, nodes["a100-0"]) == {}  # another node's ConfigMap
    # The reconciler plans from what passes, and from nothing else.
    cluster.create(stored("h100-0", 900.0))
    cluster.create(stored("h100-1", 1e9))
    cluster.add_job(_measure_job(make_job))
    Reconciler(cluster).reconcile("ns", "demo")
    assert [_node_of(p) for p in _profilers(cluster)] == ["h100-1"]


def test_profile_estimate_never_creates_profiler_pods(cluster: Any, make_job: Any) -> None:
    cluster.add_job(make_job())
    Reconciler(cluster).reconcile("ns", "demo")
    assert not _profilers(cluster)
    assert cluster.job()["status"]["phase"] == "Planned"
