"""Tensor parallelism of a rank's stages, with torch's own sharding (DTensor, ``parallelize_module``).

Sits in :mod:`adaptis.worker.runtime` above the blocks it shards (models hold no process group;
this module knows their layout and hands the MoE block its collectives); the executor
(:mod:`adaptis.worker.runtime.executor`) calls :func:`shard_stages` once per rank, after
building the full, seeded stages, so the shards are slices of exactly the weights a single
process would hold. The T ranks of one pipeline position form a 1-D ``DeviceMesh`` over their
tensor group. What each block becomes (Megatron-LM's layout, docs/parallelism.md):

- attention: ``q``, ``k``, ``v`` column-parallel (each rank ``heads / T`` query heads and
  ``kv_heads / T`` key/value heads), ``out`` row-parallel: one all-reduce in the forward (after
  ``out``) and one in the backward (before ``q/k/v``'s input gradient);
- dense and SwiGLU MLPs: ``up`` (and ``gate``) column-parallel, ``down`` row-parallel;
- MoE: every expert's FFN sharded on its inner width like the dense MLP (``w_up``/``w_gate`` on
  dim 2, ``w_down`` on dim 1), the router replicated. The experts' partial outputs are summed
  once per layer (one all-reduce for all experts, not one each), and the routing weights'
  and the experts' input gradients once in the backward. Why not experts sharded by rank
  (expert parallelism): it needs an all-to-all of routed tokens and load balance across ranks,
  and it changes what a rank computes with the routing; sharding each FFN keeps every rank's
  work equal whatever the router does, which is what a pipeline stage's cost model assumes.
- Mamba blocks, norms and the router: replicated (every rank computes them in full on the
  replicated activation, so their gradients agree without communication). The Mamba mixer's
  fused input projection packs x, z, B, C and dt with B and C shared by all heads, so sharding
  its heads needs a re-laid projection; its cost is charged unsharded by the planner too.
- embedding: vocabulary-parallel (``RowwiseParallel`` on ``nn.Embedding``); head: the final norm
  replicated, ``proj`` vocabulary-parallel with its logits left sharded, and the loss taken on
  the sharded logits by torch's ``loss_parallel`` (:func:`vocab_parallel_loss`): the full
  ``[tokens, vocab]`` logits never exist on one rank.

Activations between stages stay whole (replicated over the tensor group): the pipeline's
sends go between matching tensor ranks of adjacent stages, each the full ``[b, s, h]``. With
sequence parallelism (``sequence=True``, :func:`_sequence_plan`) the norms and the residual
stream are sharded on the sequence instead, and a stage sends its rank's ``[b, s/T, h]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from adaptis.worker.errors import WorkerError
from adaptis.worker.models.hf.stages import HFStage
from adaptis.worker.models.layers import _MLP, Embedding, Head, _Attention
from adaptis.worker.models.moe import MixtureOfExperts
from adaptis.worker.models.ssm import SelectiveSSM
from adaptis.worker.runtime.dtensors import local, reduce_in_backward, sum_partials

__all__ = ["DTensorExperts", "hf_tp_plan", "loss_parallel", "shard_hf_stages", "shard_stages",
           "vocab_parallel_loss"]


#: The sequence dimension of every ``[b, s, h]`` activation.
_SEQ = Shard(1)


def _module_plan(stage: nn.Module, *, sequence: bool = False) -> dict[str, ParallelStyle]:
    """Each sharded module's style; ``sequence``: sequence parallelism, where the activation
    between blocks is this rank's ``[b, s/T, h]`` part (see :func:`_sequence_plan`)."""
    plan: dict[str, ParallelStyle] = {}
    # Row-parallel outputs: summed whole (all-reduce), or reduce-scattered on the sequence.
    rows = RowwiseParallel(output_layouts=_SEQ) if sequence else RowwiseParallel()
    for name, mod in stage.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(mod, _Attention):
            plan.update({f"{prefix}{p}": ColwiseParallel() for p in ("q", "k", "v")})
            plan[f"{prefix}out"] = rows
        elif isinstance(mod, _MLP):
            plan[f"{prefix}up"] = ColwiseParallel()
            if mod.kind == "swiglu":
                plan[f"{prefix}gate"] = ColwiseParallel()
            plan[f"{prefix}down"] = rows
        elif isinstance(mod, Embedding):
            plan[name] = RowwiseParallel(input_layouts=Replicate(),
                                         output_layouts=_SEQ if sequence else Replicate())
        elif isinstance(mod, Head):
            # Logits stay sharded on the vocabulary, returned as this rank's local slice.
            plan[f"{prefix}proj"] = ColwiseParallel(input_layouts=_SEQ if sequence else Replicate(),
                                                    output_layouts=Shard(-1))
    if sequence:
        plan.update(_sequence_plan(stage))
    return plan


