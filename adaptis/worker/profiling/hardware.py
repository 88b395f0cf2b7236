"""The hardware profiler: this device's matmul speed and memory, and the links between ranks.

Sits in the worker layer beside the layer profiler (:mod:`adaptis.worker.profiling.profiler`); the
CLI (``adaptis profile --hardware``) prints its result and the operator reads it from the pod's
termination message, so the document stays small (well under 4 KiB). What it measures:

- **device**: dense matmul throughput in the working precision (bf16 on CUDA, fp32 on CPU with
  the current torch thread count), timed with the device's own clock; the memory size.
  ``speed`` is that throughput relative to :data:`REFERENCE_TFLOPS` (the published peak dense
  BF16 of an H100 SXM, the figure the operator's GPU table uses), so measured and tabled
  devices compare on one scale.
- **links** (only with a process group of 2 or more ranks): send/recv ping-pong between rank 0
  and one peer on the same host (``intra_node``) and one on another host (``inter_node``) over
  several message sizes; one-way time = round trip / 2, fitted as ``latency + bytes /
  bandwidth`` by least squares.

The top level also carries the flat keys ``tflops``, ``memory_bytes`` and ``intra_node_bandwidth``
that the operator plans from, so the printed document is stored as is (in its profile ConfigMaps)
once it passes the strict schema of :mod:`adaptis.api.measured_hardware`: a new key here needs a
field there.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from adaptis.worker.errors import WorkerError

__all__ = [
    "REFERENCE_TFLOPS",
    "configure_host",
    "DeviceProfile",
    "HardwareProfile",
    "LinkProfile",
    "cache_bytes",
    "device_memory_bytes",
    "device_name",
    "fit_link",
    "load_hardware",
    "device_clock",
    "measure_device",
    "measure_hardware",
    "measure_links",
    "measure_matmul_tflops",
    "working_dtype",
]

log = logging.getLogger(__name__)

#: speed 1.0 = this many dense TFLOP/s (H100 SXM peak BF16, as adaptis.operator.profiling.gpus
#: tables it).
REFERENCE_TFLOPS = 989.0

# Message sizes of the ping-pong: small ones pin the latency, large ones the bandwidth.
_LINK_SIZES = (1 << 10, 1 << 14, 1 << 18, 1 << 21, 1 << 23)


# glibc's mallopt parameters: keep freed memory for reuse instead of handing it back.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MALLOPT = ((_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 1 << 30), (_M_TOP_PAD, 64 << 20))


def configure_host(*, threads: int) -> None:
    """Set up this process as a rank (or the profiler) runs: ``threads`` torch threads, and
    host memory kept for reuse. glibc returns freed tensors above a size to the system and
    faults their pages in again on the next allocation; a stage with a 16K-vocabulary head
    then paid 15-30 % more for its backward on CPU than its layers profiled alone, differently
    per stage. Keeping the memory (up to 1 GiB spare) makes profile and run alike and the run
    faster. A no-op where the C library has no ``mallopt``."""
    torch.set_num_threads(max(1, threads))
    if platform.system() != "Linux":
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return  # not glibc (e.g. musl): nothing to tune
    for param, value in _MALLOPT:
        if mallopt(param, value) != 1:
            log.debug("mallopt(%d, %d) refused", param, value)


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    name: str
    speed: float  # matmul_tflops / REFERENCE_TFLOPS
    memory_bytes: float
    matmul_tflops: float
    precision: str


@dataclass(frozen=True, slots=True)
class LinkProfile:
    bandwidth_bytes_per_s: float
    latency_s: float


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    """One rank's view: its device and the links it measured (empty on a single process)."""

    device: DeviceProfile
    links: dict[str, LinkProfile]  # "intra_node" / "inter_node"
    ranks_per_node: int | None = None

    def to_json_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "device": {
                "name": self.device.name,
                "speed": _round(self.device.speed),
                "memory_bytes": float(self.device.memory_bytes),
                "matmul_tflops": _round(self.device.matmul_tflops),
                "precision": self.device.precision,
                "speed_reference_tflops": REFERENCE_TFLOPS,
            },
            "links": {
                k: {"bandwidth_bytes_per_s": _round(v.bandwidth_bytes_per_s), "latency_s": _round(v.latency_s)}
                for k, v in self.links.items()
            },
            # Flat keys the operator plans from (adaptis.api.measured_hardware.MeasuredHardware).
            "tflops": _round(self.device.matmul_tflops),
            "memory_bytes": float(self.device.memory_bytes),
        }
        if "intra_node" in self.links:
            doc["intra_node_bandwidth"] = _round(self.links["intra_node"].bandwidth_bytes_per_s)
        if self.ranks_per_node is not None:
            doc["ranks_per_node"] = self.ranks_per_node
        return doc

    def to_json(self) -> str:
        return json.dumps(self.to_json_dict(), separators=(",", ":"))


