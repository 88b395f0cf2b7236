"""Pipeline stages built from a Hugging Face transformers model's own modules.

Sits beside :mod:`adaptis.worker.models.zoo` (the zoo's stages); the executor picks this module
when the job's ``spec.model.huggingface`` is set (:func:`build_hf_stages`). The layer list is the
one :class:`adaptis.api.hf_model.HFLayout` names: 0 the token embedding, 1..L the decoder
layers, L+1 the final norm and LM head (the loss is applied by the schedule, as for the zoo).

How a stage is made: the whole ``AutoModelForCausalLM`` is instantiated on the meta device (no
memory, no init), and only the modules of this rank's layers are materialised on CPU and
initialised with the model's own ``_init_weights``, each layer from its own seed (``seed``,
layer index) under a forked RNG, so the weights do not depend on the partition or the process.
A stage's forward does what the model's forward does around its layers: the embedding,
position ids, the attention masks from the model's own mask helpers (one per layer type: full,
sliding window, the Mamba layers' padding mask), the rotary embedding from the model's
``rotary_emb``, each decoder layer with the model's keyword arguments, then the final norm and
``lm_head``. No cache, no router logits: the MoE auxiliary
loss is off (``output_router_logits`` false), as the Trainer's default for these configs.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from adaptis.api.hf_model import HFLayout, hf_layout, resolve_config
from adaptis.api.model import HuggingFaceModel
from adaptis.worker.errors import WorkerError
from adaptis.worker.models.hf.weights import load_stage_weights

__all__ = ["HFStage", "build_hf_model", "build_hf_stages", "hf_config", "init_hf_model"]

_SEED_STRIDE = 1_000_003  # as adaptis.worker.models.zoo: (seed, layer) pairs do not collide


def hf_config(model: HuggingFaceModel) -> Any:
    """The transformers config of the job's model (no download: built from the dict)."""
    from transformers import AutoConfig

    data = resolve_config(model.huggingface)
    hf_layout(model.huggingface)  # the supported families, with an error naming the field
    fields = {k: v for k, v in data.items() if k not in ("model_type", "architectures",
                                                          "transformers_version")}
    config = AutoConfig.for_model(data["model_type"], **fields)
    config.use_cache = False
    config.output_router_logits = False
    return config


def _base(causal_lm: nn.Module) -> nn.Module:
    return causal_lm.model  # type: ignore[return-value]


def _final_norm(base: nn.Module) -> nn.Module:
    norm = getattr(base, "norm", None) or getattr(base, "final_layernorm", None)
    if norm is None:
        raise WorkerError(f"{type(base).__name__} has no final norm (norm or final_layernorm)")
    return norm


def _layer_type(config: Any, index: int) -> str:
    """The mask a decoder layer takes, as the model's forward picks it."""
    kinds = getattr(config, "layers_block_type", None) or getattr(config, "layer_types", None)
    return kinds[index] if kinds else "full_attention"


def _mask_functions(causal_lm: nn.Module) -> dict[str, Any]:
    """The model's own mask helpers, from the module its forward lives in."""
    module = sys.modules[type(_base(causal_lm)).__module__]
    table = {"full_attention": "create_causal_mask",
             "sliding_attention": "create_sliding_window_causal_mask",
             "linear_attention": "create_recurrent_attention_mask"}
    return {kind: getattr(module, name) for kind, name in table.items() if hasattr(module, name)}


class HFStage(nn.Module):
    """Layers ``[lo, hi)`` of the pipeline's layer list, run as the model's forward runs them."""

    def __init__(self, causal_lm: nn.Module, *, config: Any, lo: int, hi: int,
                 n_layers: int) -> None:
        super().__init__()
        self.lo, self.hi = lo, hi
        self.config = config
        base = _base(causal_lm)
        self.embed_tokens = base.embed_tokens if lo == 0 else None
        decoder = range(max(lo, 1) - 1, min(hi, n_layers - 1) - 1)
        self.indices = list(decoder)
        self.layers = nn.ModuleList([base.layers[i] for i in decoder])
        self.rotary_emb = getattr(base, "rotary_emb", None) if self.indices else None
        self._masks = _mask_functions(causal_lm)
        last = hi == n_layers
        self.norm = _final_norm(base) if last else None
        self.norm_name = next((n for n, m in base.named_children() if m is self.norm), "norm")
        self.lm_head = causal_lm.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        if self.embed_tokens is not None:
            h = self.embed_tokens(x)  # Gemma's scales itself (GemmaTextScaledWordEmbedding)
        if self.indices:
            positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
            masks: dict[str, Any] = {}
            rotary = (self.rotary_emb(h, position_ids=positions)
                      if self.rotary_emb is not None else None)
            for index, layer in zip(self.indices, self.layers, strict=True):
                kind = _layer_type(self.config, index)
                if kind not in masks:
                    masks[kind] = self._masks[kind](
                        config=self.config, inputs_embeds=h, attention_mask=None,
                        past_key_values=None, position_ids=positions)
                out = layer(h, attention_mask=masks[kind], position_ids=positions,
                            position_embeddings=rotary, use_cache=False)
                h = out[0] if isinstance(out, tuple) else out
        if self.lm_head is not None:
            assert self.norm is not None
            h = self.lm_head(self.norm(h))
        return h

    #: transformers names a tied weight once (``model.embed_tokens.weight``), even when the
    #: embedding and the head are two stages of one rank.
    names_tied_weight_once = True

    @property
    def embedding_weight(self) -> nn.Parameter | None:
        return self.embed_tokens.weight if self.embed_tokens is not None else None

    @property
    def head_weight(self) -> nn.Parameter | None:
        return self.lm_head.weight if self.lm_head is not None else None

    def global_parameters(self) -> dict[str, nn.Parameter]:
        """This stage's parameters by the name ``AutoModelForCausalLM`` gives them (a tied LM
        head held apart from its embedding keeps the name ``lm_head.weight``)."""
        out: dict[str, nn.Parameter] = {}
        if self.embed_tokens is not None:
            out["model.embed_tokens.weight"] = self.embed_tokens.weight
        for index, layer in zip(self.indices, self.layers, strict=True):
            for name, p in layer.named_parameters():
                out[f"model.layers.{index}.{name}"] = p
        if self.norm is not None and self.lm_head is not None:
            for name, p in self.norm.named_parameters():
                out[f"model.{self.norm_name}.{name}"] = p
            if self.embed_tokens is None or self.lm_head.weight is not self.embed_tokens.weight:
                out["lm_head.weight"] = self.lm_head.weight
        return out


