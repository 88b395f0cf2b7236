"""The dry-run half of bench/tensor_parallel.py: paper-scale jobs planned on estimated layers.

No torch work. Each shape is a zoo job (checked by the API's rules, as ``adaptis run`` and the
operator check it), its layers estimated by :func:`adaptis.planner.estimate.estimate_layers`
at an H200's bf16 rate (989 TFLOP/s dense x the estimate's MFU 0.4; 4.8 TB/s for the
optimizer's memory traffic), on devices of 141 GB: each device of the plan is a tensor group of
T GPUs in one node (one node per pipeline stage), the tensor all-reduces over an NVLink-class
link and the pipeline's sends and the replicas' gradient all-reduce over an inter-node one.

The memory model (adaptis.planner.estimate, docs/planner-search.md): a layer holds 16 bytes a
parameter under AdamW (weights, gradients, two moments and the fp32 master, all counted alike),
and per microbatch in flight its activations as method.md counts them (34 b s h + 5 b s^2 a
bytes in 16-bit for an attention block: no flash attention's savings), both / T on a tensor
rank (no sequence parallelism: the norms' and dropout's activations are split too, which
Megatron needs sequence parallelism for, so the activations are an underestimate at T > 1);
ZeRO-1 and the framework's own memory (CUDA context, allocator fragmentation, NCCL buffers)
are not modelled.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

__all__ = ["SHAPES", "dry_runs", "dry_table"]

H200_BYTES = 141e9
H200_FLOPS = 989e12  # bf16 dense peak
H200_MEMORY_BW = 4.8e12
NVLINK = (450e9, 5e-6)  # bytes/s one way, latency of one ring step
INTER_NODE = (50e9, 5e-6)  # 400 Gb/s a GPU (InfiniBand NDR)
STRATEGIES = ("adaptis", "i1f1b", "1f1b")


@dataclass(frozen=True)
class Shape:
    """A zoo model at a mesh: spec.model, sequence, microbatches, P, T, R, a GPU's memory."""

    model: dict[str, Any]
    sequence: int
    microbatches: int
    pipeline: int
    tensor: int
    replicas: int = 1
    memory_bytes: float = H200_BYTES


def _llama70b() -> dict[str, Any]:
    return {"vocabSize": 128256, "hidden": 8192, "heads": 64, "kvHeads": 8, "ffnHidden": 28672,
            "mlp": "swiglu", "positions": "rope", "blocks": [{"kind": "attention", "count": 80}]}


def _gpt3() -> dict[str, Any]:  # 4 x hidden GELU MLP, untied head; the zoo has no learned positions
    return {"vocabSize": 50304, "hidden": 12288, "heads": 96, "blocks": [{"kind": "attention", "count": 96}]}


def _tiny() -> dict[str, Any]:
    return {"vocabSize": 8192, "hidden": 256, "heads": 8, "kvHeads": 4, "ffnHidden": 512, "mlp": "swiglu",
            "blocks": [{"kind": "attention", "count": 6}]}


#: scale -> name -> shape. ``paper``: the issue's; ``tiny``: the test's (plans in a second).
SHAPES: dict[str, dict[str, Shape]] = {
    "paper": {
        "llama3-70b PP8 x TP8 (64 GPUs)": Shape(_llama70b(), 4096, 32, 8, 8),
        "llama3-70b PP8 x TP1 (8 GPUs)": Shape(_llama70b(), 4096, 32, 8, 1),
        "llama3-70b s8192 PP8 x TP8 (64 GPUs)": Shape(_llama70b(), 8192, 32, 8, 8),
        "gpt3-175b PP8 x TP8 x DP2 (128 GPUs)": Shape(_gpt3(), 2048, 32, 8, 8, 2),
        "gpt3-175b PP8 x TP1 x DP2 (16 GPUs)": Shape(_gpt3(), 2048, 32, 8, 1, 2),
    },
    "tiny": {
        "tiny PP2 x TP2": Shape(_tiny(), 256, 8, 2, 2, memory_bytes=1e9),
        "tiny PP2 x TP1": Shape(_tiny(), 256, 8, 2, 1, memory_bytes=1e9),
    },
}


