"""The layer profiler: measure each distinct layer of a job's model into a planning problem.

Sits in the worker layer between the model zoo (:mod:`adaptis.worker.models`, whose modules it
times, so what is profiled is what is trained) and the planner's input contract
(:class:`adaptis.api.problem.Problem`, shared/planning-problem.md); ``adaptis profile`` is its
CLI face; :mod:`adaptis.worker.problem`'s ``measure_problem`` (what ``adaptis run`` uses)
calls it with few repeats, next to its FLOP-count estimate.

For every distinct layer kind (embedding, head, each block kind with its expert settings) at
the job's microbatch size and sequence length, on one device, in one precision:

- **F**: the forward with autograd recording (as training runs it; the head includes the loss).
- **B** and **W**: torch's split backward exactly as the executor runs it for split plans:
  its input pass (``stage_backward_input``: input gradients, the intermediate gradients kept)
  then its weight pass (``stage_backward_weight``), through the adapter
  (:mod:`adaptis.worker.pipelining`). The first layer takes token ids: B is 0 and W its
  fused backward, as torch's first stage runs it.
- **fused backward**: torch's one-pass ``stage_backward`` (a plan's ``BW``), written as the
  problem's optional ``backward_fused``: the split passes cost more than the fused one (+36-44 %
  on Mamba and dense blocks on CPU: the input pass walks the graph once more to find what W
  needs), so the planner charges BW actions the fused time and can choose, per plan, whether
  splitting the backward pays for itself.
- **per-action overhead** (``action_overhead_s``): :func:`measure_action_overhead`.
- **the weight pass's graph walks** (``weight_groups``, ``graph_walk``): torch's split weight
  pass makes one autograd call per parameter group, and each call walks the autograd graph of
  every earlier layer of its stage, so a deep stage's W costs more than its layers' sum
  (quadratic in depth: +30-60 % on 8 Mamba blocks on CPU). Each layer's nodes and groups are
  counted on its graph (:func:`adaptis.worker.pipelining.weight_pass_graph`) and the time per
  node walked is measured on the job's own blocks (:func:`measure_graph_visit`).
- each timed with ``warmup`` untimed runs then the median (or min) of ``repeats``, on the device's own
  clock (CUDA events; ``perf_counter`` on CPU, where compute is synchronous).
- **activation bytes**: unique storages autograd saves in the forward
  (``saved_tensors_hooks``; parameters excluded), plus the output of every module that owns
  parameters: the gradient there is what a B/W split keeps from B until W.
- **param bytes**: parameters x bytes per parameter of the optimizer: AdamW 16 (weight,
  grad, two moments in fp32; with bf16 weights+grads plus an fp32 master copy it is also
  2 + 2 + 4 + 8 = 16), SGD 8 (weight and grad; fp32 or bf16 plus master).
- **output bytes**: the layer's output (0 for the head: only the scalar loss leaves it).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
from torch import nn

from adaptis.api.job import JobSpec
from adaptis.api.problem import IdenticalDevices, Layer, Link, Network, Problem
from adaptis.worker.errors import WorkerError
from adaptis.worker.hardware import (
    HardwareProfile,
    device_clock,
    device_memory_bytes,
    device_name,
    measure_matmul_tflops,
)
from adaptis.worker.models import LayerInfo, build_layer, model_layers, token_loss
from adaptis.worker.pipelining import (
    SplitState,
    backward_full,
    backward_input,
    backward_weight,
    weight_pass_graph,
)

__all__ = [
    "LayerProfile",
    "ModuleProfile",
    "ProfileSettings",
    "bytes_per_param",
    "measure_action_overhead",
    "measure_graph_visit",
    "profile_job",
    "profile_layers",
    "profile_module",
    "problem_from_profiles",
]

log = logging.getLogger(__name__)

#: Bytes per parameter held all iteration: weight + grad (+ moments) (+ fp32 master), see above.
_BYTES_PER_PARAM = {"adamw": 16, "sgd": 8}
# Two matmul throughputs within this ratio are one kind of device measured twice (noise).
_SAME_DEVICE = 0.05


@dataclass(frozen=True, slots=True)
class ProfileSettings:
    """How to measure: where, in which precision, how often."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float32
    warmup: int = 2
    repeats: int = 5
    # median: the usual; min: the undisturbed time on a host shared with other work, where
    # every disturbance only adds (use the same estimator for what it is compared with).
    estimator: Literal["median", "min"] = "median"
    # passes over every layer kind, the estimator taken across them: a host's slow second hits
    # all repeats of one kind in a row, not every pass.
    rounds: int = 1

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.warmup < 0 or self.rounds < 1:
            raise WorkerError(f"profile: repeats and rounds must be >= 1 and warmup >= 0, got {self.repeats}, "
                              f"{self.rounds}, {self.warmup}")
        if self.estimator not in ("median", "min"):
            raise WorkerError(f"profile: estimator must be median or min, got {self.estimator!r}")


