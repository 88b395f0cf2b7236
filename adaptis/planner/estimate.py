"""Layer costs estimated from the model's sizes: the planning problem's ``layers`` without torch.

Sits in the planner (pure Python) for its two users, which have nothing measured to go on: the
operator (:mod:`adaptis.operator.scheduling.planning`; its image carries no torch) and ``adaptis run
--profile estimate`` (:func:`adaptis.worker.profiling.job_problem.estimate_problem`). It counts
FLOPs and bytes from :class:`~adaptis.api.model.ZooModel` and :class:`~adaptis.api.job.TrainingSpec`
(the same arithmetic the paper's cost ratios follow). Times are milliseconds on a device that
sustains ``flops_per_s``; by default the device of speed 1, which by convention sustains
:data:`REFERENCE_TFLOPS`, and :func:`device_speed` turns a GPU's peak into that scale.

Per microbatch of ``T = microbatch_size * sequence_length`` tokens and a layer with ``P``
matmul parameters: forward ``2TP``, input gradient ``2TP``, weight gradient ``2TP``; attention's
score and value products add ``4Ts h`` forward and ``8Ts h`` to the input gradient and have no
weights. ``P`` follows the model's shape: MLP width (``ffnHidden``, per block), gelu or swiglu
(three matrices), key/value heads (``kvHeads``), experts' width; the Mamba scan is chunked, so
its FLOPs and bytes are linear in the sequence. Activation bytes follow method.md (``34 b s h +
5 b s^2 a`` for an attention block in 16-bit; ``element_bytes`` scales the per-element terms,
e.g. 4 for an fp32 CPU run); parameters
hold 16 bytes each with AdamW (weights, gradients, two moments, master copy in mixed
precision), 8 with SGD.

Data parallel and the step after the pipeline: a layer's ``gradient_bytes`` are 4 a parameter
(fp32 gradients, what the replicas all-reduce), and its ``optimizer`` time is memory-bandwidth
bound: AdamW reads weights, gradients and two moments and writes weights and moments, 28 bytes
a parameter in fp32 (SGD with momentum 12), over ``memory_bytes_per_s``; by default the device
moves one byte per :data:`FLOPS_PER_BYTE` FLOPs it sustains (an H100 sustains about 400 TFLOP/s
in training on 3.35 TB/s).
"""

from __future__ import annotations

from dataclasses import dataclass

from adaptis.api.job import BlockSpec, TrainingSpec
from adaptis.api.model import ZooModel
from adaptis.api.problem import Layer
from adaptis.planner.kernels import Kernels, block_kernels, embedding_kernels, head_kernels
from adaptis.planner.tensor_parallel import mark_by_kind

__all__ = [
    "FLOPS_PER_BYTE", "MAMBA_CHUNK", "MAMBA_STATE", "MFU", "REFERENCE_TFLOPS", "device_speed",
    "estimate_layers",
]

#: Sustained TFLOP/s of a device of speed 1.
REFERENCE_TFLOPS = 100.0
#: Fraction of peak that dense training sustains (model FLOPs utilisation).
MFU = 0.4
#: Tokens per chunk of the Mamba block's scan and its state size: the worker's layer
#: (:mod:`adaptis.worker.models.ssm`) uses these very numbers, so the estimate counts what runs.
MAMBA_CHUNK = 64
MAMBA_STATE = 16
#: Sustained FLOPs per byte of memory traffic of a training device (sets the default bandwidth).
FLOPS_PER_BYTE = 100.0
#: Bytes of memory traffic a parameter costs in one optimizer step, and gradient bytes per one.
_OPTIMIZER_TRAFFIC = {"adamw": 28.0, "sgd": 12.0}
_GRADIENT_BYTES = 4.0

_MS = 1e3
# No layer is free: the smallest time keeps Layer.forward > 0 for tiny models.
_MIN_MS = 1e-6


@dataclass(frozen=True, slots=True)
class _Flops:
    forward: float
    backward: float
    weight: float
    params: float
    activation_bytes: float