def job_spec(name: str, shape: Shape) -> Any:
    """The shape as a job, through the API's rules: a refusal names the field."""
    from adaptis.api.job import parse_job
    from adaptis.api.rules import check_job

    gpus = max(shape.tensor, 1)
    doc = {"apiVersion": "adaptis.io/v1alpha1", "kind": "AdaPtisJob",
           "metadata": {"name": name.split(maxsplit=1)[0].replace(".", "-")},
           "spec": {"model": shape.model,
                    "training": {"steps": 10, "microbatches": shape.microbatches, "microbatchSize": 1,
                                 "sequenceLength": shape.sequence, "precision": "bf16",
                                 "optimizer": {"name": "adamw", "lr": 1e-4}},
                    "parallelism": {"workers": shape.pipeline * shape.replicas, "gpusPerWorker": gpus,
                                    "dataParallel": shape.replicas, "tensorParallel": shape.tensor},
                    "planner": {"strategy": "adaptis", "profile": "estimate"}}}
    job = parse_job(doc)
    check_job(name=job.metadata.name, spec=job.spec)
    return job.spec


def problem(name: str, shape: Shape) -> Any:
    from adaptis.api.model import ZooModel
    from adaptis.api.problem import IdenticalDevices, Link, Network, Problem
    from adaptis.planner.estimate import MFU, estimate_layers

    spec = job_spec(name, shape)
    assert isinstance(spec.model, ZooModel)
    layers = estimate_layers(spec.model, spec.training, element_bytes=2, flops_per_s=H200_FLOPS * MFU,
                             memory_bytes_per_s=H200_MEMORY_BW)
    return Problem(
        name=name, time_unit="ms", microbatches=shape.microbatches, layers=layers,
        devices=IdenticalDevices(count=shape.pipeline, per_node=1, memory_bytes=shape.memory_bytes),
        network=Network(inter_node=Link(bandwidth_bytes_per_s=INTER_NODE[0], latency_s=INTER_NODE[1]),
                        tensor=Link(bandwidth_bytes_per_s=NVLINK[0], latency_s=NVLINK[1])),
        data_parallel=shape.replicas, tensor_parallel=shape.tensor)


def dry_runs(*, scale: str = "paper", time_limit_s: float = 60.0) -> list[dict[str, Any]]:
    """Per shape and strategy: predicted iteration (s), bubble, peak memory per GPU, or why not."""
    from adaptis.api.plan import predicted_seconds
    from adaptis.planner.costs import Costs
    from adaptis.planner.strategies import plan_strategy

    rows = []
    for name, shape in SHAPES[scale].items():
        prob = problem(name, shape)
        state = max(Costs.from_problem(prob).param_bytes)  # one tensor rank's heaviest layer
        for strategy in STRATEGIES:
            out = plan_strategy(prob, strategy, time_limit_s=time_limit_s)
            row: dict[str, Any] = {"shape": name, "strategy": strategy, "gpus": shape.pipeline * shape.tensor
                                   * shape.replicas, "memory_bytes": shape.memory_bytes, "layer_state": state}
            if out.plan is None or out.simulation is None:
                row["reason"] = out.result.reason
            else:
                pred = predicted_seconds(out.plan.predicted)
                row.update(iteration=pred["iteration_seconds"], bubble=pred["bubble_ratio"],
                           peak=max(out.simulation.peak_memory), stages=len(out.plan.stages),
                           recompute=sum(1 for r in (out.plan.recompute or []) if r),
                           fits=out.simulation.feasible)
            rows.append(row)
    return rows


def dry_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| job | GPUs | strategy | stages | predicted iteration ms | bubble | peak memory per GPU GB"
             " (of the device's) | recomputed stages |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "reason" in r:
            lines.append(f"| {r['shape']} | {r['gpus']} | {r['strategy']} | no plan: {r['reason']} | | | | |")
            continue
        lines.append(f"| {r['shape']} | {r['gpus']} | {r['strategy']} | {r['stages']} | {1e3 * r['iteration']:.1f} | "
                     f"{100 * r['bubble']:.1f} % | {r['peak'] / 1e9:.1f}{'' if r['fits'] else ' (over memory)'} | "
                     f"{r['recompute']} |")
    best: dict[str, dict[str, float]] = {}
    for r in rows:  # only plans that fit: a baseline over memory is no speed to beat
        if "iteration" in r and r["fits"]:
            best.setdefault(r["shape"], {})[r["strategy"]] = r["iteration"]
    speed = [f"{k}: adaptis {v['i1f1b'] / v['adaptis']:.2f}x i1f1b" if "i1f1b" in v
             else f"{k}: adaptis fits, i1f1b does not" for k, v in best.items() if "adaptis" in v]
    ratios = [v["i1f1b"] / v["adaptis"] for v in best.values() if {"adaptis", "i1f1b"} <= v.keys()]
    if speed:
        mean = f" (geometric mean {statistics.geometric_mean(ratios):.2f}x)" if ratios else ""
        lines += ["", "; ".join(speed) + mean + "."]
    return lines
