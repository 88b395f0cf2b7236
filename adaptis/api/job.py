"""The AdaPtisJob custom resource: spec and status, the source of the CRD (``adaptis crd``).

Field names are camelCase on the wire, as every Kubernetes API is; Python uses snake_case.
Each component takes only its slice: the worker builds its model from :class:`ModelSpec` (in
:mod:`adaptis.api.model`, re-exported here) and trains with :class:`TrainingSpec`; the planner
never sees this module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic.alias_generators import to_snake
from pydantic_core import PydanticCustomError

from adaptis.api.adaptation import AdaptationSpec, AdaptationStatus
from adaptis.api.errors import SpecError, from_validation_error, read_document
from adaptis.api.model import MAX_BLOCKS, BlockSpec, ModelSpec  # re-exported
from adaptis.api.model import Spec as _Spec
from adaptis.api.pod_fields import (
    EnvVar,
    LabelKey,
    LabelValue,
    ResourceRequirements,
    Toleration,
    Volume,
    VolumeMount,
)

__all__ = [
    "API_VERSION",
    "AdaPtisJob",
    "BlockSpec",
    "CHUNKED_STRATEGIES",
    "CHUNKS_PER_RANK",
    "MAX_BLOCKS",
    "JobSpec",
    "JobStatus",
    "KIND",
    "ModelSpec",
    "RankAssignment",
    "TrainingSpec",
    "resolve_precision",
    "WorkerConfig",
    "load_job",
    "parse_job",
]

GROUP = "adaptis.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "AdaPtisJob"
PLURAL = "adaptisjobs"
SHORT_NAMES = ("apj",)

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


class ParallelismSpec(_Spec):
    """Worker pods, GPUs per pod (one rank each), and the replicas x pipeline mesh of the ranks."""

    workers: int = Field(
        default=2, ge=1, le=128,
        description="Worker pods; each runs max(1, gpusPerWorker) ranks, and with dataParallel 1 "
        "every rank is a pipeline rank. At most 128: every pipeline rank adds a hop per "
        "microbatch, and the plan (ranks x microbatches x F/B/W) grows past what the planner "
        "can search and store; 64 ranks x 4096 microbatches plan in 0.84 GiB "
        "(docs/planning-budget.md).")
    gpus_per_worker: int = Field(
        default=1, ge=0, le=16,
        description="GPUs of each worker pod; the pod runs one rank per GPU (LOCAL_RANK 0..N-1), "
        "so the job has workers x gpusPerWorker ranks. 0: CPU workers, one rank each.")
    data_parallel: int = Field(
        default=1, ge=1, le=64,
        description="Data-parallel replicas of the pipeline. The ranks (workers x "
        "max(1, gpusPerWorker)) form a replicas x pipeline mesh, pipeline innermost: rank = "
        "replica x pipeline ranks + pipeline rank, so a pipeline's stages share pods and nodes "
        "and a stage's replicas sit apart; must divide the ranks (docs/parallelism.md).")
    zero_stage: Literal[0, 1] = Field(
        default=0,
        description="ZeRO optimizer sharding across the data-parallel replicas. 0: every replica "
        "keeps the whole optimizer state of its stages; 1: each keeps about 1/dataParallel of "
        "it and broadcasts the weights it updates (docs/parallelism.md). No effect with one replica.")

    @property
    def ranks(self) -> int:
        """Processes of the job: one per GPU, or one per CPU worker."""
        return self.workers * max(1, self.gpus_per_worker)

    @property
    def pipeline_ranks(self) -> int:
        """Ranks of one pipeline replica (the devices the plan has); 0 when R does not divide."""
        return self.ranks // self.data_parallel if self.ranks % self.data_parallel == 0 else 0


class PlannerSpec(_Spec):
    """How the operator chooses partition, placement and schedule."""

    strategy: Literal["adaptis", "gpipe", "1f1b", "i1f1b", "zb-h1", "zb-v", "balanced"] = Field(
        default="adaptis",
        description="adaptis: joint search; the others are the fixed baselines it is compared with.",
    )
    memory_headroom: float = Field(
        default=0.1, ge=0, lt=1, description="Fraction of device memory the plan keeps free."
    )
    profile: Literal["estimate", "measure"] = Field(
        default="estimate", description="estimate: layer costs from sizes; measure: profile first."
    )
    time_limit_seconds: int = Field(
        default=30, ge=1, le=300,
        description="How long the planner may search. When it runs out, the job runs the best "
        "plan found so far (or the best baseline), and the Planned condition says so; a planner "
        "still busy shortly after it is stopped and the job falls back to 1F1B. Planning runs "
        "off the operator's reconcile workers, but it holds one of the operator's few planner "
        "slots while it runs, so the limit is bounded (docs/planning-budget.md).",
    )


class WorkerTemplate(_Spec):
    """Overrides of the worker pods. The Kubernetes objects pass through to every worker pod,
    checked against core/v1's shapes (adaptis.api.pod_fields); a volume's source is checked by
    the API server."""

    image: str | None = Field(
        default=None, max_length=1024, description="Worker image; default: the operator's."
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        default=None, description="Image pull policy of the worker container."
    )
    resources: ResourceRequirements | None = Field(
        default=None,
        description="Container resources (requests/limits); nvidia.com/gpu comes from "
        "parallelism.gpusPerWorker.",
    )
    env: list[EnvVar] = Field(
        default_factory=list, description="Extra container environment (core/v1 EnvVar)."
    )
    node_selector: dict[LabelKey, LabelValue] = Field(
        default_factory=dict, description="Only nodes with these labels are candidates."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, description="Pod tolerations (core/v1 Toleration)."
    )
    volumes: list[Volume] = Field(
        default_factory=list, description="Extra pod volumes (core/v1 Volume)."
    )
    volume_mounts: list[VolumeMount] = Field(
        default_factory=list, description="Extra container volume mounts (core/v1 VolumeMount)."
    )
    labels: dict[LabelKey, LabelValue] = Field(
        default_factory=dict, description="Extra labels of the worker pods."
    )
    annotations: dict[LabelKey, str] = Field(
        default_factory=dict, description="Extra annotations of the worker pods."
    )
    priority_class_name: str | None = Field(
        default=None, max_length=253, description="PriorityClass of the worker pods."
    )
    service_account_name: str | None = Field(
        default=None, max_length=253, description="ServiceAccount of the worker pods."
    )


class CheckpointSpec(_Spec):
    """Where and how often the gang saves a checkpoint to restart from."""

    every_steps: int = Field(default=0, ge=0, description="0: no periodic checkpoints.")
    claim_name: str | None = Field(
        default=None, max_length=253, description="PVC mounted at path; none: emptyDir."
    )
    path: str = Field(
        default="/checkpoints", pattern=r"^/", max_length=4096,
        description="Mount path of the checkpoint volume in the worker pods.",
    )


class MetricsSpec(_Spec):
    """The workers' Prometheus endpoint."""

    port: int = Field(default=9400, ge=1024, le=65535, description="Container port named "
                      "metrics; with N GPUs a pod, rank LOCAL_RANK serves on port + LOCAL_RANK "
                      "(container port metrics-<LOCAL_RANK>).")


