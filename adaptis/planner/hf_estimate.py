"""Layer costs of a Hugging Face decoder model, estimated from its config: no torch.

Sits beside :mod:`adaptis.planner.estimate` (the zoo's estimate) and follows its conventions
(times in ms on a device sustaining ``flops_per_s``; forward ``2TP``, input gradient ``2TP``,
weight gradient ``2TP`` per microbatch of ``T`` tokens and ``P`` matmul parameters; attention's
score and value products ``4Tsd`` forward and ``8Tsd`` backward; 16 bytes of state per
parameter with AdamW, 8 with SGD). What it adds is the real shape of each decoder layer as the
config describes it (:class:`adaptis.api.hf_model.HFLayout`): grouped-query attention with its
own head size, SwiGLU MLPs of the config's width, MoE layers (router, top-k routed experts of
their own width, a shared expert) next to dense ones, Mamba-2 layers next to attention ones,
and the head over the real vocabulary. :func:`estimate_model_layers` is the one entry point for
both kinds of model.
"""

from __future__ import annotations

from dataclasses import dataclass

from adaptis.api.hf_model import HFLayout
from adaptis.api.job import TrainingSpec
from adaptis.api.model import HuggingFaceModel, Model
from adaptis.api.problem import Layer
from adaptis.planner.estimate import REFERENCE_TFLOPS, estimate_layers

__all__ = ["estimate_hf_layers", "estimate_model_layers"]

_MS = 1e3
_MIN_MS = 1e-6


@dataclass(frozen=True, slots=True)
class _Cost:
    matmul_params: float  # parameters every token multiplies by (2TP each of F, B, W)
    held_params: float  # parameters the layer holds (all experts)
    extra_forward: float  # FLOPs without weights (attention scores, the scan)
    activation_elems: float  # per microbatch, in elements


def _attention(lay: HFLayout, *, batch: int, seq: int) -> _Cost:
    q_out = lay.heads * lay.head_dim
    kv_out = lay.kv_heads * lay.head_dim
    params = lay.hidden * (2 * q_out + 2 * kv_out)
    tokens = batch * seq
    core = 4.0 * tokens * seq * q_out
    act = 5.0 * tokens * lay.hidden + 2.5 * batch * seq * seq * lay.heads
    return _Cost(params, params, core, act)


def _swiglu(hidden: int, inner: int, *, tokens: int) -> _Cost:
    params = 3.0 * hidden * inner
    return _Cost(params, params, 0.0, tokens * (2.0 * hidden + 3.0 * inner))


def _moe(lay: HFLayout, *, tokens: int) -> _Cost:
    expert = _swiglu(lay.hidden, lay.expert_intermediate, tokens=tokens)
    router = float(lay.hidden * lay.experts)
    shared = (_swiglu(lay.hidden, lay.shared_expert_intermediate, tokens=tokens)
              if lay.shared_expert_intermediate else _Cost(0.0, 0.0, 0.0, 0.0))
    gate = float(lay.hidden) if lay.shared_expert_intermediate else 0.0
    return _Cost(
        matmul_params=lay.top_k * expert.matmul_params + router + shared.matmul_params + gate,
        held_params=lay.experts * expert.held_params + router + shared.held_params + gate,
        extra_forward=0.0,
        activation_elems=lay.top_k * expert.activation_elems + shared.activation_elems,
    )


def _mamba(lay: HFLayout, *, tokens: int) -> _Cost:
    inner = lay.mamba_heads * lay.mamba_head_dim
    bc = 2 * lay.mamba_groups * lay.mamba_state
    params = float(lay.hidden * (2 * inner + bc + lay.mamba_heads) + inner * lay.hidden)
    # The chunked scan: about six multiply-adds per state element of every inner channel.
    scan = 2.0 * tokens * inner * lay.mamba_state * 6
    return _Cost(params, params, scan, tokens * (4.0 * lay.hidden + 6.0 * inner))


def _add(a: _Cost, b: _Cost) -> _Cost:
    return _Cost(a.matmul_params + b.matmul_params, a.held_params + b.held_params,
                 a.extra_forward + b.extra_forward, a.activation_elems + b.activation_elems)


def _decoder(lay: HFLayout, kind: str, *, batch: int, seq: int) -> _Cost:
    tokens = batch * seq
    mixer = _mamba(lay, tokens=tokens) if kind == "mamba" else _attention(lay, batch=batch, seq=seq)
    ffn = _moe(lay, tokens=tokens) if kind == "moe" else _swiglu(lay.hidden, lay.intermediate,
                                                                 tokens=tokens)
    return _add(mixer, ffn)


def estimate_hf_layers(layout: HFLayout, training: TrainingSpec, *, element_bytes: int = 2,
                       flops_per_s: float = REFERENCE_TFLOPS * 1e12) -> list[Layer]:
    """Embedding, each decoder layer (named ``<kind>_<i>``), head: estimated costs in ms."""
    batch, seq = training.microbatch_size, training.sequence_length
    tokens = float(batch * seq)
    elem = float(element_bytes)
    state = 16.0 if training.optimizer.name == "adamw" else 8.0
    h, vocab = layout.hidden, layout.vocab_size
    hidden_bytes = tokens * h * elem

    def ms(flops: float) -> float:
        return flops / flops_per_s * _MS

    layers = [Layer(name="embedding", kind="embedding", forward=max(ms(2 * tokens * h), _MIN_MS),
                    backward=0.0, weight=ms(2 * tokens * h), activation_bytes=elem * tokens * h,
                    param_bytes=float(vocab * h) * state, output_bytes=hidden_bytes,
                    tensor_all_reduces=1)]  # vocabulary-parallel under tensor parallelism
    for i, kind in enumerate(layout.kinds):
        c = _decoder(layout, kind, batch=batch, seq=seq)
        mm = 2 * tokens * c.matmul_params
        layers.append(Layer(
            name=f"{kind}_{i}", kind=kind, forward=max(ms(mm + c.extra_forward), _MIN_MS),
            backward=ms(mm + 2 * c.extra_forward), weight=ms(mm),
            activation_bytes=c.activation_elems * elem, param_bytes=c.held_params * state,
            output_bytes=hidden_bytes))
    proj = 2.0 * tokens * h * vocab
    softmax = 5.0 * tokens * vocab
    head_params = 0.0 if layout.tied else float(vocab * h)
    layers.append(Layer(name="head", kind="head", forward=max(ms(proj + softmax), _MIN_MS),
                        backward=ms(proj + softmax), weight=ms(proj),
                        activation_bytes=tokens * vocab * (elem + 4),
                        param_bytes=(head_params + h) * state, output_bytes=0.0,
                        tensor_all_reduces=0))  # the vocabulary-parallel loss
    return layers


def estimate_model_layers(model: Model, training: TrainingSpec, *, element_bytes: int = 2,
                          flops_per_s: float = REFERENCE_TFLOPS * 1e12,
                          memory_bytes_per_s: float | None = None, kernel_s: float = 0.0) -> list[Layer]:
    """The estimate of either kind of model: the zoo's or a Hugging Face config's (whose
    layers leave gradient bytes and optimizer time to the problem's defaults, and whose
    operators are not counted: ``kernel_s`` applies to the zoo's)."""
    if isinstance(model, HuggingFaceModel):  # the one place the planner tells the kinds apart
        return estimate_hf_layers(model.layout, training,
                                  element_bytes=element_bytes, flops_per_s=flops_per_s)
    return estimate_layers(model, training, element_bytes=element_bytes, flops_per_s=flops_per_s,
                           memory_bytes_per_s=memory_bytes_per_s, kernel_s=kernel_s)
