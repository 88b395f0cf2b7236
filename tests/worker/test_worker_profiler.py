"""The layer profiler: real torch work on the CPU, a valid planning problem out, the CLI loop.

Timings on a shared machine are noisy, so time assertions are about sign and order of
magnitude; byte counts are exact functions of the shapes and asserted as such.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from adaptis.api.job import BlockSpec, JobSpec, OptimizerSpec, ParallelismSpec, TrainingSpec
from adaptis.api.model import ZooModel
from adaptis.api.problem import load_problem, parse_problem
from adaptis.worker.errors import WorkerError
from adaptis.worker.models.layers import AttentionBlock
from adaptis.worker.models.zoo import model_layers
from adaptis.worker.profiling.hardware import DeviceProfile, HardwareProfile, LinkProfile, configure_host
from adaptis.worker.profiling.job_problem import profile_job
from adaptis.worker.profiling.profiler import (
    ProfileSettings,
    bytes_per_param,
    measure_action_overhead,
    measure_graph_visit,
    problem_from_profiles,
    profile_layers,
    profile_module,
)
from adaptis.worker.runtime.pipelining import weight_pass_graph

REPO = Path(__file__).resolve().parents[2]
FAST = ProfileSettings(warmup=1, repeats=3)


def _spec(*, seq: int = 16, optimizer: str = "adamw") -> JobSpec:
    return JobSpec(
        model=ZooModel(vocab_size=256, hidden=16, heads=2, blocks=[
            BlockSpec(kind="mamba"), BlockSpec(kind="attention", count=2), BlockSpec(kind="moe", experts=2, top_k=1),
            BlockSpec(kind="dense")]),
        training=TrainingSpec(microbatches=4, microbatch_size=2, sequence_length=seq,
                              optimizer=OptimizerSpec(name=optimizer)),  # type: ignore[arg-type]
        parallelism=ParallelismSpec(workers=3, gpus_per_worker=0))


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def test_profiled_job_is_a_valid_problem_with_positive_times() -> None:
    spec = _spec()
    problem = profile_job(spec, settings=FAST, devices=3, name="tiny")
    reparsed = parse_problem(json.loads(json.dumps(problem.model_dump(mode="json", exclude_none=True))))
    layers = reparsed.expanded_layers()
    assert [lay.name for lay in layers] == [info.name for info in model_layers(spec.model)]
    assert reparsed.device_count == 3 and reparsed.microbatches == 4 and reparsed.time_unit == "ms"
    assert all(lay.forward > 0 for lay in layers)
    blocks = [lay for lay in layers if lay.kind not in ("embedding", "head")]
    assert all(lay.backward > 0 for lay in blocks)
    assert layers[0].backward == 0 and layers[0].weight > 0  # token input: the whole backward is W
    # The runtime's per-action overhead is measured and written (small: well under 50 ms).
    assert 0 < reparsed.action_overhead_s < 0.05
    assert all(lay.activation_bytes > 0 for lay in layers if lay.kind == "attention")
    # Identical kinds are measured once and share their figures.
    assert layers[2].model_dump(exclude={"name"}) == layers[3].model_dump(exclude={"name"})
    # Output: [b, s, h] float32 from every layer but the head (only the loss leaves it).
    assert all(lay.output_bytes == 2 * 16 * 16 * 4 for lay in layers[:-1]) and layers[-1].output_bytes == 0


def test_bad_settings_are_worker_errors() -> None:
    with pytest.raises(WorkerError, match="repeats"):
        ProfileSettings(repeats=0)
    with pytest.raises(WorkerError, match="rounds"):
        ProfileSettings(rounds=0)
    with pytest.raises(WorkerError, match="estimator"):
        ProfileSettings(estimator="mean")  # type: ignore[arg-type]
    with pytest.raises(WorkerError, match="optimizer"):
        bytes_per_param("lion")


def test_param_bytes_follow_the_optimizer_rule() -> None:
    adamw = profile_layers(_spec(optimizer="adamw"), settings=ProfileSettings(warmup=0, repeats=1))
    sgd = profile_layers(_spec(optimizer="sgd"), settings=ProfileSettings(warmup=0, repeats=1))
    emb_params = 256 * 16
    assert adamw[0].param_bytes == emb_params * bytes_per_param("adamw") == emb_params * 16
    assert sgd[0].param_bytes == emb_params * 8
    assert all(a.param_bytes == 2 * s.param_bytes for a, s in zip(adamw, sgd, strict=True))


def test_attention_activation_bytes_grow_with_the_sequence() -> None:
    block = AttentionBlock(hidden=16, heads=2)
    sizes = []
    for seq in (16, 64):
        x = torch.randn(2, seq, 16)
        m = profile_module(block, example=x, settings=ProfileSettings(warmup=0, repeats=1))
        assert m.output_bytes == x.numel() * 4
        sizes.append(m.activation_bytes)
    assert sizes[0] > 0
    assert sizes[1] >= 4 * sizes[0] * 0.9  # at least linear in the sequence (4x longer)


class _Weightless(nn.Module):
    """Compute-heavy, but no trainable parameter (the weights are frozen)."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(64, 64, bias=False).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(4):
            x = torch.tanh(self.mix(x))
        return x


