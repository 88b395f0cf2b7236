"""Weights of a Hugging Face model in: local safetensors into this rank's stages.

Sits under :mod:`adaptis.worker.models.hf.stages`, whose :func:`build_hf_stages` hands it the
parameters of the stages it built. :func:`load_stage_weights` reads, from the directory
``spec.model.huggingface.weights`` names (as ``save_pretrained`` writes it: one
``model.safetensors`` or shards with ``model.safetensors.index.json``), only the tensors of
this rank's layers; a tied LM head held apart from its embedding reads the embedding's tensor,
as transformers does. Nothing is downloaded. Out, the trained checkpoints to a directory
``from_pretrained`` loads: :mod:`adaptis.worker.state.hf_export`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path

import torch

from adaptis.worker.errors import WorkerError

__all__ = ["HEAD_TENSOR", "load_stage_weights", "weight_files"]

log = logging.getLogger(__name__)

_EMBEDDING = "model.embed_tokens.weight"
HEAD_TENSOR = "lm_head.weight"


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
            out.update(dict.fromkeys(fh.keys(), f))  # safe_open is no dict
    return out


def load_stage_weights(wanted: Mapping[str, torch.nn.Parameter], *, directory: str | Path) -> int:
    """Copy this process's tensors into its stages' parameters (``wanted``: by transformers'
    name); returns how many were read."""
    from safetensors import safe_open

    root = Path(directory)
    if not root.is_dir():
        raise WorkerError(f"spec.model.huggingface.weights: {root} is not a directory")
    where = weight_files(root)
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for name in wanted:
        source = name if name in where else (_EMBEDDING if name == HEAD_TENSOR else None)
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