@dataclass(frozen=True, slots=True)
class LayerProfile:
    """One layer's measurement: seconds and bytes of one microbatch."""

    name: str
    kind: str
    forward_s: float
    backward_s: float
    weight_s: float
    activation_bytes: int
    param_bytes: int
    output_bytes: int
    # torch's fused backward (input and weight gradients in one pass): a plan's BW action.
    fused_backward_s: float = 0.0
    # the split weight pass's view of the layer: autograd nodes and parameter groups.
    graph_nodes: int = 0
    weight_groups: int = 0

    def to_layer(self, *, unit_seconds: float, graph_visit_s: float = 0.0) -> Layer:
        # F must be > 0 in the contract: a layer too fast for the clock still costs a tick.
        def r(x: float) -> float:  # five significant digits: more is clock noise
            return float(f"{x:.5g}")

        return Layer(
            name=self.name, kind=self.kind,
            forward=max(r(self.forward_s / unit_seconds), 1e-6),
            backward=r(self.backward_s / unit_seconds), weight=r(self.weight_s / unit_seconds),
            activation_bytes=float(self.activation_bytes), param_bytes=float(self.param_bytes),
            output_bytes=float(self.output_bytes),
            backward_fused=r(self.fused_backward_s / unit_seconds) if self.fused_backward_s else None,
            weight_groups=self.weight_groups or None,
            graph_walk=r(self.graph_nodes * graph_visit_s / unit_seconds) if self.graph_nodes and graph_visit_s else None,
        )


def bytes_per_param(optimizer: str) -> int:
    try:
        return _BYTES_PER_PARAM[optimizer]
    except KeyError:
        raise WorkerError(f"profile: no memory rule for optimizer {optimizer!r}") from None


# --- one module --------------------------------------------------------------------------------
def _time_of(clock: Callable[[Callable[[], None]], float], fn: Callable[[], None], *,
                 setup: Callable[[], Any] | None, settings: ProfileSettings) -> float:
    """Seconds of ``fn(setup())`` (median or min of the repeats) after warm-ups; ``setup``
    runs outside the clock."""
    times = []
    for i in range(settings.warmup + settings.repeats):
        state = setup() if setup is not None else None
        t = clock(lambda: fn(state) if setup is not None else fn())  # type: ignore[call-arg]
        del state
        if i >= settings.warmup:
            times.append(t)
    return min(times) if settings.estimator == "min" else statistics.median(times)


def _saved_bytes(run: Callable[[], Any], *, exclude: set[int]) -> tuple[int, Any]:
    """Bytes of the unique storages autograd saves while ``run`` executes (``exclude``: data
    pointers not to count, the parameters)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in exclude and ptr not in seen:
            seen[ptr] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return sum(seen.values()), out


def _split_grad_bytes(module: nn.Module, run: Callable[[], torch.Tensor]) -> int:
    """Bytes of the outputs of the modules that own parameters: the gradients a B/W split
    keeps there from B until W computes the weight gradients from them."""
    total = 0
    handles = []

    def hook(_m: nn.Module, _inp: Any, out: Any) -> None:
        nonlocal total
        if isinstance(out, torch.Tensor):
            total += out.numel() * out.element_size()

    for sub in module.modules():
        if any(p.requires_grad for p in sub.parameters(recurse=False)):
            handles.append(sub.register_forward_hook(hook))
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return total


@dataclass(frozen=True, slots=True)
class ModuleProfile:
    """One module's seconds (F, split B and W, fused backward) and bytes of one microbatch."""

    forward_s: float
    backward_s: float
    weight_s: float
    fused_backward_s: float
    activation_bytes: int
    output_bytes: int
    graph_nodes: int = 0
    weight_groups: int = 0


