"""Layer costs estimated from model sizes (the operator has no torch to profile with;
`adaptis run --profile estimate`)."""

from __future__ import annotations

import pytest

from adaptis.api.job import ModelSpec, TrainingSpec
from adaptis.api.model import ZooModel, resolve_model
from adaptis.planner.estimate import device_speed, estimate_layers


def _model(**kw: object) -> ZooModel:
    base: dict[str, object] = {"vocabSize": 256_000, "hidden": 1536, "heads": 12,
                               "blocks": [{"kind": "dense", "count": 4}]}
    base.update(kw)
    model = resolve_model(ModelSpec.model_validate(base))
    assert isinstance(model, ZooModel)
    return model


def test_layers_are_embedding_blocks_head_in_order() -> None:
    model = _model(blocks=[{"kind": "mamba", "count": 2}, {"kind": "attention"},
                           {"kind": "moe", "experts": 8, "topK": 2}])
    layers = estimate_layers(model, TrainingSpec())
    assert [lay.kind for lay in layers] == ["embedding", "mamba", "mamba", "attention", "moe",
                                            "head"]
    assert len({lay.name for lay in layers}) == len(layers)
    assert all(lay.forward > 0 and lay.backward >= 0 and lay.weight >= 0 for lay in layers)
    assert layers[-1].output_bytes == 0 and layers[0].output_bytes > 0


def test_a_large_vocabulary_head_outweighs_a_block() -> None:
    # method.md: a 256K-vocabulary head costs several transformer layers (Gemma-like: 5.7x F).
    training = TrainingSpec(sequence_length=4096)
    layers = estimate_layers(_model(blocks=[{"kind": "attention", "count": 2}]), training)
    block, head = layers[1], layers[-1]
    assert 3 < head.forward / block.forward < 20
    bigger = estimate_layers(_model(vocabSize=1_048_576,
                                    blocks=[{"kind": "attention", "count": 2}]), training)
    assert bigger[-1].forward > 3 * head.forward


def test_moe_costs_more_than_dense_and_holds_all_experts() -> None:
    model = _model(blocks=[{"kind": "dense"}, {"kind": "moe", "experts": 16, "topK": 2}])
    _, dense, moe, _ = estimate_layers(model, TrainingSpec())
    assert moe.forward > dense.forward
    assert moe.param_bytes > 8 * dense.param_bytes


def test_attention_activations_grow_with_the_square_of_the_sequence() -> None:
    model = _model(blocks=[{"kind": "attention"}])
    short = estimate_layers(model, TrainingSpec(sequence_length=1024))[1]
    long = estimate_layers(model, TrainingSpec(sequence_length=8192))[1]
    assert long.activation_bytes > 8 * short.activation_bytes * 1.5
    assert long.forward > 8 * short.forward


def test_optimizer_state_and_device_speed() -> None:
    sgd = TrainingSpec.model_validate({"optimizer": {"name": "sgd"}})
    adam = estimate_layers(_model(), TrainingSpec())[1].param_bytes
    assert estimate_layers(_model(), sgd)[1].param_bytes == adam / 2
    assert device_speed(989.0) / device_speed(312.0) == 989.0 / 312.0


def test_precision_and_device_rate_scale_bytes_and_times() -> None:
    """The worker's fp32 estimate and the operator's 16-bit one are one arithmetic: per-element
    bytes scale with the element size, times inversely with the device's rate."""
    model = _model(blocks=[{"kind": "mamba"}, {"kind": "attention"}, {"kind": "moe", "experts": 4, "topK": 2}])
    half = estimate_layers(model, TrainingSpec())
    full = estimate_layers(model, TrainingSpec(), element_bytes=4, flops_per_s=50e12)
    for a, b in zip(half[:-1], full[:-1], strict=True):  # the head keeps fp32 logits either way
        assert b.activation_bytes == 2 * a.activation_bytes and b.output_bytes == 2 * a.output_bytes
        assert b.forward == pytest.approx(2 * a.forward) and b.param_bytes == a.param_bytes
    assert [lay.name for lay in half] == ["embedding", "mamba_0", "attention_1", "moe_2", "head"]


# --- the model's shape: MLP width and form, key/value heads, the chunked Mamba scan ---------------
def _block_cost(training: TrainingSpec | None = None, **kw: object):
    return estimate_layers(_model(**kw), training or TrainingSpec())[1]


def test_ffn_hidden_and_swiglu_scale_the_mlp() -> None:
    h = 1536
    default = _block_cost(blocks=[{"kind": "dense"}])
    half = _block_cost(ffnHidden=2 * h, blocks=[{"kind": "dense"}])
    override = _block_cost(ffnHidden=2 * h, blocks=[{"kind": "dense", "ffnHidden": 4 * h}])
    assert default.param_bytes == 16 * 2 * h * 4 * h  # AdamW: 16 bytes a weight
    assert half.param_bytes == default.param_bytes / 2
    assert half.forward == pytest.approx(default.forward / 2)
    assert override.param_bytes == default.param_bytes  # the block's own width wins
    swiglu = _block_cost(mlp="swiglu", blocks=[{"kind": "dense"}])
    assert swiglu.param_bytes == 1.5 * default.param_bytes
    assert swiglu.forward == pytest.approx(1.5 * default.forward)
    # Saved activations: 4h + 2 x width a token (gelu), 4h + 4 x width (swiglu).
    t = TrainingSpec()
    tokens = t.microbatch_size * t.sequence_length
    assert default.activation_bytes == (4 * h + 8 * h) * tokens * 2
    assert swiglu.activation_bytes == (4 * h + 16 * h) * tokens * 2


