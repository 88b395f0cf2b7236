"""Plan storage: how large a job's ConfigMap is, and how long it takes to write and read back.

A figure, not a test (docs/plan-storage.md quotes it). For each case the operator's own code
plans the job (planning.plan_job on eight-GPU H100 nodes), renders the ConfigMap
(manifests.render_config_map, the plan's actions packed) and its record in the operator's
namespace (plan_store.render_record), reads the record back as the operator does
(plan_store.parse_record, within the job's limits) and the plan as the worker does
(WorkerConfig + Plan), and checks both equal the plan made. ``--synthetic`` adds the packing
alone on 1F1B-like split-backward schedules of growing size (no planner: a 512-rank plan
would take the planner hours).

    python bench/plan_storage.py [--cases 1f1b:64:4096 zb-h1:64:4096 adaptis:16:512]
                                 [--synthetic 64 256 512]
"""

from __future__ import annotations

import argparse
import json
import time

from adaptis.api.job import JobSpec, WorkerConfig
from adaptis.api.plan import Plan
from adaptis.api.plan_packing import pack_actions, unpack_actions
from adaptis.operator.core.records import JobRef, NodeProfile
from adaptis.operator.core.settings import DEFAULT_TOPOLOGY_KEYS
from adaptis.operator.profiling.nodes import profile_node
from adaptis.operator.resources.manifests import render_config_map
from adaptis.operator.scheduling.plan_store import parse_record, render_record
from adaptis.operator.scheduling.planning import plan_job


def _node(i: int) -> NodeProfile:
    name = f"h100-{i}"
    raw = {"metadata": {"name": name, "labels": {
        "kubernetes.io/hostname": name, "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
        "nvidia.com/gpu.count": "8", "nvidia.com/gpu.memory": "81559"}},
        "spec": {}, "status": {"allocatable": {"cpu": "96", "nvidia.com/gpu": "8"},
                               "conditions": [{"type": "Ready", "status": "True"}]}}
    return profile_node(raw, topology_keys=DEFAULT_TOPOLOGY_KEYS)


def planned_case(strategy: str, workers: int, microbatches: int) -> str:
    spec = JobSpec.model_validate({
        "model": {"vocabSize": 32000, "hidden": 256, "heads": 4,
                  "blocks": [{"kind": "attention", "count": 4 * workers - 2}]},
        "training": {"steps": 4, "microbatches": microbatches, "sequenceLength": 128},
        "parallelism": {"workers": workers, "gpusPerWorker": 1},
        "planner": {"strategy": strategy},
    })
    nodes = [_node(i) for i in range((workers + 7) // 8)]
    t0 = time.perf_counter()
    record = plan_job(spec, nodes, name="bench/plan")
    planned = time.perf_counter() - t0
    actions = sum(len(a) for a in record.plan.actions)
    plain = len(record.plan.to_json())
    t0 = time.perf_counter()
    job = JobRef(name="plan", namespace="bench", uid="u")
    cm = render_config_map(job, spec, record=record)
    stored = render_record(job, record=record, namespace="ops", worker_data=cm["data"])
    written = time.perf_counter() - t0
    size = sum(len(k) + len(v.encode()) for k, v in cm["data"].items())
    t0 = time.perf_counter()
    cached = parse_record(stored, job=job, spec=spec).record
    operator_read = time.perf_counter() - t0
    t0 = time.perf_counter()
    config = WorkerConfig.model_validate_json(cm["data"]["worker.json"])
    plan = Plan.model_validate(config.plan)
    worker_read = time.perf_counter() - t0
    if cached != record or plan != record.plan:
        raise SystemExit(f"{strategy} {workers}x{microbatches}: the plan did not round-trip")
    return (f"| {strategy} | {workers} x {microbatches} | {actions:,} | {plain:,} | "
            f"{len(cm['data']['worker.json']):,} | {size:,} | {written:.2f} | "
            f"{operator_read:.2f} | {worker_read:.2f} | {planned:.0f} |")


def synthetic_case(devices: int, microbatches: int = 4096) -> str:
    actions: list[list[tuple[str, int, int]]] = []
    for d in range(devices):
        warm = min(devices - d - 1, microbatches)
        acts = [("F", d, m) for m in range(warm)]
        for m in range(microbatches):
            if warm + m < microbatches:
                acts.append(("F", d, warm + m))
            acts += [("B", d, m), ("W", d, m)]
        actions.append(acts)
    count = sum(len(a) for a in actions)
    plain = len(json.dumps(actions, separators=(",", ":")))
    t0 = time.perf_counter()
    packed = pack_actions(actions)
    packing = time.perf_counter() - t0
    t0 = time.perf_counter()
    unpacked = unpack_actions(packed)
    unpacking = time.perf_counter() - t0
    if unpacked != actions:
        raise SystemExit(f"synthetic {devices}: the actions did not round-trip")
    return (f"| synthetic zb | {devices} x {microbatches} | {count:,} | {plain:,} | "
            f"{len(packed):,} | | {packing:.2f} | {unpacking:.2f} | | |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=["1f1b:64:4096", "zb-h1:64:4096",
                                                       "adaptis:16:512"],
                        help="strategy:workers:microbatches, planned for real")
    parser.add_argument("--synthetic", nargs="*", type=int, default=[64, 256, 512],
                        help="ranks of synthetic 4096-microbatch schedules (packing only)")
    args = parser.parse_args()
    print("| plan | ranks x microbatches | actions | plain plan JSON (bytes) | worker.json "
          "(bytes) | ConfigMap data (bytes) | write s | operator read s | worker read s | "
          "plan s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for case in args.cases:
        strategy, workers, microbatches = case.split(":")
        print(planned_case(strategy, int(workers), int(microbatches)), flush=True)
    for devices in args.synthetic:
        print(synthetic_case(devices), flush=True)


if __name__ == "__main__":
    main()
