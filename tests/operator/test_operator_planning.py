"""Device choice, planning problem and plan record of a job on profiled nodes."""

from __future__ import annotations

from typing import Any

import pytest

from adaptis.api.job import JobSpec
from adaptis.operator.core.errors import Unsatisfiable
from adaptis.operator.core.records import NodeProfile
from adaptis.operator.core.settings import DEFAULT_TOPOLOGY_KEYS
from adaptis.operator.profiling.nodes import profile_node
from adaptis.operator.scheduling.planning import build_problem, choose_slots, plan_job, spec_hash
from adaptis.planner.strategies import plan_strategy


def _spec(make_job: Any, **over: Any) -> JobSpec:
    return JobSpec.model_validate({**make_job()["spec"], **over})


def _profiles(nodes: list[dict[str, Any]]) -> list[NodeProfile]:
    return [profile_node(n, topology_keys=DEFAULT_TOPOLOGY_KEYS) for n in nodes]


def test_prefers_one_host_then_one_zone_then_spans(make_node: Any, make_job: Any) -> None:
    nodes = _profiles([make_node("a100-0", product="NVIDIA-A100-SXM4-80GB", gpus=2, zone="b"),
                       make_node("h100-0", gpus=2, zone="a"),
                       make_node("h100-1", gpus=2, zone="a")])
    two = choose_slots(nodes, spec=_spec(make_job, parallelism={"workers": 2}))
    assert [s.node.name for s in two] == ["h100-0", "h100-0"]
    four = choose_slots(nodes, spec=_spec(make_job, parallelism={"workers": 4}))
    assert sorted(s.node.name for s in four) == ["h100-0", "h100-0", "h100-1", "h100-1"]
    six = choose_slots(nodes, spec=_spec(make_job, parallelism={"workers": 6}))
    assert [s.node.name for s in six][:4] == ["h100-0", "h100-0", "h100-1", "h100-1"]
    assert six[-1].node.name == "a100-0" and six[0].speed > six[-1].speed


def test_gpus_per_worker_sets_slots_speed_and_memory(make_node: Any, make_job: Any) -> None:
    nodes = _profiles([make_node("n", gpus=8)])
    spec = _spec(make_job, parallelism={"workers": 4, "gpusPerWorker": 2},
                 planner={"strategy": "1f1b", "memoryHeadroom": 0.5})
    slots = choose_slots(nodes, spec=spec)
    one = choose_slots(nodes, spec=_spec(make_job, parallelism={"workers": 4}))
    # A pod of 2 GPUs runs 2 ranks: a slot's speed and memory are one rank's, one GPU's.
    assert len(slots) == 4 and slots[0].speed == pytest.approx(one[0].speed)
    assert slots[0].memory_bytes == pytest.approx(81559 * 2**20 * 0.5)


def test_too_few_slots_is_unsatisfiable_naming_the_field(make_node: Any, make_job: Any) -> None:
    nodes = _profiles([make_node("n", gpus=2)])
    with pytest.raises(Unsatisfiable, match=r"spec.parallelism.workers: 4 workers .* offer 2"):
        choose_slots(nodes, spec=_spec(make_job))


def test_problem_and_plan_record(make_node: Any, make_job: Any) -> None:
    nodes = _profiles([make_node("h", gpus=2, zone="a"),
                       make_node("a", product="NVIDIA-A100-SXM4-80GB", gpus=2, zone="b")])
    spec = _spec(make_job)
    slots = choose_slots(nodes, spec=spec)
    problem = build_problem(spec, slots, name="ns/demo")
    assert problem.device_count == 4 and len(problem.expanded_layers()) == 8
    speeds = [d.speed for d in problem.device_specs()]
    assert speeds[0] / speeds[-1] == pytest.approx(989 / 312)
    record = plan_job(spec, nodes, name="ns/demo")
    assert record.nodes == ["h", "h", "a", "a"] and record.strategy == "1f1b"
    record.plan.check(layers=8, microbatches=8, devices=4)
    assert 0 <= record.predicted_bubble_ratio < 1 and record.predicted_iteration_seconds > 0
    assert record.predicted_speedup_over_i1f1b is not None
    by_name = {n.name: n for n in nodes}
    assert record.still_valid(spec_hash_now=spec_hash(spec), candidates=by_name)
    assert not record.still_valid(spec_hash_now=spec_hash(spec), candidates={"h": by_name["h"]})
    changed = _spec(make_job, training={"steps": 99})
    assert not record.still_valid(spec_hash_now=spec_hash(changed), candidates=by_name)



def test_the_speedup_is_i1f1b_over_the_plan_and_a_fallback_measures_none(make_node: Any, make_job: Any) -> None:
    nodes = _profiles([make_node("h", gpus=2), make_node("a", product="NVIDIA-A100-SXM4-80GB", gpus=2)])
    spec = _spec(make_job)  # strategy 1f1b
    problem = build_problem(spec, choose_slots(nodes, spec=spec), name="ns/demo")
    times = {s: plan_strategy(problem, s).result.iteration_time for s in ("1f1b", "i1f1b")}
    record = plan_job(spec, nodes, name="ns/demo")
    assert record.predicted_speedup_over_i1f1b == round(times["i1f1b"] / times["1f1b"], 4) != 1.0
    assert plan_job(spec, nodes, name="ns/demo", strategy="i1f1b").predicted_speedup_over_i1f1b == 1.0
    # A fallback (the strategy given) runs on what is left of the time: no second planner run for a yardstick.
    assert plan_job(spec, nodes, name="ns/demo", strategy="1f1b").predicted_speedup_over_i1f1b is None

def test_lifecycle_fields_do_not_change_the_spec_hash(make_job: Any) -> None:
    base = _spec(make_job)
    assert spec_hash(base) == spec_hash(_spec(make_job, suspend=True, backoffLimit=9,
                                              activeDeadlineSeconds=60))
    assert spec_hash(base) != spec_hash(_spec(make_job, parallelism={"workers": 2}))


def test_the_plan_records_the_precision_the_workers_run_and_the_problem_counts_its_bytes(
        make_node: Any, make_job: Any) -> None:
    nodes = _profiles([make_node("h", gpus=4)])
    auto = _spec(make_job)  # GPUs: auto is bf16
    fp32 = _spec(make_job, training={**make_job()["spec"].get("training", {}), "precision": "fp32"})
    assert plan_job(auto, nodes, name="ns/demo").plan.precision == "bf16"
    assert plan_job(fp32, nodes, name="ns/demo").plan.precision == "fp32"
    slots = choose_slots(nodes, spec=auto)
    half = build_problem(auto, slots, name="ns/demo").expanded_layers()
    full = build_problem(fp32, slots, name="ns/demo").expanded_layers()
    for h, f in zip(half[:-1], full[:-1], strict=True):  # the head's softmax stays fp32
        assert 2 * h.output_bytes == f.output_bytes > 0
        assert 2 * h.activation_bytes == f.activation_bytes
