"""From an AdaPtisJob's zoo model (:class:`~adaptis.api.model.ZooModel`) to torch modules: the
layer list, stages, the whole model.

The model's layer list is the planner's view of it: ``embedding``, each block in order, then
``head`` (``2 + sum(counts)`` layers). A plan's ``stages[s] = [lo, hi)`` index this list.
Every layer is initialised from its own seed (``seed``, layer index), so the weights are the
same whatever the partition and whichever process builds them. Tied embeddings: the head
reuses the embedding's seed; on one process the two share one ``Parameter``, across processes
each holds a copy kept equal by a gradient sync (see :mod:`adaptis.worker.runtime.executor`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from adaptis.api.job import BlockSpec
from adaptis.api.model import ZooModel
from adaptis.worker.errors import WorkerError
from adaptis.worker.models.layers import (
    AttentionBlock,
    BlockOptions,
    DenseBlock,
    Embedding,
    Head,
    MambaBlock,
    MoEBlock,
    init_parameters,
)
from adaptis.worker.models.moe import MixtureOfExperts

__all__ = [
    "LayerInfo",
    "StageModule",
    "build_layer",
    "build_model",
    "build_stages",
    "find_layer",
    "layer_parameters",
    "model_layers",
    "moe_layers",
    "set_aux_loss_scale",
    "token_loss",
]

_M = TypeVar("_M", bound=nn.Module)
_SEED_STRIDE = 1_000_003  # keeps (seed, layer) pairs from colliding for < 1M layers


@dataclass(frozen=True, slots=True)
class LayerInfo:
    """One entry of the model's layer list. ``kind``: embedding, head or a block kind."""

    name: str
    kind: str
    block: BlockSpec | None = None


def model_layers(model: ZooModel) -> list[LayerInfo]:
    """The layer list in pipeline order: embedding, every block, head."""
    layers = [LayerInfo(name="embedding", kind="embedding")]
    index = 0
    for block in model.blocks:
        for _ in range(block.count):
            layers.append(LayerInfo(name=f"{block.kind}_{index}", kind=block.kind, block=block))
            index += 1
    layers.append(LayerInfo(name="head", kind="head"))
    return layers


def build_layer(model: ZooModel, *, index: int, seed: int) -> nn.Module:
    """Build and initialise layer ``index`` of the layer list (float32, on CPU)."""
    layers = model_layers(model)
    if not 0 <= index < len(layers):
        raise WorkerError(f"layer index {index} outside the model's {len(layers)} layers")
    info = layers[index]
    h = model.hidden
    opts = BlockOptions(kv_heads=model.kv_heads, mlp=model.mlp,
                        rope_theta=model.rope_theta if model.positions == "rope" else None)
    module: nn.Module
    if info.kind == "embedding":
        module = Embedding(vocab_size=model.vocab_size, hidden=h)
    elif info.kind == "head":
        module = Head(vocab_size=model.vocab_size, hidden=h)
    elif info.block is None:
        raise WorkerError(f"layer {info.name}: a {info.kind!r} layer without its block spec")
    elif info.kind == "attention":
        module = AttentionBlock(hidden=h, heads=model.heads, inner=model.mlp_width(info.block),
                                opts=opts)
    elif info.kind == "mamba":
        module = MambaBlock(hidden=h, heads=model.heads)
    elif info.kind == "dense":
        module = DenseBlock(hidden=h, inner=model.mlp_width(info.block), mlp=model.mlp)
    elif info.kind == "moe":
        b = info.block
        module = MoEBlock(hidden=h, heads=model.heads, experts=b.experts, top_k=b.top_k,
                          inner=model.mlp_width(b), aux_loss_coef=b.aux_loss_coef, opts=opts)
    else:
        raise WorkerError(f"layer {info.name}: unknown kind {info.kind!r}")
    gen = torch.Generator().manual_seed(seed * _SEED_STRIDE + index)
    init_parameters(module, generator=gen)
    if info.kind == "head" and model.tie_embeddings:
        # Tied: start from exactly the embedding's weights (same seed, same draw).
        emb_gen = torch.Generator().manual_seed(seed * _SEED_STRIDE + 0)
        with torch.no_grad():
            module.weight.normal_(0.0, 0.02, generator=emb_gen)  # type: ignore[operator]
    return module


class StageModule(nn.Module):
    """A contiguous run ``[lo, hi)`` of the layer list, applied in order."""

    def __init__(self, layers: Sequence[nn.Module], *, lo: int, hi: int) -> None:
        super().__init__()
        self.lo, self.hi = lo, hi
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    # What the executor and checkpoints ask of any stage, zoo or Hugging Face (HFStage).
    #: The reference model names a tied embedding/head weight under both layer indices.
    names_tied_weight_once = False

    def global_parameters(self) -> dict[str, nn.Parameter]:
        """Parameters by partition-independent name (:func:`layer_parameters`)."""
        return layer_parameters(self)

    @property
    def embedding_weight(self) -> torch.Tensor | None:
        emb = find_layer([self], Embedding)
        return emb.weight if emb is not None else None

    @property
    def head_weight(self) -> torch.Tensor | None:
        head = find_layer([self], Head)
        return head.weight if head is not None else None


def build_stages(
    model: ZooModel, *, stages: Sequence[tuple[int, int]], seed: int
) -> list[StageModule]:
    """Build the given stages (``[lo, hi)`` ranges) of one process, sharing the tied weight
    when this process holds both the embedding and the head."""
    built = [
        StageModule([build_layer(model, index=i, seed=seed) for i in range(lo, hi)], lo=lo, hi=hi)
        for lo, hi in stages
    ]
    if model.tie_embeddings:
        emb = find_layer(built, Embedding)
        head = find_layer(built, Head)
        if emb is not None and head is not None:
            head.proj.weight = emb.weight
    return built


def build_model(model: ZooModel, *, seed: int) -> StageModule:
    """The whole model as one stage: the single-process reference of every parity test."""
    n = len(model_layers(model))
    return build_stages(model, stages=[(0, n)], seed=seed)[0]


def find_layer(stages: Sequence[nn.Module], kind: type[_M]) -> _M | None:
    """The first module of type ``kind`` inside ``stages`` (None when absent)."""
    for stage in stages:
        for module in stage.modules():
            if isinstance(module, kind):
                return module
    return None


def layer_parameters(stage: StageModule) -> dict[str, nn.Parameter]:
    """A stage's parameters named ``<global layer index>.<name inside the layer>``: the same
    names whatever the partition, so a pipeline's gradients compare with the reference's."""
    return {
        f"{stage.lo + k}.{name}": p
        for k, layer in enumerate(stage.layers)
        for name, p in layer.named_parameters()
    }


def moe_layers(modules: Sequence[nn.Module]) -> list[MixtureOfExperts]:
    """Every mixture of experts inside ``modules``, in order."""
    return [m for module in modules for m in module.modules() if isinstance(m, MixtureOfExperts)]


def set_aux_loss_scale(modules: Sequence[nn.Module], *, scale: float) -> None:
    """Scale the MoE load-balancing gradients as the token loss is scaled (``1/microbatches``),
    so a step's aux term is the mean over its microbatches, like its token loss."""
    for moe in moe_layers(modules):
        moe.aux_grad_scale = scale


def token_loss(logits: torch.Tensor, targets: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
    """Mean next-token cross-entropy of one microbatch, times ``scale`` (1/microbatches, so that
    the sum over microbatches is the batch mean and gradients need no rescaling)."""
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
    return loss * scale