def _round(x: float) -> float:
    return float(f"{x:.4g}")


def load_hardware(path: str | Path) -> HardwareProfile:
    """Read a document written by :meth:`HardwareProfile.to_json` (or printed by the CLI)."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
        dev = doc["device"]
        device = DeviceProfile(
            name=str(dev["name"]), speed=float(dev["speed"]), memory_bytes=float(dev["memory_bytes"]),
            matmul_tflops=float(dev["matmul_tflops"]), precision=str(dev.get("precision", "unknown")),
        )
        links = {
            k: LinkProfile(bandwidth_bytes_per_s=float(v["bandwidth_bytes_per_s"]), latency_s=float(v["latency_s"]))
            for k, v in (doc.get("links") or {}).items()
        }
        unknown = set(links) - {"intra_node", "inter_node"}
        if unknown:
            raise WorkerError(f"hardware file {p}: unknown links {sorted(unknown)}")
        rpn = doc.get("ranks_per_node")
        return HardwareProfile(device=device, links=links, ranks_per_node=int(rpn) if rpn else None)
    except OSError as err:
        raise WorkerError(f"hardware file {p}: cannot read: {err.strerror}") from None
    except (ValueError, KeyError, TypeError) as err:
        raise WorkerError(f"hardware file {p}: not a hardware profile: {err!r}") from None


# --- the device --------------------------------------------------------------------------------
def working_dtype(device: torch.device) -> torch.dtype:
    """The precision a device trains in: bf16 on CUDA, fp32 on CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"CPU {line.split(':', 1)[1].strip()} x{torch.get_num_threads()} threads"
    except OSError:
        pass
    return f"CPU {platform.machine()} x{torch.get_num_threads()} threads"


def device_memory_bytes(device: torch.device) -> float:
    """Total memory of the device; on CPU the cgroup limit when there is one, else RAM."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    ram = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            return min(ram, float(limit))
    except OSError:
        pass
    return ram


#: When the device does not say (no sysfs cache entries): a large server's last-level cache.
_DEFAULT_CACHE_BYTES = 64 * 2**20


@functools.cache  # read once a process: the profiler asks before every layer's timed runs
def cache_bytes(device: torch.device) -> int:
    """Bytes of the device's largest cache: L2 on CUDA, the last level (often L3) on CPU."""
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)) or _DEFAULT_CACHE_BYTES
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip().upper()
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=_DEFAULT_CACHE_BYTES)


def device_clock(device: torch.device) -> Callable[[Callable[[], None]], float]:
    """A timer of one call on the device's own clock: CUDA events on GPU, perf_counter on CPU
    (compute there is synchronous). Returns seconds."""
    if device.type == "cuda":
        def cuda_time(fn: Callable[[], None]) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3

        return cuda_time

    def wall_time(fn: Callable[[], None]) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return wall_time


def measure_matmul_tflops(device: torch.device, *, dtype: torch.dtype | None = None, size: int | None = None,
                          repeats: int = 5) -> float:
    """Dense ``size x size`` matmul throughput (median of ``repeats`` after a warm-up)."""
    dtype = dtype or working_dtype(device)
    n = size or (8192 if device.type == "cuda" else 512)
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    inner = 10 if device.type == "cuda" else 2  # several per event pair: launch gaps vanish

    def run() -> None:
        for _ in range(inner):
            torch.mm(a, b)

    clock = device_clock(device)
    clock(run)
    times = [clock(run) for _ in range(repeats)]
    return 2.0 * n**3 * inner / statistics.median(times) / 1e12


