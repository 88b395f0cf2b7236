"""The planning problem: the input contract of ``adaptis plan`` (reference: docs/problem.md).

A problem is a model (layers in pipeline order, each with profiled F/B/W times and bytes), a
number of microbatches, a set of devices (identical, or a heterogeneous list) and the network
between them. These models only parse and check; costs are derived in ``adaptis.planner``.

Extend this contract with new optional keys only; never break it. The field descriptions
below are the user-facing reference: ``adaptis docs`` renders them into docs/problem.md.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, NewType

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    model_validator,
)

from adaptis.api.errors import SpecError, from_validation_error, read_document

__all__ = [
    "DeviceId",
    "DeviceSpec",
    "Devices",
    "DeviceList",
    "IdenticalDevices",
    "Layer",
    "Link",
    "Network",
    "Problem",
    "RepeatBlock",
    "TIME_UNIT_SECONDS",
    "TimeUnit",
    "load_problem",
    "parse_problem",
]

DeviceId = NewType("DeviceId", int)

#: The units a problem's times, and so its plan's, may be written in.
TimeUnit = Literal["s", "ms", "us"]
#: Seconds in one unit of each supported ``time_unit``.
TIME_UNIT_SECONDS: dict[str, float] = {"s": 1.0, "ms": 1e-3, "us": 1e-6}

NonNeg = Annotated[float, Field(ge=0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Layer(_Strict):
    """One layer's profile: times on a device of speed 1, bytes per microbatch or in total."""

    name: str = Field(description="Layer name; a repeat block suffixes it with the repeat index.")
    kind: str | None = Field(
        default=None,
        description="Free-form kind; `embedding` and `head` are placed specially by the baselines.",
    )
    forward: float = Field(gt=0, description="F: forward time of one microbatch, in time_unit.")
    backward: NonNeg = Field(
        default=0.0, description="B: input-gradient time of one microbatch, in time_unit."
    )
    weight: NonNeg = Field(
        default=0.0, description="W: weight-gradient time of one microbatch, in time_unit."
    )
    backward_fused: NonNeg | None = Field(
        default=None,
        description="Time of the fused backward (B and W in one pass, a BW action), in "
        "time_unit; default "
        "backward + weight. torch's split passes cost more than its fused one, so a profile "
        "gives both. Optional extension of the contract.",
    )
    weight_groups: int | None = Field(
        default=None, ge=0,
        description="Parameter groups torch's split weight pass makes for this layer: one "
        "autograd call each, and each call walks the autograd graph of every layer before it in "
        "the stage (see graph_walk). Optional extension of the contract, default 0.",
    )
    graph_walk: NonNeg | None = Field(
        default=None,
        description="Time one such walk spends in this layer's autograd graph, in time_unit. "
        "A split W of a "
        "stage costs its layers' weight plus, for each layer, weight_groups times the graph_walk "
        "of the layers before it in the stage: quadratic in the stage's depth. `adaptis profile` "
        "counts and measures both. Optional extension of the contract, default 0.",
    )
    activation_bytes: NonNeg = Field(
        default=0.0, description="Bytes held per microbatch from its F until its W (or fused B)."
    )
    param_bytes: NonNeg = Field(
        default=0.0, description="Weights, gradients and optimizer state, held all iteration."
    )
    output_bytes: NonNeg = Field(
        default=0.0, description="Activation sent to the next layer (its gradient comes back)."
    )
    gradient_bytes: NonNeg | None = Field(
        default=None,
        description="Bytes of the layer's weight gradient, what data-parallel replicas all-reduce "
        "each step; default param_bytes / 4 (fp32 AdamW holds weights, gradients and two "
        "moments of one size each). Optional extension of the contract.",
    )
    optimizer: NonNeg | None = Field(
        default=None,
        description="Time of the optimizer step over the layer's parameters, in time_unit, on a "
        "device of speed 1; runs once a step after the gradients are reduced. Optional extension "
        "of the contract, default 0.",
    )
    tensor_split: float | None = Field(
        default=None, ge=0, le=1,
        description="Under tensor_parallel T > 1: the share of the layer's times, parameter and "
        "activation bytes split over the T ranks of a device (each holds and computes 1/T of "
        "it); the rest stays whole on each. Default 1; 0 for a layer kept whole (the zoo's "
        "Mamba blocks). Optional extension of the contract.",
    )
    tensor_all_reduces: int | None = Field(
        default=None, ge=0,
        description="Under tensor_parallel T > 1: all-reduces of output_bytes over network."
        "tensor in the layer's forward, and as many in its input-gradient pass (an attention "
        "block with its MLP: 2, an MLP or embedding: 1, a layer kept whole or the head with its "
        "vocabulary-parallel loss: 0). Default 2. Optional extension of the contract.",
    )

    @property
    def grad_bytes(self) -> float:
        """gradient_bytes, or its default: a quarter of param_bytes."""
        return self.param_bytes / 4 if self.gradient_bytes is None else self.gradient_bytes