def profile_module(module: nn.Module, *, example: torch.Tensor, settings: ProfileSettings,
                   loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
                   input_grad: bool = True) -> ModuleProfile:
    """F, B, W and the fused backward of one microbatch through ``module`` (already on the
    device, in the precision), timed through torch's own stage backward functions (the
    adapter's :func:`backward_input`, :func:`backward_weight`, :func:`backward_full`).
    ``loss``: applied to the output inside F (the head's). ``input_grad``: False when the
    input takes no gradient (token ids): B is then 0 and W the fused backward, as torch's
    first stage runs it."""
    clock = device_clock(settings.device)
    params = [p for p in module.parameters() if p.requires_grad]

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        x = example.detach().requires_grad_(True) if input_grad else example
        out = module(x)
        if loss is not None:
            return x, loss(out)
        # torch's input pass detaches the outputs in place, which a view does not allow.
        return x, (out.clone() if out._is_view() else out)

    def seed(out: torch.Tensor) -> list[torch.Tensor] | None:
        return None if loss is not None else [torch.ones_like(out)]  # a loss seeds itself

    def run_f() -> None:
        forward()

    def run_b(state: tuple[torch.Tensor, torch.Tensor]) -> None:
        x, out = state
        backward_input(outputs=[out], output_grads=seed(out), inputs=[x], module=module)

    def after_b() -> SplitState:
        x, out = forward()
        return backward_input(outputs=[out], output_grads=seed(out), inputs=[x], module=module)

    def run_w(state: SplitState) -> None:
        backward_weight(module=module, state=state)

    def run_full(state: tuple[torch.Tensor, torch.Tensor]) -> None:
        x, out = state
        backward_full(outputs=[out], output_grads=seed(out), inputs=[x] if input_grad else [])

    forward_s = _time_of(clock, run_f, setup=None, settings=settings)
    fused_s = _time_of(clock, run_full, setup=forward, settings=settings) if params or input_grad else 0.0
    if input_grad:
        backward_s = _time_of(clock, run_b, setup=forward, settings=settings)
        weight_s = _time_of(clock, run_w, setup=after_b, settings=settings) if params else 0.0
    else:  # torch's first stage: I is a no-op, W the fused backward
        backward_s, weight_s = 0.0, fused_s
    module.zero_grad(set_to_none=True)  # the timed passes accumulated into .grad

    exclude = {p.untyped_storage().data_ptr() for p in module.parameters()}
    saved, (_x, out) = _saved_bytes(forward, exclude=exclude)
    split = _split_grad_bytes(module, lambda: module(example)) if input_grad else 0
    output = 0 if loss is not None else out.numel() * out.element_size()
    nodes, groups = weight_pass_graph(outputs=[out], inputs=[_x], module=module) if input_grad else (0, 0)
    return ModuleProfile(forward_s=forward_s, backward_s=backward_s, weight_s=weight_s, fused_backward_s=fused_s,
                         activation_bytes=saved + split, output_bytes=output, graph_nodes=nodes,
                         weight_groups=groups)


def measure_action_overhead(*, settings: ProfileSettings) -> float:
    """Seconds one runtime action costs beyond its compute: F, B, W and the fused backward of
    a layer with next to no compute (an 8-wide linear and tanh on 4 tokens), through the same timed
    path, averaged over the four kinds. It is the per-call cost of the adapter and autograd
    (graph walk, hooks, ``.grad`` bookkeeping); not the schedule runtime's own loop and
    messages, which only a pipelined run shows (bench/accuracy.py's overhead probe)."""
    tiny = nn.Sequential(nn.Linear(8, 8), nn.Tanh()).to(device=settings.device, dtype=settings.dtype)
    x = torch.zeros(1, 4, 8, device=settings.device, dtype=settings.dtype)
    # Min over more repeats than a layer gets: the quantity is small, and noise only adds.
    many = replace(settings, repeats=max(settings.repeats, 20), warmup=max(settings.warmup, 3))
    p = profile_module(tiny, example=x, settings=many)
    return statistics.fmean([p.forward_s, p.backward_s, p.weight_s, p.fused_backward_s])


