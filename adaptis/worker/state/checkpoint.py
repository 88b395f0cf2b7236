"""Periodic per-rank checkpoints keyed by parameter name, and the resume under any plan.

Sits beside the run loop (:mod:`adaptis.worker.run.runner`), and reads a rank through
:class:`Checkpointed`, the little of it a checkpoint needs (the executor offers it). Each saving
rank writes its own file
``<dir>/step-<n>/rank-<r>.pt`` atomically (a temporary file, fsync, then ``os.replace``):

- ``model``: its weights by global parameter name (``Executor.named_parameters``: the same
  names whatever the partition);
- ``optimizer_state``: the optimizer state (AdamW's ``step``, ``exp_avg``, ``exp_avg_sq``) of
  the parameters whose state it holds, by the same names (:mod:`adaptis.worker.state.named_state`),
  and ``optimizer_covers``, those names (a parameter without a gradient yet has no state);
- the step, the job's data position and counters, the model spec, and ``savers``: the ranks of
  the writing job that write this step. A step is *complete* when a file of each of its
  savers exists; resuming picks the newest complete step, agreed with one all-gather of what
  each rank sees, so it works whether the ranks share the directory (a PVC) or each sees only
  its own.

Loading is by name, so it does not care which plan wrote the files: each rank reads its own
file first, then the others of the step, memory-mapped, taking only the tensors of the
parameters it now holds (``torch.load(mmap=True)`` pages in only what is touched) until it
has every weight and the optimizer state of every parameter its optimizer (or its ZeRO-1
share) holds. A job restored under another partition, placement, stage count, rank count,
data-parallel R or ZeRO stage therefore continues exactly: same weights, moments, step (the
learning rate is a function of the step), data position. Reading other ranks' files needs
them visible (a shared volume); a rank that cannot find a parameter fails naming it.
:class:`Resumed` ``exact`` says the optimizer state was restored too; it is False only for an
optimizer of another kind or a parameter without recorded state, and then the optimizer starts
fresh with a warning.

Why our own format, not ``torch.distributed.checkpoint`` (DCP): DCP reshards DTensors and
deduplicates replicated tensors, but our stages are plain per-rank modules with no FQN tree
in common (an executor's names are global layer names, which DCP's optimizer helpers cannot
produce from our stage modules), its completion marker (``.metadata``) is written by one
coordinator, so a same-plan resume would need a shared volume even where today each pod's own
volume suffices, and a save is a world-wide collective with planning all-gathers. Our files
keep the atomic per-rank writes, the collective "newest complete step" agreement, pruning and
:func:`scan_checkpoints` before a local run, and name-keyed tensors are all resharding needs
here: no parameter is split across ranks (ZeRO-1 shards whole parameters).

Data parallelism: without ZeRO only replica 0 (global ranks 0..P-1) writes, the other
replicas holding identical state, and they restore from those files; with ZeRO-1 every rank
writes its weights and its optimizer share. Each file records the model spec: a checkpoint
is resumable by any job of the same model spec, whatever its plan.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from adaptis.api.mesh import Mesh
from adaptis.api.model import HuggingFaceModel, Model
from adaptis.worker.errors import CheckpointError
from adaptis.worker.runtime.dtensors import gathered, local, shard_like
from adaptis.worker.runtime.replicas import ZeroOptimizer
from adaptis.worker.state.named_state import export_state, held_names, held_optimizer, import_state

__all__ = ["Checkpointed", "Resumed", "Scan", "agree_resume_step", "clear_checkpoints", "load_checkpoint",
           "save_checkpoint", "savers", "scan_checkpoints"]

log = logging.getLogger(__name__)

_KEEP = 2  # checkpoints kept per rank: the newest may be incomplete on another rank


class Checkpointed(Protocol):
    """What a checkpoint reads from a rank and restores into it (the executor is one)."""

    @property
    def rank(self) -> int: ...  # global
    @property
    def world_size(self) -> int: ...
    @property
    def mesh(self) -> Mesh: ...  # replicas x pipeline
    @property
    def checkpoint_rank(self) -> int: ...  # whose file this rank restores from first
    @property
    def model(self) -> Model: ...  # recorded, and checked on a resume
    @property
    def zero_stage(self) -> int: ...
    @property
    def optimizer_name(self) -> str: ...
    @property
    def optimizer(self) -> torch.optim.Optimizer | ZeroOptimizer: ...

    def named_parameters(self) -> dict[str, nn.Parameter]: ...


@dataclass(frozen=True, slots=True)
class Resumed:
    """Where a resumed run continues: the next step, data position and counter totals."""

    step: int
    position: int
    tokens: int
    samples: int
    exact: bool  # optimizer state restored too (see the module docstring for when it is not)


def savers(executor: Checkpointed) -> list[int]:
    """The global ranks that write this job's checkpoints (see the module docstring): tensor
    rank 0 of each position of replica 0, or of every replica with ZeRO-1."""
    mesh = executor.mesh
    replicas = range(mesh.replicas) if isinstance(executor.optimizer, ZeroOptimizer) else range(1)
    return [mesh.rank(replica=r, pipeline_rank=p) for r in replicas for p in range(mesh.pipeline)]


def _rank_file(directory: Path, *, step: int, rank: int) -> Path:
    return directory / f"step-{step:08d}" / f"rank-{rank}.pt"


def _step_dir(directory: Path, step: int) -> Path:
    return directory / f"step-{step:08d}"


def save_checkpoint(directory: str | Path, *, executor: Checkpointed, step: int, position: int,
                    tokens: int, samples: int) -> Path | None:
    """Write this rank's checkpoint after ``step`` steps; prune this rank's older ones.

    Under tensor parallelism every rank of a saving position calls this (collective over its
    tensor group): the shards are gathered whole, by name, so any degree resumes them, and
    tensor rank 0 writes the file (None on the others)."""
    root = Path(directory)
    path = _rank_file(root, step=step, rank=executor.rank)
    named = executor.named_parameters()
    held = held_optimizer(executor.optimizer)
    writers = savers(executor)
    model = {k: gathered(p).detach().cpu() for k, p in named.items()}
    optimizer_state = export_state(held, named=named)
    if executor.rank not in writers:
        return None
    state: dict[str, Any] = {
        "format": 2, "step": step, "position": position, "tokens": tokens, "samples": samples,
        "world_size": executor.world_size,
        "data_parallel": executor.mesh.replicas, "zero_stage": executor.zero_stage,
        "tensor_parallel": executor.mesh.tensor,
        "savers": writers, "model_spec": _model_doc(executor.model),
        "model": model,
        "optimizer_name": executor.optimizer_name,
        "optimizer_covers": held_names(held, named=named),
        "optimizer_state": optimizer_state,
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
        if executor.rank == writers[0]:
            # Files of ranks that do not save in this job (an earlier plan's, e.g. of more
            # ranks) have no owner to prune them now.
            for stale in _step_dir(root, old).glob("rank-*.pt"):
                if stale.stem[5:].isdigit() and int(stale.stem[5:]) not in writers:
                    stale.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            _step_dir(root, old).rmdir()  # only once every rank removed its file
    return path


def _own_steps(root: Path, *, rank: int) -> list[int]:
    return sorted(step for step, ranks in _rank_files(root).items() if rank in ranks)


def _read(path: Path) -> dict[str, Any] | None:
    """A checkpoint file, memory-mapped: tensors are read only when touched. None: unreadable
    (an interrupted copy, a stranger's file)."""
    try:
        doc = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception:  # noqa: BLE001 - any unreadable file counts as absent
        return None
    return doc if isinstance(doc, dict) else None


def _recorded_savers(doc: dict[str, Any]) -> list[int] | None:
    """The ranks that wrote a step, as its file records them (None: not one of ours)."""
    return [int(r) for r in doc["savers"]] if "savers" in doc else None


def _view(root: Path) -> dict[int, tuple[list[int], list[int] | None]]:
    """step -> (ranks with a visible file, the step's savers from the first readable file)."""
    out: dict[int, tuple[list[int], list[int] | None]] = {}
    for step, ranks in sorted(_rank_files(root).items()):
        writers = None
        for r in sorted(ranks):
            doc = _read(_rank_file(root, step=step, rank=r))
            writers = _recorded_savers(doc) if doc is not None else None
            if writers is not None:
                break
        out[step] = (sorted(ranks), writers)
    return out


def _complete(views: list[dict[int, tuple[list[int], list[int] | None]]]) -> list[int]:
    """Steps whose savers' files exist, all ranks' views together, oldest first."""
    ranks: dict[int, set[int]] = {}
    writers: dict[int, list[int]] = {}
    for view in views:
        for step, (seen, recorded) in view.items():
            ranks.setdefault(step, set()).update(seen)
            if recorded is not None:
                writers.setdefault(step, recorded)
    return sorted(s for s, w in writers.items() if set(w) <= ranks[s])


def agree_resume_step(directory: str | Path) -> int | None:
    """Collective: the newest step whose every saver's file exists, as all ranks see them
    together (None: start fresh). Each rank then removes the steps it sees newer than that:
    the incomplete future of the stopped run, which a later save of the same step number
    would otherwise mix with."""
    root = Path(directory)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, _view(root))
    complete = _complete(every)
    found = complete[-1] if complete else None
    for step in _rank_files(root):
        if found is None or step > found:
            shutil.rmtree(_step_dir(root, step), ignore_errors=True)
            log.info("removed the incomplete checkpoint of step %d in %s", step, root)
    return found