def _sequence_plan(stage: nn.Module) -> dict[str, ParallelStyle]:
    """Sequence parallelism's extra styles (Megatron-LM's sequence_parallel, torchtitan's
    layout): every norm runs on this rank's ``s/T`` tokens (``SequenceParallel``: its weight
    replicated, its gradient summed over the group); attention and the MLPs gather the whole
    sequence at their input (``PrepareModuleInput``: an all-gather, a reduce-scatter of the
    gradient), so their column-parallel projections see every token, and their row-parallel
    outputs are reduce-scattered back to ``s/T``. The experts and the Mamba mixer, computed
    whole on the gathered sequence, hand back this rank's part (``PrepareModuleOutput``: a
    local slice, an all-gather of the gradient)."""
    plan: dict[str, ParallelStyle] = {}
    whole = [f"{n}." for n, m in stage.named_modules() if isinstance(m, SelectiveSSM)]
    for name, mod in stage.named_modules():
        if isinstance(mod, nn.RMSNorm):
            if not name.startswith(tuple(whole)):  # the mixer's own gated norm runs whole
                plan[name] = SequenceParallel()
        elif isinstance(mod, _Attention | _MLP):
            plan[name] = PrepareModuleInput(input_layouts=(_SEQ,), desired_input_layouts=(Replicate(),))
        elif isinstance(mod, MixtureOfExperts | SelectiveSSM):
            plan[name] = PrepareModuleInputOutput(
                input_layouts=(_SEQ,), desired_input_layouts=(Replicate(),), use_local_input=True,
                output_layouts=(Replicate(),), desired_output_layouts=(_SEQ,))
    return plan


@dataclass(frozen=True, slots=True)
class DTensorExperts:
    """The tensor group's collectives for sharded experts (:class:`adaptis.worker.models.moe.
    ExpertSharding`), each a DTensor redistribution."""

    mesh: DeviceMesh

    def local(self, weight: torch.Tensor) -> torch.Tensor:
        return local(weight)

    def reduce_in_backward(self, t: torch.Tensor) -> torch.Tensor:
        return reduce_in_backward(t, mesh=self.mesh)

    def sum_partials(self, t: torch.Tensor) -> torch.Tensor:
        return sum_partials(t, mesh=self.mesh)


def _shard_experts(moe: MixtureOfExperts, *, mesh: DeviceMesh) -> None:
    for name, dim in (("w_up", 2), ("w_gate", 2), ("w_down", 1)):
        param = getattr(moe, name, None)
        if param is not None:
            setattr(moe, name, nn.Parameter(distribute_tensor(param.data, mesh, [Shard(dim)])))
    moe.sharding = DTensorExperts(mesh)


def shard_stages(stages: Sequence[nn.Module], *, mesh: DeviceMesh, sequence: bool = False) -> None:
    """Shard this rank's zoo stages in place over ``mesh`` (the tensor group); an embedding and
    head tied on this rank stay one parameter (both are vocabulary shards of one matrix).
    ``sequence``: sequence parallelism, the activations between blocks and stages this rank's
    ``[b, s/T, h]`` part."""
    embedding = next((m for s in stages for m in s.modules() if isinstance(m, Embedding)), None)
    head = next((m for s in stages for m in s.modules() if isinstance(m, Head)), None)
    tied = embedding is not None and head is not None and head.proj.weight is embedding.weight
    for stage in stages:
        plan = _module_plan(stage, sequence=sequence)
        if plan:
            parallelize_module(stage, mesh, plan)
        for mod in stage.modules():
            if isinstance(mod, MixtureOfExperts):
                _shard_experts(mod, mesh=mesh)
    if tied:
        assert embedding is not None and head is not None  # for mypy: tied says so
        head.proj.weight = embedding.weight


