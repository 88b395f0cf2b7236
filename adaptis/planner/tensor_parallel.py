"""A layer's costs at tensor-parallel degree T: what one rank of a T-GPU device computes, holds
and waits for.

Sits under :mod:`adaptis.planner.costs`, which flattens every problem through
:func:`sharded_layers` before anything plans: with ``problem.tensor_parallel`` T > 1 a device of
the plan is a tensor group of T GPUs, and every layer's whole (degree-1) costs become one
rank's (docs/planner-search.md, "Tensor parallelism"). For a layer whose share ``s``
(``tensor_split``, default 1) is split over the T ranks and which makes ``n``
(``tensor_all_reduces``, default 2) all-reduces of its ``output_bytes`` in the forward and as
many in its input-gradient pass:

- F, B, the fused backward: ``t x (1 - s + s/T)`` plus ``n`` ring all-reduces of
  ``output_bytes`` over ``network.tensor`` (default the intra-node link), each
  ``2 (T-1) latency + 2 (T-1)/T x bytes / bandwidth`` — on the critical path: the next layer
  needs the reduced activation;
- W and the optimizer step: ``t x (1 - s + s/T)`` (local to the shard, no collective);
- parameter, gradient and activation bytes: ``x (1 - s + s/T)``; the activation a stage sends
  on (``output_bytes``) stays whole: the pipeline passes the full activation between stages,
  except under sequence parallelism (``problem.sequence_parallel``), where each rank sends its
  ``1/T`` of the sequence: ``output_bytes / T``. Its all-gathers and reduce-scatters move the
  same bytes as the all-reduces they replace (an all-reduce is one of each); what changes is
  per kind (:data:`SEQUENCE_EXTRA_BY_KIND`, in all-reduces, an all-gather or reduce-scatter
  being half of one): the blocks computed whole on the gathered sequence (Mamba, the MoE
  experts) and the head gather it once more in F and in B, the embedding reduce-scatters
  instead of all-reducing.

The collectives do not scale with a device's speed, but the simulator divides every time by
it: on devices of speed 1 (the usual profile) that is exact, elsewhere an approximation.
"""

from __future__ import annotations

from dataclasses import dataclass

from adaptis.api.problem import Layer, Link

__all__ = ["ALL_REDUCES_BY_KIND", "DEFAULT_ALL_REDUCES", "SEQUENCE_EXTRA_BY_KIND", "ShardedLayer",
           "all_reduce_seconds", "mark_by_kind", "sharded_layers"]

#: All-reduces of a layer's output per forward when the problem does not say: an attention
#: block's (one after attention, one after its MLP).
DEFAULT_ALL_REDUCES = 2

#: What the worker does to each zoo kind (adaptis.worker.runtime.tensor_parallel): all-reduces
#: of the hidden activation per forward (as many in the input-gradient pass): after attention
#: and after the MLP or experts; one for an MLP alone or the vocabulary-parallel embedding; none
#: for a whole Mamba block or the head (its vocabulary-parallel loss reduces a few numbers per
#: token, not the activation). Mamba is the one kind kept whole.
ALL_REDUCES_BY_KIND = {"embedding": 1, "attention": 2, "moe": 2, "dense": 1, "mamba": 0, "head": 0}
_KEPT_WHOLE = frozenset({"mamba"})

#: Under sequence parallelism, all-reduces of output_bytes added per pass to a known kind's (a
#: ring all-gather or reduce-scatter costs half an all-reduce): Mamba and MoE blocks gather the
#: sequence in (F) and their output gradient (B); the head gathers its input (F) and
#: reduce-scatters its gradient (B); the embedding's all-reduce becomes a reduce-scatter.
SEQUENCE_EXTRA_BY_KIND = {"mamba": 0.5, "moe": 0.5, "head": 0.5, "embedding": -0.5}


def mark_by_kind(layers: list[Layer]) -> list[Layer]:
    """``layers`` with ``tensor_split`` and ``tensor_all_reduces`` set from each known kind
    where the layer does not say (a profile measures layers whole and names their kinds)."""
    out = []
    for lay in layers:
        update: dict[str, float | int] = {}
        if lay.kind in ALL_REDUCES_BY_KIND:
            if lay.tensor_split is None:
                update["tensor_split"] = 0.0 if lay.kind in _KEPT_WHOLE else 1.0
            if lay.tensor_all_reduces is None:
                update["tensor_all_reduces"] = ALL_REDUCES_BY_KIND[lay.kind]
        out.append(lay.model_copy(update=update) if update else lay)
    return out


@dataclass(frozen=True, slots=True)
class ShardedLayer:
    """One rank's costs of a layer at degree T (times in the problem's unit, bytes)."""

    forward: float
    backward: float
    weight: float
    fused: float
    activation_bytes: float
    param_bytes: float
    grad_bytes: float
    optimizer: float
    collective: float  # of each of F and B: the all-reduces' time included above
    output_bytes: float = 0.0  # what one rank sends on to the next stage


def all_reduce_seconds(nbytes: float, *, ranks: int, link: Link | None) -> float:
    """A ring all-reduce of ``nbytes`` among ``ranks``: 2(T-1) steps of latency, each rank
    sending and receiving 2(T-1)/T of the bytes; 0 on one rank or a free link."""
    if ranks <= 1 or link is None:
        return 0.0
    steps = 2 * (ranks - 1)
    return steps * link.latency_s + steps / ranks * nbytes / link.bandwidth_bytes_per_s


def sharded_layers(layers: list[Layer], *, degree: int, link: Link | None,
                   unit_seconds: float, sequence: bool = False) -> list[ShardedLayer]:
    """Every layer's one-rank costs at ``degree`` (1: the layers' own costs); ``sequence``:
    sequence parallelism, the activations between stages split on the sequence."""
    shards = degree if sequence else 1
    out = []
    for lay in layers:
        split = 1.0 if lay.tensor_split is None else lay.tensor_split
        share = 1.0 if degree == 1 else 1.0 - split + split / degree
        reduces: float = DEFAULT_ALL_REDUCES if lay.tensor_all_reduces is None else lay.tensor_all_reduces
        if sequence and lay.kind is not None:
            reduces = max(0.0, reduces + SEQUENCE_EXTRA_BY_KIND.get(lay.kind, 0.0))
        comm = reduces * all_reduce_seconds(lay.output_bytes, ranks=degree, link=link) / unit_seconds
        fused = lay.backward + lay.weight if lay.backward_fused is None else lay.backward_fused
        out.append(ShardedLayer(
            forward=lay.forward * share + comm,
            backward=lay.backward * share + comm,
            weight=lay.weight * share,
            fused=fused * share + comm,
            activation_bytes=lay.activation_bytes * share,
            param_bytes=lay.param_bytes * share,
            grad_bytes=lay.grad_bytes * share,
            optimizer=(lay.optimizer or 0.0) * share,
            collective=comm,
            output_bytes=lay.output_bytes / shards,
        ))
    return out
