"""The ONE adapter over torch.distributed.pipelining's private runtime (torch 2.11 and 2.13).

Sits under :mod:`adaptis.worker.runtime.executor`; nothing else in AdaPtis imports a private torch
name. It hands torch's ``_PipelineScheduleRuntime`` one process's stages and *every* rank's
action list; torch infers the stage-to-rank placement from the lists, inserts the sends and
receives, and runs them. Why torch's runtime and not our own: it already runs arbitrary,
uneven and non-contiguous placements with any number of stages per rank, and its B/W split
(``I`` then ``W``) reuses the autograd graph instead of recomputing it. Its limits are ones our
plans respect: it only talks between consecutive stages (ours are contiguous layer ranges) and
every stage runs every microbatch. Known deviations, which the performance model must know:
on the first stage ``I`` computes nothing and ``W`` does the whole backward, and a split
microbatch keeps its saved activations until its ``W``.

Kinds map as: plan ``F`` -> torch ``F``; ``B`` (input gradient) -> ``I``; ``W`` -> ``W``;
``BW`` (fused) -> ``B``. Each compute call is timed through an
:class:`~adaptis.worker.runtime.timers.ActionTimer` so busy and idle time per rank are measured,
not inferred.

The profiler times a layer's backward passes through :func:`backward_input`,
:func:`backward_weight` and :func:`backward_full`: the very functions torch's stages call for
``I``, ``W`` and ``B``, so what is profiled is what the runtime spends (its split costs more
than its fused backward: the input pass walks the graph once more to find what ``W`` needs).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import _backward as _torch_backward
from torch.distributed.pipelining import schedules as _schedules

from adaptis.worker.errors import PlanMismatchError, TorchApiError
from adaptis.worker.runtime.timers import ActionTimer

__all__ = [
    "IdleRuntime",
    "PipelineRuntime",
    "SplitState",
    "StageShapes",
    "TORCH_KIND",
    "backward_full",
    "backward_kind_of",
    "backward_input",
    "backward_weight",
    "weight_pass_graph",
]

log = logging.getLogger(__name__)

#: The argument of torch's ``backward_one_chunk`` that says fused (True) or input-only (False).
_FULL_BACKWARD = "full_backward"

#: Plan action kind -> torch computation type.
TORCH_KIND: dict[str, str] = {"F": "F", "B": "I", "W": "W", "BW": "B"}


@dataclass(frozen=True, slots=True)
class StageShapes:
    """Static shapes of every microbatch boundary, so no shape-inference step is needed.
    ``sequence_shards`` T under sequence parallelism: the hidden activations between stages
    are this rank's ``s / T`` tokens (the token ids in and the logits out stay whole)."""

    microbatch_size: int
    sequence_length: int
    hidden: int
    vocab_size: int
    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    sequence_shards: int = 1

    def example_input(self, *, first: bool) -> torch.Tensor:
        b, s = self.microbatch_size, self.sequence_length
        if first:
            return torch.zeros(b, s, dtype=torch.long, device=self.device)
        # requires_grad matters (inputs and outputs): without it torch silently skips the
        # gradient transfer of that boundary.
        return torch.zeros(b, s // self.sequence_shards, self.hidden, dtype=self.dtype, device=self.device,
                           requires_grad=True)

    def example_output(self, *, last: bool) -> torch.Tensor:
        width = self.vocab_size if last else self.hidden
        s = self.sequence_length if last else self.sequence_length // self.sequence_shards
        return torch.zeros(self.microbatch_size, s, width, dtype=self.dtype,
                           device=self.device, requires_grad=True)


@dataclass(frozen=True, slots=True)
class SplitState:
    """What torch's input pass leaves for its weight pass (its parameter groups, opaque)."""

    groups: list[dict[str, Any]]


def backward_input(*, outputs: Sequence[torch.Tensor], output_grads: Sequence[torch.Tensor] | None,
                   inputs: Sequence[torch.Tensor], module: nn.Module) -> SplitState:
    """torch's ``I``: gradients of ``inputs`` (accumulated in their ``.grad``), the graph kept
    for :func:`backward_weight`. ``output_grads`` None: ``outputs`` is the loss. The outputs
    are detached, as the runtime does."""
    _dinputs, groups = _torch_backward.stage_backward_input(
        list(outputs), None if output_grads is None else list(output_grads), list(inputs), module.parameters())
    return SplitState(groups=groups)


def backward_weight(*, module: nn.Module, state: SplitState) -> None:
    """torch's ``W`` after :func:`backward_input`: the parameters' gradients, into ``.grad``."""
    _torch_backward.stage_backward_weight(module.parameters(), state.groups)


def backward_full(*, outputs: Sequence[torch.Tensor], output_grads: Sequence[torch.Tensor] | None,
                  inputs: Sequence[torch.Tensor]) -> None:
    """torch's fused ``B`` (our ``BW``, and ``W`` on the first stage): input and parameter
    gradients in one autograd pass."""
    out: Any = outputs[0] if len(outputs) == 1 else tuple(outputs)
    grads: Any = None if output_grads is None else (output_grads[0] if len(output_grads) == 1 else tuple(output_grads))
    _torch_backward.stage_backward(out, grads, list(inputs))