def _read_order(step_dir: Path, executor: Checkpointed) -> list[Path]:
    """This rank's own file, then the one its replica-0 twin wrote, then every other."""
    first = [step_dir / f"rank-{executor.rank}.pt", step_dir / f"rank-{executor.checkpoint_rank}.pt"]
    rest = sorted((f for f in step_dir.glob("rank-*.pt") if f.stem[5:].isdigit()), key=lambda f: int(f.stem[5:]))
    out: list[Path] = []
    for f in first + rest:
        if f.is_file() and f not in out:
            out.append(f)
    return out


def load_checkpoint(directory: str | Path, *, executor: Checkpointed, step: int) -> Resumed:
    """Restore this rank from the checkpoint of ``step`` (see :func:`agree_resume_step`),
    whatever the plan that wrote it."""
    root = Path(directory)
    step_dir = _step_dir(root, step)
    named = executor.named_parameters()
    held = held_optimizer(executor.optimizer)
    want_opt = set(held_names(held, named=named))
    alias = _tied_alias(executor)
    weights: dict[str, torch.Tensor] = {}
    states: dict[str, dict[str, Any] | None] = {}
    kinds: set[str] = set()
    header: dict[str, Any] | None = None
    for path in _read_order(step_dir, executor):
        doc = _read(path)
        if doc is None:
            raise CheckpointError(f"checkpoint file {path} cannot be read")
        if header is None:
            header = doc
            _check_model(doc, executor=executor, step=step, root=root)
        model = doc.get("model", {})
        for name in set(named) - set(weights):
            source = name if name in model else alias.get(name)
            if source in model:
                weights[name] = model[source]
        if "optimizer_state" in doc:
            kinds.add(str(doc.get("optimizer_name")))
            covers = set(doc.get("optimizer_covers", []))
            for name in want_opt - set(states):
                source = name if name in covers else alias.get(name)
                if source in covers:
                    states[name] = doc["optimizer_state"].get(source)
        if len(weights) == len(named) and want_opt <= states.keys():
            break  # the remaining files hold nothing this rank needs
    if header is None:
        raise CheckpointError(f"rank {executor.rank} sees no checkpoint file in {step_dir}")
    missing = sorted(set(named) - set(weights))
    if missing:
        raise CheckpointError(
            f"checkpoint of step {step} in {root}: parameters {missing[:5]} are in none of the files rank "
            f"{executor.rank} sees; under another plan, or with dataParallel > 1, a rank reads other ranks' "
            "files, so the checkpoint directory must be shared (a ReadWriteMany volume)")
    with torch.no_grad():
        for name, p in named.items():
            # Whole tensors: a tensor-parallel rank takes its shard of each.
            local(p).copy_(local(shard_like(p, weights[name].to(p.device))))
    exact = _restore_optimizer(executor, states=states, kinds=kinds, step=step)
    return Resumed(step=int(header["step"]), position=int(header["position"]), tokens=int(header["tokens"]),
                   samples=int(header["samples"]), exact=exact)


