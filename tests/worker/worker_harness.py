"""Helpers of the worker tests: real gloo process groups in spawned processes, fail-fast.

Not a test module. ``run_ranks`` spawns one process per rank (torch.multiprocessing, spawn),
joins them with a deadline and kills them all when one fails or the deadline passes, so a
pipeline that deadlocks fails the test in seconds instead of hanging the suite.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from adaptis.api.events import StepEvent
from adaptis.api.job import BlockSpec, JobSpec, TrainingSpec, WorkerConfig
from adaptis.api.model import Model, ZooModel
from adaptis.api.plan import Plan
from adaptis.worker.data.sources import SyntheticTokens
from adaptis.worker.run.launcher import caused_by_peer
from adaptis.worker.testing import reference_train

PARITY_MODEL = ZooModel(
    vocab_size=512, hidden=32, heads=4, tie_embeddings=True,
    blocks=[BlockSpec(kind="mamba", count=3), BlockSpec(kind="attention", count=2),
            BlockSpec(kind="moe", count=2, experts=4, top_k=2), BlockSpec(kind="dense", count=1)],
)
PARITY_TRAINING = TrainingSpec(microbatches=8, microbatch_size=2, sequence_length=16, grad_clip=None, seed=3)
PARITY_LAYERS = 10  # embedding + 8 blocks + head


def parity_reference() -> tuple[float, dict[str, torch.Tensor], float]:
    """One step of PARITY_MODEL in one process: loss, gradients by name, gradient norm. The tied
    weight appears under both layer names; its gradient counts once in the norm."""
    from adaptis.worker.data.sources import SyntheticTokens
    from adaptis.worker.testing import reference_step

    torch.set_num_threads(1)
    t = PARITY_TRAINING
    data = SyntheticTokens(vocab_size=PARITY_MODEL.vocab_size, sequence_length=t.sequence_length, seed=t.seed)
    ref = reference_step(PARITY_MODEL, t, batch=data.batch(position=0, sequences=t.microbatches * t.microbatch_size))
    norm = sum(float(g.double().pow(2).sum()) for k, g in ref.grads.items() if k != f"{PARITY_LAYERS - 1}.proj.weight")
    return ref.loss, ref.grads, norm**0.5


@pytest.fixture(scope="module")
def one_rank_group() -> Iterator[None]:
    """A real gloo process group of one rank in this process: in-process executor and checkpoint
    tests, which mutation testing reaches (tests: ``pytestmark = pytest.mark.usefixtures(...)``)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    yield
    dist.destroy_process_group()


def selected_cases(request: pytest.FixtureRequest, *, cases: list[Any],
                   needs: Callable[[dict[str, Any]], list[Any] | None]) -> list[Any]:
    """The cases of ``cases`` that this session's selected tests of the module ask for, in order.

    A module fixture that spawns ranks once for all its cases spawns them only for the cases
    whose tests run (``-k``, node ids): bench/mutation.py's cross-rank step re-runs one case per
    surviving mutant, not the whole matrix. ``needs`` maps a selected test's parameters to the
    cases it reads, or None for all of them (e.g. a test without those parameters)."""
    wanted: set[Any] = set()
    for item in request.session.items:
        if getattr(item, "module", None) is not request.module or request.fixturename not in item.fixturenames:
            continue
        spec = getattr(item, "callspec", None)
        needed = needs(spec.params if spec is not None else {})
        if needed is None:
            return list(cases)
        wanted.update(needed)
    return [c for c in cases if c in wanted]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_gloo(rank: int, world: int, port: int, *, timeout_s: float = 60.0) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_s))


def run_ranks(fn: Any, *, world: int, args: tuple[Any, ...], timeout_s: float) -> None:
    """Run ``fn(rank, world, port, *args)`` on ``world`` spawned processes; raise on any failure
    or when the deadline passes (all processes are killed either way)."""
    port = free_port()
    ctx = mp.start_processes(fn, args=(world, port, *args), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=0.5):
            failed = _rank_failure(ctx.error_files)
            if failed is not None:
                raise RuntimeError(failed)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world} ranks did not finish within {timeout_s:.0f} s (hang?)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        for p in ctx.processes:
            p.join(5)


