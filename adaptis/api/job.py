"""The AdaPtisJob custom resource: spec and status, the source of the CRD (``adaptis crd``).

Field names are camelCase on the wire, as every Kubernetes API is; Python uses snake_case.
Each component takes only its slice: the worker builds its model from :data:`Model` (in
:mod:`adaptis.api.model`, re-exported here with its wire form :class:`ModelSpec`) and trains
with :class:`TrainingSpec`; the planner never sees this module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
)
from pydantic.alias_generators import to_snake
from pydantic.config import JsonValue

from adaptis.api.adaptation import AdaptationSpec, AdaptationStatus
from adaptis.api.conditions import ConditionType
from adaptis.api.errors import from_validation_error, read_document
from adaptis.api.model import MAX_BLOCKS, BlockSpec, Model, ModelSpec  # re-exported
from adaptis.api.model import Spec as _Spec
from adaptis.api.plan import StrategyName
from adaptis.api.pod_fields import (
    MAX_ENV,
    MAX_VOLUMES,
    EnvVar,
    LabelKey,
    LabelValue,
    ResourceRequirements,
    Toleration,
    Volume,
    VolumeMount,
)
from adaptis.api.training import DataSpec, OptimizerSpec, TrainingSpec, resolve_precision  # re-exported

__all__ = [
    "API_VERSION",
    "AdaPtisJob",
    "BlockSpec",
    "CHUNKED_STRATEGIES",
    "CHUNKS_PER_RANK",
    "DataSpec",
    "MAX_BLOCKS",
    "JobSpec",
    "Model",
    "JobStatus",
    "KIND",
    "ModelSpec",
    "OptimizerSpec",
    "RankAssignment",
    "TrainingSpec",
    "resolve_precision",
    "WorkerConfig",
    "load_job",
    "parse_job",
]

GROUP = "adaptis.io"
VERSION = "v1alpha1"
API_VERSION: Final = "adaptis.io/v1alpha1"  # f"{GROUP}/{VERSION}", as a literal type
KIND: Final = "AdaPtisJob"
PLURAL = "adaptisjobs"
SHORT_NAMES = ("apj",)

class ParallelismSpec(_Spec):
    """Worker pods, GPUs per pod (one rank each), and the replicas x pipeline mesh of the ranks."""

    workers: int = Field(
        default=2, ge=1, le=128,
        description="Worker pods; each runs max(1, gpusPerWorker) ranks, and with dataParallel 1 "
        "every rank is a pipeline rank. At most 128: every pipeline rank adds a hop per "
        "microbatch, and the plan (ranks x microbatches x F/B/W) grows past what the planner "
        "can search and store within the operator's planning budget "
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
    tensor_parallel: int = Field(
        default=1, ge=1, le=16,
        description="Tensor-parallel degree T: each pipeline position is T ranks of one pod "
        "sharing every layer (attention heads, MLP and expert widths, the vocabulary), as "
        "Megatron-LM's tensor_model_parallel_size. Must divide max(1, gpusPerWorker), so a "
        "tensor group never leaves its pod; ranks = dataParallel x pipeline x T, tensor "
        "innermost (docs/parallelism.md). The model's heads, key/value heads, MLP and expert "
        "widths and vocabulary must divide by T.")
    sequence_parallel: bool = Field(
        default=False,
        description="With tensorParallel T > 1: also shard the norms, residuals and the "
        "activations between blocks and between pipeline stages on the sequence (each tensor "
        "rank holds sequenceLength / T tokens of them), as Megatron-LM's sequence_parallel and "
        "torch's SequenceParallel: the all-reduces become all-gathers and reduce-scatters, and "
        "activation memory and pipeline transfers shrink by T. Needs tensorParallel > 1 and "
        "training.sequenceLength divisible by it; zoo models only (docs/parallelism.md).")

    @property
    def ranks_per_worker(self) -> int:
        """Processes of one worker pod: one per GPU; a CPU worker runs one."""
        return max(1, self.gpus_per_worker)

    @property
    def ranks(self) -> int:
        """Processes of the job (the mesh's world, :class:`adaptis.api.mesh.Mesh`)."""
        return self.workers * self.ranks_per_worker

    @property
    def pipeline_ranks(self) -> int:
        """Pipeline positions of one replica (the devices the plan has, each T ranks); 0 when
        R x T does not divide the ranks."""
        group = self.data_parallel * self.tensor_parallel
        return self.ranks // group if self.ranks % group == 0 else 0


class PlannerSpec(_Spec):
    """How the operator chooses partition, placement and schedule."""

    strategy: StrategyName = Field(
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
        default_factory=list, max_length=MAX_ENV,
        description="Extra container environment (core/v1 EnvVar)."
    )
    node_selector: dict[LabelKey, LabelValue] = Field(
        default_factory=dict, description="Only nodes with these labels are candidates."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, description="Pod tolerations (core/v1 Toleration)."
    )
    volumes: list[Volume] = Field(
        default_factory=list, max_length=MAX_VOLUMES,
        description="Extra pod volumes (core/v1 Volume)."
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
CHUNKED_STRATEGIES: tuple[StrategyName, ...] = ("i1f1b", "zb-v")
CHUNKS_PER_RANK = 2


def _job_cel_rules() -> list[JsonValue]:
    """CEL for the rules of adaptis.api.rules that need only the spec, so the API server
    refuses those manifests as the operator and ``adaptis run`` do. Nested objects get no
    default from the API server when absent, so the models' defaults stand in for them."""
    steps_default = TrainingSpec.model_fields["steps"].default
    def par(field: str) -> str:
        default = ParallelismSpec.model_fields[to_snake(field)].default
        if isinstance(default, bool):  # CEL spells them lower case
            default = str(default).lower()
        return (f"(has(self.parallelism) && has(self.parallelism.{field}) "
                f"? self.parallelism.{field} : {default})")

    gpus = par("gpusPerWorker")
    ranks = f"({par('workers')} * ({gpus} > 0 ? {gpus} : 1))"
    # The devices of one pipeline replica: what the plan partitions the layers over.
    tensor = par("tensorParallel")
    workers = f"({ranks} / ({par('dataParallel')} * {tensor}))"
    # blocks has maxItems 1024, which bounds the map's cost well within the per-rule limit.
    layers = "(2 + self.model.blocks.map(b, has(b.count) ? b.count : 1).sum())"
    # A huggingface model's layers are in its config, which CEL cannot read: rules.py checks.
    zoo = "!has(self.model.blocks) || "
    steps = ("(has(self.training) && has(self.training.steps) "
             f"? self.training.steps : {steps_default})")
    seq_len = ("(has(self.training) && has(self.training.sequenceLength) "
               f"? self.training.sequenceLength : {TrainingSpec.model_fields['sequence_length'].default})")
    chunked = ", ".join(f"'{name}'" for name in CHUNKED_STRATEGIES)
    chunks = CHUNKS_PER_RANK
    return [
        {"rule": f"{zoo}{layers} <= {MAX_BLOCKS + 2}", "fieldPath": ".model.blocks",
         "message": f"the blocks' counts must add up to at most {MAX_BLOCKS}"},
        {"rule": f"{ranks} % {par('dataParallel')} == 0", "fieldPath": ".parallelism.dataParallel",
         "message": "dataParallel must divide the ranks (workers x max(1, gpusPerWorker))"},
        {"rule": f"({gpus} > 0 ? {gpus} : 1) % {tensor} == 0", "fieldPath": ".parallelism.tensorParallel",
         "message": "tensorParallel must divide max(1, gpusPerWorker): a tensor group stays in its pod"},
        # Only once dataParallel divides the ranks: one refusal for one mistake.
        {"rule": f"{ranks} % {par('dataParallel')} != 0 || {ranks} % ({par('dataParallel')} * {tensor}) == 0",
         "fieldPath": ".parallelism.dataParallel",
         "message": "dataParallel x tensorParallel must divide the ranks (workers x max(1, gpusPerWorker))"},
        {"rule": f"!{par('sequenceParallel')} || {tensor} > 1",
         "fieldPath": ".parallelism.sequenceParallel",
         "message": "sequenceParallel needs tensorParallel > 1 (it shards on the sequence over "
                    "the tensor group): set tensorParallel or remove sequenceParallel"},
        {"rule": f"!{par('sequenceParallel')} || {seq_len} % {tensor} == 0",
         "fieldPath": ".parallelism.sequenceParallel",
         "message": "sequenceParallel needs training.sequenceLength divisible by tensorParallel"},
        {"rule": f"!{par('sequenceParallel')} || !has(self.model.huggingface)",
         "fieldPath": ".parallelism.sequenceParallel",
         "message": "sequenceParallel is not supported for Hugging Face models yet"},
        {"rule": f"{zoo}{workers} <= {layers}", "fieldPath": ".parallelism.workers",
         "message": "pipeline ranks (workers x max(1, gpusPerWorker) / (dataParallel x "
                    "tensorParallel)) must not "
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

    model: Model = Field(description="The model to train.")
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


class Condition(_Spec):
    """One observation of the job, as every Kubernetes condition."""

    type: str = Field(description=f"One of {', '.join(ConditionType)} (the operator writes no other).")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(default="", description="CamelCase reason of the last transition.")
    message: str = Field(default="", description="Human-readable detail; names the field at fault.")
    last_transition_time: str | None = Field(
        default=None, description="RFC 3339 time the status last changed."
    )


class RankAssignment(_Spec):
    """Where one rank runs and what it holds."""

    rank: int = Field(ge=0, description="Global rank: (replica x pipeline ranks + pipeline rank) "
                      "x tensorParallel + tensor rank.")
    node: str = Field(description="Node the plan places the rank on.")
    gpu: str | None = Field(default=None, description="GPU product of that node (GFD label).")
    stages: list[int] = Field(
        default_factory=list,
        description="Stage indices the rank holds: those of its pipeline rank (the plan's "
        "device), a 1/tensorParallel shard of each under tensor parallelism.")
    replica: int = Field(default=0, ge=0, description="Data-parallel replica of the rank.")
    tensor_rank: int = Field(default=0, ge=0, description="The rank's place in its tensor group "
                             "(0 .. tensorParallel - 1): which shard of its stages it holds.")
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
    model: Model
    training: TrainingSpec = TrainingSpec()
    plan: Any = Field(description="An adaptis.api.plan.Plan document, its actions plain or "
                      "packed (actionsPacked, as the operator writes it).")
    metrics_port: int | None = Field(default=None, ge=0, le=65535, description="None: off; 0: any.")
    checkpoint_dir: str | None = None
    checkpoint_every: int = Field(default=0, ge=0)
    data_parallel: int = Field(
        default=1, ge=1, description="Replicas of the plan's pipeline; world size = "
        "data_parallel x the plan's devices x tensor_parallel, rank = (replica x devices + "
        "pipeline rank) x tensor_parallel + tensor rank.")
    tensor_parallel: int = Field(
        default=1, ge=1, description="Ranks of each pipeline position, sharing its layers "
        "(tensor parallelism, torch's DTensor sharding; docs/parallelism.md).")
    sequence_parallel: bool = Field(
        default=False, description="With tensor_parallel > 1: norms and the activations "
        "between blocks and stages sharded on the sequence (docs/parallelism.md).")
    zero_stage: Literal[0, 1] = Field(
        default=0, description="1: shard the optimizer state across the replicas (ZeRO-1).")
