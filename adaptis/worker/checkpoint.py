"""Periodic per-rank checkpoints and the resume that finds the last complete one.

Sits beside the run loop (:mod:`adaptis.worker.runner`). Each rank writes its own file
``<dir>/step-<n>/rank-<r>.pt`` (model weights by global layer name, optimizer state, data
position, step, counters), atomically: a temporary file, fsync, then ``os.replace``. A step's
checkpoint is *complete* when every rank has its file; resuming picks the newest step complete
on every rank (agreed with one all-gather, so it works whether the ranks share the directory,
as a PVC does, or each sees only its own). When the plan changed since (a replan after a
restart), weights are still restored by layer name from whichever rank files are visible, and
the optimizer starts fresh.

Each file also records the model spec it was taken of: weights restore by layer name, so a
checkpoint is *compatible* with a job when its model spec is the same (whatever the plan) and
the newest step has a file of every one of the job's ranks. :func:`scan_checkpoints` answers
that before a local run starts (no process group), so ``adaptis run`` can resume by default
and refuse, rather than delete, what it cannot resume.

Data parallelism (R replicas of P pipeline ranks): without ZeRO only replica 0 (global ranks
0..P-1) writes, since the other replicas hold identical weights and optimizer state, and the
others restore from the file of their pipeline position (so with R > 1 the directory must be
visible to every replica, as a shared volume is); with ZeRO-1 every rank writes its own file
(weights plus its optimizer shard). An exact resume (optimizer state too) needs the same plan,
R and ZeRO stage; under another topology the weights are restored and the optimizer starts
fresh (resharding optimizer state is issue 17). The data position is the job's (every
replica's sequences), so it is valid under any R.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from adaptis.api.job import ModelSpec
from adaptis.api.plan import Plan
from adaptis.worker.errors import CheckpointError
from adaptis.worker.executor import Executor

__all__ = ["Resumed", "Scan", "clear_checkpoints", "latest_common_step", "load_checkpoint", "plan_fingerprint",
           "save_checkpoint", "scan_checkpoints"]

log = logging.getLogger(__name__)

_KEEP = 2  # checkpoints kept per rank: the newest may be incomplete on another rank


@dataclass(frozen=True, slots=True)
class Resumed:
    """Where a resumed run continues: the next step, data position and counter totals."""

    step: int
    position: int
    tokens: int
    samples: int
    exact: bool  # optimizer state restored too (same plan)


def plan_fingerprint(plan: Plan) -> str:
    doc = json.dumps({"stages": plan.stages, "placement": plan.placement}, sort_keys=True)
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


def _rank_file(directory: Path, *, step: int, rank: int) -> Path:
    return directory / f"step-{step:08d}" / f"rank-{rank}.pt"


def save_checkpoint(directory: str | Path, *, executor: Executor, step: int, position: int,
                    tokens: int, samples: int) -> Path:
    """Write this rank's checkpoint after ``step`` steps; prune this rank's older ones."""
    root = Path(directory)
    path = _rank_file(root, step=step, rank=executor.rank)
    state: dict[str, Any] = {
        "step": step, "position": position, "tokens": tokens, "samples": samples,
        "fingerprint": plan_fingerprint(executor.plan), "world_size": executor.world_size,
        "data_parallel": executor.mesh.replicas, "zero_stage": executor.config.zero_stage,
        "model_spec": _model_doc(executor.config.model),
        "model": {k: p.detach().cpu() for k, p in executor.named_parameters().items()},
        "optimizer": executor.optimizer.state_dict(),
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        with open(tmp, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as err:
        raise CheckpointError(f"cannot write checkpoint {path}: {err}") from err
    for old in _own_steps(root, rank=executor.rank)[:-_KEEP]:
        _rank_file(root, step=old, rank=executor.rank).unlink(missing_ok=True)
        try:
            (root / f"step-{old:08d}").rmdir()  # only once every rank removed its file
        except OSError:
            pass
    return path


def _own_steps(root: Path, *, rank: int) -> list[int]:
    if not root.is_dir():
        return []
    steps = []
    for d in root.glob("step-*"):
        if (d / f"rank-{rank}.pt").is_file() and d.name[5:].isdigit():
            steps.append(int(d.name[5:]))
    return sorted(steps)


def latest_common_step(directory: str | Path, *, rank: int, saves: bool = True) -> int | None:
    """Collective: the newest step every saving rank has a checkpoint of (None: start fresh).
    ``saves`` False: this rank writes none (a data-parallel replica > 0 without ZeRO) and
    only takes the others' answer."""
    mine = _own_steps(Path(directory), rank=rank) if saves else None
    every: list[list[int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    savers = [set(other) for other in every if other is not None]
    common = set.intersection(*savers) if savers else set()
    return max(common) if common else None


def load_checkpoint(directory: str | Path, *, executor: Executor, step: int) -> Resumed:
    """Restore this rank from the checkpoint of ``step`` (see :func:`latest_common_step`)."""
    root = Path(directory)
    path = _rank_file(root, step=step, rank=executor.checkpoint_rank)
    if not path.is_file():  # a replica > 0 reads replica 0's file: the directory must be shared
        raise CheckpointError(f"rank {executor.rank} cannot see {path}: with dataParallel > 1 "
                              "and zeroStage 0 every replica restores from replica 0's files, so "
                              "the checkpoint directory must be shared (a ReadWriteMany volume)")
    own = torch.load(path, weights_only=False)
    recorded = own.get("model_spec")
    if recorded is not None and _recorded_doc(recorded) != _model_doc(executor.config.model):
        raise CheckpointError(f"checkpoint of step {step} in {root} is of another model "
                              f"({_model_difference(recorded, executor.config.model)})")
    params = executor.named_parameters()
    exact = (own["fingerprint"] == plan_fingerprint(executor.plan)
             and own.get("data_parallel", 1) == executor.mesh.replicas
             and own.get("zero_stage", 0) == executor.config.zero_stage)
    weights: dict[str, torch.Tensor] = dict(own["model"])
    if not exact:
        log.warning("checkpoint of step %d was taken under another plan or data-parallel "
                    "topology: restoring weights by layer name, optimizer state starts fresh", step)
        for other in sorted((root / f"step-{step:08d}").glob("rank-*.pt")):
            weights.update(torch.load(other, weights_only=False)["model"])
    missing = sorted(set(params) - set(weights))
    if missing:
        raise CheckpointError(f"checkpoint of step {step} lacks parameters {missing[:5]} "
                              f"(the model changed, or the other ranks' files are not visible)")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(weights[name].to(p.device))
    if exact:
        executor.optimizer.load_state_dict(own["optimizer"])
    return Resumed(step=int(own["step"]), position=int(own["position"]), tokens=int(own["tokens"]),
                   samples=int(own["samples"]), exact=exact)


@dataclass(frozen=True, slots=True)
class Scan:
    """What a checkpoint directory holds for a job about to run (before any rank starts)."""

    directory: Path
    files: int  # rank files over every step
    steps: tuple[int, ...]  # steps with at least one rank file, oldest first
    resume_step: int | None  # the step the ranks will resume from; None: nothing compatible
    incompatible: str | None  # why files exist yet cannot be resumed (None: they can, or none)


def _model_doc(model: ModelSpec) -> dict[str, Any]:
    return model.model_dump(mode="json", by_alias=True)


def _recorded_doc(recorded: dict[str, Any]) -> dict[str, Any]:
    """A recorded model spec read through today's ModelSpec: fields added since it was written
    take their defaults (which keep the model as it was, e.g. kvHeads, ffnHidden), so an older
    checkpoint of the same model still matches. An unreadable one is compared as written."""
    try:
        return _model_doc(ModelSpec.model_validate(recorded))
    except ValueError:  # pydantic's ValidationError
        return recorded


def _model_difference(recorded: dict[str, Any], model: ModelSpec) -> str:
    recorded = _recorded_doc(recorded)
    now = _model_doc(model)
    diffs = [f"model.{k}: {recorded.get(k)!r} there, {now.get(k)!r} in this job"
             for k in sorted(set(recorded) | set(now)) if recorded.get(k) != now.get(k)]
    return "; ".join(diffs) or "model spec differs"


def _rank_files(root: Path) -> dict[int, set[int]]:
    """step -> ranks with a file there (temporary files of an interrupted write excluded)."""
    found: dict[int, set[int]] = {}
    if not root.is_dir():
        return found
    for f in root.glob("step-*/rank-*.pt"):
        step, rank = f.parent.name[5:], f.stem[5:]
        if step.isdigit() and rank.isdigit():
            found.setdefault(int(step), set()).add(int(rank))
    return found


def scan_checkpoints(directory: str | Path, *, model: ModelSpec, workers: int) -> Scan:
    """Whether a job of ``model`` on ``workers`` ranks would resume from ``directory``, and from
    which step; mirrors :func:`latest_common_step` (the newest step every rank has a file of)."""
    root = Path(directory)
    ranks = _rank_files(root)
    steps = tuple(sorted(ranks))
    files = sum(len(r) for r in ranks.values())
    if not steps:
        return Scan(root, files=0, steps=(), resume_step=None, incompatible=None)
    every = [s for s in steps if set(range(workers)) <= ranks[s]]
    if not every:
        newest = steps[-1]
        return Scan(root, files=files, steps=steps, resume_step=None, incompatible=(
            f"no step has a checkpoint of each of this run's {workers} workers (step {newest} has "
            f"ranks {', '.join(map(str, sorted(ranks[newest])))}; set --workers to match)"))
    step = every[-1]
    try:
        # mmap: only the header is read, not the weights.
        state = torch.load(_rank_file(root, step=step, rank=0), map_location="cpu", mmap=True,
                           weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unreadable file is reported, not raised
        return Scan(root, files=files, steps=steps, resume_step=None,
                    incompatible=f"step {step}'s checkpoint cannot be read ({type(err).__name__}: {err})")
    recorded = state.get("model_spec") if isinstance(state, dict) else None
    if recorded is None:
        why = f"step {step}'s checkpoint does not record its model (written by an older adaptis)"
    elif _recorded_doc(recorded) != _model_doc(model):
        why = f"step {step}'s checkpoint is of another model ({_model_difference(recorded, model)})"
    else:
        why = None
    return Scan(root, files=files, steps=steps, resume_step=None if why else step, incompatible=why)


def clear_checkpoints(directory: str | Path) -> Scan:
    """Remove every checkpoint under ``directory`` (a fresh run); returns what was there."""
    root = Path(directory)
    ranks = _rank_files(root)
    shutil.rmtree(root, ignore_errors=True)
    return Scan(root, files=sum(len(r) for r in ranks.values()), steps=tuple(sorted(ranks)),
                resume_step=None, incompatible=None)