def test_a_layer_without_weights_has_no_weight_time_and_a_dense_one_has_some() -> None:
    x = torch.randn(8, 64, 64)
    settings = ProfileSettings(warmup=1, repeats=5, estimator="min")  # min: noise only adds
    weightless = profile_module(_Weightless(), example=x, settings=settings)
    assert weightless.forward_s > 0 and weightless.backward_s > 0 and weightless.activation_bytes > 0
    assert weightless.weight_s == 0.0
    dense = nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)))
    m = profile_module(dense, example=x, settings=settings)
    # The weight gradients of four linears cost about as much as their input gradients.
    assert m.weight_s > 0.1 * m.backward_s
    # The split passes do at least the fused backward's work (torch's split costs more); 0.75: timing noise.
    assert m.backward_s + m.weight_s >= 0.75 * m.fused_backward_s > 0


def test_split_backward_of_a_block_is_at_least_its_fused_backward() -> None:
    block = AttentionBlock(hidden=32, heads=2)
    m = profile_module(block, example=torch.randn(2, 64, 32), settings=ProfileSettings(warmup=1, repeats=5,
                                                                                       estimator="min"))
    assert m.backward_s > 0 and m.weight_s > 0 and m.fused_backward_s > 0
    assert m.backward_s + m.weight_s >= 0.75 * m.fused_backward_s
    # The timed passes leave no gradient behind on the module.
    assert all(p.grad is None for p in block.parameters())


def test_first_layer_weight_is_its_fused_backward() -> None:
    layers = profile_layers(_spec(), settings=FAST)
    assert layers[0].backward_s == 0.0 and layers[0].weight_s == layers[0].fused_backward_s > 0
    assert all(lay.fused_backward_s > 0 for lay in layers)


def test_action_overhead_is_small_and_non_negative() -> None:
    overhead = measure_action_overhead(settings=FAST)
    assert 0 <= overhead < 0.01  # an 8-wide layer: microseconds to a millisecond, never more


def test_hardware_file_sets_memory_links_and_relative_speed() -> None:
    hw = HardwareProfile(
        device=DeviceProfile(name="Some Accelerator", speed=0.5, memory_bytes=8e10, matmul_tflops=1e6,
                             precision="bfloat16"),
        links={"intra_node": LinkProfile(bandwidth_bytes_per_s=4e11, latency_s=5e-6),
               "inter_node": LinkProfile(bandwidth_bytes_per_s=2.5e10, latency_s=2e-5)},
        ranks_per_node=2)
    problem = profile_job(_spec(), settings=ProfileSettings(warmup=0, repeats=1), devices=4, name="hw",
                          hardware=hw)
    devices = problem.device_specs()
    assert [d.node for d in devices] == ["node0", "node0", "node1", "node1"]
    assert all(d.memory_bytes == 8e10 for d in devices)
    assert all(d.speed > 100 for d in devices)  # a 1 EFLOP/s device against this CPU
    assert problem.network.intra_node is not None and problem.network.intra_node.latency_s == 5e-6
    assert problem.network.inter_node is not None and problem.network.inter_node.bandwidth_bytes_per_s == 2.5e10


def _adaptis(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "adaptis", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, check=False)


