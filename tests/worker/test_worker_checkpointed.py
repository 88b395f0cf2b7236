"""Checkpoints talk to a rank through the Checkpointed protocol only: a save and a resume work
for any object that answers it, no executor needed."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from worker_harness import SMALL_MODEL

from adaptis.api.mesh import Mesh
from adaptis.api.model import Model
from adaptis.worker.state.checkpoint import Checkpointed, load_checkpoint, save_checkpoint


@dataclass
class _Rank:
    """One rank of one pipeline position holding a single layer's weights."""

    layer: nn.Linear = field(default_factory=lambda: nn.Linear(4, 3))
    rank: int = 0
    world_size: int = 1
    mesh: Mesh = field(default_factory=lambda: Mesh(pods=1, per_pod=1))
    checkpoint_rank: int = 0
    model: Model = SMALL_MODEL
    zero_stage: int = 0
    optimizer_name: str = "adamw"
    optimizer: torch.optim.Optimizer = field(init=False)

    def __post_init__(self) -> None:
        self.optimizer = torch.optim.AdamW(self.layer.parameters(), lr=0.1)

    def named_parameters(self) -> dict[str, nn.Parameter]:
        return {f"1.{k}": p for k, p in self.layer.named_parameters()}


def _train_once(rank: _Rank) -> None:
    rank.layer(torch.ones(2, 4)).sum().backward()
    rank.optimizer.step()


def test_a_rank_answering_the_protocol_is_saved_and_restored_exactly(tmp_path: Path) -> None:
    saved: Checkpointed = (first := _Rank())
    _train_once(first)
    save_checkpoint(tmp_path, executor=saved, step=1, position=8, tokens=64, samples=8)
    fresh = _Rank()
    assert not torch.equal(fresh.layer.weight, first.layer.weight)
    resumed = load_checkpoint(tmp_path, executor=fresh, step=1)
    assert (resumed.step, resumed.position, resumed.tokens, resumed.exact) == (1, 8, 64, True)
    assert torch.equal(fresh.layer.weight, first.layer.weight)
    moments = fresh.optimizer.state[fresh.layer.weight]["exp_avg"]
    assert torch.equal(moments, first.optimizer.state[first.layer.weight]["exp_avg"])