def _rank_failure(error_files: list[str | None]) -> str | None:
    """The tracebacks of the ranks that raised, as soon as torch's wrapper has written one: a
    failed rank can hang on its way out (its gloo group waits on its peers), which ``join`` sees
    only when the process ends, so without this a rank's error would wait for the deadline.
    A rank that failed because a peer's exit closed its connection comes after the ranks that
    failed of themselves (the peer writes its traceback before it exits, so both are there)."""
    failures: list[tuple[bool, str]] = []
    for rank, path in enumerate(error_files):
        if path is None or not os.path.exists(path) or os.path.getsize(path) == 0:
            continue
        try:
            with open(path, "rb") as fh:
                text = f"rank {rank} failed:\n{pickle.load(fh)}"
        except (EOFError, pickle.UnpicklingError):  # still being written: the next poll reads it
            continue
        failures.append((caused_by_peer(text), text))
    if not failures:
        return None
    return "\n".join(text for _peer_gone, text in sorted(failures, key=lambda f: f[0]))


def parity_ranks(rank: int, world: int, port: int, cases_file: str, out_dir: str) -> None:
    """Every case of ``cases_file`` through the executor: one step, grads dumped per rank."""
    from adaptis.worker.data.sources import SyntheticTokens
    from adaptis.worker.runtime.executor import Executor

    init_gloo(rank, world, port)
    for case in json.loads(Path(cases_file).read_text()):
        cfg = WorkerConfig.model_validate(case["config"])
        t = cfg.training
        ex = Executor(cfg, rank=rank, world_size=world, device=torch.device("cpu"))
        data = SyntheticTokens(vocab_size=cfg.model.vocab_size, sequence_length=t.sequence_length, seed=t.seed)
        stats = ex.step(data.batch(position=0, sequences=t.microbatches * t.microbatch_size))
        grads = {k: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
                 for k, p in ex.named_parameters().items()}
        torch.save({"loss": stats.loss, "norm": stats.grad_norm, "grads": grads,
                    "busy": stats.busy_seconds, "iteration": stats.iteration_seconds},
                   Path(out_dir) / f"{case['name']}-{rank}.pt")
    dist.destroy_process_group()


def write_cases(path: Path, cases: dict[str, Plan], *, model: Model = PARITY_MODEL,
                training: TrainingSpec = PARITY_TRAINING) -> None:
    docs = [{"name": name, "config": WorkerConfig(model=model, training=training,
                                                 plan=plan.model_dump(mode="json")).model_dump(mode="json")}
            for name, plan in cases.items()]
    path.write_text(json.dumps(docs))


def job_spec(model: Model = PARITY_MODEL, training: TrainingSpec = PARITY_TRAINING) -> JobSpec:
    return JobSpec(model=model, training=training)


def topological_plan(*, stages: list[tuple[int, int]], placement: list[list[int]], microbatches: int,
                     split: bool, defer_w: bool, lag: int | None = None) -> Plan:
    """A hand-written plan for any placement: each rank runs its share of one global order (all
    F by microbatch then stage, then backward by microbatch and reverse stage), which cannot
    deadlock; ``split`` uses B then W, ``defer_w`` pushes every W to the end of its rank;
    ``lag`` interleaves instead: the backward of microbatch ``t - lag`` follows the forward of
    ``t`` (a 1F1B-like order for any placement)."""
    owner = {s: d for d, mine in enumerate(placement) for s in mine}
    acts: list[list[tuple[str, int, int]]] = [[] for _ in placement]
    late: list[list[tuple[str, int, int]]] = [[] for _ in placement]
    lag = microbatches if lag is None else lag
    for t in range(microbatches + lag):
        if t < microbatches:
            for s in range(len(stages)):
                acts[owner[s]].append(("F", s, t))
        mb = t - lag
        if mb < 0:
            continue
        for s in reversed(range(len(stages))):
            d = owner[s]
            if not split:
                acts[d].append(("BW", s, mb))
                continue
            acts[d].append(("B", s, mb))
            (late[d] if defer_w else acts[d]).append(("W", s, mb))
    return Plan(stages=stages, placement=placement,
                actions=[a + w for a, w in zip(acts, late, strict=True)])


SMALL_MODEL = ZooModel(
    vocab_size=256, hidden=16, heads=2, tie_embeddings=True,
    blocks=[BlockSpec(kind="mamba"), BlockSpec(kind="attention"), BlockSpec(kind="moe", experts=2, top_k=1)],
)


