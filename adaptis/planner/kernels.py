"""How many operators one microbatch's pass through each of the zoo's layers runs.

Sits beside the FLOP estimate (:mod:`adaptis.planner.estimate`), which charges each one a fixed
cost where the device's per-operator cost is known. Why: small layers are dominated by it. On
2 CPU cores, blocks of hidden 64 measured 1.3-2.1 ms a forward where their FLOPs take 0.3-0.5
ms, while the 32K-vocabulary head, a few large matmuls, ran at its FLOP rate; counting FLOPs
alone made ``adaptis run --profile estimate`` put every block beside a lone head and predict a
41 % bubble where the run measured 21 % (issue 16).

The counts are torch's dispatched operators of :mod:`adaptis.worker.models.layers` (forward, and the
whole backward pass), counted once and written here as functions of the block's options;
``tests/worker/test_worker_kernels.py`` counts them again on the real layers and fails when they
drift by more than a quarter. The backward pass is split between the input-gradient pass (B: two
thirds, where the elementwise work runs) and the weight-gradient pass (W: the third, one matmul
per weight); the first layer's whole backward is its W, as torch's first stage runs it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from adaptis.api.job import BlockSpec, TrainingSpec
from adaptis.api.model import ZooModel

__all__ = ["Kernels", "block_kernels", "embedding_kernels", "head_kernels"]

#: Operators of the Mamba scan per chunk, and the projections', convolution's and norm's around it.
MAMBA_CHUNK_OPS, MAMBA_OPS = (71, 109), (24, 38)
#: (forward, backward pass) operators of: the MLP (gelu; swiglu adds its gate), the attention part
#: of a block with its norm and residual, rotary positions' extra, the MoE router and combine,
#: and each expert (its MLP, gather and scatter).
MLP_OPS, SWIGLU_EXTRA = (17, 42), (5, 12)
ATTENTION_OPS, ROPE_EXTRA = (23, 45), (35, 20)
ROUTER_OPS, EXPERT_OPS = (18, 42), (13, 25)
#: The embedding's gather; the head's norm and projection with the loss applied to it.
EMBEDDING_OPS, HEAD_OPS = (1, 5), (16, 36)


@dataclass(frozen=True, slots=True)
class Kernels:
    """Operators of one microbatch's F, B and W through a layer."""

    forward: float
    backward: float
    weight: float


def _split(forward: float, backward_pass: float) -> Kernels:
    return Kernels(forward, backward_pass * 2.0 / 3.0, backward_pass / 3.0)


def _plus(*parts: tuple[float, float]) -> tuple[float, float]:
    return sum(p[0] for p in parts), sum(p[1] for p in parts)


def _mlp(model: ZooModel) -> tuple[float, float]:
    return _plus(MLP_OPS, SWIGLU_EXTRA) if model.mlp == "swiglu" else MLP_OPS


def _attention(model: ZooModel) -> tuple[float, float]:
    return _plus(ATTENTION_OPS, ROPE_EXTRA) if model.positions == "rope" else ATTENTION_OPS


def block_kernels(block: BlockSpec, *, model: ZooModel, training: TrainingSpec, chunk: int) -> Kernels:
    """One block's operators; ``chunk``: the Mamba scan's tokens per chunk."""
    if block.kind == "mamba":
        chunks = math.ceil(training.sequence_length / chunk)
        return _split(MAMBA_OPS[0] + chunks * MAMBA_CHUNK_OPS[0], MAMBA_OPS[1] + chunks * MAMBA_CHUNK_OPS[1])
    if block.kind == "dense":
        return _split(*_mlp(model))
    if block.kind == "attention":
        return _split(*_plus(_attention(model), _mlp(model)))
    # MoE: the attention part, the router, and every expert (each runs, tokens or not).
    expert = _plus(EXPERT_OPS, SWIGLU_EXTRA) if model.mlp == "swiglu" else EXPERT_OPS
    return _split(*_plus(_attention(model), ROUTER_OPS,
                         (block.experts * expert[0], block.experts * expert[1])))


def embedding_kernels() -> Kernels:
    return Kernels(EMBEDDING_OPS[0], 0.0, EMBEDDING_OPS[1])


def head_kernels() -> Kernels:
    return _split(*HEAD_OPS)
