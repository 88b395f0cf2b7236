"""What one training run does (``spec.training``): steps, batch shape, optimizer, data.

Part of :mod:`adaptis.api`, re-exported by :mod:`adaptis.api.job`. The worker trains with
:class:`TrainingSpec` (its slice of the job); the planner sees only the batch shape.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from adaptis.api.errors import SpecError
from adaptis.api.model import Spec as _Spec

__all__ = ["DataSpec", "OptimizerSpec", "TrainingSpec", "resolve_precision"]


class OptimizerSpec(_Spec):
    """The optimizer every stage runs on its own parameters."""

    name: Literal["adamw", "sgd"] = Field(default="adamw", description="adamw or sgd.")
    lr: float = Field(default=1e-3, gt=0, le=10, description="Peak learning rate.")
    weight_decay: float = Field(default=0.0, ge=0, le=1, description="Decoupled weight decay.")
    schedule: Literal["constant", "cosine", "linear"] = Field(
        default="constant",
        description="Learning rate over the steps: constant (lr throughout, after any warm-up), "
        "or linear warm-up from 0 to lr over warmupSteps then cosine or linear decay to "
        "lr x minLrRatio at training.steps. A function of the step only, so a resumed run "
        "continues the same curve (docs/precision.md).")
    warmup_steps: int = Field(
        default=0, ge=0, le=10_000_000,
        description="Steps of linear warm-up from 0 to lr (0: none); counts within training.steps.")
    min_lr_ratio: float = Field(
        default=0.0, ge=0, le=1,
        description="cosine and linear: the final learning rate as a fraction of lr.")


class DataSpec(_Spec):
    """Synthetic tokens (seeded), a flat file of uint16/uint32 token ids (memory-mapped), or a
    local text corpus tokenized with the model's tokenizer (docs/data.md)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {"rule": "!has(self.source) || self.source == 'synthetic' || has(self.path)",
                 "message": "path is required when source is token-file or text", "fieldPath": ".path"},
                {"rule": "!has(self.tokenizer) || (has(self.source) && self.source == 'text')",
                 "message": "tokenizer goes only with source text", "fieldPath": ".tokenizer"},
                {"rule": "!has(self.cacheDir) || (has(self.source) && self.source == 'text')",
                 "message": "cacheDir goes only with source text", "fieldPath": ".cacheDir"},
            ]
        }
    )

    source: Literal["synthetic", "token-file", "text"] = Field(
        default="synthetic", description="synthetic: seeded random tokens; token-file: a file of "
        "token ids; text: UTF-8 text or JSONL files, tokenized with the model's tokenizer."
    )
    path: str | None = Field(
        default=None, max_length=4096, validate_default=True,
        description="token-file: the file; text: a file, a directory (its *.txt, *.md, *.jsonl, "
        "recursively) or a glob; a path inside the pod."
    )
    dtype: Literal["uint16", "uint32"] = Field(
        default="uint16", description="token-file only: integer type of the token ids."
    )
    tokenizer: str | None = Field(
        default=None, min_length=1, max_length=4096,
        description="text only: a tokenizer.json, or a directory holding one (and optionally "
        "tokenizer_config.json naming eos_token), inside the pod. Default: the Hugging Face "
        "model's weights directory, then its config path's directory.")
    cache_dir: str | None = Field(
        default=None, min_length=1, max_length=4096,
        description="text only: where the tokenized corpus is cached, keyed by a hash of the "
        "files and the tokenizer. Default: <system temp dir>/adaptis-data.")
    shuffle: bool = Field(
        default=True, description="text only: visit the packed sequences in a fresh seeded "
        "order each epoch (training.seed); false: in corpus order.")

    # Field validators (not a model validator) so the error's path ends in .path or .tokenizer;
    # validate_default runs them on an absent path too; source is declared first.
    @field_validator("path")
    @classmethod
    def _path_for_file(cls, path: str | None, info: ValidationInfo) -> str | None:
        source = info.data.get("source")
        if source in ("token-file", "text") and not path:
            raise PydanticCustomError(
                "path_required", "required when source is {source}: give the file (for text also "
                "a directory or a glob) inside the pod", {"source": source})
        return path

    @field_validator("tokenizer", "cache_dir")
    @classmethod
    def _text_only(cls, value: str | None, info: ValidationInfo) -> str | None:
        source = info.data.get("source")
        if value is not None and source is not None and source != "text":
            raise PydanticCustomError(
                "text_only", "goes only with source text (source is {source}): remove it or set "
                "source: text", {"source": source})
        return value


class TrainingSpec(_Spec):
    """What one training run does: steps, batch shape, optimizer, data."""

    steps: int = Field(default=10, ge=1, le=10_000_000, description="Optimizer steps to run.")
    microbatches: int = Field(default=8, ge=1, le=4096, description="Microbatches per step.")
    microbatch_size: int = Field(default=1, ge=1, le=4096, description="Sequences per microbatch.")
    sequence_length: int = Field(
        default=64, ge=2, le=1_048_576, description="Tokens per sequence."
    )
    optimizer: OptimizerSpec = Field(default=OptimizerSpec(), description="The optimizer.")
    grad_clip: float | None = Field(default=1.0, gt=0, description="Max global grad norm; null: off.")
    seed: int = Field(default=0, ge=0, le=2**31 - 1, description="Seed of weights, synthetic data and the text order.")
    data: DataSpec = Field(default=DataSpec(), description="Where the tokens come from.")
    precision: Literal["auto", "bf16", "fp32"] = Field(
        default="auto",
        description="Compute precision: bf16 runs the stages' forward under bf16 autocast with "
        "fp32 master weights and optimizer state, and sends bf16 activations between stages; "
        "fp32 runs everything in fp32; auto is bf16 on GPUs and fp32 on CPU (docs/precision.md).")


def resolve_precision(precision: str, *, cuda: bool) -> Literal["bf16", "fp32"]:
    """The precision a run computes in: ``auto`` is bf16 on CUDA devices and fp32 on CPU (bf16
    autocast on CPU is slower than fp32 on most hosts, and CPU runs are the parity tests)."""
    if precision == "auto":
        return "bf16" if cuda else "fp32"
    if precision not in ("bf16", "fp32"):
        raise SpecError(f"training.precision: {precision!r} is not auto, bf16 or fp32")
    return "bf16" if precision == "bf16" else "fp32"