def weight_pass_graph(*, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                      module: nn.Module) -> tuple[int, int]:
    """(autograd nodes, parameter groups) of one forward's graph as torch's split passes see
    it: the input pass groups ``module``'s parameters by the graph nodes their gradients
    leave from, and the weight pass makes one autograd call per group, each walking the graph
    down to the stage's input. Nodes exclude the inputs' own (the previous layer's)."""
    roots = [n for n in map(_torch_backward._get_grad_fn_or_grad_acc, outputs) if n is not None]
    reverse = _torch_backward.construct_reverse_graph(roots)
    leaves = {n for n in map(_torch_backward._get_grad_fn_or_grad_acc, inputs) if n is not None}
    weights = [n for p in module.parameters() if p.requires_grad
               for n in [_torch_backward._get_grad_fn_or_grad_acc(p)] if n is not None]
    groups = _torch_backward.get_param_groups(list(leaves), weights, reverse) if leaves else []
    return len((set(reverse) | set(roots)) - leaves), len(groups)


class _Runtime(_schedules._PipelineScheduleRuntime):
    """torch's runtime with losses kept per microbatch index: torch's own list assumes the
    last stage runs its forwards in microbatch order, which a plan need not do."""

    def __init__(self, *args: Any, loss_by_mb: dict[int, torch.Tensor], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._loss_by_mb = loss_by_mb

    def _maybe_compute_loss(  # noqa: PLR0917 - torch's runtime calls its own method positionally
            self, stage: Any, output: Any, target_mbs: Any, mb_index: int, *_rest: Any, **_kw: Any) -> None:
        if stage.is_last and self._loss_fn is not None:
            self._loss_by_mb[mb_index] = self._loss_fn(output, target_mbs[mb_index])

    def _maybe_get_loss(self, stage: Any, mb_index: int) -> torch.Tensor | None:
        if stage.is_last and self._loss_fn is not None:
            return self._loss_by_mb[mb_index]
        return None


def _skip_self_warmup(stage: PipelineStage) -> None:
    """torch 2.11 warms up the neighbours of every stage with a send and a receive, also when
    the neighbour stage sits on this very rank (looped and V placements), and gloo has no
    connection to itself. Drop the ops whose peer is this rank; both ends of such a pair are
    local, so the warm-up stays matched. torch 2.13's vote protocol never calls this."""
    original = stage._get_init_p2p_neighbors_ops
    me = dist.get_rank()

    def filtered() -> list[dist.P2POp]:
        return [op for op in original() if getattr(op, "peer", None) != me]

    stage._get_init_p2p_neighbors_ops = filtered  # type: ignore[method-assign]


def backward_kind_of(backward_one_chunk: Callable[..., Any]) -> Callable[..., str]:
    """The plan kind (``BW`` fused, ``B`` input only) of each call of torch's private
    ``PipelineStage.backward_one_chunk``, read from its ``full_backward`` argument by name.

    Why by name: torch passes it positionally in some versions and by keyword in others, and a
    reordering of the private signature would otherwise swap B and BW timings silently. Raises
    :class:`TorchApiError`, naming the torch version, when the parameter is gone."""
    try:
        signature = inspect.signature(backward_one_chunk)
    except (TypeError, ValueError) as err:
        raise TorchApiError(
            f"torch {torch.__version__}: cannot read the signature of "
            f"PipelineStage.backward_one_chunk ({err}); AdaPtis supports torch 2.11 and 2.13"
        ) from err
    param = signature.parameters.get(_FULL_BACKWARD)
    if param is None or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
        raise TorchApiError(
            f"torch {torch.__version__}: PipelineStage.backward_one_chunk{signature} has no "
            f"parameter {_FULL_BACKWARD!r}, by which AdaPtis tells a fused backward (BW) from an "
            "input-gradient one (B); use torch 2.11 or 2.13 (constraints.txt)"
        )
    # A required parameter is always bound; the default only stands in when torch omits it.
    default = True if param.default is param.empty else param.default

    def kind_of(*args: Any, **kwargs: Any) -> str:
        bound = signature.bind(*args, **kwargs)
        return "BW" if bound.arguments.get(_FULL_BACKWARD, default) else "B"

    return kind_of


def _timed(fn: Callable[..., Any], timer: ActionTimer, *, kind_of: Callable[..., str],
           after: Callable[[str], None] | None = None) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        kind = kind_of(*args, **kwargs)
        with timer.measure(kind):
            out = fn(*args, **kwargs)
        if after is not None:
            after(kind)
        return out

    return wrapper


class PipelineRuntime:
    """One rank's share of a plan, runnable step after step.

    ``stage_ids`` are the global stage indices of ``modules`` (this rank's stages);
    ``actions[r]`` every rank's list of ``(kind, stage, microbatch)`` with plan kinds.
    """

    def __init__(
        self,
        *,
        modules: Sequence[nn.Module],
        stage_ids: Sequence[int],
        num_stages: int,
        actions: Sequence[Sequence[tuple[str, int, int]]],
        microbatches: int,
        shapes: StageShapes,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        timer: ActionTimer,
        group: dist.ProcessGroup | None = None,
        on_stage_grads: Callable[[int], None] | None = None,
    ) -> None:
        """``group``: the pipeline's process group (None: the world); ``actions`` are keyed by
        rank in it. ``on_stage_grads(stage)``: called once per step, right after the last
        weight-gradient action (``W`` or ``BW``) of that stage of this rank has run, so a
        data-parallel gradient reduction of the stage can start while the rest still runs."""
        self.timer = timer
        me = dist.get_rank(group)
        self._grad_actions = {sid: sum(1 for k, s, _mb in actions[me] if s == sid and k in ("W", "BW"))
                              for sid in stage_ids}
        self._grads_left: dict[int, int] = {}
        self._on_stage_grads = on_stage_grads
        self.losses: dict[int, torch.Tensor] = {}
        self.holds_first = 0 in stage_ids
        self.holds_last = num_stages - 1 in stage_ids
        self._stages: list[PipelineStage] = []
        for module, sid in zip(modules, stage_ids, strict=True):
            stage = PipelineStage(
                module, sid, num_stages, shapes.device,
                input_args=shapes.example_input(first=sid == 0),
                output_args=shapes.example_output(last=sid == num_stages - 1),
                group=group,
            )
            self._instrument(stage, sid)
            _skip_self_warmup(stage)
            self._stages.append(stage)

        def timed_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            # The loss belongs to the head's forward: count it as F time.
            with timer.measure("F"):
                return loss_fn(output, target)

        self._schedule = _Runtime(
            self._stages, microbatches, loss_fn=timed_loss, scale_grads=False,
            loss_by_mb=self.losses,
        )
        lists: dict[int, list[Any]] = {}
        for rank, acts in enumerate(actions):
            try:
                lists[rank] = [
                    _schedules._Action(int(s), _schedules._ComputationType(TORCH_KIND[k]), int(mb))
                    for k, s, mb in acts
                ]
            except KeyError as err:
                raise PlanMismatchError(f"plan: rank {rank}: unknown action kind {err}") from None
        try:
            self._schedule._prepare_schedule_with_comms(lists)
        except (AssertionError, RuntimeError, ValueError) as err:
            raise PlanMismatchError(f"torch pipelining rejected the plan: {err}") from err
        self._step_accepts_return_outputs = (
            "return_outputs" in inspect.signature(self._schedule.step).parameters
        )

    def _instrument(self, stage: PipelineStage, sid: int) -> None:
        t = self.timer

        def after(kind: str) -> None:
            # Count down this stage's weight-gradient actions; at zero its grads are final.
            if kind in ("W", "BW") and self._on_stage_grads is not None:
                self._grads_left[sid] -= 1
                if self._grads_left[sid] == 0:
                    self._on_stage_grads(sid)

        stage.forward_one_chunk = _timed(  # type: ignore[method-assign]
            stage.forward_one_chunk, t, kind_of=lambda *_a, **_k: "F",
        )
        stage.backward_one_chunk = _timed(  # type: ignore[method-assign]
            stage.backward_one_chunk, t, kind_of=backward_kind_of(stage.backward_one_chunk), after=after,
        )
        stage.backward_weight_one_chunk = _timed(  # type: ignore[method-assign]
            stage.backward_weight_one_chunk, t, kind_of=lambda *_a, **_k: "W", after=after,
        )

    def step(self, *, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> None:
        """Run every action of this rank for one batch; gradients accumulate in ``.grad``.

        ``inputs`` (token ids of the whole batch) only on the rank holding stage 0, ``targets``
        only on the rank holding the last stage; the others pass None.
        """
        self.losses.clear()
        self._grads_left = dict(self._grad_actions)
        args = (inputs,) if self.holds_first and inputs is not None else ()
        kwargs: dict[str, Any] = {}
        if self.holds_last:
            kwargs["target"] = targets
        if self._step_accepts_return_outputs:
            kwargs["return_outputs"] = False
        self._schedule.step(*args, **kwargs)

    def loss_sum(self) -> float:
        """Sum of this step's (scaled) microbatch losses; 0 on ranks without the last stage."""
        return float(sum(loss.detach().float().item() for loss in self.losses.values()))


class IdleRuntime:
    """The runtime of a rank the plan gives no stage and no action: it runs nothing.

    torch's pipelining refuses a schedule with an empty rank, so such a rank stays out of the
    pipeline's work group altogether (:func:`adaptis.worker.runtime.replicas.create_groups`); the
    executor still takes it through every collective of a step."""

    holds_first = False
    holds_last = False

    def __init__(self) -> None:
        self.losses: dict[int, torch.Tensor] = {}

    def step(self, *, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> None:
        del inputs, targets

    def loss_sum(self) -> float:
        return 0.0