class RepeatBlock(_Strict):
    """``repeat: n`` copies of ``layers`` in place; names get the copy index as a suffix."""

    repeat: int = Field(ge=1, description="How many times the block repeats (at least 1).")
    layers: list[LayerEntry] = Field(
        min_length=1, description="The layers (or nested repeat blocks) to copy, in order."
    )


def _layer_tag(value: Any) -> str:
    if isinstance(value, Mapping):
        return "repeat-block" if "repeat" in value else "layer-entry"
    return "repeat-block" if isinstance(value, RepeatBlock) else "layer-entry"


LayerEntry = Annotated[
    Annotated[Layer, Tag("layer-entry")] | Annotated[RepeatBlock, Tag("repeat-block")],
    Discriminator(_layer_tag),
]
RepeatBlock.model_rebuild()


class IdenticalDevices(_Strict):
    """``count`` identical devices, ``per_node`` of them in each node."""

    count: int = Field(ge=1, description="Number of devices.")
    per_node: int = Field(
        default=8, ge=1, description="Devices per node; device i sits on node i // per_node."
    )
    memory_bytes: float | None = Field(
        default=None, gt=0, description="Memory of each device in bytes; null: unbounded."
    )
    speed: float = Field(
        default=1.0, gt=0, description="Relative speed: a layer takes its time / speed."
    )


class DeviceSpec(_Strict):
    """One device of a heterogeneous cluster."""

    name: str | None = Field(
        default=None, description="Device name; default device0, device1, ... by index."
    )
    node: str = Field(description="Devices with the same node share the intra-node link.")
    speed: float = Field(
        default=1.0, gt=0, description="Relative speed: a layer takes its time / speed."
    )
    memory_bytes: float | None = Field(
        default=None, gt=0, description="Memory of the device in bytes; null: unbounded."
    )


class DeviceList(_Strict):
    """A heterogeneous cluster: every device listed with its node, speed and memory."""

    list: Annotated[
        list[DeviceSpec], Field(min_length=1, description="The devices, in device-index order.")
    ]


def _devices_tag(value: Any) -> str:
    if isinstance(value, Mapping):
        return "device-list" if "list" in value else "identical-devices"
    return "device-list" if isinstance(value, DeviceList) else "identical-devices"


Devices = Annotated[
    Annotated[IdenticalDevices, Tag("identical-devices")] | Annotated[DeviceList, Tag("device-list")],
    Discriminator(_devices_tag),
]


class Link(_Strict):
    """One kind of link: a transfer of n bytes costs latency_s + n / bandwidth_bytes_per_s."""

    bandwidth_bytes_per_s: float = Field(gt=0, description="Bandwidth in bytes per second.")
    latency_s: NonNeg = Field(default=0.0, description="Latency of one transfer in seconds.")


class Network(_Strict):
    """Links between devices. A missing link is free (zero cost)."""

    intra_node: Link | None = Field(
        default=None, description="Between devices of the same node; null: free."
    )
    inter_node: Link | None = Field(
        default=None, description="Between devices of different nodes; null: free."
    )
    data_parallel: Link | None = Field(
        default=None,
        description="Between a stage's data-parallel replicas, for the gradient all-reduce; "
        "default: inter_node (replicas sit on other nodes: the mesh puts the pipeline "
        "innermost). Optional extension of the contract.",
    )

    tensor: Link | None = Field(
        default=None,
        description="Between the tensor_parallel ranks of one device (a tensor group inside a "
        "pod), for the layers' all-reduces; default: intra_node. Optional extension of the "
        "contract.",
    )

    @property
    def tensor_link(self) -> Link | None:
        """The link the tensor-parallel all-reduces run over: tensor, else intra_node."""
        return self.intra_node if self.tensor is None else self.tensor

    @property
    def replica_link(self) -> Link | None:
        """The link the gradient all-reduce runs over: data_parallel, else inter_node."""
        return self.inter_node if self.data_parallel is None else self.data_parallel