def _weight_pass_s(module: nn.Module, *, example: torch.Tensor, settings: ProfileSettings) -> float:
    """Seconds of torch's split weight pass through ``module`` (its input pass, untimed, first)."""
    def after_b() -> SplitState:
        x = example.detach().requires_grad_(True)
        out = module(x)
        return backward_input(outputs=[out], output_grads=[torch.ones_like(out)], inputs=[x], module=module)

    def run_w(state: SplitState) -> None:
        backward_weight(module=module, state=state)

    seconds = _time_of(device_clock(settings.device), run_w, setup=after_b, settings=settings)
    module.zero_grad(set_to_none=True)
    return seconds


def _graph_counts(layers: list[nn.Module], *, example: torch.Tensor) -> list[tuple[int, int]]:
    out = []
    for layer in layers:
        x = example.detach().requires_grad_(True)
        out.append(weight_pass_graph(outputs=[layer(x)], inputs=[x], module=layer))
    return out


def measure_graph_visit(*, settings: ProfileSettings, spec: JobSpec | None = None) -> float:
    """Seconds torch's split weight pass spends per autograd node it walks (see the module
    docstring). It depends on what runs between the walks (the weight gradients' own compute
    evicts the graph from the caches: about 0.25 us a node between tiny layers, 0.4-0.55 us
    between the accuracy benchmark's blocks on CPU), so with ``spec`` it is measured on the
    job's own blocks in order (up to 8, in two halves: W(both) - W(first) - W(second) is the
    walks of the second half's groups through the first half's graph, all three measured in
    context, taking turns, the minimum kept). Without, or with fewer than 4 blocks: W of 16
    stacked tiny blocks (next to no compute) beyond 16 times one block's, over all the walks."""
    dev, dtype = settings.device, settings.dtype
    once = replace(settings, estimator="min")
    n_blocks = len(model_layers(spec.model)) - 2 if spec is not None else 0
    if spec is not None and n_blocks >= 4:
        half = min(8, n_blocks) // 2
        layers = [build_layer(spec.model, index=1 + i, seed=spec.training.seed).to(device=dev, dtype=dtype)
                  for i in range(2 * half)]
        t = spec.training
        gen = torch.Generator(device=dev).manual_seed(t.seed)
        x = torch.randn(t.microbatch_size, t.sequence_length, spec.model.hidden, generator=gen, device=dev,
                        dtype=dtype)
        counts = _graph_counts(layers, example=x)
        visits = sum(n for n, _g in counts[:half]) * sum(g for _n, g in counts[half:])
        stacks = [nn.Sequential(*layers), nn.Sequential(*layers[:half]), nn.Sequential(*layers[half:])]
        best = [math.inf] * 3
        for _round in range(3):
            for i, stack in enumerate(stacks):
                best[i] = min(best[i], _weight_pass_s(stack, example=x, settings=once))
        extra = best[0] - best[1] - best[2]
    else:
        def block() -> nn.Module:
            return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh()).to(device=dev, dtype=dtype)

        depth = 16
        x = torch.zeros(1, 4, 8, device=dev, dtype=dtype)
        many = replace(once, repeats=max(settings.repeats, 10), warmup=max(settings.warmup, 2))
        single = block()
        (nodes, groups), = _graph_counts([single], example=x)
        visits = groups * nodes * depth * (depth - 1) // 2
        extra = (_weight_pass_s(nn.Sequential(*[block() for _ in range(depth)]), example=x, settings=many)
                 - depth * _weight_pass_s(single, example=x, settings=many))
    return max(extra, 0.0) / visits if visits else 0.0


# --- a job's model -----------------------------------------------------------------------------
def _kind_key(info: LayerInfo) -> tuple[str, int, int]:
    b = info.block
    return (info.kind, b.experts if b and info.kind == "moe" else 0, b.top_k if b and info.kind == "moe" else 0)


