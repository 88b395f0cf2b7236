"""One table of invalid AdaPtisJobs, refused alike by every entry point, each naming its field.

For every row: (a) the api layer (``parse_job`` then ``check_job``) raises a SpecError naming the
field; (b) the operator's ``validate_job`` raises InvalidJob naming it; (c) ``adaptis run`` (a
real subprocess) exits 2 with ``<field>: `` in stderr, before planning and before any rank
starts; (d) where CEL can express the rule, the generated CRD carries one for that field (the
real API server applying it is tests/integration/test_crd_rules.py).
"""

from __future__ import annotations

import copy
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import yaml

from adaptis.api.crd import crd_manifest
from adaptis.api.errors import SpecError
from adaptis.api.job import parse_job
from adaptis.api.rules import check_job, job_violations, pod_name
from adaptis.operator.core.errors import InvalidJob
from adaptis.operator.resources.validation import validate_job

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "tiny-heterogeneous.yaml"
# Python, adaptis and torch start in a few seconds; a profile or a rank would take far longer.
CLI_DEADLINE_S = 60


class Case(NamedTuple):
    id: str
    change: dict[str, Any]  # dotted path in the manifest -> value
    field: str  # the field every entry point must name
    # The CRD schema node (".spec.model.blocks[]", "" for the root) holding a CEL rule for it,
    # and what names the field there: the rule's fieldPath, or its message at the root.
    cel: tuple[str, str] | None


def valid_job() -> dict[str, Any]:
    """The README's example (10 layers: embedding, 8 blocks, head), small enough to be quick."""
    doc: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = "rules-test"
    doc["spec"]["training"]["steps"] = 20
    return doc


def _set(doc: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    node: Any = doc
    for part in parents:
        node = node[int(part)] if part.isdigit() else node[part]
    node[int(last) if last.isdigit() else last] = value


def invalid_job(case: Case) -> dict[str, Any]:
    doc = copy.deepcopy(valid_job())
    for dotted, value in case.change.items():
        _set(doc, dotted, value)
    return doc


CASES = [
    Case("topK-exceeds-experts", {"spec.model.blocks.3.topK": 8, "spec.model.blocks.3.experts": 4},
         "spec.model.blocks[3].topK", (".spec.model.blocks[]", ".topK")),
    Case("more-workers-than-layers", {"spec.parallelism.workers": 40},
         "spec.parallelism.workers", (".spec", ".parallelism.workers")),
    Case("replicas-do-not-divide-the-ranks",
         {"spec.parallelism.workers": 4, "spec.parallelism.dataParallel": 3},
         "spec.parallelism.dataParallel", (".spec", ".parallelism.dataParallel")),
    Case("more-pipeline-ranks-than-layers",  # 3 pods x 4 GPUs = 12 ranks, one replica
         {"spec.parallelism.workers": 3, "spec.parallelism.gpusPerWorker": 4},
         "spec.parallelism.workers", (".spec", ".parallelism.workers")),
    Case("tensor-group-leaves-its-pod",  # 2 pods x 3 GPUs, tensor groups of 2
         {"spec.parallelism.gpusPerWorker": 3, "spec.parallelism.tensorParallel": 2},
         "spec.parallelism.tensorParallel", (".spec", ".parallelism.tensorParallel")),
    Case("replicas-of-tensor-groups-do-not-divide-the-ranks",  # 6 ranks, 2 x 2 do not divide
         {"spec.parallelism.workers": 3, "spec.parallelism.gpusPerWorker": 2,
          "spec.parallelism.tensorParallel": 2, "spec.parallelism.dataParallel": 2},
         "spec.parallelism.dataParallel", (".spec", ".parallelism.dataParallel")),
    Case("heads-do-not-divide-by-tensor",  # 4 heads over 8 tensor ranks
         {"spec.parallelism.workers": 1, "spec.parallelism.gpusPerWorker": 8,
          "spec.parallelism.tensorParallel": 8},
         "spec.model.heads", None),
    Case("sequence-parallel-without-tensor-parallel", {"spec.parallelism.sequenceParallel": True},
         "spec.parallelism.sequenceParallel", (".spec", ".parallelism.sequenceParallel")),
    Case("sequence-does-not-divide-by-tensor",  # 2 pods x 2 GPUs, T 2, 63 tokens
         {"spec.parallelism.gpusPerWorker": 2, "spec.parallelism.tensorParallel": 2,
          "spec.parallelism.sequenceParallel": True, "spec.training.sequenceLength": 63},
         "spec.parallelism.sequenceParallel", (".spec", ".parallelism.sequenceParallel")),
    Case("more-blocks-than-can-be-planned", {"spec.model.blocks.0.count": 4096},
         "spec.model.blocks", (".spec", ".model.blocks")),
    Case("zb-v-needs-two-layers-per-rank",
         {"spec.parallelism.workers": 6, "spec.planner.strategy": "zb-v"},
         "spec.planner.strategy", (".spec", ".planner.strategy")),
    Case("i1f1b-needs-two-layers-per-rank",
         {"spec.parallelism.workers": 6, "spec.planner.strategy": "i1f1b"},
         "spec.planner.strategy", (".spec", ".planner.strategy")),
    Case("checkpoint-after-the-last-step", {"spec.checkpoint.everySteps": 50},
         "spec.checkpoint.everySteps", (".spec", ".checkpoint.everySteps")),
    Case("name-not-dns-1035", {"metadata.name": "Rules_Test"}, "metadata.name", ("", "metadata.name")),
    Case("name-starts-with-digit", {"metadata.name": "1job"}, "metadata.name", ("", "metadata.name")),
    Case("child-name-too-long", {"metadata.name": "j" * 55}, "metadata.name", ("", "metadata.name")),
    Case("heads-do-not-divide-hidden", {"spec.model.heads": 5}, "spec.model", (".spec.model", ".heads")),
    Case("kvHeads-do-not-divide-heads", {"spec.model.kvHeads": 3}, "spec.model.kvHeads",
         (".spec.model", ".kvHeads")),
    Case("rope-with-an-odd-head-size", {"spec.model.heads": 64, "spec.model.positions": "rope"},
         "spec.model", (".spec.model", ".positions")),
    Case("text-corpus-without-path", {"spec.training.data": {"source": "text"}},
         "spec.training.data.path", (".spec.training.data", ".path")),
    Case("tokenizer-without-text",
         {"spec.training.data": {"source": "token-file", "path": "/t.bin", "tokenizer": "/tok"}},
         "spec.training.data.tokenizer", (".spec.training.data", ".tokenizer")),
    Case("text-without-a-tokenizer", {"spec.training.data": {"source": "text", "path": "/corpus"}},
         "spec.training.data.tokenizer", (".spec", ".training.data.tokenizer")),
]
IDS = [c.id for c in CASES]


def test_the_base_job_is_valid_everywhere() -> None:
    doc = valid_job()
    job = parse_job(doc)
    check_job(name=job.metadata.name, spec=job.spec)
    validate_job(name=doc["metadata"]["name"], spec_raw=doc["spec"])


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_api_rules_name_the_field(case: Case) -> None:
    doc = invalid_job(case)
    with pytest.raises(SpecError) as info:
        job = parse_job(doc)
        check_job(name=job.metadata.name, spec=job.spec)
    assert case.field in info.value.fields
    assert f"{case.field}: " in str(info.value)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_operator_validation_names_the_field(case: Case) -> None:
    doc = invalid_job(case)
    with pytest.raises(InvalidJob) as info:
        validate_job(name=doc["metadata"]["name"], spec_raw=doc["spec"])
    assert case.field in info.value.fields
    assert f"{case.field}: " in str(info.value)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_local_run_refuses_before_any_rank_starts(case: Case, tmp_path: Path) -> None:
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(invalid_job(case)))
    workdir = tmp_path / "work"
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "adaptis", "run", str(manifest), "--workdir", str(workdir),
         "--metrics-port", "0"],
        capture_output=True, text=True, cwd=tmp_path, timeout=CLI_DEADLINE_S, check=False)
    took = time.monotonic() - started
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"{case.field}: " in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "planned" not in out.stdout  # refused before profiling and planning
    assert not list(workdir.glob("rank-*.log")), "a rank was started"
    assert took < CLI_DEADLINE_S


