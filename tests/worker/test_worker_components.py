"""The executor's parts built from their slices of the config (adaptis.worker.runtime.components)."""

from __future__ import annotations

import torch
from torch import nn

from adaptis.api.job import OptimizerSpec
from adaptis.api.mesh import Mesh
from adaptis.worker.runtime.components import build_optimizer, build_reducer, make_optimizer, unique_params


def _layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(4, 4), nn.Linear(4, 2)]


def test_the_optimizer_is_the_specs_class_rate_and_decay() -> None:
    params = unique_params(_layers())
    adamw = make_optimizer(params, OptimizerSpec(name="adamw", lr=3e-3, weight_decay=0.1))
    sgd = make_optimizer(params, OptimizerSpec(name="sgd", lr=0.5, weight_decay=0.0))
    assert type(adamw) is torch.optim.AdamW and type(sgd) is torch.optim.SGD
    assert [(g["lr"], g["weight_decay"]) for g in adamw.param_groups] == [(3e-3, 0.1)]
    assert [(g["lr"], g["weight_decay"]) for g in sgd.param_groups] == [(0.5, 0.0)]
    assert [len(g["params"]) for g in adamw.param_groups] == [4]


def test_an_idle_rank_gets_an_optimizer_over_no_parameters() -> None:
    # torch refuses an empty parameter list; the idle rank's optimizer still holds a rate.
    opt = make_optimizer([], OptimizerSpec(name="adamw", lr=1e-3))
    assert [len(g["params"]) for g in opt.param_groups] == [0]
    opt.step()


def test_a_tied_weight_is_one_parameter() -> None:
    first, second = _layers()
    second.weight = first.weight  # the same tensor in two stages
    params = unique_params([first, second])
    assert len(params) == 3 and sum(p is first.weight for p in params) == 1


def test_without_replicas_there_is_no_reducer_and_no_sharded_optimizer() -> None:
    mesh = Mesh(pods=2, per_pod=1)
    params = unique_params(_layers())
    opt = build_optimizer(params, spec=OptimizerSpec(), zero_stage=1, mesh=mesh, rank=0, replica_group=None)
    assert type(opt) is torch.optim.AdamW
    assert build_reducer(params=params, actions=[], stage_ids=[0], modules=_layers(), mesh=mesh,
                         replica_group=None) is None
