"""A Hugging Face transformers model as the job's model: the spec and what its config says.

Sits in the api layer beside :mod:`adaptis.api.job`, whose ``ModelSpec.huggingface`` holds a
:class:`HuggingFaceSpec`. Pure Python (no torch, no transformers): the operator, the planner and
the rules read a model's layout from its ``config.json`` alone, with :func:`hf_layout`. The
worker builds the real modules from the same config (:mod:`adaptis.worker.models.hf.stages`).

The pipeline's layer list of such a model is the zoo's: ``embedding``, each decoder layer in order
(named ``<kind>_<i>`` with kind ``attention``, ``moe`` or ``mamba``), then ``head`` (final norm, LM
head and the loss): ``num_hidden_layers + 2`` layers. Only the standard decoder-only layout is
supported (``model.embed_tokens``, ``model.layers``, a final norm, ``lm_head``), for the
``model_type`` values of :data:`SUPPORTED_MODEL_TYPES`; anything else is refused with an error
naming ``model_type``. Nothing is ever downloaded: the config is inline, a local file, or a
ConfigMap in the job's namespace (``configMap``), which the operator reads to plan
(:mod:`adaptis.operator.resources.hf_config`, through :func:`with_resolved_config`) and the worker
pods mount at :data:`CONFIG_MAP_MOUNT`, where :func:`resolve_config` reads it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from adaptis.api.errors import SpecError

__all__ = ["CONFIG_MAP_FILE", "CONFIG_MAP_MOUNT", "FIELD", "SUPPORTED_MODEL_TYPES",
           "ConfigMapRef", "HFLayout", "HuggingFaceSpec", "hf_layout", "parse_config_text",
           "resolve_config", "with_resolved_config", "worker_spec"]

FIELD = "spec.model.huggingface"
#: Where a worker pod finds ``configMap``'s config: the operator mounts the ConfigMap's key
#: there, read-only, under the name :data:`CONFIG_MAP_FILE`.
CONFIG_MAP_MOUNT = "/etc/adaptis/huggingface"
CONFIG_MAP_FILE = "config.json"

# model_type -> (family of layer kinds, tie_word_embeddings when the config omits it: the
# default of the transformers config class).
_FAMILIES: dict[str, tuple[str, bool]] = {
    "llama": ("dense", False),
    "mistral": ("dense", False),
    "qwen2": ("dense", False),
    "qwen3": ("dense", False),
    "gemma": ("dense", True),
    "mixtral": ("mixtral", False),
    "qwen2_moe": ("qwen_moe", False),
    "qwen3_moe": ("qwen_moe", False),
    "bamba": ("bamba", False),
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(_FAMILIES))


class ConfigMapRef(BaseModel):
    """A key of a ConfigMap in the job's namespace that holds a config.json."""

    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel,
                              populate_by_name=True)

    name: str = Field(
        min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="The ConfigMap, in the job's namespace.")
    key: str = Field(
        default=CONFIG_MAP_FILE, min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$",
        description="Its key holding the config.json.")


