"""The layer zoo: small but real heterogeneous blocks in plain torch.

Sits under :mod:`adaptis.worker.models.zoo`, which turns an AdaPtisJob's ``ZooModel`` into a list of
these layers. Each layer maps ``[batch, seq, hidden]`` to the same shape (the embedding takes token
ids, the head returns vocabulary logits), so any contiguous run of them is a pipeline stage. The
blocks carry the heterogeneity of method.md: attention (+MLP) decoder blocks (multi-head or
grouped-query, no positions or rotary ones, gelu or swiglu MLPs of any width), MoE blocks with a
top-k router and its load-balancing loss (:mod:`adaptis.worker.models.moe`), Mamba-2 style selective
state-space blocks (a chunked scan, :mod:`adaptis.worker.models.ssm`), dense MLP blocks, and a
large-vocabulary head. docs/models.md says why each is built as it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from adaptis.worker.models.moe import MixtureOfExperts
from adaptis.worker.models.ssm import SelectiveSSM

__all__ = [
    "AttentionBlock",
    "BlockOptions",
    "DenseBlock",
    "Embedding",
    "Head",
    "MambaBlock",
    "MoEBlock",
    "apply_rotary",
    "init_parameters",
]

_INIT_STD = 0.02


class Embedding(nn.Embedding):
    """Token ids ``[b, s]`` (int64) to hidden states ``[b, s, h]``. An ``nn.Embedding`` so that
    torch's tensor parallelism can shard it on the vocabulary (``RowwiseParallel``)."""

    def __init__(self, *, vocab_size: int, hidden: int) -> None:
        # An explicit empty weight: nn.Embedding's own init would draw from the global RNG,
        # which init_parameters never touches.
        super().__init__(vocab_size, hidden, _weight=torch.empty(vocab_size, hidden))


class Head(nn.Module):
    """Final norm and the vocabulary projection ``proj`` (an ``nn.Linear``, so that tensor
    parallelism can shard it on the vocabulary); the loss is applied outside (by the schedule)."""

    def __init__(self, *, vocab_size: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden)
        self.proj = nn.Linear(hidden, vocab_size, bias=False)

    @property
    def weight(self) -> torch.Tensor:
        """The ``[vocab, hidden]`` projection (the tied embedding's twin)."""
        return self.proj.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