def _materialise(module: nn.Module, *, owner: nn.Module, seed: int, index: int) -> None:
    """Allocate ``module`` on CPU and initialise it as the model does, from its own seed."""
    module.to_empty(device="cpu")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * _SEED_STRIDE + index)
        with torch.no_grad():
            module.apply(owner._init_weights)  # children first, as transformers' smart_apply


def _skeleton(model: HuggingFaceModel) -> tuple[nn.Module, Any, HFLayout]:
    from transformers import AutoModelForCausalLM

    config = hf_config(model)
    layout = model.layout
    with torch.device("meta"):
        causal_lm = AutoModelForCausalLM.from_config(config)
    return causal_lm, config, layout


def init_hf_model(causal_lm: nn.Module, *, layout: HFLayout, owned: set[int], seed: int) -> None:
    """Materialise and initialise the layers ``owned`` of a (meta) model, each from its seed;
    the tied LM head starts from exactly the embedding's draw."""
    base = _base(causal_lm)
    n = layout.layer_count
    if 0 in owned:
        _materialise(base.embed_tokens, owner=causal_lm, seed=seed, index=0)
    decoder = [i for i in owned if 0 < i < n - 1]
    for i in decoder:
        _materialise(base.layers[i - 1], owner=causal_lm, seed=seed, index=i)
    if decoder and getattr(base, "rotary_emb", None) is not None:
        _materialise(base.rotary_emb, owner=causal_lm, seed=seed, index=0)
    if n - 1 in owned:
        _materialise(_final_norm(base), owner=causal_lm, seed=seed, index=n - 1)
        head: nn.Module = causal_lm.lm_head
        if layout.tied and 0 in owned:
            head.weight = base.embed_tokens.weight
        elif layout.tied:
            # Across processes: a copy of the embedding's initial weights (same seed, same
            # init), kept equal by the executor's tied-gradient exchange.
            emb = nn.Embedding(layout.vocab_size, layout.hidden, device="meta",
                               padding_idx=base.embed_tokens.padding_idx)
            _materialise(emb, owner=causal_lm, seed=seed, index=0)
            head.weight = emb.weight
        else:
            _materialise(head, owner=causal_lm, seed=seed, index=n - 1)


def build_hf_stages(model: HuggingFaceModel, *, stages: Sequence[tuple[int, int]],
                    seed: int) -> list[HFStage]:
    """This process's stages (``[lo, hi)`` ranges): only their layers are materialised, then
    overwritten with the local weights when the spec names them (only these layers' tensors
    are read)."""
    if not stages:
        return []  # an idle rank (the plan gives it no stage): nothing to build or read
    causal_lm, config, layout = _skeleton(model)
    n = layout.layer_count
    owned = {i for lo, hi in stages for i in range(lo, hi)}
    if not owned or max(owned) >= n:
        raise WorkerError(f"stages {list(stages)} outside the model's {n} layers")
    init_hf_model(causal_lm, layout=layout, owned=owned, seed=seed)
    built = [HFStage(causal_lm, config=config, lo=lo, hi=hi, n_layers=n) for lo, hi in stages]
    if model.huggingface.weights is not None:
        wanted: dict[str, nn.Parameter] = {}
        for stage in built:
            wanted.update(stage.global_parameters())
        load_stage_weights(wanted, directory=model.huggingface.weights)
    return built


def build_hf_model(model: HuggingFaceModel, *, seed: int) -> nn.Module:
    """The whole ``AutoModelForCausalLM``, initialised as the stages are: the single-process
    reference of the parity tests and what ``adaptis export`` fills."""
    causal_lm, _config, layout = _skeleton(model)
    init_hf_model(causal_lm, layout=layout, owned=set(range(layout.layer_count)), seed=seed)
    return causal_lm
