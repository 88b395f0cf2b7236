"""The stages of a job's model, of either kind: the one place the worker's models tell them apart.

Sits in :mod:`adaptis.worker.models` above its two builders, :func:`adaptis.worker.models.zoo.
build_stages` (the block zoo) and :func:`adaptis.worker.models.hf.stages.build_hf_stages` (a
Hugging Face model's own modules); the executor builds its stages here.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from adaptis.api.model import HuggingFaceModel, Model
from adaptis.worker.models.hf.stages import build_hf_stages
from adaptis.worker.models.zoo import build_stages

__all__ = ["build_model_stages"]


def build_model_stages(model: Model, *, stages: Sequence[tuple[int, int]], seed: int) -> list[nn.Module]:
    """This process's stages (``[lo, hi)`` ranges) of ``model``, each built from its own seed."""
    if isinstance(model, HuggingFaceModel):
        return list(build_hf_stages(model, stages=stages, seed=seed))
    return list(build_stages(model, stages=stages, seed=seed))
