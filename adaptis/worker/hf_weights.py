"""Weights of a Hugging Face model in and out: local safetensors into the stages, the trained
checkpoints out to a directory ``AutoModelForCausalLM.from_pretrained`` loads.

Sits beside :mod:`adaptis.worker.hf_stages`. In: :func:`load_stage_weights` reads, from the
directory ``spec.model.huggingface.weights`` names (as ``save_pretrained`` writes it: one
``model.safetensors`` or shards with ``model.safetensors.index.json``), only the tensors of
this rank's layers; a tied LM head held apart from its embedding reads the embedding's tensor,
as transformers does. Nothing is downloaded. Out: :func:`export_checkpoint` merges the ranks'
checkpoint files of one step (:mod:`adaptis.worker.checkpoint`, parameters under transformers'
names) into ``model.safetensors`` beside the model's ``config.json``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from adaptis.api.job import ModelSpec
from adaptis.worker.errors import WorkerError
from adaptis.worker.hf_stages import HFStage, hf_config

__all__ = ["export_checkpoint", "load_stage_weights", "weight_files"]

log = logging.getLogger(__name__)

_EMBEDDING = "model.embed_tokens.weight"
_HEAD = "lm_head.weight"


def weight_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (from the index, else every file's
    header: reading the header of a file reads none of its tensors)."""
    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        mapping = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in mapping.items()}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise WorkerError(f"spec.model.huggingface.weights: no *.safetensors in {directory} "
                          "(nothing is downloaded: mount the model's files there)")
    out: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            out.update({name: f for name in fh.keys()})  # noqa: SIM118 (safe_open is no dict)
    return out


def load_stage_weights(stages: Sequence[HFStage], *, directory: str | Path) -> int:
    """Copy this process's tensors into its stages; returns how many were read."""
    from safetensors import safe_open

    root = Path(directory)
    if not root.is_dir():
        raise WorkerError(f"spec.model.huggingface.weights: {root} is not a directory")
    where = weight_files(root)
    wanted: dict[str, torch.nn.Parameter] = {}
    for stage in stages:
        wanted.update(stage.global_parameters())
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for name in wanted:
        source = name if name in where else (_EMBEDDING if name == _HEAD else None)
        if source is None or source not in where:
            raise WorkerError(f"spec.model.huggingface.weights: {root} has no tensor {name!r} "
                              "(another model's weights?)")
        by_file.setdefault(where[source], []).append((name, source))
    with torch.no_grad():
        for file, names in by_file.items():
            with safe_open(str(file), framework="pt") as fh:
                for name, source in names:
                    tensor = fh.get_tensor(source)
                    param = wanted[name]
                    if tuple(tensor.shape) != tuple(param.shape):
                        raise WorkerError(f"spec.model.huggingface.weights: {name} in {file} has "
                                          f"shape {tuple(tensor.shape)}; the config makes "
                                          f"{tuple(param.shape)}")
                    param.copy_(tensor.to(dtype=param.dtype))
    log.info("read %d tensors of this rank's layers from %s", len(wanted), root)
    return len(wanted)


def export_checkpoint(model: ModelSpec, *, checkpoint: str | Path, out: str | Path) -> Path:
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
        state.pop(_HEAD, None)  # one tensor, as save_pretrained writes a tied model
    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    config.use_cache = True  # what inference after export expects
    config.save_pretrained(target)
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    log.info("exported %d tensors of %s to %s", len(state), step_dir, target)
    return target