def measure_device(device: torch.device, *, repeats: int = 5, size: int | None = None) -> DeviceProfile:
    tflops = measure_matmul_tflops(device, repeats=repeats, size=size)
    return DeviceProfile(
        name=device_name(device), speed=tflops / REFERENCE_TFLOPS, memory_bytes=device_memory_bytes(device),
        matmul_tflops=tflops, precision=str(working_dtype(device)).removeprefix("torch."),
    )


# --- the links ---------------------------------------------------------------------------------
def fit_link(sizes: Sequence[float], seconds: Sequence[float]) -> LinkProfile:
    """Least-squares ``t = latency + n / bandwidth``; latency clamped at 0, bandwidth > 0."""
    if len(sizes) != len(seconds) or len(sizes) < 2:
        raise WorkerError("fit_link: need at least two (size, time) pairs")
    mx, my = statistics.fmean(sizes), statistics.fmean(seconds)
    sxx = sum((x - mx) ** 2 for x in sizes)
    slope = sum((x - mx) * (y - my) for x, y in zip(sizes, seconds, strict=True)) / sxx if sxx else 0.0
    if slope <= 0:  # flat or noisy: bandwidth from the largest message alone
        slope = max(seconds[-1], 1e-12) / max(sizes[-1], 1.0)
    latency = max(0.0, my - slope * mx)
    return LinkProfile(bandwidth_bytes_per_s=1.0 / slope, latency_s=latency)


def _ping_pong(*, peer: int, sizes: Sequence[int], repeats: int, device: torch.device) -> list[float]:
    """One-way seconds per size (median over repeats of round trip / 2); rank ``me`` leads."""
    out = []
    for n in sizes:
        buf = torch.zeros(max(1, n // 4), dtype=torch.float32, device=device)
        times = []
        for i in range(repeats + 1):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            dist.send(buf, dst=peer)
            dist.recv(buf, src=peer)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i:  # the first exchange of a size sets up buffers: not timed
                times.append((time.perf_counter() - start) / 2)
        out.append(statistics.median(times))
    return out


def _echo(*, peer: int, sizes: Sequence[int], repeats: int, device: torch.device) -> None:
    for n in sizes:
        buf = torch.zeros(max(1, n // 4), dtype=torch.float32, device=device)
        for _ in range(repeats + 1):
            dist.recv(buf, src=peer)
            dist.send(buf, dst=peer)


def measure_links(*, device: torch.device, sizes: Sequence[int] = _LINK_SIZES,
                  repeats: int = 10) -> tuple[dict[str, LinkProfile], int]:
    """Collective: every rank of the default group calls it. Rank 0 ping-pongs with the first
    peer on its host and the first on another host; every rank returns the fitted links and
    the number of ranks on rank 0's host."""
    rank, world = dist.get_rank(), dist.get_world_size()
    hosts: list[Any] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    peers = {
        "intra_node": next((r for r in range(1, world) if hosts[r] == hosts[0]), None),
        "inter_node": next((r for r in range(1, world) if hosts[r] != hosts[0]), None),
    }
    fitted: dict[str, tuple[float, float]] = {}
    for kind, peer in peers.items():
        if peer is None:
            continue
        if rank == 0:
            secs = _ping_pong(peer=peer, sizes=sizes, repeats=repeats, device=device)
            link = fit_link([float(s) for s in sizes], secs)
            fitted[kind] = (link.bandwidth_bytes_per_s, link.latency_s)
            log.info("%s link to rank %d: %s", kind, peer,
                     ", ".join(f"{s} B {t * 1e6:.1f} us" for s, t in zip(sizes, secs, strict=True)))
        elif rank == peer:
            _echo(peer=0, sizes=sizes, repeats=repeats, device=device)
        dist.barrier()
    shared: list[Any] = [fitted]
    dist.broadcast_object_list(shared, src=0)
    links = {k: LinkProfile(bandwidth_bytes_per_s=bw, latency_s=lat) for k, (bw, lat) in shared[0].items()}
    return links, sum(1 for h in hosts if h == hosts[0])


def measure_hardware(*, device: torch.device, repeats: int = 5, matmul_size: int | None = None) -> HardwareProfile:
    """The device, plus the links when a process group with 2 or more ranks is initialised."""
    dev = measure_device(device, repeats=repeats, size=matmul_size)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() >= 2:
        links, per_node = measure_links(device=device)
        return HardwareProfile(device=dev, links=links, ranks_per_node=per_node)
    return HardwareProfile(device=dev, links={})
