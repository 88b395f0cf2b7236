"""The model of an AdaPtisJob (``spec.model``): the built-in zoo's blocks, or a Hugging Face model.

Part of :mod:`adaptis.api`, the single source of truth; re-exported by :mod:`adaptis.api.job`,
where the rest of the custom resource lives. The worker builds its stages from
:class:`ModelSpec`; the planner sees only the per-layer costs derived from it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

from adaptis.api.hf_model import HuggingFaceSpec

__all__ = ["BlockKind", "BlockSpec", "MAX_BLOCKS", "ModelSpec", "Spec"]

# The most blocks a model may have in all (the layers the planner partitions, less embedding and
# head): planning time and memory grow with them; docs/planning-budget.md measures 64 workers x
# 4096 blocks x 4096 microbatches at 38 s and 0.84 GiB within a 30 s limit.
MAX_BLOCKS = 4096


class Spec(BaseModel):
    """Base of every spec model: camelCase on the wire, unknown fields refused, immutable."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True
    )

BlockKind = Literal["attention", "mamba", "moe", "dense"]


class BlockSpec(Spec):
    """A run of identical blocks in pipeline order."""

    # The API server applies the scalar defaults before CEL runs, so topK and experts are set;
    # the has() guards only keep the rule total. Only moe blocks route, so only they are held
    # to it (the same as _top_k_within_experts).
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {"rule": "self.kind != 'moe' || !has(self.topK) || !has(self.experts) || "
                         "self.topK <= self.experts",
                 "message": "topK must not exceed experts", "fieldPath": ".topK"}
            ]
        }
    )

    kind: BlockKind = Field(description="attention (+MLP), mamba (selective SSM), moe, dense MLP.")
    count: int = Field(
        default=1, ge=1, le=MAX_BLOCKS,
        description=f"How many such blocks in a row; all runs together at most {MAX_BLOCKS} "
        "(the planner's time and memory grow with them, docs/planning-budget.md).")
    experts: int = Field(default=4, ge=1, le=256, description="MoE only: number of experts.")
    top_k: int = Field(default=2, ge=1, le=16, description="MoE only: experts per token.")
    ffn_hidden: int | None = Field(
        default=None, ge=1, le=1_048_576,
        description="This run's MLP width (moe: each expert's). null: the model's ffnHidden for "
        "attention and dense blocks, 2 x hidden for a moe expert.")
    aux_loss_coef: float = Field(
        default=0.0, ge=0, le=1,
        description="MoE only: weight of the load-balancing loss (Switch/Megatron form, 1.0 at a "
        "perfect balance) added to the training loss; 0 turns it off. Typical: 0.01.")

    @field_validator("top_k")
    @classmethod
    def _top_k_within_experts(cls, top_k: int, info: ValidationInfo) -> int:
        # A field validator (not a model validator) so the error's path ends in .topK; kind and
        # experts are declared first, so info.data holds them unless they were invalid.
        experts = info.data.get("experts")
        if info.data.get("kind") == "moe" and experts is not None and top_k > experts:
            # A custom error type keeps pydantic's "Value error, " prefix off the message.
            raise PydanticCustomError("top_k_exceeds_experts",
                                      "{top_k} exceeds experts ({experts})",
                                      {"top_k": top_k, "experts": experts})
        return top_k