def small_config(*, steps: int, strategy: str = "1f1b", world: int = 2, checkpoint_dir: str | None = None,
                 checkpoint_every: int = 0, metrics_port: int | None = None, job: str = "test") -> WorkerConfig:
    """A tiny model, planned by the planner for ``world`` ranks: steps take tens of ms."""
    from adaptis.planner.strategies import plan_strategy
    from adaptis.worker.profiling.job_problem import estimate_problem

    training = TrainingSpec(steps=steps, microbatches=4, microbatch_size=1, sequence_length=16, seed=1)
    outcome = plan_strategy(estimate_problem(JobSpec(model=SMALL_MODEL, training=training), devices=world),
                            strategy)
    assert outcome.plan is not None
    return WorkerConfig(job_name=job, model=SMALL_MODEL, training=training,
                        plan=outcome.plan.model_dump(mode="json", exclude_none=True),
                        metrics_port=metrics_port, checkpoint_dir=checkpoint_dir,
                        checkpoint_every=checkpoint_every)


DP_TRAINING = TrainingSpec(microbatches=4, microbatch_size=2, sequence_length=16, seed=3, grad_clip=0.5,
                           optimizer={"name": "adamw", "lr": 0.01, "weight_decay": 0.01})


def dp_parity_ranks(rank: int, world: int, port: int, cases_file: str, out_dir: str) -> None:
    """Every case of ``cases_file`` (data-parallel configs) through the executor for the
    config's steps, each replica reading its shard; dumps per-step losses and norms, the last
    step's gradients (after the replica average, before clipping is irrelevant: clipping
    scales them after) and the final weights, per rank."""
    from adaptis.worker.data.sources import SyntheticTokens, shard_position
    from adaptis.worker.runtime.dtensors import gathered as whole
    from adaptis.worker.runtime.dtensors import local
    from adaptis.worker.runtime.executor import Executor

    init_gloo(rank, world, port)
    for case in json.loads(Path(cases_file).read_text()):
        cfg = WorkerConfig.model_validate(case["config"])
        t = cfg.training
        ex = Executor(cfg, rank=rank, world_size=world, device=torch.device("cpu"))
        data = SyntheticTokens(vocab_size=model_vocab(cfg.model), sequence_length=t.sequence_length, seed=t.seed)
        per_step = t.microbatches * t.microbatch_size
        losses, norms, waits, overlapped = [], [], [], []
        grads: dict[str, torch.Tensor] = {}
        first_grads: dict[str, torch.Tensor] = {}
        for step in range(t.steps):
            start = shard_position(position=step * per_step * cfg.data_parallel, replica=ex.replica,
                                   sequences=per_step)
            # Capture the averaged, unclipped gradients: the executor clips in place.
            real_clip, captured = ex._clip, {}

            def clip(real_clip=real_clip, captured=captured, ex=ex) -> float:
                captured.update({k: whole(p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
                                 for k, p in ex.named_parameters().items()})
                return real_clip()

            ex._clip = clip  # type: ignore[method-assign]
            stats = ex.step(data.batch(position=start, sequences=per_step))
            ex._clip = real_clip  # type: ignore[method-assign]
            losses.append(stats.loss)
            norms.append(stats.grad_norm)
            waits.append(stats.reduce_wait_seconds)
            overlapped.append((ex.reducer.overlapped, ex.reducer.stages) if ex.reducer is not None else None)
            grads = captured
            first_grads = first_grads or captured
        weights = {k: whole(p).detach().clone() for k, p in ex.named_parameters().items()}
        numels = {k: (local(p).numel(), p.numel()) for k, p in ex.named_parameters().items()}
        torch.save({"losses": losses, "norms": norms, "grads": grads, "weights": weights, "waits": waits,
                    "numels": numels, "first_grads": first_grads,
                    "overlapped": overlapped, "optimizer_state": _state_bytes(ex.optimizer)},
                   Path(out_dir) / f"{case['name']}-{rank}.pt")
    dist.destroy_process_group()


def resume_ranks(rank: int, world: int, port: int, config_file: str, ckpt_dir: str, out_file: str,
                 steps: str) -> None:
    """``steps`` "first:last": resume from ``ckpt_dir`` when it holds a step (a fresh start
    else), train to step ``last``, checkpoint there (every rank of a saving position joins),
    dump rank 0's losses and every rank's whole weights."""
    from adaptis.worker.data.sources import SyntheticTokens, shard_position
    from adaptis.worker.runtime.dtensors import gathered
    from adaptis.worker.runtime.executor import Executor
    from adaptis.worker.state.checkpoint import agree_resume_step, load_checkpoint, save_checkpoint

    init_gloo(rank, world, port)
    cfg = WorkerConfig.model_validate_json(Path(config_file).read_text())
    t = cfg.training
    ex = Executor(cfg, rank=rank, world_size=world, device=torch.device("cpu"))
    first, last = (int(x) for x in steps.split(":"))
    found = agree_resume_step(ckpt_dir)
    assert (found or 0) == first, f"resume from {found}, expected {first}"
    if found is not None:
        load_checkpoint(ckpt_dir, executor=ex, step=found)
    data = SyntheticTokens(vocab_size=cfg.model.vocab_size, sequence_length=t.sequence_length, seed=t.seed)
    per_step = t.microbatches * t.microbatch_size
    losses = []
    for step in range(first, last):
        start = shard_position(position=step * per_step * cfg.data_parallel, replica=ex.replica, sequences=per_step)
        ex.set_learning_rate(step=step)
        losses.append(ex.step(data.batch(position=start, sequences=per_step), number=step + 1).loss)
    if ex.joins_checkpoint:
        save_checkpoint(ckpt_dir, executor=ex, step=last, position=last * per_step * cfg.data_parallel,
                        tokens=0, samples=0)
    weights = {k: gathered(p).detach().clone() for k, p in ex.named_parameters().items()}
    torch.save({"losses": losses, "weights": weights}, f"{out_file}-{rank}.pt")
    dist.destroy_process_group()


def model_vocab(model: Model) -> int:
    """The vocabulary of a zoo model or of a Hugging Face model's config."""
    return model.vocab_size


def _state_bytes(optimizer: Any) -> int:
    if hasattr(optimizer, "state_bytes"):
        return int(optimizer.state_bytes())
    from adaptis.worker.runtime.dtensors import local

    return sum(local(t).numel() * t.element_size() for s in optimizer.state.values()
               for t in s.values() if isinstance(t, torch.Tensor))


def write_dp_cases(path: Path, cases: dict[str, tuple[Plan, int]], *, replicas: int, steps: int,
                   model: Model = PARITY_MODEL, training: TrainingSpec = DP_TRAINING,
                   tensor: int = 1, sequence: bool = False) -> None:
    """``cases``: name -> (plan of one pipeline replica, ZeRO stage); ``tensor``: the ranks of
    each pipeline position (tensor parallelism); ``sequence``: sequence parallelism too."""
    t = training.model_copy(update={"steps": steps})
    docs = [{"name": name, "config": WorkerConfig(
        model=model, training=t, plan=plan.model_dump(mode="json"), data_parallel=replicas,
        zero_stage=zero, tensor_parallel=tensor, sequence_parallel=sequence).model_dump(mode="json")}
        for name, (plan, zero) in cases.items()]
    path.write_text(json.dumps(docs))


def assert_bf16_near_fp32(tmp_path: Path, *, plan: Plan, pipeline: int, tensor: int, steps: int,
                          sequence: bool = False) -> None:
    """bf16 on ``pipeline`` x ``tensor`` ranks (``sequence``: sequence parallel too): every step's
    loss on every rank within 0.1 % of one fp32 process's, and not fp32's own numbers (a run
    silently in fp32 would match them to 1e-6)."""
    bf16 = DP_TRAINING.model_copy(update={"precision": "bf16"})
    write_dp_cases(tmp_path / "cases.json", {"bf16": (plan, 0)}, replicas=1, steps=steps,
                   tensor=tensor, training=bf16, sequence=sequence)
    run_ranks(dp_parity_ranks, world=pipeline * tensor, args=(str(tmp_path / "cases.json"), str(tmp_path)),
              timeout_s=600)
    torch.set_num_threads(1)
    source = SyntheticTokens(vocab_size=PARITY_MODEL.vocab_size, sequence_length=DP_TRAINING.sequence_length,
                             seed=DP_TRAINING.seed)
    fp32 = reference_train(PARITY_MODEL, DP_TRAINING, source=source, steps=steps)
    for r in range(pipeline * tensor):
        losses = torch.load(tmp_path / f"bf16-{r}.pt")["losses"]
        assert losses == pytest.approx(fp32.losses, rel=1e-3), f"rank {r}"
        assert losses != pytest.approx(fp32.losses, rel=1e-6), f"rank {r}: bf16 gave fp32's numbers"


def step_event(**fields: Any) -> StepEvent:
    """A rank's step event with every field not given zero (None for the predictions)."""
    base: dict[str, Any] = {name: None if name.startswith("predicted") else 0
                            for name in StepEvent.model_fields if name != "event"}
    base["precision"] = "fp32"
    return StepEvent(**{**base, **fields})