def test_moe_experts_take_their_own_width() -> None:
    h = 1536
    narrow = _block_cost(blocks=[{"kind": "moe", "experts": 8, "topK": 2}])
    wide = _block_cost(blocks=[{"kind": "moe", "experts": 8, "topK": 2, "ffnHidden": 4 * h}])
    assert (wide.param_bytes - narrow.param_bytes) / 16 == 8 * 2 * h * (4 * h - 2 * h)


def test_grouped_query_attention_shrinks_k_and_v() -> None:
    h, heads = 1536, 12
    d = h // heads
    mha = _block_cost(blocks=[{"kind": "attention"}])
    for kv in (1, 4):
        gqa = _block_cost(kvHeads=kv, blocks=[{"kind": "attention"}])
        assert (mha.param_bytes - gqa.param_bytes) / 16 == 2 * h * d * (heads - kv)
        assert gqa.activation_bytes < mha.activation_bytes and gqa.forward < mha.forward


def test_chunked_mamba_is_linear_in_the_sequence() -> None:
    mamba = [{"kind": "mamba"}]
    short = _block_cost(TrainingSpec(sequence_length=4096), blocks=mamba)
    long = _block_cost(TrainingSpec(sequence_length=8192), blocks=mamba)
    assert long.activation_bytes == 2 * short.activation_bytes
    assert long.forward == pytest.approx(2 * short.forward)
    assert long.backward == pytest.approx(2 * short.backward)
    # Attention, for contrast, stays quadratic in its scores.
    attn = [{"kind": "attention"}]
    a_short = _block_cost(TrainingSpec(sequence_length=4096), blocks=attn)
    a_long = _block_cost(TrainingSpec(sequence_length=8192), blocks=attn)
    assert a_long.activation_bytes > 3 * a_short.activation_bytes


def test_gradient_bytes_and_optimizer_time_follow_the_parameters() -> None:
    # A dense block of hidden 1536 holds 8 h^2 parameters: 4 gradient bytes each, and AdamW
    # moves 28 bytes each over the default bandwidth (flops / 100 = 1e12 B/s on 100 TFLOP/s).
    layers = estimate_layers(_model(), TrainingSpec())
    params = 8.0 * 1536 * 1536
    block = layers[1]
    assert block.gradient_bytes == pytest.approx(4 * params)
    assert block.optimizer == pytest.approx(28 * params / 1e12 * 1e3)
    sgd = estimate_layers(_model(), TrainingSpec.model_validate({"optimizer": {"name": "sgd"}}),
                          memory_bytes_per_s=2e12)
    assert sgd[1].optimizer == pytest.approx(12 * params / 2e12 * 1e3)


def test_each_operator_adds_its_fixed_cost_to_the_pass_that_runs_it() -> None:
    from adaptis.api.job import BlockSpec
    from adaptis.planner.kernels import EMBEDDING_OPS, HEAD_OPS, MLP_OPS

    model = ZooModel(vocab_size=64, hidden=16, heads=2, blocks=(BlockSpec(kind="dense"), BlockSpec(kind="mamba")))
    training = TrainingSpec(sequence_length=128)  # two chunks of the Mamba scan
    plain = estimate_layers(model, training)
    costly = estimate_layers(model, training, kernel_s=1e-5)  # 0.01 ms an operator
    added = [(c.forward - p.forward, c.backward - p.backward, c.weight - p.weight)
             for p, c in zip(plain, costly, strict=True)]
    # Embedding: its gather forward; its whole backward is W (the first stage's).
    assert added[0] == pytest.approx((0.01 * EMBEDDING_OPS[0], 0.0, 0.01 * EMBEDDING_OPS[1]), abs=1e-5)  # F floor
    # Dense block: the MLP's operators; the backward pass two thirds B, one third W.
    assert added[1] == pytest.approx((0.17, 0.01 * MLP_OPS[1] * 2 / 3, 0.01 * MLP_OPS[1] / 3))
    # Mamba at two chunks: 24 + 2 x 71 forward operators, 38 + 2 x 109 in the backward pass.
    assert added[2] == pytest.approx((1.66, 2.56 * 2 / 3, 2.56 / 3))
    assert added[3] == pytest.approx((0.01 * HEAD_OPS[0], 0.01 * HEAD_OPS[1] * 2 / 3, 0.01 * HEAD_OPS[1] / 3))
    # Bytes do not change.
    assert [c.activation_bytes for c in costly] == [p.activation_bytes for p in plain]