class ModelSpec(Spec):
    """The model: the built-in zoo (vocabSize, hidden, heads, blocks: a small but real
    heterogeneous model), or a Hugging Face transformers model (huggingface), one or the other."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {"rule": "!has(self.heads) || !has(self.hidden) || self.hidden % self.heads == 0",
                 "message": "heads must divide hidden", "fieldPath": ".heads"},
                {"rule": "!has(self.kvHeads) || !has(self.heads) || self.heads % self.kvHeads == 0",
                 "message": "kvHeads must divide heads", "fieldPath": ".kvHeads"},
                {"rule": "!has(self.positions) || self.positions != 'rope' || !has(self.heads) || "
                         "!has(self.hidden) || "
                         "(self.hidden / self.heads) % 2 == 0",
                 "message": "rope needs an even head size (hidden / heads)",
                 "fieldPath": ".positions"},
                {"rule": "has(self.huggingface) ? !has(self.blocks) && !has(self.vocabSize) && "
                         "!has(self.hidden) : has(self.blocks) && has(self.vocabSize) && "
                         "has(self.hidden)",
                 "message": "give either huggingface or the zoo's vocabSize, hidden and blocks"},
            ]
        }
    )

    # Optional only so that huggingface can stand in for them (_zoo_or_huggingface).
    vocab_size: int | None = Field(
        default=None, ge=2, le=4_194_304, description="Vocabulary of embedding and head.")
    hidden: int | None = Field(default=None, ge=8, le=65_536, description="Hidden size.")
    heads: int = Field(default=4, ge=1, le=512, description="Attention heads; divides hidden.")
    kv_heads: int | None = Field(
        default=None, ge=1, le=512,
        description="Key/value heads of grouped-query attention; divides heads. null: heads "
        "(multi-head attention); 1: multi-query attention.")
    ffn_hidden: int | None = Field(
        default=None, ge=1, le=1_048_576,
        description="MLP width of attention and dense blocks (a block may override it). "
        "null: 4 x hidden.")
    mlp: Literal["gelu", "swiglu"] = Field(
        default="gelu", description="MLP form of every block: gelu (up, GELU, down) or swiglu "
        "(Llama: down(silu(gate) * up), one more matrix of the same width).")
    positions: Literal["none", "rope"] = Field(
        default="none", description="Position information of attention: none (causal mask "
        "only) or rope (rotary embedding of queries and keys).")
    rope_theta: float = Field(default=10_000.0, gt=1, le=1e9,
                              description="rope only: base of the rotary frequencies.")
    blocks: list[BlockSpec] | None = Field(
        default=None, min_length=1, max_length=1024,
        description="The layers between embedding and head.")
    tie_embeddings: bool = Field(default=False, description="Share embedding and head weights.")
    huggingface: HuggingFaceSpec | None = Field(
        default=None, description="A transformers decoder model instead of the zoo "
        "(docs/huggingface.md): its config.json inline or a local path, optional local weights.")

    @field_validator("kv_heads")
    @classmethod
    def _kv_heads_divide_heads(cls, kv_heads: int | None, info: ValidationInfo) -> int | None:
        # A field validator so the error's path ends in .kvHeads (heads is declared first).
        heads = info.data.get("heads")
        if kv_heads is not None and heads is not None and heads % kv_heads:
            raise PydanticCustomError(
                "kv_heads_divide_heads",
                "{kv_heads} must divide heads ({heads}); e.g. kvHeads: 1, or leave it unset for "
                "multi-head attention", {"kv_heads": kv_heads, "heads": heads})
        return kv_heads

    @model_validator(mode="after")
    def _zoo_or_huggingface(self) -> ModelSpec:
        if self.huggingface is not None:
            for name in ("vocab_size", "hidden", "blocks"):
                if getattr(self, name) is not None:
                    raise ValueError(f"model.{to_camel(name)} does not go with model.huggingface "
                                     "(the config gives it): remove one of the two")
            # heads and tieEmbeddings get defaults from the API server: only a change is wrong.
            for name in ("heads", "tie_embeddings"):
                if getattr(self, name) != type(self).model_fields[name].default:
                    raise ValueError(f"model.{to_camel(name)} does not go with model.huggingface "
                                     "(the config gives it): remove it")
            return self
        for name in ("vocab_size", "hidden", "blocks"):
            if getattr(self, name) is None:
                raise ValueError(f"model.{to_camel(name)} is required (or name a Hugging Face "
                                 "model with model.huggingface)")
        if self.hidden % self.heads:  # type: ignore[operator]
            raise ValueError(f"model.heads ({self.heads}) must divide model.hidden ({self.hidden})")
        if self.positions == "rope" and (self.hidden // self.heads) % 2:
            raise ValueError(f"model.positions rope rotates pairs of features: the head size "
                             f"hidden / heads ({self.hidden // self.heads}) must be even")
        return self

    @property
    def key_value_heads(self) -> int:
        """The key/value heads: ``kv_heads``, or ``heads`` when unset (multi-head attention)."""
        return self.kv_heads if self.kv_heads is not None else self.heads

    def mlp_width(self, block: BlockSpec) -> int:
        """The MLP width of ``block``: its own ``ffn_hidden``, else the model's (4 x hidden) for
        attention and dense blocks and 2 x hidden for a moe expert, the widths before
        ffnHidden existed (so existing models are unchanged)."""
        if block.ffn_hidden is not None:
            return block.ffn_hidden
        if block.kind == "moe":
            return 2 * self.hidden
        return self.ffn_hidden if self.ffn_hidden is not None else 4 * self.hidden
