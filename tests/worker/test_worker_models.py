"""Models: the layer list the planner sees, seeded initialisation independent of the partition,
tied embeddings, and every block kind trains (finite loss, gradients reach every parameter)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from adaptis.api.job import BlockSpec
from adaptis.api.model import ZooModel
from adaptis.worker.errors import WorkerError
from adaptis.worker.models.zoo import (
    build_layer,
    build_model,
    build_stages,
    layer_parameters,
    model_layers,
    token_loss,
)

MODEL = ZooModel(vocab_size=300, hidden=16, heads=2, tie_embeddings=True,
                  blocks=[BlockSpec(kind="mamba", count=2), BlockSpec(kind="attention"),
                          BlockSpec(kind="moe", experts=3, top_k=2), BlockSpec(kind="dense")])


def test_layer_list_is_embedding_blocks_head_in_order() -> None:
    layers = model_layers(MODEL)
    assert [lay.kind for lay in layers] == ["embedding", "mamba", "mamba", "attention", "moe", "dense", "head"]
    assert len(layers) == 2 + sum(b.count for b in MODEL.blocks)
    assert len({lay.name for lay in layers}) == len(layers)


def test_weights_do_not_depend_on_the_partition() -> None:
    whole = layer_parameters(build_model(MODEL, seed=7))
    parts: dict[str, torch.Tensor] = {}
    for stage in build_stages(MODEL, stages=[(0, 2), (2, 3), (3, 7)], seed=7):
        parts.update(layer_parameters(stage))
    assert set(parts) == set(whole)
    for name, p in whole.items():
        assert torch.equal(p, parts[name]), name
    other = layer_parameters(build_model(MODEL, seed=8))
    assert not torch.equal(other["1.ssm.in_proj.weight"], whole["1.ssm.in_proj.weight"])


def test_tied_head_shares_the_embedding_weight() -> None:
    net = build_model(MODEL, seed=0)
    params = layer_parameters(net)
    assert params["0.weight"] is params["6.proj.weight"]
    # Built apart (as two ranks do), the copies start equal.
    emb, head = build_layer(MODEL, index=0, seed=0), build_layer(MODEL, index=6, seed=0)
    assert torch.equal(emb.weight, head.weight)  # type: ignore[arg-type]
    untied = build_layer(dataclasses.replace(MODEL, tie_embeddings=False), index=6, seed=0)
    assert not torch.equal(emb.weight, untied.weight)  # type: ignore[arg-type]


def test_every_block_kind_trains() -> None:
    torch.manual_seed(0)
    net = build_model(MODEL, seed=1)
    tokens = torch.randint(300, (2, 12))
    loss = token_loss(net(tokens), tokens)
    assert torch.isfinite(loss) and loss.item() == pytest.approx(torch.log(torch.tensor(300.0)).item(), rel=0.1)
    loss.backward()
    for name, p in layer_parameters(net).items():
        assert p.grad is not None, f"{name} has no gradient"
        assert torch.isfinite(p.grad).all(), name
    # MoE experts all sit in the graph (zeros when unrouted), never missing.
    assert layer_parameters(net)["4.moe.w_up"].grad is not None


def test_blocks_are_causal() -> None:
    net = build_model(MODEL, seed=2)
    a = torch.randint(300, (1, 10))
    b = a.clone()
    b[0, 7:] = (b[0, 7:] + 1) % 300
    with torch.no_grad():
        diff = (net(a) - net(b)).abs().amax(dim=-1)[0]
    assert torch.all(diff[:7] < 1e-6) and diff[7] > 0


def test_layer_index_out_of_range_is_a_worker_error() -> None:
    with pytest.raises(WorkerError, match="outside"):
        build_layer(MODEL, index=7, seed=0)