#: transformers' TP plan styles we apply, as torch's own ParallelStyles (the model's authors
#: declare them in ``config.base_model_tp_plan``); packed and expert styles are refused.
_HF_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def hf_tp_plan(config: Any) -> dict[str, str]:
    """The decoder layers' part of a transformers config's ``base_model_tp_plan``
    (``layers.*.<module>`` -> style), checked to hold only styles we apply."""
    plan: dict[str, str] = dict(getattr(config, "base_model_tp_plan", None) or {})
    layers = {k.removeprefix("layers.*."): v for k, v in plan.items() if k.startswith("layers.*.")}
    if not layers:
        raise WorkerError(f"{config.model_type}: its config declares no tensor-parallel plan "
                          "(base_model_tp_plan); use tensorParallel: 1")
    odd = sorted({v for v in layers.values() if v not in _HF_STYLES})
    if odd:
        raise WorkerError(f"{config.model_type}: its tensor-parallel plan uses {odd} (packed or "
                          "expert weights), not supported yet; use tensorParallel: 1")
    return layers


def _has(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def shard_hf_stages(stages: Sequence[nn.Module], *, mesh: DeviceMesh, config: Any) -> None:
    """Shard this rank's Hugging Face stages (:class:`adaptis.worker.models.hf.stages.HFStage`)
    in place: each decoder layer by the model's own ``base_model_tp_plan``, the embedding and
    LM head vocabulary-parallel as the zoo's (the loss on the sharded logits)."""
    layers = hf_tp_plan(config)
    hf = [s for s in stages if isinstance(s, HFStage)]
    embedding = next((w for s in hf if (w := s.embedding_weight) is not None), None)
    tied = embedding is not None and any(s.head_weight is embedding for s in hf)
    for stage in hf:
        # A plan names every module any layer of the family may have (a MoE layer's dense
        # MLP, say): each layer gets the entries for the modules it has.
        plan: dict[str, ParallelStyle] = {
            f"layers.{j}.{module}": _HF_STYLES[style]()
            for j, layer in enumerate(stage.layers) for module, style in layers.items()
            if _has(layer, module)}
        if stage.embed_tokens is not None:
            plan["embed_tokens"] = RowwiseParallel(input_layouts=Replicate())
        if stage.lm_head is not None:
            plan["lm_head"] = ColwiseParallel(output_layouts=Shard(-1))
        if plan:
            parallelize_module(stage, mesh, plan)
    if tied:  # both are now the same vocabulary shard of one matrix: one parameter again
        shard = next(w for s in hf if (w := s.embedding_weight) is not None)
        for s in hf:
            if s.lm_head is not None:
                setattr(s.lm_head, "weight", shard)  # noqa: B010 - lm_head is typed Tensor | Module


def vocab_parallel_loss(logits: torch.Tensor, targets: torch.Tensor, *, mesh: DeviceMesh,
                        scale: float = 1.0) -> torch.Tensor:
    """:func:`adaptis.worker.models.zoo.token_loss` of vocabulary-sharded logits (this rank's
    ``[b, s, vocab / T]`` slice): torch's ``loss_parallel`` cross-entropy, whose softmax is
    reduced over the tensor group. Call it, and run its backward, inside one
    :func:`loss_parallel` (the executor wraps the whole pipeline step): that context does not
    nest, leaving an inner one switches torch's loss handlers off for the outer one too."""
    whole: Any = DTensor.from_local(logits, mesh, [Shard(logits.dim() - 1)], run_check=False)
    loss: Any = F.cross_entropy(whole.reshape(-1, whole.shape[-1]).float(), targets.reshape(-1))
    return loss.to_local() * scale