class Problem(_Strict):
    """A planning problem, parsed and checked. Use :meth:`expanded_layers` for the flat model."""

    name: str | None = Field(default=None, description="Optional name, echoed in the output.")
    time_unit: TimeUnit = Field(
        default="ms", description="Unit of every layer time, and of the planner's output times."
    )
    microbatches: int = Field(ge=1, description="Microbatches per iteration.")
    layers: list[LayerEntry] = Field(
        min_length=1,
        description="The model in pipeline order: layers and repeat blocks (expanded in place).",
    )
    devices: Devices = Field(
        description="Identical devices (count, per_node, ...) or a heterogeneous list."
    )
    network: Network = Field(
        default=Network(), description="Links between devices; default: free communication."
    )
    data_parallel: int = Field(
        default=1, ge=1,
        description="Data-parallel replicas of the pipeline: the devices are one replica's, and "
        "each stage all-reduces its gradients with its replicas over network.data_parallel "
        "after its last weight-gradient action. Optional extension of the contract, default 1.",
    )
    objective: Literal["auto", "iteration", "step"] = Field(
        default="auto",
        description="What the joint search minimises: `iteration` (the pipeline), `step` (the "
        "pipeline, then the part of the replicas' gradient all-reduce it does not hide, then the "
        "optimizer), or `auto`: the step where data_parallel > 1, else the iteration. Optional "
        "extension of the contract, default auto.",
    )
    tensor_parallel: int = Field(
        default=1, ge=1, le=64,
        description="Tensor-parallel degree T: each device of the plan is a group of T GPUs "
        "sharing every layer (memory_bytes is one GPU's). A layer's times and bytes are given "
        "whole (degree 1); the planner charges 1/T of its tensor_split share plus its "
        "tensor_all_reduces over network.tensor. Optional extension of the contract, default 1.",
    )
    sequence_parallel: bool = Field(
        default=False,
        description="Under tensor_parallel T > 1: the activations between layers and stages are "
        "sharded on the sequence over the T ranks (Megatron-LM's sequence parallelism), so each "
        "rank sends and receives 1/T of every layer's output_bytes between stages. Optional "
        "extension of the contract, default false.",
    )
    action_overhead_s: NonNeg = Field(
        default=0.0,
        description="Fixed runtime cost of every F/B/W action in seconds (launches, bookkeeping); "
        "`adaptis profile` measures it. Optional extension of the contract, default 0.",
    )

    @property
    def scores_step(self) -> bool:
        """Whether the search minimises the step (``objective``; ``auto``: with replicas)."""
        return self.objective == "step" or (self.objective == "auto" and self.data_parallel > 1)

    @model_validator(mode="after")
    def _check_counts(self) -> Problem:
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise ValueError("sequence_parallel needs tensor_parallel > 1 (it shards the sequence "
                             "over a device's tensor ranks): set tensor_parallel or remove it")
        n_layers = sum(1 for _ in _expand(self.layers))
        if n_layers > 100_000:
            raise ValueError(f"layers expand to {n_layers} layers; at most 100000 are supported")
        return self

    # --- derived views (cheap, recomputed on demand) ---------------------------------------
    def expanded_layers(self) -> list[Layer]:
        """The model in pipeline order, repeat blocks expanded, names suffixed ``_<index>``."""
        return list(_expand(self.layers))

    def device_specs(self) -> list[DeviceSpec]:
        """Every device as a :class:`DeviceSpec` (the identical form expanded)."""
        d = self.devices
        if isinstance(d, DeviceList):
            return [
                spec if spec.name else spec.model_copy(update={"name": f"device{i}"})
                for i, spec in enumerate(d.list)
            ]
        return [
            DeviceSpec(
                name=f"device{i}",
                node=f"node{i // d.per_node}",
                speed=d.speed,
                memory_bytes=d.memory_bytes,
            )
            for i in range(d.count)
        ]

    @property
    def device_count(self) -> int:
        d = self.devices
        return len(d.list) if isinstance(d, DeviceList) else d.count


def _expand(entries: list[Layer | RepeatBlock], suffix: str = "") -> Iterator[Layer]:
    for entry in entries:
        if isinstance(entry, RepeatBlock):
            for i in range(entry.repeat):
                yield from _expand(entry.layers, f"{suffix}_{i}")
        elif suffix:
            yield entry.model_copy(update={"name": f"{entry.name}{suffix}"})
        else:
            yield entry


def parse_problem(data: Any) -> Problem:
    """Validate a loaded document; raise :class:`SpecError` naming every bad key."""
    if not isinstance(data, Mapping):
        raise SpecError(f"problem: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return Problem.model_validate(data)
    except ValidationError as err:
        raise from_validation_error(err, what="problem") from None


def load_problem(path: str | Path) -> Problem:
    """Read a YAML or JSON problem file."""
    return parse_problem(read_document(path, what="problem"))
