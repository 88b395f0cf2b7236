"""A planning problem for a job's model: an analytic estimate, a quick local measurement, or
the full profile.

Sits at the top of the worker's profiling (:mod:`adaptis.worker.profiling`), between the
models and the planner's input contract (:class:`adaptis.api.problem.Problem`), and chooses
the profiler a job's model needs: the zoo's (:mod:`adaptis.worker.profiling.profiler`) or a
Hugging Face model's real modules (:mod:`adaptis.worker.profiling.hf_profile`).
``estimate_problem`` needs no torch work at all (FLOPs and bytes from the sizes, by
:mod:`adaptis.planner.estimate` as the operator estimates); ``measure_problem`` times each
distinct layer once on this process's device (F, B and W as the executor runs them, few
repeats) and is what ``adaptis run`` uses; ``profile_job`` is ``adaptis profile``'s full
measurement, written as the problem of the devices the job will run on.
"""

from __future__ import annotations

import torch

from adaptis.api.job import JobSpec
from adaptis.api.model import HuggingFaceModel
from adaptis.api.problem import IdenticalDevices, Link, Network, Problem
from adaptis.planner.hf_estimate import estimate_model_layers
from adaptis.planner.tensor_parallel import mark_by_kind
from adaptis.worker.profiling.hardware import (
    HardwareProfile,
    device_memory_bytes,
    device_name,
    measure_matmul_tflops,
)
from adaptis.worker.profiling.hf_profile import measure_hf_problem, profile_hf_layers
from adaptis.worker.profiling.profiler import (
    ProfileSettings,
    measure_action_overhead,
    measure_graph_visit,
    problem_from_profiles,
    profile_layers_among_ranks,
)

__all__ = ["estimate_problem", "measure_problem", "profile_job"]

_CPU_FLOPS = 4.0e10  # sustained FLOP/s of one CPU core thread in float32 matmuls (rough)
_GPU_FLOPS = 2.0e14  # one modern accelerator, mixed precision (rough)
_CPU_BYTES = 1.0e10  # memory bandwidth one process sees on a CPU (rough; the optimizer's bound)
# Seconds of one torch operator on a CPU core beyond its FLOPs (dispatch, allocation, a cold
# cache): 10-40 us measured per operator of the zoo's small blocks on 2 cores, 10-22 us in
# their forwards (issue 16); 15 us, within that range. On a GPU at training sizes the FLOPs
# dominate, and the estimate counts no operator.
_CPU_KERNEL_S = 15e-6
# Two matmul throughputs within this ratio are one kind of device measured twice (noise).
_SAME_DEVICE = 0.05


def estimate_problem(spec: JobSpec, *, devices: int, precision: str = "fp32") -> Problem:
    """Layer costs from FLOPs and bytes alone (no torch work): ms on a rough device speed,
    activations of 2 bytes an element in bf16 and 4 in fp32 (``precision``: the ranks' resolved
    precision, bf16 or fp32)."""
    gpu = spec.parallelism.gpus_per_worker > 0
    flops = _GPU_FLOPS if gpu else _CPU_FLOPS
    return Problem(
        name=spec.model.name,
        time_unit="ms",
        microbatches=spec.training.microbatches,
        layers=estimate_model_layers(spec.model, spec.training,
                                     element_bytes=2 if precision == "bf16" else 4, flops_per_s=flops,
                                     memory_bytes_per_s=None if gpu else _CPU_BYTES,
                                     kernel_s=0.0 if gpu else _CPU_KERNEL_S),
        devices=IdenticalDevices(count=devices, per_node=max(devices, 1)),
        tensor_parallel=spec.parallelism.tensor_parallel,
        sequence_parallel=spec.parallelism.sequence_parallel and spec.parallelism.tensor_parallel > 1,
    )


