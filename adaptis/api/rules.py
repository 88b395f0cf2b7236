"""The job-level rules of an AdaPtisJob: one place for the cluster and the local run.

Sits in the api layer, on top of :mod:`adaptis.api.job`. The pydantic models reject what one object
can judge alone (bounds, ``topK <= experts``, ``heads`` divides ``hidden``); the rules here need the
whole spec and the job's name: the names of the children must be DNS labels, a pipeline cannot have
more ranks than layers, the two-chunk schedules need two layers per rank, a periodic checkpoint must
fall within the run. Every entry point applies them before anything starts: the operator's
:func:`adaptis.operator.resources.validation.validate_job` (which adds only its own checks: reserved
env, volumes, ports, GPU request) and ``adaptis run``. Where CEL can say the same,
:class:`~adaptis.api.job.JobSpec` carries it as an ``x-kubernetes-validations`` rule so the API
server refuses the manifest too; :data:`JOB_CEL_RULES` holds the one CEL rule that needs
``metadata.name`` and therefore sits at the CRD's root.

The child names live here (not in the operator) because the length rule must know them; the
operator's manifests import them, so the names checked are the names created.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from adaptis.api.errors import SpecError
from adaptis.api.job import (
    CHUNKED_STRATEGIES,
    CHUNKS_PER_RANK,
    MAX_BLOCKS,
    JobSpec,
    ParallelismSpec,
)
from adaptis.api.model import Model, ZooModel

__all__ = [
    "JOB_CEL_RULES",
    "MAX_NAME_LENGTH",
    "Violation",
    "check_job",
    "config_map_name",
    "format_violations",
    "job_violations",
    "layer_count",
    "pod_name",
    "service_name",
]

# Kubernetes' DNS-1035 label: the Service (and the ranks' hostnames) are named after the job.
_DNS_1035 = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
_DNS_1035_RE = re.compile(_DNS_1035)
MAX_NAME_LENGTH = 63
# The longest fixed suffix of a child: f"-worker-{rank}" vs "-workers" vs "-config".
_WORKER_INFIX = "-worker-"

Violation = tuple[str, str]  # (dotted field path, what is wrong and how to fix it)


def config_map_name(job: str) -> str:
    return f"{job}-config"


def service_name(job: str) -> str:
    return f"{job}-workers"


def pod_name(job: str, rank: int) -> str:
    return f"{job}{_WORKER_INFIX}{rank}"


def layer_count(model: Model) -> int:
    """Pipeline layers: embedding, every block (a Hugging Face model: every decoder layer,
    from its config), head."""
    return model.layer_count


def _name_violations(name: str, *, workers: int) -> list[Violation]:
    out: list[Violation] = []
    if not _DNS_1035_RE.match(name):
        out.append(("metadata.name", f"{name!r} must be a DNS-1035 label (a-z, 0-9, '-', "
                    "starting with a letter): it names the headless Service"))
    longest = max(pod_name(name, workers - 1), service_name(name), config_map_name(name),
                  key=len)
    if len(longest) > MAX_NAME_LENGTH:
        # Also the value of the pods' adaptis.io/job label, which may not exceed 63 either; a
        # name of hundreds of characters is shown by its length, not twice in full.
        shown = (repr(name) if len(name) <= MAX_NAME_LENGTH
                 else f"a name of {len(name)} characters")
        child = repr(longest) if len(name) <= MAX_NAME_LENGTH else "of a child"
        out.append(("metadata.name", f"{shown} is too long: the name {child} exceeds "
                    f"{MAX_NAME_LENGTH} characters (DNS label, label value); shorten it by "
                    f"{len(longest) - MAX_NAME_LENGTH}"))
    return out


def job_violations(*, name: str, spec: JobSpec) -> list[Violation]:
    """Every job-level rule ``spec`` (named ``name``) breaks; empty when it follows them all."""
    out = _name_violations(name, workers=spec.parallelism.workers)
    par = spec.parallelism
    try:
        layers = layer_count(spec.model)
    except SpecError as err:  # a Hugging Face config that names no supported model
        field = err.fields[0] if err.fields else "spec.model.huggingface"
        return [*out, (field, str(err).removeprefix(f"{field}: "))]
    if layers - 2 > MAX_BLOCKS:
        out.append((spec.model.layers_field, f"the model has {layers - 2} blocks; at most "
                    f"{MAX_BLOCKS} can be planned (docs/planning-budget.md): use fewer blocks"))
    if par.ranks % par.data_parallel:
        out.append(("spec.parallelism.dataParallel", f"{par.data_parallel} replicas do not "
                    f"divide the job's {par.ranks} ranks (workers x max(1, gpusPerWorker)); "
                    "use a divisor of the ranks"))
        return out
    tensor = _tensor_violations(spec) or _sequence_violations(spec)
    if tensor:
        return [*out, *tensor]
    workers = par.pipeline_ranks  # the devices of one pipeline: what the plan partitions over
    what = ("pipeline ranks (ranks / (dataParallel x tensorParallel))" if par.ranks != workers
            else "workers")
    if workers > layers:
        out.append(("spec.parallelism.workers", f"{workers} {what} exceed the model's {layers} "
                    f"layers (embedding, blocks, head): each rank needs one; use at most {layers}"))
    chunks = CHUNKS_PER_RANK
    if spec.planner.strategy in CHUNKED_STRATEGIES and layers < chunks * workers:
        out.append(("spec.planner.strategy", f"{spec.planner.strategy} needs {chunks} layers per "
                    f"rank ({chunks * workers} for {workers} {what}); the model has {layers}: "
                    "use fewer workers or another strategy"))
    data = spec.training.data
    if data.source == "text" and data.tokenizer is None and not spec.model.file_dirs:
        out.append(("spec.training.data.tokenizer", "required for source text unless the model is a "
                    "Hugging Face one with weights (or path) beside its tokenizer.json: give the "
                    "tokenizer.json or its directory"))
    if spec.checkpoint.every_steps > spec.training.steps:
        out.append(("spec.checkpoint.everySteps", f"{spec.checkpoint.every_steps} exceeds "
                    f"spec.training.steps ({spec.training.steps}): no checkpoint would be "
                    "written; use 0 (off) or at most the steps"))
    return out


def _tensor_violations(spec: JobSpec) -> list[Violation]:
    """tensorParallel T: it must divide a pod's ranks, R x T the job's, and every width the
    tensor-parallel layers split (docs/parallelism.md)."""
    par, t = spec.parallelism, spec.parallelism.tensor_parallel
    if t == 1:
        return []
    field = "spec.parallelism.tensorParallel"
    if par.ranks_per_worker % t:
        return [(field, f"{t} does not divide a worker pod's {par.ranks_per_worker} ranks "
                 "(max(1, gpusPerWorker)): a tensor group never leaves its pod (its all-reduces "
                 "run every layer); use a divisor of gpusPerWorker")]
    if par.ranks % (par.data_parallel * t):
        return [("spec.parallelism.dataParallel", f"dataParallel x tensorParallel "
                 f"({par.data_parallel} x {t}) does not divide the job's {par.ranks} ranks; use "
                 "divisors whose product divides the ranks")]
    model = spec.model
    if isinstance(model, ZooModel):
        widths = {"spec.model.heads": model.heads, "spec.model.kvHeads": model.key_value_heads,
                  "spec.model.vocabSize": model.vocab_size}
        for i, block in enumerate(model.blocks):
            if block.kind in ("attention", "dense", "moe"):
                widths[f"spec.model.blocks[{i}] (MLP width)"] = model.mlp_width(block)
    else:  # a Hugging Face model: the sharding its config declares (base_model_tp_plan)
        layout = model.layout
        if set(layout.kinds) != {"attention"}:
            kinds = "/".join(sorted(set(layout.kinds) - {"attention"}))
            return [(field, f"{t}: tensor parallelism of Hugging Face models with {kinds} layers "
                     "(packed expert or Mamba weights) is not supported yet; use tensorParallel: 1")]
        where = "spec.model.huggingface config"
        widths = {f"{where} num_attention_heads": layout.heads,
                  f"{where} num_key_value_heads": layout.kv_heads,
                  f"{where} intermediate_size": layout.intermediate,
                  f"{where} vocab_size": layout.vocab_size}
    return [(name, f"{value} does not divide by tensorParallel {t}: every tensor rank holds an "
             f"equal share; use a multiple of {t}, or tensorParallel dividing {value}")
            for name, value in widths.items() if value % t]


def _sequence_violations(spec: JobSpec) -> list[Violation]:
    """sequenceParallel: it shards on the sequence over the tensor group, so it needs one
    (T > 1), a sequence that splits evenly over it, and a zoo model (docs/parallelism.md)."""
    par, t = spec.parallelism, spec.parallelism.tensor_parallel
    if not par.sequence_parallel:
        return []
    field = "spec.parallelism.sequenceParallel"
    if t == 1:
        return [(field, "needs tensorParallel > 1: it shards the norms and the activations "
                 "between blocks on the sequence over the tensor group; set "
                 "spec.parallelism.tensorParallel to 2 or more, or remove sequenceParallel")]
    length = spec.training.sequence_length
    if length % t:
        return [(field, f"training.sequenceLength {length} does not divide by tensorParallel "
                 f"{t}: every tensor rank holds an equal part of the sequence; use a "
                 f"sequenceLength that is a multiple of {t}, or remove sequenceParallel")]
    if not isinstance(spec.model, ZooModel):
        return [(field, "not supported for Hugging Face models yet (their decoder layers take "
                 "position embeddings and masks for the whole sequence, and transformers' "
                 "base_model_tp_plan declares no sequence-parallel norms): remove "
                 "sequenceParallel, tensorParallel alone works")]
    return []


def format_violations(violations: Sequence[Violation]) -> str:
    """One line per violation: ``field: message``."""
    return "\n".join(f"{field}: {message}" for field, message in violations)


def check_job(*, name: str, spec: JobSpec) -> None:
    """Raise :class:`SpecError` (one line per broken rule, naming its field) unless ``spec``
    follows every job-level rule."""
    violations = job_violations(name=name, spec=spec)
    if violations:
        raise SpecError(format_violations(violations), fields=[f for f, _ in violations])


def _name_cel() -> dict[str, Any]:
    # At the CRD's root CEL sees metadata.name; the longest child is the last rank's pod,
    # whose index has as many digits as workers - 1 (the model's default when unset).
    default = ParallelismSpec.model_fields["workers"].default
    workers = ("(has(self.spec.parallelism) && has(self.spec.parallelism.workers) "
               f"? self.spec.parallelism.workers : {default})")
    digits = f"string({workers} - 1).size()"
    return {
        "rule": f"self.metadata.name.matches('{_DNS_1035}') && "
                f"self.metadata.name.size() + {len(_WORKER_INFIX)} + {digits} "
                f"<= {MAX_NAME_LENGTH}",
        "message": f"metadata.name must be a DNS-1035 label and its worker pod names "
                   f"(<name>-worker-<rank>) must fit {MAX_NAME_LENGTH} characters",
    }


JOB_CEL_RULES: tuple[dict[str, Any], ...] = (_name_cel(),)