# Schedules that give every rank CHUNKS_PER_RANK model chunks, hence need that many layers.
CHUNKED_STRATEGIES: tuple[str, ...] = ("i1f1b", "zb-v")
CHUNKS_PER_RANK = 2


def _job_cel_rules() -> list[dict[str, str]]:
    """CEL for the rules of adaptis.api.rules that need only the spec, so the API server
    refuses those manifests as the operator and ``adaptis run`` do. Nested objects get no
    default from the API server when absent, so the models' defaults stand in for them."""
    steps_default = TrainingSpec.model_fields["steps"].default
    def par(field: str) -> str:
        default = ParallelismSpec.model_fields[to_snake(field)].default
        return (f"(has(self.parallelism) && has(self.parallelism.{field}) "
                f"? self.parallelism.{field} : {default})")

    gpus = par("gpusPerWorker")
    ranks = f"({par('workers')} * ({gpus} > 0 ? {gpus} : 1))"
    # The devices of one pipeline replica: what the plan partitions the layers over.
    workers = f"({ranks} / {par('dataParallel')})"
    # blocks has maxItems 1024, which bounds the map's cost well within the per-rule limit.
    layers = "(2 + self.model.blocks.map(b, has(b.count) ? b.count : 1).sum())"
    # A huggingface model's layers are in its config, which CEL cannot read: rules.py checks.
    zoo = "!has(self.model.blocks) || "
    steps = ("(has(self.training) && has(self.training.steps) "
             f"? self.training.steps : {steps_default})")
    chunked = ", ".join(f"'{name}'" for name in CHUNKED_STRATEGIES)
    chunks = CHUNKS_PER_RANK
    return [
        {"rule": f"{zoo}{layers} <= {MAX_BLOCKS + 2}", "fieldPath": ".model.blocks",
         "message": f"the blocks' counts must add up to at most {MAX_BLOCKS}"},
        {"rule": f"{ranks} % {par('dataParallel')} == 0", "fieldPath": ".parallelism.dataParallel",
         "message": "dataParallel must divide the ranks (workers x max(1, gpusPerWorker))"},
        {"rule": f"{zoo}{workers} <= {layers}", "fieldPath": ".parallelism.workers",
         "message": "pipeline ranks (workers x max(1, gpusPerWorker) / dataParallel) must not "
                    "exceed the model's layers (2 + the sum of block counts)"},
        {"rule": "!has(self.planner) || !has(self.planner.strategy) || "
                 f"!(self.planner.strategy in [{chunked}]) || {zoo}{chunks} * {workers} <= {layers}",
         "fieldPath": ".planner.strategy",
         "message": f"{'/'.join(CHUNKED_STRATEGIES)} need {chunks} layers per worker"},
        {"rule": "!has(self.checkpoint) || !has(self.checkpoint.everySteps) || "
                 f"self.checkpoint.everySteps <= {steps}",
         "fieldPath": ".checkpoint.everySteps",
         "message": "everySteps must not exceed training.steps"},
        {"rule": "!has(self.training) || !has(self.training.data) || !has(self.training.data.source) || "
                 "self.training.data.source != 'text' || has(self.training.data.tokenizer) || "
                 "(has(self.model.huggingface) && (has(self.model.huggingface.weights) || "
                 "has(self.model.huggingface.path)))",
         "fieldPath": ".training.data.tokenizer",
         "message": "tokenizer is required for source text unless model.huggingface has weights or path"},
    ]