def measure_problem(spec: JobSpec, *, devices: int, repeats: int = 3,
                    precision: str = "fp32") -> Problem:
    """Time each distinct layer kind once on this process (current thread count) with the
    layer profiler, as ``adaptis profile`` does, few repeats, in ``precision`` (bf16: under
    autocast, as the ranks run); no memory limit is set."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    if isinstance(spec.model, HuggingFaceModel):  # its own modules (hf_profile)
        return measure_hf_problem(spec, devices=devices, repeats=repeats, precision=precision)
    settings = ProfileSettings(warmup=1, repeats=repeats, dtype=dtype)
    profiles = profile_layers_among_ranks(spec, settings=settings, ranks_on_host=devices)
    problem = problem_from_profiles(profiles, name=spec.model.name,
                                    microbatches=spec.training.microbatches, devices=devices, memory_bytes=None,
                                    action_overhead_s=measure_action_overhead(settings=settings),
                                    graph_visit_s=measure_graph_visit(settings=settings, spec=spec))
    # The layers are profiled whole, marked by kind; the planner charges them at the job's degree.
    par = spec.parallelism
    return problem.model_copy(update={"tensor_parallel": par.tensor_parallel,
                                      "sequence_parallel": par.sequence_parallel and par.tensor_parallel > 1,
                                      "layers": mark_by_kind(problem.expanded_layers())})


def profile_job(spec: JobSpec, *, settings: ProfileSettings, devices: int, name: str,
                hardware: HardwareProfile | None = None) -> Problem:
    """Profile ``spec``'s model here and write it as a planning problem.

    Times are this device's, so it is the speed-1 device. With ``hardware`` (a profile of the
    devices the job will run on, e.g. from ``adaptis profile --hardware`` in a pod) the
    problem takes its memory, links and ranks per node, and its speed relative to this device
    (the ratio of matmul throughputs; 1 for the same device name or within noise). Without it: this
    device's memory (on CPU shared by ``devices`` local ranks) and free links. Either way the
    problem's ``action_overhead_s`` is :func:`measure_action_overhead` here, and its layers'
    ``graph_walk`` come from :func:`measure_graph_visit` here."""
    hf = isinstance(spec.model, HuggingFaceModel)  # its own modules (hf_profile), or the zoo's
    if hf:  # the real modules
        profiles = profile_hf_layers(spec, settings=settings)
    else:
        on_host = hardware.ranks_per_node if hardware is not None else devices
        profiles = profile_layers_among_ranks(spec, settings=settings, ranks_on_host=on_host)
    overhead = measure_action_overhead(settings=settings)
    # The zoo's own blocks time the graph walks in context; a Hugging Face model's: the default.
    visit = measure_graph_visit(settings=settings, spec=None if hf else spec)
    dev = settings.device
    label = f"{name} ({device_name(dev)}, torch {torch.__version__}, {str(settings.dtype).removeprefix('torch.')})"
    if hardware is None:
        memory = device_memory_bytes(dev)
        if dev.type == "cpu":
            memory /= devices
        return problem_from_profiles(profiles, name=label, microbatches=spec.training.microbatches,
                                     devices=devices, memory_bytes=memory, action_overhead_s=overhead,
                                     graph_visit_s=visit)
    local = measure_matmul_tflops(dev, dtype=settings.dtype)
    ratio = hardware.device.matmul_tflops / local if local > 0 else 1.0
    same = hardware.device.name == device_name(dev) or abs(ratio - 1.0) <= _SAME_DEVICE
    speed = 1.0 if same else ratio
    links = hardware.links

    def link(key: str) -> Link | None:
        lk = links.get(key)
        return None if lk is None else Link(bandwidth_bytes_per_s=lk.bandwidth_bytes_per_s, latency_s=lk.latency_s)

    network = Network(intra_node=link("intra_node"), inter_node=link("inter_node"))
    return problem_from_profiles(profiles, name=label, microbatches=spec.training.microbatches, devices=devices,
                                 memory_bytes=hardware.device.memory_bytes, speed=speed,
                                 per_node=hardware.ranks_per_node, network=network, action_overhead_s=overhead,
                                 graph_visit_s=visit)
