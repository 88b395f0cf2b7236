"""The planner's operator counts (adaptis.planner.kernels) against the real layers: torch's
dispatcher counts every operator a forward and a whole backward pass of each zoo layer run,
across the options that change them. A block that gains or loses work fails here, and its
count in the planner is updated with it."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from adaptis.api.job import BlockSpec, TrainingSpec
from adaptis.api.model import ZooModel
from adaptis.planner.estimate import MAMBA_CHUNK
from adaptis.planner.kernels import block_kernels, embedding_kernels, head_kernels
from adaptis.worker.models.zoo import build_layer, token_loss


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.n += 1
        return func(*args, **(kwargs or {}))


def _counted(model: ZooModel, *, index: int, seq: int, head: bool = False) -> tuple[int, int]:
    layer = build_layer(model, index=index, seed=0)
    tokens = torch.randint(model.vocab_size, (1, seq))
    x = tokens if index == 0 else torch.randn(1, seq, model.hidden, requires_grad=True)
    with _Count() as c:
        out = layer(x)
        if head:
            out = token_loss(out, tokens)
    forward = c.n
    with _Count() as c:
        (out if head else out.float().sum()).backward()
    return forward, c.n


CASES = [
    ("attention", {}, {}, 64), ("attention", {}, {"positions": "rope"}, 64),
    ("attention", {}, {"mlp": "swiglu"}, 64), ("dense", {}, {}, 64), ("dense", {}, {"mlp": "swiglu"}, 64),
    ("moe", {"experts": 2, "top_k": 1}, {}, 64), ("moe", {"experts": 8, "top_k": 2}, {}, 64),
    ("moe", {"experts": 4, "top_k": 2}, {"mlp": "swiglu"}, 64),
    ("mamba", {}, {}, 64), ("mamba", {}, {}, 256),
]


@pytest.mark.parametrize(("kind", "block", "model", "seq"), CASES)
def test_block_operator_counts_match_the_layers(kind: str, block: dict, model: dict, seq: int) -> None:
    spec = ZooModel(vocab_size=128, hidden=32, heads=4, blocks=[BlockSpec(kind=kind, **block)], **model)
    forward, backward = _counted(spec, index=1, seq=seq)
    k = block_kernels(spec.blocks[0], model=spec, training=TrainingSpec(sequence_length=seq), chunk=MAMBA_CHUNK)
    assert k.forward == pytest.approx(forward, rel=0.25), (k, forward, backward)
    assert k.backward + k.weight == pytest.approx(backward, rel=0.25), (k, forward, backward)


def test_embedding_and_head_operator_counts_match_the_layers() -> None:
    spec = ZooModel(vocab_size=128, hidden=32, heads=4, blocks=[BlockSpec(kind="dense")])
    forward, backward = _counted(spec, index=0, seq=16)
    e = embedding_kernels()
    assert (e.forward, e.backward + e.weight) == pytest.approx((forward, backward), rel=0.25)
    forward, backward = _counted(spec, index=2, seq=16, head=True)  # with its loss, as profiled
    h = head_kernels()
    assert (h.forward, h.backward + h.weight) == pytest.approx((forward, backward), rel=0.25)
