"""Which rank exchanges the tied gradient and which stage starts each parameter's replica
all-reduce (adaptis.worker.runtime.ownership), for every rank of a plan, in one process, with the
zoo's real stage modules. The exchanges themselves run in test_worker_parity.py and
test_worker_data_parallel.py."""

from __future__ import annotations

from worker_harness import SMALL_MODEL

from adaptis.api.plan import Plan
from adaptis.worker.models.zoo import build_stages
from adaptis.worker.runtime.ownership import TiePeer, reducing_stage, tie_peer, tied_ranks

N_LAYERS = 5  # SMALL_MODEL: embedding, three blocks, head


def _plan(stages: list[tuple[int, int]], placement: list[list[int]]) -> Plan:
    owner = {s: d for d, mine in enumerate(placement) for s in mine}
    acts: list[list[tuple[str, int, int]]] = [[] for _ in placement]
    for s in range(len(stages)):
        acts[owner[s]].append(("F", s, 0))
    for s in reversed(range(len(stages))):
        acts[owner[s]].append(("BW", s, 0))
    return Plan(stages=stages, placement=placement, actions=acts)  # type: ignore[arg-type]


def test_the_embedding_and_head_ranks_exchange_and_the_others_do_not() -> None:
    plan = _plan([(0, 2), (2, 3), (3, 4), (4, 5)], [[0], [1], [2], [3]])
    assert tied_ranks(plan, n_layers=N_LAYERS) == (0, 3)
    assert tie_peer(plan, n_layers=N_LAYERS, pipeline_rank=0) == TiePeer(peer=3, holds_head=False)
    assert tie_peer(plan, n_layers=N_LAYERS, pipeline_rank=3) == TiePeer(peer=0, holds_head=True)
    assert tie_peer(plan, n_layers=N_LAYERS, pipeline_rank=1) is None
    assert tie_peer(plan, n_layers=N_LAYERS, pipeline_rank=2) is None
    # The head's stage on a middle rank: that rank is the embedding's peer.
    middle = _plan([(0, 1), (1, 3), (3, 5)], [[0], [2], [1]])
    assert tied_ranks(middle, n_layers=N_LAYERS) == (0, 1)
    assert tie_peer(middle, n_layers=N_LAYERS, pipeline_rank=1) == TiePeer(peer=0, holds_head=True)
    assert tie_peer(middle, n_layers=N_LAYERS, pipeline_rank=2) is None


def test_a_v_placement_holds_both_ends_on_one_rank_and_exchanges_nothing() -> None:
    v = _plan([(0, 1), (1, 3), (3, 4), (4, 5)], [[0, 3], [1, 2]])
    assert tied_ranks(v, n_layers=N_LAYERS) == (0, 0)
    assert [tie_peer(v, n_layers=N_LAYERS, pipeline_rank=r) for r in (0, 1)] == [None, None]


def _owners(actions: list[tuple[str, int, int]]) -> dict[str, int]:
    stages = [(0, 2), (2, 3), (3, 5)]
    modules = build_stages(SMALL_MODEL, stages=stages, seed=1)
    owner = reducing_stage(actions, stage_ids=[0, 1, 2], modules=modules)
    named = {k: p for m in modules for k, p in m.global_parameters().items()}
    # Every parameter of the rank has one reducing stage.
    assert set(owner) == {id(p) for m in modules for p in m.parameters()}
    return {k: owner[id(p)] for k, p in named.items()}


def test_a_weight_shared_by_two_stages_is_reduced_after_the_later_ones_gradient() -> None:
    # The tied embedding (stage 0) and head (stage 2) are one Parameter on this rank.
    fwd = [("F", 0, 0), ("F", 1, 0), ("F", 2, 0)]
    head_last = [*fwd, ("B", 2, 0), ("B", 1, 0), ("BW", 0, 0), ("W", 1, 0), ("W", 2, 0)]
    owner = _owners(head_last)
    assert owner["0.weight"] == owner["4.proj.weight"] == 2
    assert owner["2.norm1.weight"] == 1 and owner["1.norm.weight"] == 0 and owner["4.norm.weight"] == 2
    # Fused BW counts as the stage's weight gradient as W does.
    emb_last = [*fwd, ("B", 2, 0), ("W", 2, 0), ("B", 1, 0), ("W", 1, 0), ("BW", 0, 0)]
    owner = _owners(emb_last)
    assert owner["0.weight"] == owner["4.proj.weight"] == 0
    assert owner["3.moe.router.weight"] == 2 and owner["4.norm.weight"] == 2