def _schema_node(path: str) -> dict[str, Any]:
    node: dict[str, Any] = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for part in filter(None, path.split(".")):
        items = part.endswith("[]")
        node = node["properties"][part.removesuffix("[]")]
        if items:
            node = node["items"]
    return node


@pytest.mark.parametrize("case", [c for c in CASES if c.cel is not None],
                         ids=[c.id for c in CASES if c.cel is not None])
def test_the_crd_carries_a_cel_rule_for_the_field(case: Case) -> None:
    assert case.cel is not None
    where, names = case.cel
    rules = _schema_node(where).get("x-kubernetes-validations") or []
    assert [r for r in rules if r.get("fieldPath") == names or names in r["message"]], (
        f"no CEL rule at {where or '<root>'} for {case.field}: {rules}")


def test_the_name_rule_matches_the_names_the_operator_creates() -> None:
    spec = parse_job(valid_job()).spec  # 2 workers: the longest child is <name>-worker-1
    fits = "j" * (63 - len(pod_name("", 1)))
    assert job_violations(name=fits, spec=spec) == []
    assert [f for f, _ in job_violations(name=fits + "j", spec=spec)] == ["metadata.name"]


def test_a_hugging_face_model_with_weights_lends_the_text_corpus_its_tokenizer() -> None:
    doc = valid_job()
    doc["spec"]["model"] = {"huggingface": {"config": {"model_type": "llama", "vocab_size": 256,
                                                       "hidden_size": 64, "num_hidden_layers": 8,
                                                       "num_attention_heads": 4, "intermediate_size": 128},
                                       "weights": "/models/tiny"}}
    doc["spec"]["training"]["data"] = {"source": "text", "path": "/corpus"}
    job = parse_job(doc)
    assert job_violations(name=job.metadata.name, spec=job.spec) == []
    del doc["spec"]["model"]["huggingface"]["weights"]  # inline config, no weights: nowhere to look
    job = parse_job(doc)
    assert [f for f, _ in job_violations(name=job.metadata.name, spec=job.spec)] == ["spec.training.data.tokenizer"]


def test_sequence_parallel_is_refused_for_a_hugging_face_model_and_taken_for_a_zoo_one() -> None:
    doc = valid_job()
    doc["spec"]["parallelism"].update({"gpusPerWorker": 2, "tensorParallel": 2, "sequenceParallel": True})
    job = parse_job(doc)
    assert job_violations(name=job.metadata.name, spec=job.spec) == []  # a zoo model: runs
    doc["spec"]["model"] = {"huggingface": {"config": {"model_type": "llama", "vocab_size": 256,
                                                       "hidden_size": 64, "num_hidden_layers": 8,
                                                       "num_attention_heads": 4, "intermediate_size": 128}}}
    job = parse_job(doc)
    violations = job_violations(name=job.metadata.name, spec=job.spec)
    assert [f for f, _ in violations] == ["spec.parallelism.sequenceParallel"]
    assert "Hugging Face" in violations[0][1]
