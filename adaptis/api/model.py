"""The model of an AdaPtisJob (``spec.model``): the built-in zoo's blocks, or a Hugging Face model.

Part of :mod:`adaptis.api`, the single source of truth; re-exported by :mod:`adaptis.api.job`,
where the rest of the custom resource lives.

Two forms of one model (docs/architecture.md, "One model, two kinds"):

- :class:`ModelSpec` is the wire form: the one object the CRD's structural schema, docs/job.md
  and a manifest's YAML hold, with the zoo's fields optional so that ``huggingface`` can stand
  in for them. Only validation reads it.
- :data:`Model` (``ZooModel | HuggingFaceModel``) is what everything else holds: a job's
  ``spec.model`` and a worker's ``model`` validate as :class:`ModelSpec` (same schema, same
  errors) and are resolved into one of the two kinds there, once; they serialize back to
  :class:`ModelSpec`'s form. Both kinds answer the questions every layer asks
  (:attr:`~ZooModel.vocab_size`, :attr:`~ZooModel.hidden`, :attr:`~ZooModel.tied`,
  :attr:`~ZooModel.layer_count`, :attr:`~ZooModel.name`); only code that builds, estimates or
  profiles the layers themselves tells the kinds apart, in one dispatch at its entry.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError, core_schema

from adaptis.api.errors import SpecError
from adaptis.api.hf_model import HFLayout, HuggingFaceSpec, hf_layout, resolve_config

__all__ = ["BlockKind", "BlockSpec", "HuggingFaceModel", "MAX_BLOCKS", "Model", "ModelSpec",
           "Spec", "ZooModel", "expect_kind", "resolve_model"]

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
        hidden = self.hidden
        if hidden is None or self.vocab_size is None or self.blocks is None:
            name = next(n for n in ("vocab_size", "hidden", "blocks") if getattr(self, n) is None)
            raise ValueError(f"model.{to_camel(name)} is required (or name a Hugging Face "
                             "model with model.huggingface)")
        if hidden % self.heads:
            raise ValueError(f"model.heads ({self.heads}) must divide model.hidden ({hidden})")
        if self.positions == "rope" and (hidden // self.heads) % 2:
            raise ValueError(f"model.positions rope rotates pairs of features: the head size "
                             f"hidden / heads ({hidden // self.heads}) must be even")
        return self


# The zoo's scalar fields a Hugging Face model's config gives instead: the API server defaults
# them on every model (one structural schema), so a Hugging Face model carries them unused.
_KNOBS = ("heads", "kv_heads", "ffn_hidden", "mlp", "positions", "rope_theta", "tie_embeddings")


def _default(name: str) -> Any:
    return ModelSpec.model_fields[name].default


@dataclass(frozen=True, slots=True, kw_only=True)
class ZooModel:
    """A model of the built-in zoo: embedding, ``blocks`` in order, head. Made from a valid
    :class:`ModelSpec` by :func:`resolve_model`; made directly (tests, benches), it is checked
    as a manifest's would be (a :class:`pydantic.ValidationError` naming the field)."""

    vocab_size: int
    hidden: int
    blocks: tuple[BlockSpec, ...]
    heads: int = _default("heads")
    kv_heads: int | None = _default("kv_heads")
    ffn_hidden: int | None = _default("ffn_hidden")
    mlp: Literal["gelu", "swiglu"] = _default("mlp")
    positions: Literal["none", "rope"] = _default("positions")
    rope_theta: float = _default("rope_theta")
    tie_embeddings: bool = _default("tie_embeddings")

    def __post_init__(self) -> None:
        object.__setattr__(self, "blocks", tuple(self.blocks))
        ModelSpec.model_validate(self._given())

    def _given(self) -> dict[str, Any]:
        return {**{f.name: getattr(self, f.name) for f in fields(self)},
                "blocks": list(self.blocks)}

    def wire(self) -> ModelSpec:
        """The wire form (what a manifest or a worker's config holds)."""
        return ModelSpec.model_construct(**self._given())

    @property
    def key_value_heads(self) -> int:
        """The key/value heads: ``kv_heads``, or ``heads`` when unset (multi-head attention)."""
        return self.kv_heads if self.kv_heads is not None else self.heads

    @property
    def tied(self) -> bool:
        """Whether embedding and head share their weights."""
        return self.tie_embeddings

    @property
    def layer_count(self) -> int:
        """Pipeline layers: embedding, every block, head."""
        return 2 + sum(b.count for b in self.blocks)

    @property
    def layers_field(self) -> str:
        """The manifest's field that sets the number of layers."""
        return "spec.model.blocks"

    @property
    def name(self) -> str:
        """A short name of the model: its first block's kind, e.g. ``attention-model``."""
        return f"{self.blocks[0].kind}-model"

    @property
    def file_dirs(self) -> tuple[Path, ...]:
        """Directories holding the model's files (where a tokenizer may sit): none."""
        return ()

    @property
    def eos_token_id(self) -> int | None:
        """The end-of-sequence token the model names: none."""
        return None

    def mlp_width(self, block: BlockSpec) -> int:
        """The MLP width of ``block``: its own ``ffn_hidden``, else the model's (4 x hidden) for
        attention and dense blocks and 2 x hidden for a moe expert, the widths before
        ffnHidden existed (so existing models are unchanged)."""
        if block.ffn_hidden is not None:
            return block.ffn_hidden
        if block.kind == "moe":
            return 2 * self.hidden
        return self.ffn_hidden if self.ffn_hidden is not None else 4 * self.hidden