def apply_rotary(x: torch.Tensor, *, theta: float, offset: int = 0) -> torch.Tensor:
    """Rotary position embedding of ``x`` ``[b, heads, s, d]`` at positions ``offset ..
    offset + s - 1``: feature pairs ``(i, i + d/2)`` turn by ``position * theta^(-2i/d)`` (the
    "rotate half" layout of GPT-NeoX and Llama in Hugging Face). A query at ``m`` dotted with a
    key at ``n`` then depends on ``m - n`` only. Computed in float32, returned in x's dtype."""
    d = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    pos = torch.arange(offset, offset + x.shape[-2], device=x.device, dtype=torch.float32)
    angles = torch.outer(pos, inv_freq)  # [s, d/2]
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class _Attention(nn.Module):
    """Causal self-attention; grouped-query when ``kv_heads < heads`` (each key/value head
    serves ``heads / kv_heads`` query heads); rotary positions when ``rope_theta`` is set.

    Separate ``q``, ``k`` and ``v`` projections (not one fused one): tensor parallelism shards
    each on its heads (``ColwiseParallel``) and ``out`` on its input (``RowwiseParallel``), and
    the forward reads the head counts from the projections' widths, so the same code runs a
    rank's ``heads / T`` local heads."""

    def __init__(self, *, hidden: int, heads: int, kv_heads: int | None = None,
                 rope_theta: float | None = None) -> None:
        super().__init__()
        self.heads = heads
        self.kv_heads = heads if kv_heads is None else kv_heads
        self.head_dim = hidden // heads
        self.rope_theta = rope_theta
        kv_width = self.kv_heads * self.head_dim
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.k = nn.Linear(hidden, kv_width, bias=False)
        self.v = nn.Linear(hidden, kv_width, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)

    def project(self, x: torch.Tensor, *, offset: int = 0) -> tuple[torch.Tensor, ...]:
        """Queries ``[b, heads, s, d]``, keys and values ``[b, kv_heads, s, d]`` (this rank's
        heads under tensor parallelism), positions applied (tokens at ``offset ..``)."""
        b, s, _ = x.shape
        d = self.head_dim
        q, k, v = (proj(x) for proj in (self.q, self.k, self.v))
        q = q.view(b, s, q.shape[-1] // d, d).transpose(1, 2)
        k = k.view(b, s, k.shape[-1] // d, d).transpose(1, 2)
        v = v.view(b, s, v.shape[-1] // d, d).transpose(1, 2)
        if self.rope_theta is not None:
            q = apply_rotary(q, theta=self.rope_theta, offset=offset)
            k = apply_rotary(k, theta=self.rope_theta, offset=offset)
        return q, k, v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.project(x)
        gqa = q.shape[1] != k.shape[1]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return self.out(y.transpose(1, 2).reshape(b, s, q.shape[1] * self.head_dim))


class _MLP(nn.Module):
    """``down(gelu(up x))``, or with ``kind="swiglu"`` ``down(silu(gate x) * up x)``."""

    def __init__(self, *, hidden: int, inner: int, kind: str = "gelu") -> None:
        super().__init__()
        self.kind = kind
        self.up = nn.Linear(hidden, inner, bias=False)
        if kind == "swiglu":
            self.gate = nn.Linear(hidden, inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.down(F.gelu(self.up(x)))


@dataclass(frozen=True, slots=True)
class BlockOptions:
    """What the attention and MLP of every block of a model share (from ``ZooModel``); the
    defaults are the plain blocks (multi-head, no positions, gelu)."""

    kv_heads: int | None = None
    rope_theta: float | None = None
    mlp: str = "gelu"


_PLAIN = BlockOptions()


def _attention(hidden: int, heads: int, *, opts: BlockOptions) -> _Attention:
    return _Attention(hidden=hidden, heads=heads, kv_heads=opts.kv_heads,
                      rope_theta=opts.rope_theta)


class AttentionBlock(nn.Module):
    """Pre-norm decoder block: causal self-attention then an MLP of width ``inner`` (4 x hidden
    unless set)."""

    def __init__(self, *, hidden: int, heads: int, inner: int | None = None,
                 opts: BlockOptions = _PLAIN) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(hidden)
        self.attn = _attention(hidden, heads, opts=opts)
        self.norm2 = nn.RMSNorm(hidden)
        self.mlp = _MLP(hidden=hidden, inner=inner or 4 * hidden, kind=opts.mlp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class MoEBlock(nn.Module):
    """DeepSeek-style MoE layer: causal self-attention then a top-k mixture of experts, each an
    MLP of width ``inner`` (2 x hidden unless set)."""

    def __init__(self, *, hidden: int, heads: int, experts: int, top_k: int,
                 inner: int | None = None, aux_loss_coef: float = 0.0,
                 opts: BlockOptions = _PLAIN) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(hidden)
        self.attn = _attention(hidden, heads, opts=opts)
        self.norm2 = nn.RMSNorm(hidden)
        self.moe = MixtureOfExperts(hidden=hidden, experts=experts, top_k=top_k,
                                    inner=inner or 2 * hidden, mlp=opts.mlp,
                                    aux_loss_coef=aux_loss_coef)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.moe(self.norm2(x))


class MambaBlock(nn.Module):
    """Pre-norm selective state-space block (Nemotron-H's Mamba layers)."""

    def __init__(self, *, hidden: int, heads: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden)
        self.ssm = SelectiveSSM(hidden=hidden, heads=heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ssm(self.norm(x))


class DenseBlock(nn.Module):
    """Pre-norm MLP-only block."""

    def __init__(self, *, hidden: int, inner: int | None = None, mlp: str = "gelu") -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden)
        self.mlp = _MLP(hidden=hidden, inner=inner or 4 * hidden, kind=mlp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def init_parameters(module: nn.Module, *, generator: torch.Generator) -> None:
    """Initialise every parameter of ``module`` from ``generator`` alone, in name order.

    Global RNG state is never touched, so a layer's weights depend only on its seed: the same
    model comes out whatever the partition, placement or process.
    """
    with torch.no_grad():
        for name, param in sorted(module.named_parameters(), key=lambda kv: kv[0]):
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "A_log":
                param.copy_(torch.log(torch.linspace(1.0, 8.0, param.numel())))
            elif leaf == "dt_bias":
                # softplus^-1 of a step size spread over [1e-3, 1e-1], as Mamba does.
                dt = torch.exp(torch.linspace(math.log(1e-3), math.log(1e-1), param.numel()))
                param.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif leaf == "D" or (param.dim() == 1 and "norm" in name):
                param.fill_(1.0)
            elif param.dim() == 1:
                param.zero_()
            else:
                param.normal_(0.0, _INIT_STD, generator=generator)
