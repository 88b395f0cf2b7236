"""The estimate of a Hugging Face model from its config: each decoder layer kind costs what its
shape says (dense vs MoE, attention vs Mamba, the head over the real vocabulary)."""

from __future__ import annotations

import json
from pathlib import Path

from adaptis.api.hf_model import hf_layout
from adaptis.api.job import ModelSpec, TrainingSpec, load_job
from adaptis.planner.hf_estimate import estimate_hf_layers, estimate_model_layers

REPO = Path(__file__).resolve().parents[2]
TRAINING = TrainingSpec(microbatches=8, microbatch_size=1, sequence_length=4096)


def _layers(path: Path) -> list:
    return estimate_model_layers(load_job(path).spec.model, TRAINING)


def test_moe_layers_hold_every_expert_but_compute_top_k() -> None:
    qwen = _layers(REPO / "examples" / "hf-qwen3-moe-30b-a3b.yaml")
    assert [layer.name for layer in qwen[:2]] == ["embedding", "moe_0"] and len(qwen) == 50
    moe, head = qwen[1], qwen[-1]
    # 128 experts of 3 x 2048 x 768 held, 8 of them computed per token (plus attention).
    experts_held = 128 * 3 * 2048 * 768
    assert moe.param_bytes > 16 * experts_held
    dense_equivalent = 2 * 4096 * (experts_held + 2048 * 128 * 2 * (32 + 4)) / 100e12 * 1e3
    assert moe.weight < dense_equivalent / 10  # top-8 of 128: far below all experts' matmuls
    # The 152K-vocabulary head costs more than a decoder layer.
    assert head.forward > moe.forward


def test_dense_and_moe_layers_of_one_model_differ() -> None:
    config = json.loads((REPO / "examples" / "models" / "tiny-qwen2-moe.json").read_text())
    model = ModelSpec.model_validate({"huggingface": {"config": config}})
    layers = estimate_hf_layers(hf_layout(model.huggingface), TRAINING)
    dense, moe = layers[1], layers[2]
    assert (dense.kind, moe.kind) == ("attention", "moe")
    assert moe.param_bytes > dense.param_bytes and moe.forward != dense.forward


def test_mamba_and_attention_layers_of_the_hybrid_differ() -> None:
    config = json.loads((REPO / "examples" / "models" / "tiny-bamba.json").read_text())
    model = ModelSpec.model_validate({"huggingface": {"config": config}})
    layers = estimate_hf_layers(hf_layout(model.huggingface), TRAINING)
    assert [layer.kind for layer in layers[1:5]] == ["mamba", "attention", "mamba", "attention"]
    assert layers[1].forward != layers[2].forward
    assert layers[1].activation_bytes != layers[2].activation_bytes


def test_llama_8b_layers_follow_grouped_query_attention() -> None:
    layers = _layers(REPO / "examples" / "hf-llama-8b.yaml")
    # q, o: 4096 x 4096; k, v: 4096 x 1024 (8 KV heads); MLP 3 x 4096 x 14336.
    params = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    assert layers[1].param_bytes == 16 * params
    assert len(layers) == 34 and layers[-1].param_bytes == 16 * (128256 * 4096 + 4096)
