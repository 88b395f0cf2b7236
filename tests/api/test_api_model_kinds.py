"""spec.model held as one of two kinds (ZooModel, HuggingFaceModel), on the wire as ModelSpec.

Pure Python: what every layer below the api reads instead of the wire's optional fields."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from adaptis.api.errors import SpecError
from adaptis.api.job import BlockSpec, JobSpec, ModelSpec, WorkerConfig
from adaptis.api.model import HuggingFaceModel, ZooModel, expect_kind, resolve_model

LLAMA = json.loads((Path(__file__).resolve().parents[2] / "examples" / "models"
                    / "tiny-llama.json").read_text())
ZOO = {"vocabSize": 64, "hidden": 16, "heads": 2, "tieEmbeddings": True,
       "blocks": [{"kind": "attention", "count": 2}, {"kind": "moe", "experts": 4}]}


def test_a_job_holds_the_kind_its_manifest_names() -> None:
    zoo = JobSpec.model_validate({"model": ZOO}).model
    assert isinstance(zoo, ZooModel)
    assert (zoo.vocab_size, zoo.hidden, zoo.tied, zoo.layer_count) == (64, 16, True, 5)
    assert zoo.blocks == (BlockSpec(kind="attention", count=2), BlockSpec(kind="moe", experts=4))
    assert (zoo.name, zoo.layers_field, zoo.file_dirs, zoo.eos_token_id) == (
        "attention-model", "spec.model.blocks", (), None)
    hf = JobSpec.model_validate({"model": {"huggingface": {"config": LLAMA}}}).model
    assert isinstance(hf, HuggingFaceModel)
    assert (hf.vocab_size, hf.hidden, hf.tied, hf.layer_count) == (
        LLAMA["vocab_size"], LLAMA["hidden_size"], False, LLAMA["num_hidden_layers"] + 2)
    assert hf.name == "llama-model"
    assert hf.layers_field == "spec.model.huggingface.config.num_hidden_layers"


def test_each_kind_serializes_back_to_the_wire_form_it_came_as() -> None:
    # The API server defaults the zoo's scalars on every model: a Hugging Face model keeps
    # them (unused) so the worker's config and checkpoint headers are what they were.
    for raw in (ZOO, {"huggingface": {"config": LLAMA}, "mlp": "swiglu", "kvHeads": 2}):
        wire = ModelSpec.model_validate(raw)
        config = WorkerConfig(model=resolve_model(wire), plan={})
        want = wire.model_dump(mode="json", by_alias=True)
        assert config.model_dump(mode="json", by_alias=True)["model"] == want
        assert config.model.wire().model_dump(mode="json", by_alias=True) == want
        assert WorkerConfig.model_validate_json(config.model_dump_json()) == config


def test_errors_name_the_wire_field_as_before() -> None:
    with pytest.raises(ValidationError) as err:
        JobSpec.model_validate({"model": {**ZOO, "hidden": 15}})
    assert err.value.errors()[0]["loc"] == ("model",)
    assert "model.heads (2) must divide model.hidden (15)" in str(err.value)
    with pytest.raises(ValidationError) as err:
        JobSpec.model_validate({"model": {**ZOO, "heads": 0}})
    assert err.value.errors()[0]["loc"] == ("model", "heads")


def test_a_zoo_model_made_directly_is_checked_as_a_manifests_is() -> None:
    made = ZooModel(vocab_size=64, hidden=16, heads=2, tie_embeddings=True,
                    blocks=[BlockSpec(kind="attention", count=2), BlockSpec(kind="moe", experts=4)])
    assert made == JobSpec.model_validate({"model": ZOO}).model
    with pytest.raises(ValidationError, match=r"must divide model\.hidden"):
        ZooModel(vocab_size=64, hidden=15, heads=2, blocks=[BlockSpec(kind="dense")])
    with pytest.raises(ValidationError, match=r"must divide model\.hidden"):
        dataclasses.replace(made, hidden=15)


def test_code_for_one_kind_refuses_the_other_naming_the_field() -> None:
    zoo = JobSpec.model_validate({"model": ZOO}).model
    hf = JobSpec.model_validate({"model": {"huggingface": {"config": LLAMA}}}).model
    assert expect_kind(zoo, ZooModel, what="x") is zoo
    assert expect_kind(hf, HuggingFaceModel, what="x") is hf
    with pytest.raises(SpecError, match="the layer profiler takes the zoo's blocks") as err:
        expect_kind(hf, ZooModel, what="the layer profiler")
    assert err.value.fields == ("spec.model.huggingface",)
    with pytest.raises(SpecError, match="export takes a Hugging Face model"):
        expect_kind(zoo, HuggingFaceModel, what="export")


def test_a_hugging_face_models_files_and_eos() -> None:
    hf = HuggingFaceModel(huggingface=ModelSpec.model_validate(
        {"huggingface": {"config": {**LLAMA, "eos_token_id": [7, 8]}, "weights": "/w"}}).huggingface)
    assert hf.file_dirs == (Path("/w"),) and hf.eos_token_id == 7
    by_path = resolve_model(ModelSpec.model_validate({"huggingface": {"path": "/m/config.json"}}))
    assert isinstance(by_path, HuggingFaceModel) and by_path.file_dirs == (Path("/m"),)