def profile_layers(spec: JobSpec, *, settings: ProfileSettings) -> list[LayerProfile]:
    """Every layer of the model in pipeline order; each distinct kind is measured once per
    round, the times combined over ``settings.rounds`` rounds with the settings' estimator.

    One untimed pass over every kind comes first: a fresh process measured its first pass
    40-50 % slower than the next ones (heap growth, lazy initialisation), whatever the
    per-measurement warm-up, and ``adaptis profile`` and ``adaptis run`` profile in fresh ones."""
    _profile_pass(spec, settings=replace(settings, warmup=0, repeats=1))
    passes = [_profile_pass(spec, settings=settings) for _ in range(settings.rounds)]
    if len(passes) == 1:
        return passes[0]
    pick = min if settings.estimator == "min" else statistics.median
    return [replace(first, **{f: pick(getattr(p[i], f) for p in passes) for f in _TIMES})
            for i, first in enumerate(passes[0])]


_TIMES = ("forward_s", "backward_s", "weight_s", "fused_backward_s")


def _profile_pass(spec: JobSpec, *, settings: ProfileSettings) -> list[LayerProfile]:
    model, train = spec.model, spec.training
    infos = model_layers(model)
    b, s, h = train.microbatch_size, train.sequence_length, model.hidden
    dev, dtype = settings.device, settings.dtype
    gen = torch.Generator(device=dev).manual_seed(train.seed)
    tokens = torch.randint(model.vocab_size, (b, s), generator=gen, device=dev)
    hidden = torch.randn(b, s, h, generator=gen, device=dev, dtype=dtype)
    per_param = bytes_per_param(train.optimizer.name)
    cache: dict[tuple[str, int, int], tuple[ModuleProfile, int]] = {}
    out: list[LayerProfile] = []
    last = len(infos) - 1
    for index, info in enumerate(infos):
        # The head is measured with the loss; position matters only for embedding and head.
        key = _kind_key(info)
        if key not in cache:
            module = build_layer(model, index=index, seed=train.seed).to(device=dev, dtype=dtype)
            first = index == 0
            m = profile_module(
                module, example=tokens if first else hidden, settings=settings, input_grad=not first,
                loss=(lambda o: token_loss(o, tokens)) if index == last else None,
            )
            n_params = sum(p.numel() for p in module.parameters())
            cache[key] = (m, n_params * per_param)
            log.info("profiled %-10s F %.3f ms  B %.3f ms  W %.3f ms  fused %.3f ms  act %.3g B", info.kind,
                     m.forward_s * 1e3, m.backward_s * 1e3, m.weight_s * 1e3, m.fused_backward_s * 1e3,
                     m.activation_bytes)
            del module
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        m, pb = cache[key]
        out.append(LayerProfile(name=info.name, kind=info.kind, forward_s=m.forward_s, backward_s=m.backward_s,
                                weight_s=m.weight_s, activation_bytes=m.activation_bytes, param_bytes=pb,
                                output_bytes=m.output_bytes, fused_backward_s=m.fused_backward_s,
                                graph_nodes=m.graph_nodes, weight_groups=m.weight_groups))
    return out


def problem_from_profiles(profiles: Sequence[LayerProfile], *, name: str, microbatches: int, devices: int,
                          memory_bytes: float | None, speed: float = 1.0, per_node: int | None = None,
                          network: Network | None = None, action_overhead_s: float = 0.0,
                          graph_visit_s: float = 0.0) -> Problem:
    """The planning problem (time unit ms) of measured layers on ``devices`` identical devices."""
    if devices < 1:
        raise WorkerError(f"profile: devices must be >= 1, got {devices}")
    return Problem(
        name=name, time_unit="ms", microbatches=microbatches,
        layers=[p.to_layer(unit_seconds=1e-3, graph_visit_s=graph_visit_s) for p in profiles],
        devices=IdenticalDevices(count=devices, per_node=per_node or devices, memory_bytes=memory_bytes,
                                 speed=speed),
        network=network or Network(),
        action_overhead_s=float(f"{max(action_overhead_s, 0.0):.3g}"),
    )


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
    profiles = profile_layers(spec, settings=settings)
    overhead = measure_action_overhead(settings=settings)
    visit = measure_graph_visit(settings=settings, spec=spec)
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
