"""The block zoo's model features: grouped-query attention, rotary positions, MLP width and
form, the MoE load-balancing loss (attached in the backward) and the chunked Mamba scan (equal
to the quadratic form, memory linear in the sequence). Pipelined: test_worker_blocks_parity."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from adaptis.api.job import BlockSpec
from adaptis.api.model import ZooModel
from adaptis.worker.models.layers import AttentionBlock, BlockOptions, MambaBlock, _Attention, apply_rotary
from adaptis.worker.models.moe import MixtureOfExperts, load_balancing_loss
from adaptis.worker.models.ssm import chunked_scan
from adaptis.worker.models.zoo import build_layer, build_model, layer_parameters, moe_layers, token_loss

H, HEADS = 32, 4


def _model(**kw: object) -> ZooModel:
    blocks = [BlockSpec(kind="attention"), BlockSpec(kind="moe", experts=4, top_k=2),
              BlockSpec(kind="dense")]
    base: dict[str, object] = {"vocab_size": 97, "hidden": H, "heads": HEADS, "blocks": blocks}
    base.update(kw)
    return ZooModel(**base)  # type: ignore[arg-type]


def _tokens(s: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(97, (2, s), generator=torch.Generator().manual_seed(seed))


# --- grouped-query attention -------------------------------------------------------------------
def test_kv_heads_equal_to_heads_is_todays_attention() -> None:
    tokens = _tokens()
    with torch.no_grad():
        mha = build_model(_model(), seed=4)(tokens)
        same = build_model(_model(kv_heads=HEADS), seed=4)(tokens)
    assert torch.equal(mha, same)


def test_grouped_query_attention_is_mha_with_shared_key_value_heads() -> None:
    """A GQA layer equals the MHA layer whose key/value heads repeat each shared head."""
    kv, d = 2, H // HEADS
    gqa = _Attention(hidden=H, heads=HEADS, kv_heads=kv)
    mha = _Attention(hidden=H, heads=HEADS)
    gen = torch.Generator().manual_seed(1)
    for proj in (gqa.q, gqa.k, gqa.v):
        torch.nn.init.normal_(proj.weight, std=0.2, generator=gen)
    group = HEADS // kv  # query head i uses key/value head i // group
    with torch.no_grad():
        mha.q.weight.copy_(gqa.q.weight)
        for mine, shared in ((mha.k, gqa.k), (mha.v, gqa.v)):
            mine.weight.copy_(shared.weight.view(kv, d, H).repeat_interleave(group, dim=0).reshape(H, H))
        mha.out.weight.copy_(gqa.out.weight)
        x = torch.randn(2, 9, H, generator=torch.Generator().manual_seed(2))
        torch.testing.assert_close(gqa(x), mha(x), rtol=0, atol=1e-6)


def _layer_params(kv: int) -> int:
    return sum(p.numel() for p in build_layer(_model(kv_heads=kv), index=1, seed=0).parameters())


def test_grouped_query_attention_has_fewer_parameters_by_the_formula() -> None:
    d = H // HEADS
    count = {kv: _layer_params(kv) for kv in (1, 2, HEADS)}
    for kv in (1, 2):  # q and out keep H x H each; k and v shrink to kv heads of size d
        assert count[HEADS] - count[kv] == 2 * H * d * (HEADS - kv)


# --- rotary positions --------------------------------------------------------------------------
def test_rotary_scores_depend_only_on_relative_position() -> None:
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 2, 10, 8, generator=g), torch.randn(1, 2, 10, 8, generator=g)

    def scores(offset: int) -> torch.Tensor:
        rq, rk = (apply_rotary(t, theta=1e4, offset=offset) for t in (q, k))
        return rq @ rk.transpose(-1, -2)

    torch.testing.assert_close(scores(0), scores(37), rtol=0, atol=1e-5)
    # Not trivially so: the rotation changes the scores, and by how far apart the tokens are.
    assert not torch.allclose(scores(0), q @ k.transpose(-1, -2), atol=1e-3)
    same = torch.randn(1, 1, 1, 8, generator=g).expand(1, 1, 10, 8)
    s0 = (apply_rotary(same, theta=1e4) @ apply_rotary(same, theta=1e4).transpose(-1, -2))[0, 0]
    assert s0[5, 5] > s0[5, 0] + 1e-3 or s0[5, 5] < s0[5, 0] - 1e-3


def test_rope_attention_layer_is_shift_invariant_and_causal() -> None:
    attn = build_layer(_model(positions="rope", rope_theta=500.0), index=1, seed=0).attn
    x = torch.randn(1, 12, H, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        q0, k0, _ = attn.project(x, offset=0)
        q1, k1, _ = attn.project(x, offset=1000)
        torch.testing.assert_close(q0 @ k0.transpose(-1, -2), q1 @ k1.transpose(-1, -2),
                                   rtol=0, atol=2e-5)
        plain = build_layer(_model(), index=1, seed=0)
        rope = build_layer(_model(positions="rope"), index=1, seed=0)
        for layer in (plain, rope):  # sharper attention than the 0.02 init gives
            for proj in (layer.attn.q, layer.attn.k):
                proj.weight.mul_(50.0)
        assert not torch.allclose(plain(x), rope(x), atol=1e-3)  # same weights, rope applied
        y = rope(x)
        x2 = x.clone()
        x2[0, 8:] += 1.0
        assert torch.equal(rope(x2)[0, :8], y[0, :8])


def test_rope_needs_an_even_head_size() -> None:
    with pytest.raises(ValueError, match="head size"):
        _model(hidden=36, heads=4, positions="rope")


# --- MLP width and form ------------------------------------------------------------------------
def test_ffn_hidden_sets_widths_and_defaults_keep_todays() -> None:
    widths = {name: p.shape for name, p in build_model(_model(), seed=0).named_parameters()}
    assert widths["layers.1.mlp.up.weight"] == (4 * H, H)
    assert widths["layers.2.moe.w_up"] == (4, H, 2 * H)
    m = _model(ffn_hidden=40, blocks=[BlockSpec(kind="attention"),
                                      BlockSpec(kind="moe", ffn_hidden=24),
                                      BlockSpec(kind="dense", ffn_hidden=56)])
    widths = {name: p.shape for name, p in build_model(m, seed=0).named_parameters()}
    assert widths["layers.1.mlp.up.weight"] == (40, H)
    assert widths["layers.1.mlp.down.weight"] == (H, 40)
    assert widths["layers.2.moe.w_up"] == (4, H, 24) and widths["layers.3.mlp.up.weight"] == (56, H)


def test_swiglu_is_down_of_silu_gate_times_up() -> None:
    block = build_layer(_model(mlp="swiglu", ffn_hidden=20), index=3, seed=0)
    mlp = block.mlp
    assert mlp.gate.weight.shape == (20, H)
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = (F.silu(x @ mlp.gate.weight.T) * (x @ mlp.up.weight.T)) @ mlp.down.weight.T
        torch.testing.assert_close(mlp(x), want)
    moe = build_layer(_model(mlp="swiglu"), index=2, seed=0).moe
    assert moe.w_gate.shape == moe.w_up.shape


# --- MoE load-balancing loss -------------------------------------------------------------------
def test_load_balancing_loss_is_one_when_balanced() -> None:
    probs = torch.full((8, 4), 0.25)
    chosen = torch.tensor([[0, 1], [2, 3]] * 4)
    assert load_balancing_loss(probs=probs, chosen=chosen).item() == pytest.approx(1.0)
    skewed = torch.tensor([[0.7, 0.1, 0.1, 0.1]] * 8)
    assert load_balancing_loss(probs=skewed, chosen=torch.tensor([[0, 1]] * 8)).item() > 1.0


def test_aux_gradient_attached_in_backward_equals_adding_it_to_the_loss() -> None:
    m = _model(blocks=[BlockSpec(kind="moe", experts=4, top_k=2, aux_loss_coef=0.05)])
    tokens = _tokens(s=10)
    attached, added = build_model(m, seed=2), build_model(m, seed=2)
    for moe in moe_layers([attached]):
        moe.aux_grad_scale = 0.5
    token_loss(attached(tokens), tokens, scale=0.5).backward()
    (moe,) = moe_layers([added])
    moe.collected = []
    loss = token_loss(added(tokens), tokens, scale=0.5)
    (loss + 0.5 * 0.05 * moe.collected.pop()).backward()
    a, b = layer_parameters(attached), layer_parameters(added)
    for name in a:
        torch.testing.assert_close(a[name].grad, b[name].grad, rtol=1e-5, atol=1e-8, msg=name)
    # The aux term is really there: without it the router's gradient differs.
    off = [m.blocks[0].model_copy(update={"aux_loss_coef": 0.0})]
    plain = build_model(dataclasses.replace(m, blocks=off), seed=2)
    token_loss(plain(tokens), tokens, scale=0.5).backward()
    router = "1.moe.router.weight"
    assert not torch.allclose(layer_parameters(plain)[router].grad, a[router].grad, atol=1e-7)


def test_moe_aux_loss_is_off_by_default() -> None:
    moe = build_layer(_model(), index=2, seed=0).moe
    assert isinstance(moe, MixtureOfExperts) and moe.aux_loss_coef == 0.0


# --- chunked Mamba scan ------------------------------------------------------------------------
def _quadratic_ssm(ssm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The SSD quadratic form this block computed before the chunked scan (the oracle)."""
    b, s, _ = x.shape
    z, xbc, dt = ssm.in_proj(x).split([ssm.inner, ssm.inner + 2 * ssm.state, ssm.heads], -1)
    xbc = F.silu(ssm.conv(xbc.transpose(1, 2))[..., :s].transpose(1, 2))
    xs, bm, cm = xbc.split([ssm.inner, ssm.state, ssm.state], dim=-1)
    xs = xs.reshape(b, s, ssm.heads, ssm.inner // ssm.heads)
    dt = F.softplus(dt + ssm.dt_bias)
    log_decay = torch.cumsum(dt * -torch.exp(ssm.A_log), dim=1).transpose(1, 2)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    seg = (log_decay.unsqueeze(-1) - log_decay.unsqueeze(-2)).masked_fill(~causal, -math.inf)
    mix = torch.exp(seg) * (cm @ bm.transpose(1, 2)).unsqueeze(1)
    y = mix @ (xs * dt.unsqueeze(-1)).transpose(1, 2)
    y = y.transpose(1, 2) + xs * ssm.D.view(1, 1, -1, 1)
    return ssm.out_proj(ssm.norm(y.reshape(b, s, ssm.inner) * F.silu(z)))


@pytest.mark.parametrize("chunk,seq", [(64, 16), (4, 19), (8, 64), (64, 150)])
def test_chunked_scan_equals_the_quadratic_form(chunk: int, seq: int) -> None:
    block = build_layer(_model(blocks=[BlockSpec(kind="mamba")]), index=1, seed=3)
    assert isinstance(block, MambaBlock)
    ssm = block.ssm
    ssm.chunk = chunk
    # The initial steps (1e-3 .. 1e-1) keep much of the state across chunks: the carried part
    # matters (larger steps would decay it to nothing and hide a wrong carry).
    x = torch.randn(2, seq, H, generator=torch.Generator().manual_seed(7), requires_grad=True)
    got, want = ssm(x), _quadratic_ssm(ssm, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    gx, = torch.autograd.grad(got.square().sum(), x)
    wx, = torch.autograd.grad(want.square().sum(), x)
    torch.testing.assert_close(gx, wx, rtol=1e-4, atol=1e-5)


def _quadratic_scan(*, xs, dt, decay, bm, cm):
    s = xs.shape[1]
    log_decay = torch.cumsum(dt * decay, dim=1).transpose(1, 2)
    seg = (log_decay.unsqueeze(-1) - log_decay.unsqueeze(-2)).masked_fill(
        ~torch.ones(s, s, dtype=torch.bool).tril(), -math.inf)
    mix = torch.exp(seg) * (cm @ bm.transpose(1, 2)).unsqueeze(1)
    return (mix @ (xs * dt.unsqueeze(-1)).transpose(1, 2)).transpose(1, 2)


@pytest.mark.parametrize("chunk,seq", [(4, 19), (16, 64), (64, 130)])
def test_chunked_scan_carries_the_state_across_chunks(chunk: int, seq: int) -> None:
    """The scan alone, on inputs where the carried state dominates (in the block, the skip term
    D x would hide an error in it)."""
    g = torch.Generator().manual_seed(8)
    b, heads, p, n = 2, 3, 4, 5
    xs = torch.randn(b, seq, heads, p, generator=g)
    dt = 0.02 + 0.1 * torch.rand(b, seq, heads, generator=g)
    decay = -torch.tensor([0.1, 0.5, 2.0])
    bm, cm = torch.randn(b, seq, n, generator=g), torch.randn(b, seq, n, generator=g)
    want = _quadratic_scan(xs=xs, dt=dt, decay=decay, bm=bm, cm=cm)
    got = chunked_scan(xs=xs, dt=dt, decay=decay, bm=bm, cm=cm, chunk=chunk)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    within = chunked_scan(xs=xs, dt=dt, decay=decay, bm=bm, cm=cm, chunk=seq)
    torch.testing.assert_close(within, want, rtol=1e-5, atol=1e-5)


def _saved_bytes(module: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the tensors autograd saves for the backward of one forward (each storage once)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(seen.values())


def test_mamba_saved_activations_grow_linearly_with_the_sequence() -> None:
    torch.set_num_threads(1)
    block = build_layer(_model(blocks=[BlockSpec(kind="mamba")]), index=1, seed=0)
    sizes = {s: _saved_bytes(block, torch.randn(1, s, H, requires_grad=True)) for s in (256, 512)}
    ratio = sizes[512] / sizes[256]
    assert 1.8 < ratio < 2.2, f"saved bytes {sizes}: ratio {ratio:.2f}, linear is 2, quadratic 4"


def test_attention_block_keeps_parameter_names() -> None:
    block = AttentionBlock(hidden=H, heads=HEADS, opts=BlockOptions(kv_heads=2, rope_theta=1e4))
    assert sorted(n for n, _ in block.named_parameters()) == [
        "attn.k.weight", "attn.out.weight", "attn.q.weight", "attn.v.weight", "mlp.down.weight",
        "mlp.up.weight",
        "norm1.weight", "norm2.weight"]


# --- the planner's estimate counts the weights the layers hold --------------------------------
@pytest.mark.parametrize("features", [
    {}, {"kv_heads": 2, "mlp": "swiglu", "ffn_hidden": 40}, {"kv_heads": 1}])
def test_estimated_weights_are_the_layers_matmul_weights(features: dict) -> None:
    from adaptis.api.job import TrainingSpec
    from adaptis.planner.estimate import estimate_layers

    blocks = [BlockSpec(kind="attention"), BlockSpec(kind="moe", experts=4, top_k=2, ffn_hidden=24),
              BlockSpec(kind="dense"), BlockSpec(kind="mamba")]
    model = _model(blocks=blocks, **features)
    estimated = estimate_layers(model, TrainingSpec())
    for index in range(1, 5):
        layer = build_layer(model, index=index, seed=0)
        # Norm gains, SSM scalars and the depthwise convolution are not matmul weights.
        weights = sum(p.numel() for n, p in layer.named_parameters()
                      if p.dim() >= 2 and "conv" not in n)
        assert estimated[index].param_bytes == 16 * weights, estimated[index].name


def test_the_profiler_measures_runs_that_differ_apart() -> None:
    from adaptis.worker.models.zoo import model_layers
    from adaptis.worker.profiling.profiler import _kind_key

    m = _model(blocks=[BlockSpec(kind="dense", count=2), BlockSpec(kind="dense", ffn_hidden=8),
                       BlockSpec(kind="dense", count=3)])
    keys = [_kind_key(info) for info in model_layers(m)[1:-1]]
    assert keys[0] == keys[1] == keys[3] and keys[2] != keys[0]