def device_speed(peak_tflops: float) -> float:
    """Speed of a device of this peak, relative to the reference device."""
    return peak_tflops * MFU / REFERENCE_TFLOPS


def _attention(*, tokens: float, seq: int, model: ZooModel, batch: int, elem: float) -> _Flops:
    h, heads, kv = model.hidden, model.heads, model.key_value_heads
    kv_width = kv * (h // heads)
    # q and out are h x h; grouped-query attention shrinks k and v to kv_heads heads.
    params = 2.0 * h * h + 2.0 * h * kv_width
    core = 4.0 * tokens * seq * h  # QK^T and AV (every query head attends)
    # Saved per token: input, q, k, v, output (k and v at kv width); rotary keeps its rotated q, k.
    per_token = 3.0 * h + 2.0 * kv_width + ((h + kv_width) if model.positions == "rope" else 0.0)
    act = (batch * seq * per_token + 2.5 * batch * seq * seq * heads) * elem
    return _Flops(2 * tokens * params + core, 2 * tokens * params + 2 * core,
                  2 * tokens * params, params, act)


def _mlp(*, tokens: float, hidden: int, inner: int, form: str, batch: int, seq: int,
         elem: float) -> _Flops:
    """gelu: up and down (``2 h inner`` weights); swiglu adds the gate matrix. Saved per token:
    ``4h + 2 inner`` (gelu: 12h at the default width 4h), ``4h + 4 inner`` for swiglu."""
    matrices = 3.0 if form == "swiglu" else 2.0
    params = matrices * hidden * inner
    act = (4.0 * hidden + 2.0 * (matrices - 1.0) * inner) * batch * seq * elem
    return _Flops(2 * tokens * params, 2 * tokens * params, 2 * tokens * params, params, act)


def _mamba(*, tokens: float, seq: int, model: ZooModel, batch: int, elem: float) -> _Flops:
    """The chunked selective scan (:mod:`adaptis.worker.models.ssm`): projections of an expand-2 SSM
    plus, per token, the within-chunk quadratic part (``chunk`` wide) and the carried state's
    read and update (``state x inner``): linear in the sequence, as are its saved activations."""
    h, heads = model.hidden, model.heads
    inner, n = 2 * h, MAMBA_STATE
    q = min(MAMBA_CHUNK, seq)
    params = h * (2.0 * inner + 2 * n + heads) + inner * h
    scan = tokens * (2.0 * q * n + 2.0 * q * inner + 3.0 * heads * q + 4.0 * n * inner)
    # Elementwise tensors of the projections, convolution, gate and norm (~17h a token), and per
    # chunk the [chunk, chunk] decay, its exp and the mixing matrix of each head plus C.B.
    act = (17.0 * h + (3.0 * heads + 1.0) * q) * batch * seq * elem
    return _Flops(2 * tokens * params + scan, 2 * tokens * params + 2 * scan,
                  2 * tokens * params, params, act)


def _block(block: BlockSpec, *, model: ZooModel, training: TrainingSpec, elem: float) -> _Flops:
    batch, seq, h = training.microbatch_size, training.sequence_length, model.hidden
    tokens = float(batch * seq)
    if block.kind == "mamba":
        return _mamba(tokens=tokens, seq=seq, model=model, batch=batch, elem=elem)
    mlp = _mlp(tokens=tokens, hidden=h, inner=model.mlp_width(block), form=model.mlp, batch=batch,
               seq=seq, elem=elem)
    if block.kind == "dense":
        return mlp
    attn = _attention(tokens=tokens, seq=seq, model=model, batch=batch, elem=elem)
    if block.kind == "attention":
        return _sum(attn, mlp)
    # MoE: attention plus top_k experts' MLPs run per token; all experts' weights are held.
    router = 2.0 * tokens * h * block.experts
    return _Flops(
        attn.forward + block.top_k * mlp.forward + router,
        attn.backward + block.top_k * mlp.backward + router,
        attn.weight + block.top_k * mlp.weight + router,
        attn.params + block.experts * mlp.params + h * block.experts,
        attn.activation_bytes + block.top_k * mlp.activation_bytes,
    )


def _sum(a: _Flops, b: _Flops) -> _Flops:
    return _Flops(a.forward + b.forward, a.backward + b.backward, a.weight + b.weight,
                  a.params + b.params, a.activation_bytes + b.activation_bytes)


@dataclass(frozen=True, slots=True)
class _Rates:
    """What a layer's figures scale by: the device's rates and the optimizer's bytes."""

    flops_per_s: float
    memory_bytes_per_s: float
    state_bytes: float  # held per parameter
    optimizer_traffic: float  # moved per parameter in one optimizer step
    kernel_s: float  # fixed seconds of one operator (adaptis.planner.kernels)


def _layer(name: str, *, kind: str, f: _Flops, rates: _Rates, output_bytes: float, ops: Kernels) -> Layer:
    def ms(flops: float, kernels: float) -> float:
        return (flops / rates.flops_per_s + kernels * rates.kernel_s) * _MS

    return Layer(
        name=name,
        kind=kind,
        forward=max(ms(f.forward, ops.forward), _MIN_MS),
        backward=ms(f.backward, ops.backward),
        weight=ms(f.weight, ops.weight),
        activation_bytes=f.activation_bytes,
        param_bytes=f.params * rates.state_bytes,
        output_bytes=output_bytes,
        gradient_bytes=f.params * _GRADIENT_BYTES,
        optimizer=f.params * rates.optimizer_traffic / rates.memory_bytes_per_s * _MS,
    )


def estimate_layers(model: ZooModel, training: TrainingSpec, *, element_bytes: int = 2,
                    flops_per_s: float = REFERENCE_TFLOPS * 1e12,
                    memory_bytes_per_s: float | None = None, kernel_s: float = 0.0) -> list[Layer]:
    """Embedding, every block, head (named as the worker's models name them): estimated costs
    in ms on a device sustaining ``flops_per_s`` and ``memory_bytes_per_s`` (default
    ``flops_per_s / FLOPS_PER_BYTE``), activations of ``element_bytes`` each, and
    ``kernel_s`` seconds for each operator a pass runs (:mod:`adaptis.planner.kernels`)."""
    batch, seq, h, vocab = (training.microbatch_size, training.sequence_length,
                            model.hidden, model.vocab_size)
    tokens = float(batch * seq)
    elem = float(element_bytes)
    state = 16.0 if training.optimizer.name == "adamw" else 8.0
    rates = _Rates(flops_per_s=flops_per_s,
                   memory_bytes_per_s=memory_bytes_per_s or flops_per_s / FLOPS_PER_BYTE,
                   state_bytes=state,
                   optimizer_traffic=_OPTIMIZER_TRAFFIC.get(training.optimizer.name, 28.0),
                   kernel_s=kernel_s)
    hidden_bytes = tokens * h * elem
    # The embedding is a gather (memory bound): count it as touching every output element.
    embedding = _Flops(2 * tokens * h, 0.0, 2 * tokens * h, float(vocab * h), elem * tokens * h)
    layers = [_layer("embedding", kind="embedding", f=embedding, rates=rates,
                     output_bytes=hidden_bytes, ops=embedding_kernels())]
    index = 0
    for block in model.blocks:
        cost = _block(block, model=model, training=training, elem=elem)
        ops = block_kernels(block, model=model, training=training, chunk=MAMBA_CHUNK)
        for _ in range(block.count):
            layers.append(_layer(f"{block.kind}_{index}", kind=block.kind, f=cost, rates=rates,
                                 output_bytes=hidden_bytes, ops=ops))
            index += 1
    # Head: projection to the vocabulary plus softmax cross-entropy over fp32 logits.
    proj = 2.0 * tokens * h * vocab
    softmax = 5.0 * tokens * vocab
    head_params = 0.0 if model.tie_embeddings else float(vocab * h)
    head = _Flops(proj + softmax, proj + softmax, proj, head_params, tokens * vocab * (elem + 4))
    layers.append(_layer("head", kind="head", f=head, rates=rates, output_bytes=0.0, ops=head_kernels()))
    return mark_by_kind(layers)  # what tensor parallelism splits of each, and its all-reduces