def test_cli_profile_then_plan_round_trip(tmp_path: Path) -> None:
    job = {"apiVersion": "adaptis.io/v1alpha1", "kind": "AdaPtisJob", "metadata": {"name": "round-trip"},
           "spec": {"model": {"vocabSize": 512, "hidden": 16, "heads": 2,
                              "blocks": [{"kind": "mamba", "count": 3}, {"kind": "attention", "count": 3}]},
                    "training": {"microbatches": 4, "microbatchSize": 1, "sequenceLength": 16},
                    "parallelism": {"workers": 2, "gpusPerWorker": 0}}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    out = _adaptis("profile", str(tmp_path / "job.yaml"), "-o", str(tmp_path / "p.yaml"), "--repeats", "2")
    assert out.returncode == 0, out.stderr[-2000:]
    problem = load_problem(tmp_path / "p.yaml")
    assert problem.device_count == 2 and len(problem.expanded_layers()) == 8
    assert problem.action_overhead_s > 0 and "action overhead" in out.stderr
    assert "round-trip" in (problem.name or "") and "float32" in (problem.name or "")
    plan = _adaptis("plan", str(tmp_path / "p.yaml"), "--compare", "--json")
    assert plan.returncode == 0, plan.stderr[-2000:]
    doc = json.loads(plan.stdout)
    assert doc["time_unit"] == "ms"
    assert doc["strategies"]["adaptis"]["feasible"] and doc["strategies"]["adaptis"]["iteration_time"] > 0
    assert doc["strategies"]["1f1b"]["iteration_time"] >= doc["lower_bound"]


def test_cli_profile_reports_a_bad_manifest_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text("spec: {model: {hidden: 16}}\n")
    out = _adaptis("profile", str(tmp_path / "bad.yaml"))
    assert out.returncode == 2
    assert out.stderr.startswith("adaptis profile:") and "vocab" in out.stderr.lower()


def test_weight_pass_graph_counts_add_up_over_stacked_blocks() -> None:
    """The planner charges a stage's walks from per-layer counts: k stacked blocks must have k
    times one block's nodes and groups, or the per-layer form is wrong."""
    def block() -> nn.Module:
        return AttentionBlock(hidden=16, heads=2)

    x = torch.randn(1, 8, 16, requires_grad=True)
    single = block()
    one = weight_pass_graph(outputs=[single(x)], inputs=[x], module=single)
    stack = nn.Sequential(block(), block(), block())
    three = weight_pass_graph(outputs=[stack(x)], inputs=[x], module=stack)
    assert one[0] > 10 and one[1] >= 2
    assert three == (3 * one[0], 3 * one[1])


def test_graph_visit_is_measured_and_each_layer_walk_is_its_nodes_times_it() -> None:
    # 32 tiny blocks walk each other 496 times over: milliseconds against ~0.1 ms of noise.
    visit = measure_graph_visit(settings=FAST)
    assert 0 < visit < 1e-4  # tens of nanoseconds to a few microseconds a node, never 0.1 ms
    profiles = profile_layers(_spec(), settings=FAST)
    problem = problem_from_profiles(profiles, name="tiny", microbatches=4, devices=3, memory_bytes=None,
                                    graph_visit_s=2e-7)
    blocks = list(zip(profiles, problem.expanded_layers(), strict=True))[1:-1]
    assert all(p.graph_nodes > 10 and lay.weight_groups == p.weight_groups >= 1 for p, lay in blocks)
    assert all(lay.graph_walk == pytest.approx(p.graph_nodes * 2e-7 / 1e-3, rel=1e-4) for p, lay in blocks)
    assert problem.expanded_layers()[0].weight_groups is None  # the first stage never splits
    # With a job, the visit is measured on its own blocks (>= 4 of them): a rate, never negative.
    assert measure_graph_visit(settings=FAST, spec=_spec()) >= 0


def test_configure_host_sets_threads() -> None:
    configure_host(threads=2)
    assert torch.get_num_threads() == 2
    configure_host(threads=0)  # clamped: a rank always has a thread
    assert torch.get_num_threads() == 1


def test_rounds_take_the_estimator_across_passes() -> None:
    """Rounds combine whole passes: the bytes (exact) are one pass's, every time is still measured."""
    spec = _spec()
    one = profile_layers(spec, settings=ProfileSettings(warmup=0, repeats=1, estimator="min"))
    three = profile_layers(spec, settings=ProfileSettings(warmup=0, repeats=1, estimator="min", rounds=3))
    assert [p.activation_bytes for p in three] == [p.activation_bytes for p in one]
    assert all(p.forward_s > 0 and p.fused_backward_s > 0 for p in three)


def test_optimizer_step_and_gradient_bytes_are_measured_per_layer() -> None:
    layers = profile_layers(_spec(optimizer="adamw"), settings=ProfileSettings(warmup=0, repeats=1))
    for lay in layers:
        # fp32 gradients: 4 bytes a parameter, a quarter of AdamW's 16 (Layer's default rule).
        assert lay.gradient_bytes * 4 == lay.param_bytes, lay.name
        assert (lay.optimizer_s > 0) == (lay.param_bytes > 0), lay.name
    layer = layers[0].to_layer(unit_seconds=1e-3)
    assert layer.gradient_bytes == layers[0].gradient_bytes
    assert layer.optimizer == pytest.approx(layers[0].optimizer_s * 1e3, rel=1e-4)


def test_the_optimizer_step_grows_with_the_parameters() -> None:
    from adaptis.api.job import OptimizerSpec as Opt
    from adaptis.worker.profiling.optimizer_timing import time_optimizer_step

    settings = ProfileSettings(warmup=1, repeats=3, estimator="min")
    small = time_optimizer_step(torch.nn.Linear(32, 32), optimizer=Opt(), settings=settings)
    large = time_optimizer_step(torch.nn.Linear(1024, 1024), optimizer=Opt(), settings=settings)
    assert 0 < small < large  # 1K vs 1M parameters: bandwidth-bound, far apart
    assert time_optimizer_step(torch.nn.ReLU(), optimizer=Opt(), settings=settings) == 0.0
