"""spec.model.huggingface: the spec's shape, its errors, and what the layout reads from a config.

Pure Python (no torch, no transformers): the operator and the planner read these."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adaptis.api.errors import SpecError
from adaptis.api.hf_model import hf_layout
from adaptis.api.job import JobSpec, ModelSpec, parse_job
from adaptis.api.model import resolve_model
from adaptis.api.rules import check_job, job_violations, layer_count

MODELS = Path(__file__).resolve().parents[2] / "examples" / "models"


def _config(name: str) -> dict:
    return json.loads((MODELS / f"{name}.json").read_text())


def _job(model: dict, **spec: object) -> dict:
    return {"apiVersion": "adaptis.io/v1alpha1", "kind": "AdaPtisJob",
            "metadata": {"name": "hf"}, "spec": {"model": model, **spec}}


def test_zoo_fields_and_huggingface_are_exclusive_with_the_field_named() -> None:
    hf = {"huggingface": {"config": _config("tiny-llama")}}
    with pytest.raises(SpecError, match=r"model.blocks does not go with model.huggingface"):
        parse_job(_job({**hf, "blocks": [{"kind": "dense"}]}))
    with pytest.raises(SpecError, match=r"model.vocabSize does not go with"):
        parse_job(_job({**hf, "vocabSize": 10}))
    with pytest.raises(SpecError, match=r"model.heads does not go with"):
        parse_job(_job({**hf, "heads": 8}))
    # The API server's defaults (heads 4, tieEmbeddings false) are not a user's choice.
    assert parse_job(_job({**hf, "heads": 4, "tieEmbeddings": False})).spec.model.huggingface
    with pytest.raises(SpecError, match=r"model.blocks is required"):
        parse_job(_job({"vocabSize": 10, "hidden": 8}))


def test_exactly_one_of_config_and_path() -> None:
    with pytest.raises(SpecError, match="exactly one of config"):
        parse_job(_job({"huggingface": {}}))
    with pytest.raises(SpecError, match="exactly one of config"):
        parse_job(_job({"huggingface": {"config": {"model_type": "llama"}, "path": "/x"}}))


def test_path_reads_a_local_config_and_a_missing_one_names_the_field(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_config("tiny-llama")))
    by_dir = ModelSpec.model_validate({"huggingface": {"path": str(tmp_path)}})
    assert layer_count(resolve_model(by_dir)) == 6
    gone = ModelSpec.model_validate({"huggingface": {"path": str(tmp_path / "nope")}})
    with pytest.raises(SpecError, match=r"spec.model.huggingface.path: cannot read") as err:
        hf_layout(gone.huggingface)
    assert err.value.fields == ("spec.model.huggingface.path",)


def test_unsupported_model_type_is_refused_naming_model_type() -> None:
    job = parse_job(_job({"huggingface": {"config": {**_config("tiny-llama"),
                                                     "model_type": "t5"}}}))
    violations = job_violations(name="hf", spec=job.spec)
    assert violations[0][0] == "spec.model.huggingface.config.model_type"
    assert "'t5' is not supported" in violations[0][1] and "llama" in violations[0][1]
    bad = parse_job(_job({"huggingface": {"config": {**_config("tiny-llama"),
                                                     "hidden_size": "big"}}}))
    with pytest.raises(SpecError, match=r"config.hidden_size: must be a positive integer"):
        check_job(name="hf", spec=bad.spec)


def test_layer_kinds_follow_the_families_rules() -> None:
    qwen = hf_layout(ModelSpec.model_validate(
        {"huggingface": {"config": _config("tiny-qwen2-moe")}}).huggingface)
    assert qwen.kinds == ("attention", "moe", "moe", "moe")  # mlp_only_layers: [0]
    assert (qwen.experts, qwen.top_k, qwen.shared_expert_intermediate) == (4, 2, 64)
    every_other = {**_config("tiny-qwen2-moe"), "mlp_only_layers": [], "decoder_sparse_step": 2}
    assert hf_layout(ModelSpec.model_validate({"huggingface": {"config": every_other}})
                     .huggingface).kinds == ("attention", "moe", "attention", "moe")
    bamba = hf_layout(ModelSpec.model_validate(
        {"huggingface": {"config": _config("tiny-bamba")}}).huggingface)
    assert bamba.kinds == ("mamba", "attention", "mamba", "attention")
    gemma = hf_layout(ModelSpec.model_validate(
        {"huggingface": {"config": {k: v for k, v in _config("tiny-gemma").items()
                                    if k != "tie_word_embeddings"}}}).huggingface)
    assert gemma.tied  # Gemma's config class ties by default
    assert gemma.layer_names == ["embedding", *(f"attention_{i}" for i in range(4)), "head"]


def test_rules_count_the_decoder_layers_plus_embedding_and_head() -> None:
    spec = JobSpec.model_validate({"model": {"huggingface": {"config": _config("tiny-llama")}},
                                   "parallelism": {"workers": 7}})
    (field, message), = job_violations(name="hf", spec=spec)
    assert field == "spec.parallelism.workers" and "6 layers" in message
    ok = spec.model_copy(update={"parallelism": spec.parallelism.model_copy(update={"workers": 3})})
    assert job_violations(name="hf", spec=ok) == []


def test_yaml_exponents_in_an_inline_config_are_numbers() -> None:
    from adaptis.api.hf_model import resolve_config

    job = parse_job(_job({"huggingface": {"config": {**_config("tiny-llama"),
                                                     "rms_norm_eps": "1e-6"}}}))
    config = resolve_config(job.spec.model.huggingface)
    assert config["rms_norm_eps"] == 1e-6 and config["model_type"] == "llama"