def _tied_alias(executor: Checkpointed) -> dict[str, str]:
    """Another name a tied weight may be saved under: a Hugging Face model's embedding and
    tied head on one rank are one Parameter, named once (``model.embed_tokens.weight``); a
    plan that puts the head on another rank looks for ``lm_head.weight`` (the zoo's models
    name both layers of a tie, so need none)."""
    model = executor.model
    if not isinstance(model, HuggingFaceModel) or not model.tied:
        return {}
    return {"lm_head.weight": "model.embed_tokens.weight"}


def _restore_optimizer(executor: Checkpointed, *, states: dict[str, dict[str, Any] | None], kinds: set[str],
                       step: int) -> bool:
    """Whether the optimizer state was restored (else it starts fresh, with a warning)."""
    named = executor.named_parameters()
    held = held_optimizer(executor.optimizer)
    kind = executor.optimizer_name
    if kinds and kinds != {kind}:
        log.warning("checkpoint of step %d holds %s optimizer state, this job trains with %s: weights "
                    "restored, the optimizer starts fresh", step, "/".join(sorted(kinds)), kind)
        return False
    missing = import_state(held, named=named, find=states)
    if missing:
        log.warning("checkpoint of step %d has no optimizer state of %s (in the files rank %d sees): "
                    "weights restored, the optimizer starts fresh", step, missing[:5], executor.rank)
        return False
    return True