class HuggingFaceSpec(BaseModel):
    """A transformers decoder model: its config.json (inline, a local file or a ConfigMap) and
    optionally local safetensors weights. Never a download."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True,
        json_schema_extra={
            "x-kubernetes-validations": [
                {"rule": "(has(self.config) ? 1 : 0) + (has(self.path) ? 1 : 0) + "
                         "(has(self.configMap) ? 1 : 0) == 1",
                 "message": "give exactly one of config (config.json inline), path and "
                            "configMap"}
            ]
        },
    )

    config: dict[str, Any] | None = Field(
        default=None, description="The model's config.json, inline (model_type, hidden_size, "
        "num_hidden_layers, ...): what the operator plans from.")
    path: str | None = Field(
        default=None, min_length=1, max_length=4096,
        description="A config.json, or a directory holding one, on the machine that reads the "
        "job (adaptis run, adaptis plan). The operator cannot read a pod's volume: use config.")
    config_map: ConfigMapRef | None = Field(
        default=None,
        description="A ConfigMap in the job's namespace holding the config.json (name, key: "
        "default config.json): the operator reads it to plan, the worker pods mount it. A "
        "missing ConfigMap or key keeps the job Pending until it appears.")
    weights: str | None = Field(
        default=None, min_length=1, max_length=4096,
        description="A directory of *.safetensors (as save_pretrained writes) inside the pod; "
        "each rank reads only its layers. Absent: seeded initialisation.")

    @model_validator(mode="after")
    def _one_config(self) -> HuggingFaceSpec:
        given = [self.config is not None, self.path is not None, self.config_map is not None]
        if sum(given) != 1:
            raise ValueError("model.huggingface: give exactly one of config (config.json "
                             "inline), path (a local config.json) and configMap (a ConfigMap "
                             "in the job's namespace)")
        return self


@dataclass(frozen=True, slots=True)
class HFLayout:
    """What the planner and the worker need to know of a model, read from its config."""

    model_type: str
    vocab_size: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    kinds: tuple[str, ...]  # one per decoder layer: attention, moe or mamba
    tied: bool
    experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0
    shared_expert_intermediate: int = 0
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_state: int = 0
    mamba_groups: int = 1

    @property
    def layer_count(self) -> int:
        """Pipeline layers: embedding, each decoder layer, head."""
        return len(self.kinds) + 2

    @property
    def layer_names(self) -> list[str]:
        return ["embedding", *(f"{k}_{i}" for i, k in enumerate(self.kinds)), "head"]


_YAML_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def _floats(value: Any) -> Any:
    """YAML 1.1 (PyYAML, the API server's manifests) reads ``1e-6`` as a string: the config
    means the number, as config.json's JSON does."""
    if isinstance(value, str) and _YAML_FLOAT.match(value):
        return float(value)
    if isinstance(value, dict):
        return {k: _floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_floats(v) for v in value]
    return value


def with_resolved_config(spec: HuggingFaceSpec, config: dict[str, Any]) -> HuggingFaceSpec:
    """``spec`` (a ``configMap`` one) carrying the ConfigMap's content as ``config`` too: the
    operator's copy to validate and plan with, and whose hash changes with the content. Made
    without validation (a user may not give both); never written to a worker, which reads the
    mounted ConfigMap (:func:`worker_spec`)."""
    return spec.model_copy(update={"config": config})


def worker_spec(spec: HuggingFaceSpec) -> HuggingFaceSpec:
    """What a worker is given: a ``configMap`` spec without the operator's resolved copy."""
    if spec.config_map is None or spec.config is None:
        return spec
    return spec.model_copy(update={"config": None})


def parse_config_text(text: str, *, field: str, source: str) -> dict[str, Any]:
    """A config.json's text as a dict; a :class:`SpecError` naming ``field`` otherwise."""
    # ValueError: not JSON, or an integer past Python's 4300 digits; RecursionError: nested
    # deeper than the parser goes. Either is the text's fault, never the reader's crash.
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as err:
        what = "nested too deeply" if isinstance(err, RecursionError) else f"not JSON: {err}"
        raise SpecError(f"{field}: {source} is {what}", fields=[field]) from None
    if not isinstance(data, dict):
        raise SpecError(f"{field}: {source} must hold a JSON object (a config.json), not "
                        f"{type(data).__name__}", fields=[field])
    return data


def resolve_config(spec: HuggingFaceSpec) -> dict[str, Any]:
    """The config.json as a dict: the inline one (or the operator's resolved copy of the
    ConfigMap), read from ``path`` (a file or a directory holding config.json), or, for
    ``configMap``, from where a worker pod mounts it (:data:`CONFIG_MAP_MOUNT`)."""
    if spec.config is not None:
        return _floats(dict(spec.config))  # type: ignore[no-any-return]
    if spec.config_map is not None:
        p = Path(CONFIG_MAP_MOUNT) / CONFIG_MAP_FILE
        field = f"{FIELD}.configMap"
        hint = (f"the ConfigMap {spec.config_map.name!r} is read in the cluster: the operator "
                f"plans from it and mounts it into the worker pods at {p}; outside a cluster "
                "(adaptis run, adaptis plan) give config or path")
    else:
        assert spec.path is not None  # the model validator guarantees one of the three
        p = Path(spec.path)
        if p.is_dir():
            p = p / "config.json"
        field = f"{FIELD}.path"
        hint = "give a local config.json (nothing is downloaded) or the config inline"
    try:
        text = p.read_text()
    except OSError as err:
        raise SpecError(f"{field}: cannot read {p}: {err.strerror}; {hint}",
                        fields=[field]) from None
    return parse_config_text(text, field=field, source=str(p))


def _int(config: dict[str, Any], key: str, *, default: int | None = None) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(f"{FIELD}.config.{key}: must be a positive integer (got {value!r})",
                        fields=[f"{FIELD}.config.{key}"])
    return value


def _kinds(config: dict[str, Any], *, family: str, layers: int) -> tuple[str, ...]:
    if family == "dense":
        return ("attention",) * layers
    if family == "mixtral":
        return ("moe",) * layers
    if family == "qwen_moe":
        # As Qwen2MoeDecoderLayer / Qwen3MoeDecoderLayer decide: sparse unless listed in
        # mlp_only_layers, on every decoder_sparse_step-th layer, when there are experts.
        dense_only = set(config.get("mlp_only_layers") or [])
        step = int(config.get("decoder_sparse_step", 1) or 1)
        experts = int(config.get("num_experts", 0) or 0)
        return tuple("moe" if i not in dense_only and experts > 0 and (i + 1) % step == 0
                     else "attention" for i in range(layers))
    # bamba: attention at attn_layer_indices, Mamba-2 elsewhere (BambaConfig.layers_block_type).
    attn = set(config.get("attn_layer_indices") or [])
    return tuple("attention" if i in attn else "mamba" for i in range(layers))


def hf_layout(spec: HuggingFaceSpec) -> HFLayout:
    """The layout of the model ``spec`` names; a :class:`SpecError` naming the field when the
    config is not one of the supported decoder families."""
    config = resolve_config(spec)
    model_type = config.get("model_type")
    if model_type not in _FAMILIES:
        raise SpecError(
            f"{FIELD}.config.model_type: {model_type!r} is not supported; supported decoder "
            f"families: {', '.join(SUPPORTED_MODEL_TYPES)}", fields=[f"{FIELD}.config.model_type"])
    family, tied_default = _FAMILIES[model_type]
    hidden = _int(config, "hidden_size")
    heads = _int(config, "num_attention_heads")
    layers = _int(config, "num_hidden_layers")
    kinds = _kinds(config, family=family, layers=layers)
    extra: dict[str, int] = {}
    if family == "mixtral":
        extra = {"experts": _int(config, "num_local_experts"),
                 "top_k": _int(config, "num_experts_per_tok"),
                 "expert_intermediate": _int(config, "intermediate_size")}
    elif family == "qwen_moe" and "moe" in kinds:
        extra = {"experts": _int(config, "num_experts"),
                 "top_k": _int(config, "num_experts_per_tok"),
                 "expert_intermediate": _int(config, "moe_intermediate_size"),
                 "shared_expert_intermediate": int(config.get("shared_expert_intermediate_size")
                                                   or 0)}
    elif family == "bamba":
        extra = {"mamba_heads": _int(config, "mamba_n_heads", default=128),
                 "mamba_head_dim": _int(config, "mamba_d_head", default=max(1, 2 * hidden // 128)),
                 "mamba_state": _int(config, "mamba_d_state", default=256),
                 "mamba_groups": _int(config, "mamba_n_groups", default=1)}
    return HFLayout(
        model_type=model_type,
        vocab_size=_int(config, "vocab_size"),
        hidden=hidden,
        heads=heads,
        kv_heads=_int(config, "num_key_value_heads", default=heads),
        head_dim=_int(config, "head_dim", default=hidden // heads) if config.get("head_dim") is not None
        else hidden // heads,
        intermediate=_int(config, "intermediate_size"),
        kinds=kinds,
        tied=bool(config.get("tie_word_embeddings", tied_default)),
        **extra,
    )
