"""The measured hardware profile of a node: the document ``adaptis profile --hardware`` prints.

Sits in the api layer, read by :mod:`adaptis.operator.profiling.profile_store` (which stores the
document of each profiled node) and :mod:`adaptis.operator.profiling.nodes` (which plans from it).
A stored profile changes the plans of every tenant whose jobs may run on the node, so the
document is held to a strict schema before any figure in it is used: no unknown key at any
level, numbers only where numbers belong (no strings, no booleans, no NaN or infinity), and
each figure within bounds no real device reaches (a B200 is ~2,250 dense BF16 TFLOP/s, an
NVLink 5 domain 1.8 TB/s per GPU), so a forged or garbled document is refused, not planned
from. :func:`parse_measured_hardware` raises :class:`~adaptis.api.errors.SpecError` naming
the field at fault.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from adaptis.api.errors import SpecError, from_validation_error

__all__ = [
    "MAX_BANDWIDTH",
    "MAX_DOCUMENT_CHARS",
    "MAX_MEMORY_BYTES",
    "MAX_TFLOPS",
    "MIN_TFLOPS",
    "MeasuredDevice",
    "MeasuredHardware",
    "MeasuredLink",
    "parse_measured_hardware",
]

#: Per device, dense: ten times the fastest part of the operator's GPU table.
MAX_TFLOPS = 25_000.0
#: A CPU "device" measured in fp32 on one thread is still well above this.
MIN_TFLOPS = 1e-4
#: Device memory; a CPU node reports host memory, hence far above any GPU's.
MAX_MEMORY_BYTES = float(2**46)  # 64 TiB
MIN_MEMORY_BYTES = float(2**20)
#: Bytes/s of one link: ten times NVLink 5's per-GPU figure.
MAX_BANDWIDTH = 2e13
#: The kubelet keeps at most 4 KiB of a termination message, where the document comes from.
MAX_DOCUMENT_CHARS = 4096


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class MeasuredDevice(_Doc):
    """The device block (informational: the planner reads the flat keys)."""

    name: str = Field(min_length=1, max_length=128)
    speed: float = Field(gt=0, le=MAX_TFLOPS / MIN_TFLOPS)
    memory_bytes: float = Field(ge=MIN_MEMORY_BYTES, le=MAX_MEMORY_BYTES)
    matmul_tflops: float = Field(ge=MIN_TFLOPS, le=MAX_TFLOPS)
    precision: str = Field(min_length=1, max_length=32, pattern=r"^[a-z0-9_]+$")
    speed_reference_tflops: float = Field(ge=MIN_TFLOPS, le=MAX_TFLOPS)


class MeasuredLink(_Doc):
    bandwidth_bytes_per_s: float = Field(gt=0, le=MAX_BANDWIDTH)
    latency_s: float = Field(ge=0, le=1.0)


class MeasuredHardware(_Doc):
    """What the operator plans from: ``tflops``, ``memory_bytes``, ``intra_node_bandwidth``."""

    device: MeasuredDevice | None = None
    links: dict[Literal["intra_node", "inter_node"], MeasuredLink] = Field(default_factory=dict)
    tflops: float = Field(ge=MIN_TFLOPS, le=MAX_TFLOPS)
    memory_bytes: float = Field(ge=MIN_MEMORY_BYTES, le=MAX_MEMORY_BYTES)
    intra_node_bandwidth: float | None = Field(default=None, gt=0, le=MAX_BANDWIDTH)
    ranks_per_node: int | None = Field(default=None, ge=1, le=1024)

    def figures(self) -> dict[str, float]:
        """The planner's figures (a missing bandwidth keeps the table's)."""
        out = {"tflops": self.tflops, "memory_bytes": self.memory_bytes}
        if self.intra_node_bandwidth is not None:
            out["intra_node_bandwidth"] = self.intra_node_bandwidth
        return out


def parse_measured_hardware(text: str) -> MeasuredHardware:
    """The document, validated; :class:`SpecError` (one line per field at fault) if not."""
    if len(text) > MAX_DOCUMENT_CHARS:
        raise SpecError(f"hardware profile: {len(text)} characters, more than the "
                        f"{MAX_DOCUMENT_CHARS} a profile can have")
    try:
        return MeasuredHardware.model_validate_json(text)
    except ValidationError as err:
        raise from_validation_error(err, what="hardware profile") from None