def _check_model(doc: dict[str, Any], *, executor: Checkpointed, step: int, root: Path) -> None:
    recorded = doc.get("model_spec")
    if recorded is None:
        raise CheckpointError(f"checkpoint of step {step} in {root} does not record its model")
    if recorded != _model_doc(executor.model):
        raise CheckpointError(f"checkpoint of step {step} in {root} is of another model "
                              f"({_model_difference(recorded, executor.model)})")


@dataclass(frozen=True, slots=True)
class Scan:
    """What a checkpoint directory holds for a job about to run (before any rank starts)."""

    directory: Path
    files: int  # rank files over every step
    steps: tuple[int, ...]  # steps with at least one rank file, oldest first
    resume_step: int | None  # the step the ranks will resume from; None: nothing compatible
    incompatible: str | None  # why files exist yet cannot be resumed (None: they can, or none)


def _model_doc(model: Model) -> dict[str, Any]:
    return model.wire().model_dump(mode="json", by_alias=True)


def _model_difference(recorded: dict[str, Any], model: Model) -> str:
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


def scan_checkpoints(directory: str | Path, *, model: Model) -> Scan:
    """Whether a job of ``model`` (under any plan) would resume from ``directory``, and from
    which step; mirrors :func:`agree_resume_step` (the newest step every saver has a file of)."""
    root = Path(directory)
    view = _view(root)
    steps = tuple(sorted(view))
    files = sum(len(ranks) for ranks, _ in view.values())
    if not steps:
        return Scan(root, files=0, steps=(), resume_step=None, incompatible=None)
    complete = _complete([view])
    if not complete:
        newest = steps[-1]
        seen, writers = view[newest]
        expected = ("its files are unreadable" if writers is None
                    else f"written by ranks {', '.join(map(str, writers))}")
        return Scan(root, files=files, steps=steps, resume_step=None, incompatible=(
            f"no step has the files of every rank that wrote it (step {newest} has the files of ranks "
            f"{', '.join(map(str, seen))}, {expected})"))
    step = complete[-1]
    state = _read(_rank_file(root, step=step, rank=view[step][0][0]))
    recorded = state.get("model_spec") if state is not None else None
    if recorded is None:
        why = f"step {step}'s checkpoint does not record its model"
    elif recorded != _model_doc(model):
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