class JobSpec(_Spec):
    """An AdaPtisJob: a model trained with a planned pipeline over a gang of worker pods."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": _job_cel_rules()})

    model: ModelSpec = Field(description="The model to train.")
    training: TrainingSpec = Field(default=TrainingSpec(), description="The training run.")
    parallelism: ParallelismSpec = Field(
        default=ParallelismSpec(), description="Worker pods, GPUs per pod and data-parallel replicas."
    )
    planner: PlannerSpec = Field(default=PlannerSpec(), description="The planner's choices.")
    worker: WorkerTemplate = Field(
        default=WorkerTemplate(), description="Overrides of the worker pods."
    )
    checkpoint: CheckpointSpec = Field(
        default=CheckpointSpec(), description="Checkpoints to restart the gang from."
    )
    metrics: MetricsSpec = Field(default=MetricsSpec(), description="Worker metrics.")
    adaptation: AdaptationSpec = Field(
        default=AdaptationSpec(), description="Re-plan the running job when its measured compute "
        "drifts from the plan's prediction (docs/adaptation.md).")
    suspend: bool = Field(
        default=False, description="true: remove the worker pods; false again: recreate them."
    )
    backoff_limit: int = Field(
        default=3, ge=0, le=1000, description="Gang restarts after a failed pod before Failed."
    )
    active_deadline_seconds: int | None = Field(
        default=None, ge=1, description="Seconds from start after which the job fails."
    )
    ttl_seconds_after_finished: int | None = Field(
        default=None, ge=0, description="Seconds after Succeeded/Failed until the job is deleted."
    )
    queue_name: str | None = Field(
        default=None, max_length=63,
        description="Kueue LocalQueue; sets kueue.x-k8s.io/queue-name on the worker pods.",
    )


Phase = Literal[
    "Pending", "Queued", "Profiling", "Planned", "Running", "Restarting", "Suspended",
    "Succeeded", "Failed",
]
ConditionType = Literal[
    "Queued", "Profiling", "Planned", "Running", "Restarting", "Suspended", "Succeeded", "Failed",
    "Replanned", "ReplanSuggested",
]


class Condition(_Spec):
    """One observation of the job, as every Kubernetes condition."""

    type: str = Field(description="Queued, Profiling, Planned, Running, Restarting, ...")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(default="", description="CamelCase reason of the last transition.")
    message: str = Field(default="", description="Human-readable detail; names the field at fault.")
    last_transition_time: str | None = Field(
        default=None, description="RFC 3339 time the status last changed."
    )


class RankAssignment(_Spec):
    """Where one rank runs and what it holds."""

    rank: int = Field(ge=0, description="Global rank: replica x pipeline ranks + pipeline rank.")
    node: str = Field(description="Node the plan places the rank on.")
    gpu: str | None = Field(default=None, description="GPU product of that node (GFD label).")
    stages: list[int] = Field(
        default_factory=list,
        description="Stage indices the rank holds: those of its pipeline rank (the plan's "
        "device rank mod pipeline ranks).")
    replica: int = Field(default=0, ge=0, description="Data-parallel replica of the rank.")
    pod: str | None = Field(
        default=None,
        description="Worker pod of the rank: <job>-worker-<w>, w = rank / gpusPerWorker; the "
        "rank's LOCAL_RANK (its GPU in the pod) is rank mod gpusPerWorker.")


class JobStatus(_Spec):
    """What the operator observed and decided; written only by the operator."""

    phase: Phase = Field(default="Pending", description="Where the job is in its lifecycle.")
    conditions: list[Condition] = Field(default_factory=list, description="Latest observations.")
    workers_ready: str | None = Field(default=None, description="ready/total, e.g. 3/4.")
    stages: int | None = Field(default=None, description="Stages of the plan.")
    strategy: str | None = Field(default=None, description="Strategy that made the plan.")
    predicted_iteration_seconds: float | None = Field(
        default=None, description="Iteration time the performance model predicts."
    )
    predicted_bubble_ratio: float | None = Field(
        default=None, description="Idle fraction of device time the model predicts."
    )
    observed_bubble_ratio: float | None = Field(
        default=None, description="Idle fraction the workers reported."
    )
    predicted_speedup_over_i1f1b: float | None = Field(
        default=None, description="Predicted I-1F1B iteration time / this plan's."
    )
    predicted_step_seconds: float | None = Field(
        default=None, description="Step time the performance model predicts: the iteration, "
        "then the gradient all-reduce across replicas not hidden and the optimizer step."
    )
    restarts: int = Field(default=0, description="Gang restarts after failures.")
    replans: int = Field(
        default=0, description="Re-plans after lost nodes, changed hardware, a placement that "
        "stayed unschedulable, or drift (adaptation).")
    adaptation: AdaptationStatus | None = Field(
        default=None, description="Measured drift, a suggested plan and the re-plans it caused.")
    launched: str | None = Field(
        default=None, description="<plan hash>/<attempt> whose ranks all got a pod: a rank of "
        "it lost since (deleted, evicted) restarts the gang.")
    start_time: str | None = Field(default=None, description="When the worker pods were created.")
    completion_time: str | None = Field(default=None, description="When the job finished.")
    message: str | None = Field(default=None, description="Why the job is in its phase.")
    placement: list[RankAssignment] = Field(
        default_factory=list, description="Node and stages of every rank."
    )
    observed_generation: int | None = Field(
        default=None, description="metadata.generation the status reflects."
    )


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
    return parse_job(read_document(path, what="AdaPtisJob"))


class WorkerConfig(_Spec):
    """The worker's whole input: its slice of the job plus the plan. Written by the operator
    (ConfigMap ``worker.json``) or by ``adaptis run``; read by ``adaptis worker``."""

    job_name: str = Field(default="local", description="Label value of the metrics.")
    model: ModelSpec
    training: TrainingSpec = TrainingSpec()
    plan: Any = Field(description="An adaptis.api.plan.Plan document, its actions plain or "
                      "packed (actionsPacked, as the operator writes it).")
    metrics_port: int | None = Field(default=None, ge=0, le=65535, description="None: off; 0: any.")
    checkpoint_dir: str | None = None
    checkpoint_every: int = Field(default=0, ge=0)
    data_parallel: int = Field(
        default=1, ge=1, description="Replicas of the plan's pipeline; world size = "
        "data_parallel x the plan's devices, rank = replica x devices + pipeline rank.")
    zero_stage: Literal[0, 1] = Field(
        default=0, description="1: shard the optimizer state across the replicas (ZeRO-1).")
