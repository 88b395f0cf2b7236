"""How a stage computes: its precision (bf16 autocast or fp32) and activation recomputation.

Sits between the executor (:mod:`adaptis.worker.runtime.executor`), which builds this rank's
:class:`~adaptis.worker.models.zoo.StageModule` objects and keeps them for checkpoints and the tied
embedding, and the torch adapter (:mod:`adaptis.worker.runtime.pipelining`), which runs what
:func:`wrap_stage` returns. The profiler (:mod:`adaptis.worker.profiling.profiler`) times layers
through :func:`compute_context` so a layer is measured in the precision the worker runs it in.

bf16 (docs/precision.md): the weights, their gradients and the optimizer state stay fp32 (the master
copy); the forward runs under ``torch.autocast(dtype=bfloat16)`` so matmuls compute in bf16 and
reductions (norms, softmax, the loss) in fp32, and every layer's output is rounded to bf16. The last
rule makes the numerics independent of the partition (a stage boundary is a layer boundary, and what
crosses it is that layer's bf16 output, half the bytes of fp32) and makes the dtype a stage really
outputs the one :class:`~adaptis.worker.runtime.pipelining.StageShapes` declares, which torch's
pipelining checks.

Recomputation wraps the stage's layers in ``torch.utils.checkpoint`` (non-reentrant): the
forward keeps only the stage input, and the backward runs the forward again. Plans may mark
only stages with fused backwards (:meth:`adaptis.api.plan.Plan.check` says why).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from adaptis.api.job import resolve_precision
from adaptis.worker.models.zoo import StageModule

__all__ = ["PRECISION_DTYPE", "StageRunner", "compute_context", "resolve_precision", "wrap_stage"]

#: The dtype of the tensors that cross layer and stage boundaries in each precision.
PRECISION_DTYPE: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp32": torch.float32}


@contextlib.contextmanager
def compute_context(precision: str, *, device: torch.device) -> Iterator[None]:
    """The autocast region of a forward in ``precision`` (a no-op for fp32)."""
    if precision == "bf16":
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            yield
    else:
        yield


class StageRunner(nn.Module):
    """A stage as the pipeline runs it: its layers in ``precision``, optionally recomputed.

    Holds the stage as a submodule, so its parameters are the stage's own (the optimizer,
    checkpoints and torch's backward passes see the same tensors)."""

    def __init__(self, stage: nn.Module, *, precision: str, recompute: bool,
                 device: torch.device) -> None:
        super().__init__()
        self.stage = stage
        self.precision = precision
        self.recompute = recompute
        self._device = device
        self._dtype = PRECISION_DTYPE[precision]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute:
            return checkpoint(self._layers, x, use_reentrant=False)
        return self._layers(x)

    def _layers(self, x: torch.Tensor) -> torch.Tensor:
        # A zoo stage rounds after each of its layers; another stage (a Hugging Face model's own
        # modules, adaptis.worker.models.hf.stages) runs whole under autocast, rounded at its end:
        # its ``layers`` are decoder layers that need the stage's rotary embedding and masks, so
        # they are never called one by one here.
        layers = self.stage.layers if isinstance(self.stage, StageModule) else [self.stage]
        with compute_context(self.precision, device=self._device):
            for layer in layers:
                x = layer(x)
                if x.is_floating_point() and x.dtype != self._dtype:
                    x = x.to(self._dtype)
        return x


def wrap_stage(stage: nn.Module, *, precision: str, recompute: bool,
               device: torch.device) -> nn.Module:
    """``stage`` itself when it runs plain fp32 without recompute (nothing to add), else its
    :class:`StageRunner`."""
    if precision == "fp32" and not recompute:
        return stage
    return StageRunner(stage, precision=precision, recompute=recompute, device=device)
