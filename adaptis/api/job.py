"""The AdaPtisJob custom resource: spec and status, the source of the CRD (``adaptis crd``).

Field names are camelCase on the wire, as every Kubernetes API is; Python uses snake_case.
Each component takes only its slice: the worker builds its model from :class:`ModelSpec` and
trains with :class:`TrainingSpec`; the planner never sees this module.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from adaptis.api.errors import SpecError, from_validation_error

__all__ = [
    "API_VERSION",
    "AdaPtisJob",
    "BlockSpec",
    "JobSpec",
    "JobStatus",
    "KIND",
    "ModelSpec",
    "TrainingSpec",
    "load_job",
    "parse_job",
]

GROUP = "adaptis.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "AdaPtisJob"
PLURAL = "adaptisjobs"
SHORT_NAMES = ("apj",)


class _Spec(BaseModel):
    model_config = ConfigDict(
        extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True
    )


BlockKind = Literal["attention", "mamba", "moe", "dense"]


class BlockSpec(_Spec):
    """A run of identical blocks in pipeline order."""

    kind: BlockKind = Field(description="attention (+MLP), mamba (selective SSM), moe, dense MLP.")
    count: int = Field(default=1, ge=1, le=4096, description="How many such blocks in a row.")
    experts: int = Field(default=4, ge=1, le=256, description="MoE only: number of experts.")
    top_k: int = Field(default=2, ge=1, le=16, description="MoE only: experts per token.")


class ModelSpec(_Spec):
    """A small but real heterogeneous model: embedding, blocks, large-vocabulary head."""

    vocab_size: int = Field(ge=2, le=4_194_304, description="Vocabulary of embedding and head.")
    hidden: int = Field(ge=8, le=65_536, description="Hidden size.")
    heads: int = Field(default=4, ge=1, le=512, description="Attention heads; divides hidden.")
    blocks: list[BlockSpec] = Field(min_length=1, description="The layers between embedding and head.")
    tie_embeddings: bool = Field(default=False, description="Share embedding and head weights.")

    @model_validator(mode="after")
    def _heads_divide_hidden(self) -> ModelSpec:
        if self.hidden % self.heads:
            raise ValueError(f"model.heads ({self.heads}) must divide model.hidden ({self.hidden})")
        return self

    @property
    def block_kinds(self) -> list[str]:
        return [b.kind for b in self.blocks for _ in range(b.count)]


class OptimizerSpec(_Spec):
    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = Field(default=1e-3, gt=0, le=10)
    weight_decay: float = Field(default=0.0, ge=0, le=1)


class DataSpec(_Spec):
    """Synthetic tokens (seeded), or a flat file of uint16/uint32 token ids, memory-mapped."""

    source: Literal["synthetic", "token-file"] = "synthetic"
    path: str | None = Field(default=None, description="token-file only: path inside the pod.")
    dtype: Literal["uint16", "uint32"] = "uint16"

    @model_validator(mode="after")
    def _path_for_file(self) -> DataSpec:
        if self.source == "token-file" and not self.path:
            raise ValueError("training.data.path is required when source is token-file")
        return self


class TrainingSpec(_Spec):
    steps: int = Field(default=10, ge=1, le=10_000_000)
    microbatches: int = Field(default=8, ge=1, le=4096, description="Microbatches per step.")
    microbatch_size: int = Field(default=1, ge=1, le=4096, description="Sequences per microbatch.")
    sequence_length: int = Field(default=64, ge=2, le=1_048_576)
    optimizer: OptimizerSpec = OptimizerSpec()
    grad_clip: float | None = Field(default=1.0, gt=0, description="Max global grad norm; null: off.")
    seed: int = Field(default=0, ge=0)
    data: DataSpec = DataSpec()


class ParallelismSpec(_Spec):
    workers: int = Field(default=2, ge=1, le=4096, description="Pipeline ranks (pods).")
    gpus_per_worker: int = Field(default=1, ge=0, le=16, description="0: CPU workers.")


class PlannerSpec(_Spec):
    strategy: Literal["adaptis", "gpipe", "1f1b", "i1f1b", "zb-h1", "zb-v", "balanced"] = "adaptis"
    memory_headroom: float = Field(
        default=0.1, ge=0, lt=1, description="Fraction of device memory the plan keeps free."
    )
    profile: Literal["estimate", "measure"] = Field(
        default="estimate", description="estimate: layer costs from sizes; measure: profile first."
    )


class WorkerTemplate(_Spec):
    """Overrides of the worker pods. Kubernetes objects pass through unchecked."""

    image: str | None = None
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    resources: dict[str, Any] | None = None
    env: list[dict[str, Any]] = Field(default_factory=list)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    volumes: list[dict[str, Any]] = Field(default_factory=list)
    volume_mounts: list[dict[str, Any]] = Field(default_factory=list)


class CheckpointSpec(_Spec):
    every_steps: int = Field(default=0, ge=0, description="0: no periodic checkpoints.")
    claim_name: str | None = Field(default=None, description="PVC mounted at path; none: emptyDir.")
    path: str = Field(default="/checkpoints", pattern=r"^/")


class MetricsSpec(_Spec):
    port: int = Field(default=9400, ge=1024, le=65535)


class JobSpec(_Spec):
    model: ModelSpec
    training: TrainingSpec = TrainingSpec()
    parallelism: ParallelismSpec = ParallelismSpec()
    planner: PlannerSpec = PlannerSpec()
    worker: WorkerTemplate = WorkerTemplate()
    checkpoint: CheckpointSpec = CheckpointSpec()
    metrics: MetricsSpec = MetricsSpec()
    suspend: bool = False
    backoff_limit: int = Field(default=3, ge=0, le=1000)
    active_deadline_seconds: int | None = Field(default=None, ge=1)
    ttl_seconds_after_finished: int | None = Field(default=None, ge=0)


Phase = Literal[
    "Pending", "Profiling", "Planned", "Running", "Restarting", "Suspended", "Succeeded", "Failed"
]


class Condition(_Spec):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = ""
    message: str = ""
    last_transition_time: str | None = None


class JobStatus(_Spec):
    phase: Phase = "Pending"
    conditions: list[Condition] = Field(default_factory=list)
    workers_ready: str | None = Field(default=None, description="ready/total, e.g. 3/4.")
    stages: int | None = None
    strategy: str | None = None
    predicted_iteration_seconds: float | None = None
    predicted_bubble_ratio: float | None = None
    observed_bubble_ratio: float | None = None
    predicted_speedup_over_i1f1b: float | None = None
    restarts: int = 0
    start_time: str | None = None
    completion_time: str | None = None
    message: str | None = None


class ObjectMeta(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)
    name: str = "local"
    namespace: str | None = None


class AdaPtisJob(_Spec):
    api_version: Literal["adaptis.io/v1alpha1"] = Field(default=API_VERSION, alias="apiVersion")
    kind: Literal["AdaPtisJob"] = KIND
    metadata: ObjectMeta = ObjectMeta()
    spec: JobSpec
    status: JobStatus | None = None


def parse_job(data: Any) -> AdaPtisJob:
    try:
        return AdaPtisJob.model_validate(data)
    except ValidationError as err:
        raise from_validation_error(err, what="AdaPtisJob") from None


def load_job(path: str | Path) -> AdaPtisJob:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as err:
        raise SpecError(f"AdaPtisJob: cannot read {p}: {err.strerror}") from None
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError) as err:
        raise SpecError(f"AdaPtisJob: {p} is not valid YAML/JSON: {err}") from None
    return parse_job(data)
