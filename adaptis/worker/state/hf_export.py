"""A Hugging Face job's checkpoint out to a directory ``from_pretrained`` loads.

Sits beside the checkpoints (:mod:`adaptis.worker.state.checkpoint`), whose files of one step it
reads (each rank's parameters, under transformers' names), and under ``adaptis export``
(:mod:`adaptis.cli.export`). :func:`export_checkpoint` merges the ranks' files into
``model.safetensors`` beside the model's ``config.json``; a tied LM head is written once, as
``save_pretrained`` writes a tied model.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from adaptis.api.model import HuggingFaceModel
from adaptis.worker.errors import WorkerError
from adaptis.worker.models.hf.stages import hf_config
from adaptis.worker.models.hf.weights import HEAD_TENSOR

__all__ = ["export_checkpoint"]

log = logging.getLogger(__name__)


def export_checkpoint(model: HuggingFaceModel, *, checkpoint: str | Path, out: str | Path) -> Path:
    """Merge the ranks' files of one checkpoint step (a ``step-*`` directory) into ``out``:
    ``config.json`` and ``model.safetensors``, loadable by ``from_pretrained``."""
    from safetensors.torch import save_file

    step_dir = Path(checkpoint)
    files = sorted(step_dir.glob("rank-*.pt"))
    if not files:
        raise WorkerError(f"export: no rank-*.pt checkpoint files in {step_dir}")
    config = hf_config(model)
    state: dict[str, torch.Tensor] = {}
    for f in files:
        for name, tensor in torch.load(f, weights_only=False)["model"].items():
            state.setdefault(name, tensor.detach().cpu().contiguous())
    if getattr(config, "tie_word_embeddings", False):
        state.pop(HEAD_TENSOR, None)  # one tensor, as save_pretrained writes a tied model
    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    config.use_cache = True  # what inference after export expects
    config.save_pretrained(target)
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    log.info("exported %d tensors of %s to %s", len(state), step_dir, target)
    return target
