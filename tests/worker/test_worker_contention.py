"""Profiling as a pipeline runs a layer: caches evicted before each timed run, and co-runners
standing for the host's other ranks (issue 16). Real processes and real torch work; the
assertions are about what runs when, not about how fast (this host is shared and noisy)."""

from __future__ import annotations

import inspect
import multiprocessing as mp
import os
from pathlib import Path

import pytest
import torch

from adaptis.api.job import BlockSpec, JobSpec, ParallelismSpec, TrainingSpec
from adaptis.api.model import ZooModel
from adaptis.worker.errors import WorkerError
from adaptis.worker.profiling import module_timing
from adaptis.worker.profiling.contention import co_runner_count, co_runners, usable_cores
from adaptis.worker.profiling.hardware import cache_bytes
from adaptis.worker.profiling.module_timing import ProfileSettings, _time_of

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _spec() -> JobSpec:
    return JobSpec(
        model=ZooModel(vocab_size=128, hidden=16, heads=2,
                        blocks=[BlockSpec(kind="attention"), BlockSpec(kind="moe", experts=2, top_k=1)]),
        training=TrainingSpec(microbatches=2, microbatch_size=1, sequence_length=8),
        parallelism=ParallelismSpec(workers=2, gpus_per_worker=0))


def test_cache_bytes_is_the_largest_sysfs_cache_of_the_cpu() -> None:
    entries = list(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"))
    if not entries:
        pytest.fail("this host has no /sys/devices/system/cpu/cpu0/cache: the CPU path cannot be checked here")
    largest = 0
    for e in entries:
        text = e.read_text().strip()
        largest = max(largest, int(text[:-1]) * {"K": 2**10, "M": 2**20}[text[-1]])
    assert cache_bytes(CPU) == largest


def test_each_timed_run_follows_an_eviction_outside_the_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []

    def evictor(_device: torch.device):  # type: ignore[no-untyped-def]
        return lambda: events.append("evict")

    def clock(fn):  # type: ignore[no-untyped-def]
        events.append("clock")
        fn()
        events.append("stop")
        return 1.0

    monkeypatch.setattr(module_timing, "_cache_evictor", evictor)
    settings = ProfileSettings(warmup=1, repeats=2)
    _time_of(clock, lambda state: events.append(f"run {state}"), setup=lambda: "s", settings=settings)
    assert events == ["evict", "clock", "run s", "stop"] * 3
    events.clear()
    _time_of(clock, lambda: events.append("run"), setup=None, settings=ProfileSettings(warmup=0, repeats=2,
                                                                                         cold_caches=False))
    assert events == ["clock", "run", "stop"] * 2  # warm: nothing between the runs


def test_the_evictor_writes_twice_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(module_timing, "cache_bytes", lambda _d: 4096)
    evict = module_timing._cache_evictor(CPU)
    evict()
    buffer = inspect.getclosurevars(evict).nonlocals["buffer"]
    assert buffer.numel() == 8192 and buffer.dtype == torch.uint8 and bool((buffer == 1).all())
    evict()
    assert bool((buffer == 2).all())  # a write each time, not once


def test_co_runner_count_stands_for_the_other_ranks_of_a_cpu_host() -> None:
    cores = usable_cores()
    assert 1 <= cores <= (os.cpu_count() or 1)
    assert co_runner_count(device=CPU, ranks_on_host=1) == 0
    assert co_runner_count(device=CPU, ranks_on_host=2) == min(2, cores) - 1
    assert co_runner_count(device=CPU, ranks_on_host=cores + 4) == cores - 1  # never oversubscribed
    assert co_runner_count(device=CUDA, ranks_on_host=8) == 0  # a GPU each: nothing shared
    assert co_runner_count(device=CPU, ranks_on_host=2, asked=3) == 3
    assert co_runner_count(device=CUDA, ranks_on_host=8, asked=0) == 0


def test_co_runners_run_during_the_block_and_are_gone_after() -> None:
    before = {p.pid for p in mp.active_children()}
    with co_runners(_spec(), count=2, dtype=torch.float32):
        mine = [p for p in mp.active_children() if p.pid not in before]
        assert len(mine) == 2 and all(p.is_alive() for p in mine)
        assert all(p.name.startswith("adaptis-co-runner-") for p in mine)
    assert all(not p.is_alive() for p in mine)
    assert {p.pid for p in mp.active_children()} <= before


def test_no_co_runner_starts_no_process() -> None:
    before = {p.pid for p in mp.active_children()}
    with co_runners(_spec(), count=0, dtype=torch.float32):
        assert {p.pid for p in mp.active_children()} == before


def test_negative_co_runners_are_a_worker_error() -> None:
    with pytest.raises(WorkerError, match="co_runners"):
        ProfileSettings(co_runners=-1)


@pytest.mark.parametrize("entry", ["profile_job", "measure_problem"])
def test_profiling_a_job_on_cpu_runs_beside_the_hosts_other_ranks(entry: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from contextlib import contextmanager

    from adaptis.worker.profiling import job_problem as problem
    from adaptis.worker.profiling import profiler

    seen: list[int] = []

    @contextmanager
    def record(_spec: JobSpec, *, count: int, dtype: torch.dtype):  # type: ignore[no-untyped-def]
        seen.append(count)
        yield

    quick = ProfileSettings(warmup=0, repeats=1)
    monkeypatch.setattr(profiler, "co_runners", record)
    if entry == "profile_job":
        problem.profile_job(_spec(), settings=quick, devices=2, name="t")
        problem.profile_job(_spec(), settings=ProfileSettings(warmup=0, repeats=1, co_runners=0), devices=2,
                             name="t")
    else:
        problem.measure_problem(_spec(), devices=2, repeats=1)
        problem.measure_problem(_spec(), devices=1, repeats=1)
    assert seen == [co_runner_count(device=CPU, ranks_on_host=2), 0]


def test_usable_cores_follow_a_cgroup_quota(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from adaptis.worker.profiling import contention

    real = Path
    # The CPUs a quota allows: ceil(quota / period); none: the affinity's.
    limits = {"max 100000\n": len(os.sched_getaffinity(0)), "150000 100000\n": 2, "50000 100000\n": 1}
    for text, want in limits.items():
        (tmp_path / "cpu.max").write_text(text)
        monkeypatch.setattr(contention, "Path", lambda p, _t=tmp_path: real(_t / "cpu.max") if p.endswith("cpu.max")
                            else real(p))
        assert contention.usable_cores() == min(want, len(os.sched_getaffinity(0))), text
