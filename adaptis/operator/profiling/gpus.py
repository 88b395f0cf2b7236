"""Known GPUs: what a GPU Feature Discovery product label means for the planner.

Sits under :mod:`adaptis.operator.profiling.nodes`. GFD labels a node with the product name
(``nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3``), the count, the memory in MiB and the
architecture family; the planner needs speed, memory and the intra-node link. The figures are
the vendors' published peak *dense* BF16 throughput (FP16 where the part has no BF16) and the
per-direction NVLink or PCIe bandwidth; the planner only uses their ratios and orders of
magnitude, and a measured profile (node annotation) overrides them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["GpuModel", "LINK_BANDWIDTH", "lookup_gpu"]

#: Per-direction bandwidth (bytes/s) between GPUs of one node, by link class.
LINK_BANDWIDTH: dict[str, float] = {
    "nvlink5": 900e9,
    "nvlink4": 450e9,
    "nvlink3": 300e9,
    "nvlink2": 150e9,
    "pcie5": 64e9,
    "pcie4": 32e9,
    "pcie3": 16e9,
}


@dataclass(frozen=True, slots=True)
class GpuModel:
    """One GPU part: peak dense BF16 TFLOP/s, memory, and how GPUs in a node are linked."""

    name: str
    bf16_tflops: float
    memory_gib: float
    link: str


# Ordered: the first pattern that matches the upper-cased product label wins, so the specific
# variants (PCIe, NVL, 40GB) come before the generic name of their family.
_KNOWN: tuple[tuple[str, GpuModel], ...] = (
    (r"GB200", GpuModel("GB200", 2500.0, 186.0, "nvlink5")),
    (r"B200", GpuModel("B200", 2250.0, 180.0, "nvlink5")),
    (r"B100", GpuModel("B100", 1750.0, 180.0, "nvlink5")),
    (r"GH200", GpuModel("GH200", 989.0, 96.0, "nvlink4")),
    (r"H200", GpuModel("H200", 989.0, 141.0, "nvlink4")),
    (r"H100.*NVL", GpuModel("H100 NVL", 835.0, 94.0, "nvlink4")),
    (r"H100.*PCIE", GpuModel("H100 PCIe", 756.0, 80.0, "pcie5")),
    (r"H100", GpuModel("H100 SXM", 989.0, 80.0, "nvlink4")),
    (r"H800", GpuModel("H800", 989.0, 80.0, "nvlink4")),
    (r"A100.*PCIE.*40|A100.*40.*PCIE", GpuModel("A100 PCIe 40GB", 312.0, 40.0, "pcie4")),
    (r"A100.*PCIE", GpuModel("A100 PCIe", 312.0, 80.0, "pcie4")),
    (r"A100.*40", GpuModel("A100 40GB", 312.0, 40.0, "nvlink3")),
    (r"A100", GpuModel("A100 80GB", 312.0, 80.0, "nvlink3")),
    (r"A800", GpuModel("A800", 312.0, 80.0, "nvlink3")),
    (r"L40S", GpuModel("L40S", 362.0, 48.0, "pcie4")),
    (r"L40", GpuModel("L40", 181.0, 48.0, "pcie4")),
    (r"L4\b|L4$", GpuModel("L4", 121.0, 24.0, "pcie4")),
    (r"A10G", GpuModel("A10G", 70.0, 24.0, "pcie4")),
    (r"A10\b|A10$", GpuModel("A10", 125.0, 24.0, "pcie4")),
    (r"RTX.*6000.*ADA", GpuModel("RTX 6000 Ada", 364.0, 48.0, "pcie4")),
    (r"4090", GpuModel("RTX 4090", 165.0, 24.0, "pcie4")),
    (r"V100.*32", GpuModel("V100 32GB", 125.0, 32.0, "nvlink2")),
    (r"V100", GpuModel("V100", 125.0, 16.0, "nvlink2")),
    (r"T4\b|T4$", GpuModel("T4", 65.0, 16.0, "pcie3")),
)

# When the product is unknown, the family label still tells the order of magnitude.
_FAMILY: dict[str, GpuModel] = {
    "blackwell": GpuModel("blackwell", 2250.0, 180.0, "nvlink5"),
    "hopper": GpuModel("hopper", 989.0, 80.0, "nvlink4"),
    "ada-lovelace": GpuModel("ada-lovelace", 181.0, 48.0, "pcie4"),
    "ampere": GpuModel("ampere", 125.0, 24.0, "pcie4"),
    "turing": GpuModel("turing", 65.0, 16.0, "pcie3"),
    "volta": GpuModel("volta", 125.0, 16.0, "nvlink2"),
}

_COMPILED = tuple((re.compile(pattern), model) for pattern, model in _KNOWN)


def lookup_gpu(product: str | None, *, family: str | None = None) -> GpuModel | None:
    """The known part a GFD product label names (or its family's typical part); None: unknown."""
    if product:
        key = product.upper().replace("_", "-")
        for pattern, model in _COMPILED:
            if pattern.search(key):
                return model
    if family:
        return _FAMILY.get(family.lower())
    return None
