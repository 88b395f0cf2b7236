"""Stages of every tiny config in examples/models/ (each supported family) against the model
itself, in one process: partitioned stages give the logits and gradients of a plain
``AutoModelForCausalLM`` with the same weights, and the weights do not depend on the partition.
The multi-process training parity is tests/worker/test_hf_parity.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from adaptis.api.errors import SpecError
from adaptis.api.hf_model import HuggingFaceSpec
from adaptis.api.model import HuggingFaceModel
from adaptis.worker.models.zoo import token_loss

pytest.importorskip("transformers")

MODELS = Path(__file__).resolve().parents[2] / "examples" / "models"
CONFIGS = sorted(p.stem for p in MODELS.glob("*.json"))


def _model(name: str) -> HuggingFaceModel:
    return HuggingFaceModel(
        huggingface=HuggingFaceSpec(config=json.loads((MODELS / f"{name}.json").read_text())))


def test_every_supported_family_has_a_tiny_config() -> None:
    from adaptis.api.hf_model import SUPPORTED_MODEL_TYPES

    types = {json.loads((MODELS / f"{n}.json").read_text())["model_type"] for n in CONFIGS}
    assert types == set(SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("name", CONFIGS)
def test_partitioned_stages_equal_the_model(name: str) -> None:
    from transformers import AutoModelForCausalLM

    from adaptis.worker.models.hf.stages import build_hf_model, build_hf_stages, hf_config

    torch.set_num_threads(1)
    model = _model(name)
    plain = AutoModelForCausalLM.from_config(hf_config(model))
    plain.load_state_dict(build_hf_model(model, seed=5).state_dict())
    n = plain.config.num_hidden_layers + 2
    stages = build_hf_stages(model, stages=[(0, 2), (2, n - 1), (n - 1, n)], seed=5)
    vocab = plain.config.vocab_size
    ids = torch.randint(vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    targets = torch.randint(vocab, (2, 12), generator=torch.Generator().manual_seed(1))
    x = ids
    for stage in stages:
        x = stage(x)
    want = plain(input_ids=ids).logits
    torch.testing.assert_close(x, want, rtol=1e-5, atol=1e-6)
    token_loss(x, targets).backward()
    token_loss(want, targets).backward()
    got: dict[str, torch.Tensor] = {}
    for stage in stages:
        got.update({k: p.grad for k, p in stage.global_parameters().items() if p.grad is not None})
    ref = {k: p.grad for k, p in plain.named_parameters() if p.grad is not None}
    if "lm_head.weight" in got and "lm_head.weight" not in ref:  # tied, one Parameter here
        got.pop("lm_head.weight")
    assert set(got) == set(ref)
    for k, g in ref.items():
        torch.testing.assert_close(got[k], g, rtol=1e-4, atol=1e-6, msg=k)


def test_weights_do_not_depend_on_the_partition() -> None:
    from adaptis.worker.models.hf.stages import build_hf_stages

    model = _model("tiny-qwen2-moe")
    one = build_hf_stages(model, stages=[(0, 6)], seed=2)[0].global_parameters()
    split: dict[str, torch.Tensor] = {}
    for ranges in ([(4, 6)], [(1, 2), (3, 4)], [(2, 3), (0, 1)]):  # one call a rank
        for stage in build_hf_stages(model, stages=ranges, seed=2):
            split.update(stage.global_parameters())
    assert set(one) == set(split)
    assert all(torch.equal(one[k], split[k]) for k in one)
    other = build_hf_stages(model, stages=[(0, 6)], seed=3)[0].global_parameters()
    assert not torch.equal(one["model.layers.1.self_attn.q_proj.weight"],
                           other["model.layers.1.self_attn.q_proj.weight"])


def test_an_unsupported_model_type_is_refused_before_any_module_is_built() -> None:
    from adaptis.worker.models.hf.stages import build_hf_stages

    model = HuggingFaceModel(huggingface=HuggingFaceSpec(config={"model_type": "gpt2"}))
    with pytest.raises(SpecError, match=r"config.model_type: 'gpt2' is not supported"):
        build_hf_stages(model, stages=[(0, 1)], seed=0)