@dataclass(frozen=True, slots=True, kw_only=True)
class HuggingFaceModel:
    """A transformers decoder model: everything about it is in its config
    (:attr:`layout`, read afresh from the config each time, as the config may be a file)."""

    huggingface: HuggingFaceSpec
    #: The zoo's scalar fields as the manifest held them (the API server defaults them on every
    #: model): unused, kept so the model serializes back as it came.
    unused: Mapping[str, Any] = field(default_factory=dict)

    def wire(self) -> ModelSpec:
        """The wire form (what a manifest or a worker's config holds)."""
        knobs = {name: self.unused.get(name, _default(name)) for name in _KNOBS}
        return ModelSpec.model_construct(**knobs, huggingface=self.huggingface)

    def with_huggingface(self, spec: HuggingFaceSpec) -> HuggingFaceModel:
        """This model with ``spec`` in place of its :class:`HuggingFaceSpec`."""
        return HuggingFaceModel(huggingface=spec, unused=self.unused)

    @property
    def layout(self) -> HFLayout:
        """The layout its config describes; a :class:`~adaptis.api.errors.SpecError` naming the
        field when the config is not a supported one."""
        return hf_layout(self.huggingface)

    @property
    def vocab_size(self) -> int:
        return self.layout.vocab_size

    @property
    def hidden(self) -> int:
        return self.layout.hidden

    @property
    def tied(self) -> bool:
        return self.layout.tied

    @property
    def layer_count(self) -> int:
        return self.layout.layer_count

    @property
    def layers_field(self) -> str:
        return "spec.model.huggingface.config.num_hidden_layers"

    @property
    def name(self) -> str:
        return f"{self.layout.model_type}-model"

    @property
    def file_dirs(self) -> tuple[Path, ...]:
        """Its weights directory, then the directory of its config path, where given."""
        dirs = []
        if self.huggingface.weights:
            dirs.append(Path(self.huggingface.weights))
        if self.huggingface.path:
            p = Path(self.huggingface.path)
            dirs.append(p if p.is_dir() else p.parent)
        return tuple(dirs)

    @property
    def eos_token_id(self) -> int | None:
        """The config's ``eos_token_id`` (the first, when it lists several)."""
        eos = resolve_config(self.huggingface).get("eos_token_id")
        if isinstance(eos, list) and eos:
            return cast(int, eos[0])  # as config.json lists them
        return eos if isinstance(eos, int) else None


def resolve_model(spec: ModelSpec) -> ZooModel | HuggingFaceModel:
    """The kind of model ``spec`` (a valid one) names."""
    if spec.huggingface is not None:
        unused = {name: getattr(spec, name) for name in _KNOBS}
        return HuggingFaceModel(huggingface=spec.huggingface, unused=unused)
    return ZooModel(**{f.name: getattr(spec, f.name) for f in fields(ZooModel)})


_Kind = TypeVar("_Kind", ZooModel, HuggingFaceModel)


def expect_kind(model: Model, kind: type[_Kind], *, what: str) -> _Kind:
    """``model`` as ``kind``, the one kind ``what`` (code building that kind's own layers)
    takes; a :class:`~adaptis.api.errors.SpecError` naming the field otherwise."""
    if isinstance(model, kind):
        return model
    if kind is ZooModel:
        raise SpecError(f"spec.model.huggingface: {what} takes the zoo's blocks, not a Hugging "
                        "Face model", fields=["spec.model.huggingface"])
    raise SpecError(f"spec.model.huggingface: {what} takes a Hugging Face model; this one is "
                    "the zoo's", fields=["spec.model.huggingface"])


class _AsModelSpec:
    """Pydantic's view of :data:`Model`: validated and serialized as :class:`ModelSpec` (its
    JSON schema, hence the CRD's and docs/job.md's), held as one of the two kinds."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any,
                                     handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        wire = handler.generate_schema(ModelSpec)

        def validate(value: Any, inner: core_schema.ValidatorFunctionWrapHandler) -> Model:
            if isinstance(value, ZooModel | HuggingFaceModel):
                return value
            return resolve_model(inner(value))

        return core_schema.no_info_wrap_validator_function(
            validate, wire,
            serialization=core_schema.plain_serializer_function_ser_schema(
                lambda model: model.wire(), return_schema=wire))


#: A job's model, of either kind; validated and serialized as :class:`ModelSpec`.
Model = Annotated[ZooModel | HuggingFaceModel, _AsModelSpec]
