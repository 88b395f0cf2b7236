"""Timing one module the way torch's pipelining runtime runs it, and the runtime's own costs.

Sits under the layer profiler (:mod:`adaptis.worker.profiling.profiler`, which measures a job's
layers with it and writes the planning problem) and over the adapter
(:mod:`adaptis.worker.runtime.pipelining`, whose
``backward_input``/``backward_weight``/``backward_full`` are the very functions torch's stages call
for ``I``, ``W`` and ``B``). What it measures:

- one module's F, split B and W, fused backward, saved-activation and output bytes, and the
  autograd nodes and parameter groups torch's weight pass sees (:func:`profile_module`);
- the per-action overhead of the adapter and autograd (:func:`measure_action_overhead`);
- the time torch's split weight pass spends per autograd node it walks
  (:func:`measure_graph_visit`).

Each time is taken with ``warmup`` untimed runs then the median (or min) of ``repeats``, on the
device's own clock (CUDA events; ``perf_counter`` on CPU, where compute is synchronous).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Literal

import torch
from torch import nn

from adaptis.api.job import JobSpec
from adaptis.api.model import ZooModel, expect_kind
from adaptis.worker.errors import WorkerError
from adaptis.worker.models.zoo import build_layer, model_layers
from adaptis.worker.profiling.hardware import cache_bytes, device_clock
from adaptis.worker.runtime.pipelining import (
    SplitState,
    backward_full,
    backward_input,
    backward_weight,
    weight_pass_graph,
)

__all__ = ["ModuleProfile", "ProfileSettings", "measure_action_overhead", "measure_graph_visit", "profile_module"]


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
    # Evict the device's caches before every timed run. In a pipeline, between two runs of one
    # layer the rank runs its other layers and microbatches, which evict that layer's weights
    # and saved activations; timed back to back, a small layer finds them cached (issue 16, 2
    # CPU cores, blocks of hidden 64: attention and MoE blocks ran 1.4-1.8x their back-to-back
    # time in a pipeline, and 1.7-1.9x it when timed after an eviction; the large head about
    # 1x either way). On a GPU, with weights far larger than L2, it changes little.
    cold_caches: bool = True
    # Processes kept busy with the model while layers are timed
    # (adaptis.worker.profiling.contention); None: one per other rank on this CPU host, none on a
    # GPU.
    co_runners: int | None = None

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.warmup < 0 or self.rounds < 1 or (self.co_runners or 0) < 0:
            raise WorkerError(f"profile: repeats and rounds must be >= 1, warmup and co_runners >= 0, got "
                              f"{self.repeats}, {self.rounds}, {self.warmup}, {self.co_runners}")
        if self.estimator not in ("median", "min"):
            raise WorkerError(f"profile: estimator must be median or min, got {self.estimator!r}")


# --- one module --------------------------------------------------------------------------------
def _time_of(clock: Callable[[Callable[[], None]], float], fn: Callable[[], None], *,
                 setup: Callable[[], Any] | None, settings: ProfileSettings) -> float:
    """Seconds of ``fn(setup())`` (median or min of the repeats) after warm-ups; ``setup``
    and, with ``settings.cold_caches``, the cache eviction run outside the clock."""
    evict = _cache_evictor(settings.device) if settings.cold_caches else None
    times = []
    for i in range(settings.warmup + settings.repeats):
        # The state lives in the partial only: released before the next setup allocates anew.
        call = fn if setup is None else partial(fn, setup())
        if evict is not None:
            evict()
        t = clock(call)  # type: ignore[arg-type]
        if i >= settings.warmup:
            times.append(t)
    return min(times) if settings.estimator == "min" else statistics.median(times)


def _cache_evictor(device: torch.device) -> Callable[[], None]:
    """Writes a buffer twice the device's largest cache, which leaves none of the module's
    data cached (a write, so dirty lines are flushed too); queued before the clock starts."""
    buffer = torch.empty(2 * cache_bytes(device), dtype=torch.uint8, device=device)
    pass_no = 0

    def evict() -> None:
        nonlocal pass_no
        pass_no += 1
        buffer.fill_(pass_no % 251)

    return evict


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
    forward = _forward_of(module, example=example, loss=loss, input_grad=input_grad)

    def run_f() -> None:
        forward()

    def run_b(state: tuple[torch.Tensor, torch.Tensor]) -> None:
        x, out = state
        backward_input(outputs=[out], output_grads=_seed(out, loss=loss), inputs=[x], module=module)

    def run_full(state: tuple[torch.Tensor, torch.Tensor]) -> None:
        x, out = state
        backward_full(outputs=[out], output_grads=_seed(out, loss=loss), inputs=[x] if input_grad else [])

    forward_s = _time_of(clock, run_f, setup=None, settings=settings)
    fused_s = _time_of(clock, run_full, setup=forward, settings=settings) if params or input_grad else 0.0
    if input_grad:
        backward_s = _time_of(clock, run_b, setup=forward, settings=settings)
        weight_s = _weight_pass_s(module, example=example, settings=settings, loss=loss) if params else 0.0
    else:  # torch's first stage: I is a no-op, W the fused backward
        backward_s, weight_s = 0.0, fused_s
    module.zero_grad(set_to_none=True)  # the timed passes accumulated into .grad

    exclude = {p.untyped_storage().data_ptr() for p in module.parameters()}
    saved, (x_in, out) = _saved_bytes(forward, exclude=exclude)
    split = _split_grad_bytes(module, lambda: module(example)) if input_grad else 0
    output = 0 if loss is not None else out.numel() * out.element_size()
    nodes, groups = weight_pass_graph(outputs=[out], inputs=[x_in], module=module) if input_grad else (0, 0)
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
    # Warm caches: what is measured is the per-call cost of the code path; a cold start would
    # measure the refill of the caches the layers' own cold profiles already pay.
    many = replace(settings, repeats=max(settings.repeats, 20), warmup=max(settings.warmup, 3), cold_caches=False)
    p = profile_module(tiny, example=x, settings=many)
    return statistics.fmean([p.forward_s, p.backward_s, p.weight_s, p.fused_backward_s])


def _forward_of(module: nn.Module, *, example: torch.Tensor, loss: Callable[[torch.Tensor], torch.Tensor] | None,
                input_grad: bool) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """F as the timed passes run it: (the input, the output or the loss)."""
    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        x = example.detach().requires_grad_(True) if input_grad else example
        out = module(x)
        if loss is not None:
            return x, loss(out)
        # torch's input pass detaches the outputs in place, which a view does not allow.
        return x, (out.clone() if out._is_view() else out)

    return forward


def _seed(out: torch.Tensor, *, loss: Callable[[torch.Tensor], torch.Tensor] | None) -> list[torch.Tensor] | None:
    return None if loss is not None else [torch.ones_like(out)]  # a loss seeds itself


def _weight_pass_s(module: nn.Module, *, example: torch.Tensor, settings: ProfileSettings,
                   loss: Callable[[torch.Tensor], torch.Tensor] | None = None) -> float:
    """Seconds of torch's split weight pass through ``module`` (its input pass, untimed, first)."""
    forward = _forward_of(module, example=example, loss=loss, input_grad=True)

    def after_b() -> SplitState:
        x, out = forward()
        return backward_input(outputs=[out], output_grads=_seed(out, loss=loss), inputs=[x], module=module)

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
    context, taking turns, the minimum kept). Without, or with fewer than 4 blocks: W of 32
    stacked tiny blocks (next to no compute) beyond 32 times one block's, over all the walks."""
    dev, dtype = settings.device, settings.dtype
    once = replace(settings, estimator="min", cold_caches=False)  # a difference of warm runs: calibrated so
    model = expect_kind(spec.model, ZooModel, what="the graph walk's timing") if spec is not None else None
    n_blocks = len(model_layers(model)) - 2 if model is not None else 0
    if spec is not None and model is not None and n_blocks >= 4:
        half = min(8, n_blocks) // 2
        layers = [build_layer(model, index=1 + i, seed=spec.training.seed).to(device=dev, dtype=dtype)
                  for i in range(2 * half)]
        t = spec.training
        gen = torch.Generator(device=dev).manual_seed(t.seed)
        x = torch.randn(t.microbatch_size, t.sequence_length, model.hidden, generator=gen, device=dev,
                        dtype=dtype)
        counts = _graph_counts(layers, example=x)
        visits = sum(n for n, _g in counts[:half]) * sum(g for _n, g in counts[half:])
        stacks = [nn.Sequential(*layers), nn.Sequential(*layers[:half]), nn.Sequential(*layers[half:])]
        weights = [1.0, -1.0, -1.0]  # W(both) - W(first) - W(second)
    else:
        def block() -> nn.Module:
            return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh()).to(device=dev, dtype=dtype)

        # 32 deep: the walks are ~40 % of the stack's W (16 deep: ~25 %, too close to the noise).
        depth = 32
        x = torch.zeros(1, 4, 8, device=dev, dtype=dtype)
        once = replace(once, repeats=max(settings.repeats, 10), warmup=max(settings.warmup, 2))
        single = block()
        (nodes, groups), = _graph_counts([single], example=x)
        visits = groups * nodes * depth * (depth - 1) // 2
        stacks = [nn.Sequential(*[block() for _ in range(depth)]), single]
        weights = [1.0, -float(depth)]  # W(deep) - depth x W(one)
    best = [math.inf] * len(stacks)
    for _round in range(3):  # taking turns, so one slow moment of the host does not hit one side
        for i, stack in enumerate(stacks):
            best[i] = min(best[i], _weight_pass_s(stack, example=x, settings=once))
    extra = sum(w * b for w, b in zip(weights, best, strict=True))
    return max(extra, 0.0) / visits if visits else 0.0
