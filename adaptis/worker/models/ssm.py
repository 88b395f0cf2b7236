"""The selective state-space mixer of the Mamba block, as a chunked scan (memory linear in length).

Sits under :mod:`adaptis.worker.models.layers` (whose ``MambaBlock`` wraps it). Mamba-2 style: the
step ``dt``, the input matrix B and the output matrix C depend on the input; the decay is one
scalar per head. The output is ``y_t = sum_{u<=t} C_t.B_u * exp(sum_{u<j<=t} dt_j A) * dt_u * x_u
+ D x_t``. Written as one ``[seq, seq]`` "attention" matrix (the SSD quadratic form) it is exact
but its memory grows with the square of the sequence; here the sequence is cut into chunks of
``chunk`` tokens (64 by default): within a chunk the quadratic form (``[chunk, chunk]`` per
head), across chunks a recurrent state ``[heads, head_dim, state]`` carried forward, as the
Mamba-2 SSD algorithm does. Saved activations and FLOPs are then linear in the sequence length
(times the chunk), and on a sequence no longer than one chunk the result is the quadratic form's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from adaptis.planner.estimate import MAMBA_CHUNK, MAMBA_STATE

__all__ = ["DEFAULT_CHUNK", "SelectiveSSM", "chunked_scan"]

#: Tokens per chunk: the within-chunk part is quadratic in it, the rest linear in the sequence.
#: The planner's estimate counts the same chunk (one number, defined there).
DEFAULT_CHUNK = MAMBA_CHUNK


def chunked_scan(*, xs: torch.Tensor, dt: torch.Tensor, decay: torch.Tensor, bm: torch.Tensor,
                 cm: torch.Tensor, chunk: int) -> torch.Tensor:
    """The selective scan without the skip term.

    ``xs`` ``[b, s, H, p]`` inputs per head, ``dt`` ``[b, s, H]`` positive steps, ``decay``
    ``[H]`` (negative: ``-exp(A_log)``), ``bm``/``cm`` ``[b, s, N]`` input and output matrices
    (one group, shared by the heads). Returns ``[b, s, H, p]``.
    """
    b, s, heads, p = xs.shape
    state = xs.new_zeros(b, heads, p, bm.shape[-1])
    outs = []
    for lo in range(0, s, chunk):
        hi = min(lo + chunk, s)
        q = hi - lo
        u = (xs[:, lo:hi] * dt[:, lo:hi].unsqueeze(-1)).transpose(1, 2)  # [b, H, q, p]
        b_c, c_c = bm[:, lo:hi], cm[:, lo:hi]  # [b, q, N]
        # Log-decay from the chunk's start to each of its positions: <= 0, so exp never overflows.
        log_decay = torch.cumsum(dt[:, lo:hi] * decay, dim=1).transpose(1, 2)  # [b, H, q]
        causal = torch.ones(q, q, dtype=torch.bool, device=xs.device).tril()
        seg = (log_decay.unsqueeze(-1) - log_decay.unsqueeze(-2)).masked_fill(~causal, -torch.inf)
        mix = torch.exp(seg) * (c_c @ b_c.transpose(1, 2)).unsqueeze(1)  # [b, H, q, q]
        y = mix @ u
        # What the earlier chunks left in the state, decayed to each position of this chunk.
        y = y + torch.exp(log_decay).unsqueeze(-1) * (c_c.unsqueeze(1) @ state.transpose(-1, -2))
        outs.append(y)
        if hi < s:  # the state this chunk leaves for the next one
            to_end = torch.exp(log_decay[..., -1:] - log_decay).unsqueeze(-1)  # [b, H, q, 1]
            state = (torch.exp(log_decay[..., -1]).unsqueeze(-1).unsqueeze(-1) * state
                     + (u * to_end).transpose(-1, -2) @ b_c.unsqueeze(1))
    return torch.cat(outs, dim=2).transpose(1, 2)


class SelectiveSSM(nn.Module):
    """Mamba-2 style selective mixer: input projection, short causal convolution, chunked scan,
    gated norm, output projection. ``chunk`` may be changed after construction (tests do)."""

    def __init__(self, *, hidden: int, heads: int, state: int = MAMBA_STATE, conv: int = 4,
                 chunk: int = DEFAULT_CHUNK) -> None:
        super().__init__()
        self.inner = 2 * hidden
        self.heads = heads
        self.state = state
        self.chunk = chunk
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
        widths = [self.inner, self.inner + 2 * self.state, self.heads]
        z, xbc, dt = self.in_proj(x).split(widths, -1)
        xbc = F.silu(self.conv(xbc.transpose(1, 2))[..., :s].transpose(1, 2))
        xs, bm, cm = xbc.split([self.inner, self.state, self.state], dim=-1)
        xs = xs.reshape(b, s, self.heads, self.inner // self.heads)
        dt = F.softplus(dt + self.dt_bias)  # [b, s, heads]
        y = chunked_scan(xs=xs, dt=dt, decay=-torch.exp(self.A_log), bm=bm, cm=cm, chunk=self.chunk)
        y = y + xs * self.D.view(1, 1, -1, 1)
        y = self.norm(y.reshape(b, s, self.inner) * F.silu(z))
        return self.out_proj(y)
