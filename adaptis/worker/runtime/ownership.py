"""Which rank or stage answers for a weight shared across a plan: pure functions of the plan.

Used by the executor (:mod:`adaptis.worker.runtime.executor`) when it builds a rank: the tied
embedding's exchange peer (the embedding and the head on two ranks each hold a copy, whose
gradients they add before the update) and, with data parallelism, the stage of this rank whose
backward completes each parameter's gradient, which starts that parameter's replica
all-reduce (:class:`adaptis.worker.runtime.replicas.GradReducer`). No process group and no torch
collective here, so every rank's answer can be checked in one process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from adaptis.api.plan import Action, Plan

__all__ = ["TiePeer", "reducing_stage", "tie_peer", "tied_ranks"]


@dataclass(frozen=True, slots=True)
class TiePeer:
    """The pipeline rank this rank exchanges the tied gradient with, and which copy it holds."""

    peer: int
    holds_head: bool  # this rank holds the head's copy (left out of the gradient norm)


def tied_ranks(plan: Plan, *, n_layers: int) -> tuple[int, int]:
    """The pipeline ranks holding the embedding (the stage starting at layer 0) and the head
    (the stage ending at the last layer)."""
    owner = plan.stage_device()
    first = next(s for s, (lo, _hi) in enumerate(plan.stages) if lo == 0)
    last = next(s for s, (_lo, hi) in enumerate(plan.stages) if hi == n_layers)
    return owner[first], owner[last]


def tie_peer(plan: Plan, *, n_layers: int, pipeline_rank: int) -> TiePeer | None:
    """With tied embeddings, the exchange ``pipeline_rank`` takes part in; None when it takes
    none: the embedding and the head on one rank share one Parameter, and a rank holding
    neither has no copy."""
    emb, head = tied_ranks(plan, n_layers=n_layers)
    if emb == head or pipeline_rank not in (emb, head):
        return None
    if pipeline_rank == head:
        return TiePeer(peer=emb, holds_head=True)
    return TiePeer(peer=head, holds_head=False)


def reducing_stage(actions: Sequence[Action], *, stage_ids: Sequence[int],
                   modules: Sequence[nn.Module]) -> dict[int, int]:
    """``id(parameter)`` -> the stage (of ``stage_ids``, whose modules are ``modules``) whose
    weight gradients finish last in this rank's ``actions``: a tied weight shared by two local
    stages has its whole gradient only then. A stage with no weight-gradient action counts as
    finishing first."""
    last = {sid: max((i for i, (kind, s, _mb) in enumerate(actions) if s == sid and kind in ("W", "BW")),
                     default=-1) for sid in stage_ids}
    owner: dict[int, int] = {}
    for sid, module in zip(stage_ids, modules, strict=True):
        for p in module.parameters():
            if id(p) not in owner or last[sid] > last[owner[id(p)]]:
                owner[id(p)] = sid
    return owner
