"""Optimizer state by parameter name: what makes a checkpoint independent of the plan.

Sits under :mod:`adaptis.worker.state.checkpoint`. ``torch.optim.Optimizer.state_dict()`` keys each
parameter's state (AdamW: ``step``, ``exp_avg``, ``exp_avg_sq``) by its *position* in the optimizer,
which depends on the partition (which layers this rank holds), the ZeRO-1 shares and the rank count.
Here the same state is keyed by the parameter's global name
(:meth:`adaptis.worker.runtime.executor.Executor.named_parameters`: ``<global layer>.<name in
layer>`` or transformers' names), which is the same under every plan, so a rank of another plan can
pick out exactly the entries of the parameters it now holds.

A parameter shared under two names (tied embedding and head on one rank) is written under
both; a rank that holds the two as separate copies (on two ranks) finds each under its own
name, and the copies' states are equal, since both get the summed gradient.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from adaptis.worker.runtime.dtensors import gathered, shard_like
from adaptis.worker.runtime.replicas import ZeroOptimizer

__all__ = ["export_state", "held_optimizer", "held_names", "import_state"]


def held_optimizer(optimizer: torch.optim.Optimizer | ZeroOptimizer) -> torch.optim.Optimizer | None:
    """The torch optimizer whose state this rank holds: ZeRO-1's local shard (None when the
    rank owns no share), else the optimizer itself."""
    return optimizer.local if isinstance(optimizer, ZeroOptimizer) else optimizer


def _names_by_param(named: Mapping[str, nn.Parameter]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for name, p in named.items():
        out.setdefault(id(p), []).append(name)
    return out


def _params(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def held_names(optimizer: torch.optim.Optimizer | None, *, named: Mapping[str, nn.Parameter]) -> list[str]:
    """Every name of every parameter whose optimizer state ``optimizer`` holds (its shard)."""
    if optimizer is None:
        return []
    by_param = _names_by_param(named)
    return [n for p in _params(optimizer) for n in by_param.get(id(p), [])]


def export_state(optimizer: torch.optim.Optimizer | None, *,
                 named: Mapping[str, nn.Parameter]) -> dict[str, dict[str, Any]]:
    """name -> that parameter's optimizer state, copied to CPU. A parameter that never had a
    gradient has no state yet (torch creates it at the first update) and is left out."""
    if optimizer is None:
        return {}
    by_param = _names_by_param(named)
    out: dict[str, dict[str, Any]] = {}
    for p in _params(optimizer):
        state = optimizer.state.get(p)
        if not state:
            continue
        # Tensor-parallel moments are gathered whole (collective over the tensor group).
        copied = {k: gathered(v).detach().cpu().clone() if isinstance(v, torch.Tensor) else v
                  for k, v in state.items()}
        for name in by_param.get(id(p), []):
            out[name] = copied
    return out


def import_state(optimizer: torch.optim.Optimizer | None, *, named: Mapping[str, nn.Parameter],
                 find: Mapping[str, dict[str, Any] | None]) -> list[str]:
    """Load each held parameter's state from ``find`` (name -> state, None: recorded as having
    none yet). Returns the names of held parameters ``find`` says nothing of; when there is any,
    nothing is loaded (a half-restored optimizer would be neither exact nor fresh)."""
    if optimizer is None:
        return []
    by_param = _names_by_param(named)
    chosen: list[dict[str, Any] | None] = []
    missing: list[str] = []
    for p in _params(optimizer):
        names = by_param.get(id(p), [])
        known = [n for n in names if n in find]
        if not known:
            missing.append(names[0] if names else f"<unnamed parameter {tuple(p.shape)}>")
            chosen.append(None)
            continue
        chosen.append(find[known[0]])
    if missing:
        return missing
    doc = optimizer.state_dict()
    # Tensors are cloned: the source may be a memory-mapped file that a later prune unlinks,
    # and load_state_dict keeps a tensor already of the parameter's dtype and device as is.
    params = _params(optimizer)
    doc["state"] = {i: {k: _held(v, param=params[i]) for k, v in state.items()}
                    for i, state in enumerate(chosen) if state}
    optimizer.load_state_dict(doc)
    return []


def _held(value: Any, *, param: torch.Tensor) -> Any:
    """A saved state entry as this rank holds it: a whole moment of a tensor-parallel
    parameter becomes its shard (``step`` and other scalars stay as they are); cloned, since
    the source may be a memory-mapped file that a later prune unlinks."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.shape == param.shape and value.dim() > 0:
        return shard_like(param, value.to(param.device)).clone()
    return value.clone()
