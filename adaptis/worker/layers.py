"""The layer zoo: small but real heterogeneous blocks in plain torch.

Sits under :mod:`adaptis.worker.models`, which turns an AdaPtisJob ``ModelSpec`` into a list of
these layers. Each layer maps ``[batch, seq, hidden]`` to the same shape (the embedding takes
token ids, the head returns vocabulary logits), so any contiguous run of them is a pipeline
stage. The blocks carry the heterogeneity of method.md: attention (+MLP) decoder blocks, MoE
blocks with a top-k router, Mamba-2 style selective state-space blocks (a chunk-free quadratic
"SSD" form, exact and simple), dense MLP blocks, and a large-vocabulary head.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "AttentionBlock",
    "DenseBlock",
    "Embedding",
    "Head",
    "MambaBlock",
    "MoEBlock",
    "init_parameters",
]

_INIT_STD = 0.02


class Embedding(nn.Module):
    """Token ids ``[b, s]`` (int64) to hidden states ``[b, s, h]``."""

    def __init__(self, *, vocab_size: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight)


class Head(nn.Module):
    """Final norm and the vocabulary projection; the loss is applied outside (by the schedule)."""

    def __init__(self, *, vocab_size: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden)
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(x), self.weight)


class _Attention(nn.Module):
    def __init__(self, *, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, h))


class _MLP(nn.Module):
    def __init__(self, *, hidden: int, inner: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class _MoE(nn.Module):
    """Top-k routed experts. Every expert runs (possibly on zero tokens) so that every parameter
    is in the autograd graph of every microbatch: gradients are zeros, never missing."""

    def __init__(self, *, hidden: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = min(top_k, experts)
        inner = 2 * hidden
        self.router = nn.Linear(hidden, experts, bias=False)
        self.w_up = nn.Parameter(torch.empty(experts, hidden, inner))
        self.w_down = nn.Parameter(torch.empty(experts, inner, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = torch.softmax(self.router(flat), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e in range(self.w_up.shape[0]):
            token, slot = torch.nonzero(chosen == e, as_tuple=True)
            hidden = F.gelu(flat[token] @ self.w_up[e]) @ self.w_down[e]
            out = out.index_add(0, token, hidden * weights[token, slot].unsqueeze(-1))
        return out.view(shape)


class _SelectiveSSM(nn.Module):
    """Mamba-2 style selective scan: input-dependent step ``dt``, B and C; scalar decay per head.

    Computed in the exact quadratic form ``y_t = sum_{u<=t} C_t.B_u * exp(sum_{u<j<=t} dt_j A)
    * dt_u * x_u`` (the SSD "attention" form), which is a plain batched matmul on CPU.
    """

    def __init__(self, *, hidden: int, heads: int, state: int = 16, conv: int = 4) -> None:
        super().__init__()
        self.inner = 2 * hidden
        self.heads = heads
        self.state = state
        self.in_proj = nn.Linear(hidden, 2 * self.inner + 2 * state + heads, bias=False)
        conv_dim = self.inner + 2 * state
        self.conv = nn.Conv1d(conv_dim, conv_dim, conv, groups=conv_dim, padding=conv - 1)
        self.A_log = nn.Parameter(torch.empty(heads))
        self.dt_bias = nn.Parameter(torch.empty(heads))
        self.D = nn.Parameter(torch.empty(heads))
        self.norm = nn.RMSNorm(self.inner)
        self.out_proj = nn.Linear(self.inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        z, xbc, dt = self.in_proj(x).split([self.inner, self.inner + 2 * self.state, self.heads], -1)
        xbc = F.silu(self.conv(xbc.transpose(1, 2))[..., :s].transpose(1, 2))
        xs, bm, cm = xbc.split([self.inner, self.state, self.state], dim=-1)
        xs = xs.reshape(b, s, self.heads, self.inner // self.heads)
        dt = F.softplus(dt + self.dt_bias)  # [b, s, heads]
        log_decay = torch.cumsum(dt * -torch.exp(self.A_log), dim=1).transpose(1, 2)  # [b, H, s]
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        seg = (log_decay.unsqueeze(-1) - log_decay.unsqueeze(-2)).masked_fill(~causal, -math.inf)
        mix = torch.exp(seg) * (cm @ bm.transpose(1, 2)).unsqueeze(1)  # [b, H, s, s]
        y = mix @ (xs * dt.unsqueeze(-1)).transpose(1, 2)  # [b, H, s, p]
        y = y.transpose(1, 2) + xs * self.D.view(1, 1, -1, 1)
        y = self.norm(y.reshape(b, s, self.inner) * F.silu(z))
        return self.out_proj(y)


class AttentionBlock(nn.Module):
    """Pre-norm decoder block: causal self-attention then an MLP."""

    def __init__(self, *, hidden: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(hidden)
        self.attn = _Attention(hidden=hidden, heads=heads)
        self.norm2 = nn.RMSNorm(hidden)
        self.mlp = _MLP(hidden=hidden, inner=4 * hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class MoEBlock(nn.Module):
    """DeepSeek-style MoE layer: causal self-attention then a top-k mixture of experts."""

    def __init__(self, *, hidden: int, heads: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(hidden)
        self.attn = _Attention(hidden=hidden, heads=heads)
        self.norm2 = nn.RMSNorm(hidden)
        self.moe = _MoE(hidden=hidden, experts=experts, top_k=top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.moe(self.norm2(x))


class MambaBlock(nn.Module):
    """Pre-norm selective state-space block (Nemotron-H's Mamba layers)."""

    def __init__(self, *, hidden: int, heads: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden)
        self.ssm = _SelectiveSSM(hidden=hidden, heads=heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ssm(self.norm(x))


class DenseBlock(nn.Module):
    """Pre-norm MLP-only block."""

    def __init__(self, *, hidden: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden)
        self.mlp = _MLP(hidden=hidden, inner=4 * hidden)

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
