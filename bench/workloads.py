"""The AdaPtis paper's workloads as planning problems.

Costs are the paper's ratios to the base layer's forward time at 4K sequence (base = 1 ms,
about what a 1.5K-hidden layer takes on an H100-class GPU at 4K tokens). Other sequence lengths
scale each kind by a per-token FLOP model relative to the base layer, so ratios shift the way
the paper's sweep shows (attention grows with s, the head and Mamba stay linear):

    attention-bearing layer (dense, MoE, attention): 24 h^2 + 4 s h      per token
    Mamba layer:                                      24 h^2              per token
    head:                                             2 h V               per token

Bytes (16-bit training, microbatch of one sequence, flash attention so no s^2 term):
activations 34 s h per layer (x1.5 for MoE, the router keeps more), head logits 2 s V;
parameters x 18 bytes (weights, grads, Adam, fp32 master); transfers s h x 2 bytes.
Devices: 80 GB, 8 per node, NVLink-class intra-node (400 GB/s, 5 us) and 200 Gb/s InfiniBand
between nodes (25 GB/s, 20 us). Microbatches: 8 per device.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

#: Where bench/gpu_check.sh's measured profiles are committed.
PROFILES = Path(__file__).resolve().parent / "profiles"

FAMILIES = ("gemma", "deepseek", "nemotron-h")
SIZES = ("S", "M", "L")


@dataclass(frozen=True)
class Family:
    hidden: int
    layers: dict[str, int]
    vocab: dict[str, int]
    devices: dict[str, int]
    base: tuple[float, float, float]
    kinds: dict[str, tuple[float, float, float]]
    head: dict[int, tuple[float, float, float]]


K = 1024
SPECS = {
    "gemma": Family(
        hidden=1536,
        layers={"S": 32, "M": 64, "L": 128},
        vocab={"S": 256 * K, "M": 512 * K, "L": 1024 * K},
        devices={"S": 4, "M": 8, "L": 16},
        base=(1.0, 1.65, 0.22),
        kinds={"dense": (1.0, 1.65, 0.22)},
        head={256 * K: (5.72, 1.21, 0.58), 512 * K: (10.37, 2.85, 1.15), 1024 * K: (19.22, 5.93, 2.29)},
    ),
    "deepseek": Family(
        hidden=2048,
        layers={"S": 16, "M": 32, "L": 64},
        vocab={"S": 128 * K, "M": 256 * K, "L": 512 * K},
        devices={"S": 4, "M": 8, "L": 8},
        base=(1.0, 2.05, 0.2),
        kinds={"dense": (1.0, 2.05, 0.2), "moe": (2.28, 3.49, 0.16)},
        head={128 * K: (6.26, 1.98, 0.82), 256 * K: (11.2, 3.73, 1.59), 512 * K: (21.57, 7.82, 3.23)},
    ),
    "nemotron-h": Family(
        hidden=1024,
        layers={"S": 28, "M": 56, "L": 112},
        vocab={"S": 128 * K, "M": 256 * K, "L": 512 * K},
        devices={"S": 4, "M": 8, "L": 16},
        base=(1.0, 2.79, 0.02),
        kinds={"mamba": (1.0, 2.79, 0.02), "attention": (3.12, 4.96, 0.52)},
        head={128 * K: (13.99, 2.13, 0.86), 256 * K: (23.94, 5.24, 1.71), 512 * K: (39.97, 10.33, 3.18)},
    ),
}
ATTENTION_EVERY = {"S": 3, "M": 6, "L": 12}
REF_SEQ = 4096


def _flops(kind: str, *, h: int, s: int, vocab: int) -> float:
    if kind == "head":
        return 2.0 * h * vocab
    if kind == "mamba":
        return 24.0 * h * h
    return 24.0 * h * h + 4.0 * s * h


def _scaled(cost: tuple[float, float, float], *, kind: str, base_kind: str, fam: Family,
            seq: int, vocab: int) -> tuple[float, float, float]:
    h = fam.hidden
    now = _flops(kind, h=h, s=seq, vocab=vocab) / _flops(base_kind, h=h, s=seq, vocab=vocab)
    ref = _flops(kind, h=h, s=REF_SEQ, vocab=vocab) / _flops(base_kind, h=h, s=REF_SEQ, vocab=vocab)
    f = now / ref
    return (cost[0] * f, cost[1] * f, cost[2] * f)


def _params(kind: str, h: int, vocab: int) -> float:
    per = {"dense": 12 * h * h, "attention": 12 * h * h, "mamba": 6 * h * h, "moe": 48 * h * h}
    n = vocab * h if kind in ("head", "embedding") else per[kind]
    return 18.0 * n


def _kinds(family: str, size: str, n_layers: int, devices: int) -> list[str]:
    if family == "gemma":
        return ["dense"] * n_layers
    if family == "deepseek":
        dense = max(0, n_layers // devices - 1)  # "the first L/PP - 1 dense, the rest MoE"
        return ["dense"] * dense + ["moe"] * (n_layers - dense)
    every = ATTENTION_EVERY[size]
    return ["attention" if (i + 1) % every == 0 else "mamba" for i in range(n_layers)]


def problem(family: str, size: str, *, seq: int = 4096, devices: int | None = None,
            microbatches_per_device: int = 8, blocks: int | None = None) -> dict[str, Any]:
    """A planning problem document (the contract's YAML shape) for one configuration;
    ``blocks``: the layers between embedding and head (default the size's)."""
    fam = SPECS[family]
    p = devices or fam.devices[size]
    vocab = fam.vocab[size]
    h = fam.hidden
    base_kind = "mamba" if family == "nemotron-h" else "dense"
    act = 34.0 * seq * h
    out = 2.0 * seq * h
    layers: list[dict[str, Any]] = [{
        "name": "embedding", "kind": "embedding", "forward": 0.02, "backward": 0.0, "weight": 0.02,
        "activation_bytes": out, "param_bytes": _params("embedding", h, vocab), "output_bytes": out,
    }]
    for i, kind in enumerate(_kinds(family, size, blocks or fam.layers[size], p)):
        f, b, w = _scaled(fam.kinds[kind], kind=kind, base_kind=base_kind, fam=fam, seq=seq, vocab=vocab)
        layers.append({
            "name": f"{kind}_{i}", "kind": kind, "forward": round(f, 4), "backward": round(b, 4),
            "weight": round(w, 4), "activation_bytes": act * (1.5 if kind == "moe" else 1.0),
            "param_bytes": _params(kind, h, vocab), "output_bytes": out,
        })
    f, b, w = _scaled(fam.head[vocab], kind="head", base_kind=base_kind, fam=fam, seq=seq, vocab=vocab)
    layers.append({
        "name": "head", "kind": "head", "forward": round(f, 4), "backward": round(b, 4),
        "weight": round(w, 4), "activation_bytes": 2.0 * seq * vocab + act,
        "param_bytes": _params("head", h, vocab), "output_bytes": 0.0,
    })
    return {
        "name": f"{family}-{size}-{p}dev-{seq // K}k",
        "time_unit": "ms",
        "microbatches": microbatches_per_device * p,
        "layers": layers,
        "devices": {"count": p, "per_node": 8, "memory_bytes": 8.0e10},
        "network": {
            "intra_node": {"bandwidth_bytes_per_s": 4.0e11, "latency_s": 5.0e-6},
            "inter_node": {"bandwidth_bytes_per_s": 2.5e10, "latency_s": 2.0e-5},
        },
    }


def end_to_end() -> list[dict[str, Any]]:
    """The 18 end-to-end configurations: 3 families x 3 sizes x sequence 2K and 4K."""
    return [problem(f, s, seq=seq) for f in FAMILIES for s in SIZES for seq in (2048, 4096)]


def sequence_sweep() -> list[dict[str, Any]]:
    return [problem("nemotron-h", "S", seq=seq) for seq in (1024, 2048, 4096, 8192, 16384, 32768)]


def scaling_series() -> list[dict[str, Any]]:
    return [problem("gemma", "L", devices=p) for p in (4, 8, 16, 32)]


def planner_scale(devices: int, microbatches: int) -> dict[str, Any]:
    """Issue 13's scale workload: Nemotron-H L's layers and head, 6 blocks a device, 80 GB."""
    doc = problem("nemotron-h", "L", devices=devices, blocks=6 * devices,
                  microbatches_per_device=max(1, microbatches // devices))
    return {**doc, "name": f"nemotron-h-scale-{devices}x{microbatches}", "microbatches": microbatches}


def memory_scale(devices: int, microbatches: int) -> dict[str, Any]:
    """Issue 32's memory-bound scale workload: Nemotron-H M at 8K sequence, 6 blocks a device,
    80 GB; every seed is over memory from 32 devices on (1F1B's device 0: 116 GB at 64)."""
    doc = problem("nemotron-h", "M", seq=8192, devices=devices, blocks=6 * devices,
                  microbatches_per_device=max(1, microbatches // devices))
    return {**doc, "name": f"nemotron-h-memory-{devices}x{microbatches}", "microbatches": microbatches}


def measured(directory: Path = PROFILES) -> list[dict[str, Any]]:
    """The measured profiles (``<family>.yaml``, written by bench/gpu_check.sh), named after
    their file; none when the directory is missing or empty."""
    docs = []
    for path in sorted(directory.glob("*.yaml")) if directory.is_dir() else []:
        doc = yaml.safe_load(path.read_text())
        docs.append({**doc, "name": f"{path.stem} (measured)"})
    return docs
