"""Co-runners: the other ranks of a shared CPU host, kept busy while the profiler measures.

Sits under the layer profiler (:mod:`adaptis.worker.profiling.profiler` and ``measure_problem``),
which times each layer kind in one process. On a GPU every rank has its own device, so a layer timed
alone is timed as it runs. On CPU the local ranks share the host's last-level cache and memory
bandwidth: while one rank runs a small block, the others stream their own weights and activations
through the same cache. Measured on 2 cores (issue 16, the MoE mix of bench/measured_speedup.py): an
attention or MoE block ran 15-25 % slower beside a busy second process than on an idle host, and the
pipeline measured its blocks that much slower than an idle-host profile predicted. So while the
profiler times layers, ``count`` other processes run the job's own layers, forward and backward, in
a loop, as the other ranks of a pipeline do.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from adaptis.api.job import JobSpec

__all__ = ["co_runner_count", "co_runners", "usable_cores"]

log = logging.getLogger(__name__)

#: Seconds a co-runner may take to start (a fresh interpreter importing torch) or to stop.
_START_S, _STOP_S = 120.0, 30.0


def co_runner_count(*, device: torch.device, ranks_on_host: int, asked: int | None = None) -> int:
    """How many co-runners stand for the other ranks: ``asked`` when given; else on CPU one
    per other rank of this host, at most one per other core (more would measure
    oversubscription, not sharing); on a GPU none."""
    if asked is not None:
        return asked
    if device.type != "cpu":
        return 0
    return max(0, min(ranks_on_host, usable_cores()) - 1)


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota (a pod's
    CPU limit), which ``os.cpu_count()`` does not see."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cores


@contextmanager
def co_runners(spec: JobSpec, *, count: int, dtype: torch.dtype) -> Iterator[None]:
    """Keep ``count`` processes running ``spec``'s layers for the duration of the block.

    Each runs one torch thread, like a rank, and has done one whole pass over the layers
    before the block starts; they are stopped (and, if stuck, killed) when it ends. The zoo's
    models only: a Hugging Face model's callers pass 0 (its modules need its weights)."""
    if count <= 0:
        yield
        return
    ctx = mp.get_context("spawn")  # a fork would inherit this process's torch thread pools
    stop, ready = ctx.Event(), ctx.Semaphore(0)
    model = spec.model.wire().model_dump(mode="json", by_alias=True)
    train = spec.training.model_dump(mode="json", by_alias=True)
    procs = [ctx.Process(target=_run, kwargs={"model": model, "training": train, "dtype": str(dtype),
                                              "stop": stop, "ready": ready},
                         name=f"adaptis-co-runner-{i}", daemon=True) for i in range(count)]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            if not ready.acquire(timeout=_START_S):
                log.warning("profile: a co-runner did not start within %.0f s; profiling without it", _START_S)
                break
        log.info("profiling beside %d co-runner(s) standing for the host's other ranks", count)
        yield
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=_STOP_S)
            if p.is_alive():
                p.kill()
                p.join()


def _run(*, model: dict[str, Any], training: dict[str, Any], dtype: str, stop: Any, ready: Any) -> None:
    """A co-runner's loop: every layer of the model, forward then backward, until ``stop``."""
    from adaptis.api.model import ModelSpec, ZooModel, expect_kind, resolve_model
    from adaptis.api.training import TrainingSpec
    from adaptis.worker.models.zoo import build_layer, model_layers

    torch.set_num_threads(1)
    spec = expect_kind(resolve_model(ModelSpec.model_validate(model)), ZooModel, what="a co-runner")
    train = TrainingSpec.model_validate(training)
    kind = getattr(torch, dtype.removeprefix("torch."))
    layers = [build_layer(spec, index=i, seed=train.seed + 1) for i in range(len(model_layers(spec)))]
    b, s = train.microbatch_size, train.sequence_length
    tokens = torch.randint(spec.vocab_size, (b, s))
    hidden = torch.randn(b, s, spec.hidden)
    first = True
    while not stop.is_set():
        for i, layer in enumerate(layers):
            with torch.autocast("cpu", dtype=kind, enabled=kind != torch.float32):
                out = layer(tokens if i == 0 else hidden.requires_grad_(True))
            out.float().sum().backward()
            hidden = hidden.detach()
        if first:
            ready.release()
            first = False
