"""Checkpoints: a rank killed mid-run, the run restarted, the loss curve continues exactly.

Three real 2-rank runs through the local launcher: an uninterrupted one (the reference curve),
one where rank 1 is SIGKILLed after step 5 (checkpoints every 2 steps), and its restart, which
must resume from the last checkpoint complete on both ranks (step 4, or 6 if the ranks
outran the kill) and reproduce the
reference losses of steps 5-8. The killed run must also fail naming rank 1 and the signal.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from worker_harness import run_ranks, small_config

from adaptis.api.events import WorkerEvent
from adaptis.worker.errors import RankFailedError
from adaptis.worker.run.launcher import LocalLauncher
from adaptis.worker.state.checkpoint import scan_checkpoints

STEPS = 8


def _losses(events: list[WorkerEvent]) -> dict[int, float]:
    return {e.step: e.loss for e in events if e.event == "step" and e.rank == 0}


def test_killed_rank_resumes_from_last_complete_checkpoint(tmp_path: Path) -> None:
    reference: list[WorkerEvent] = []
    LocalLauncher(small_config(steps=STEPS), world_size=2, workdir=tmp_path / "ref").run(reference.append)
    ref = _losses(reference)
    assert sorted(ref) == list(range(1, STEPS + 1))
    assert ref[STEPS] < ref[1], "the synthetic data is learnable: loss must fall"

    ckpt = str(tmp_path / "ckpt")
    config = small_config(steps=STEPS, checkpoint_dir=ckpt, checkpoint_every=2)
    first: list[WorkerEvent] = []
    pids: dict[int, int] = {}

    def kill_after_step_5(event: WorkerEvent) -> None:
        first.append(event)
        if event.event == "start":
            pids[event.rank] = event.pid
        if event.event == "step" and event.rank == 0 and event.step == 5:
            os.kill(pids[1], signal.SIGKILL)

    with pytest.raises(RankFailedError) as failure:
        LocalLauncher(config, world_size=2, workdir=tmp_path / "run1").run(kill_after_step_5)
    assert failure.value.rank == 1
    assert "SIGKILL" in failure.value.cause
    interrupted = _losses(first)
    assert max(interrupted) < STEPS
    assert sorted((Path(ckpt)).glob("step-*/rank-*.pt"))[-1].parent.name >= "step-00000004"

    second: list[WorkerEvent] = []
    LocalLauncher(config, world_size=2, workdir=tmp_path / "run2").run(second.append)
    starts = [e for e in second if e.event == "start"]
    (resumed_at,) = {e.resumed_step for e in starts}
    # Step 4's checkpoint was complete when step 5 was printed; the ranks may have raced on
    # to finish step 6 (and its checkpoint) before the kill landed.
    assert resumed_at in (4, 6) and resumed_at <= max(interrupted) + 1
    resumed = _losses(second)
    assert sorted(resumed) == list(range(resumed_at + 1, STEPS + 1))
    for step in range(1, max(interrupted) + 1):
        assert interrupted[step] == pytest.approx(ref[step], rel=1e-6, abs=1e-7)
    for step in resumed:
        assert resumed[step] == pytest.approx(ref[step], rel=1e-6, abs=1e-7), f"step {step}"
    done = [e for e in second if e.event == "done"]
    assert {e.steps for e in done} == {STEPS}
    assert {e.tokens for e in done} == {STEPS * 4 * 16}  # counters continue, not restart


def test_a_checkpoint_of_another_model_is_refused_not_guessed_at(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    config = small_config(steps=2, world=1, checkpoint_dir=str(ckpt), checkpoint_every=1)
    LocalLauncher(config, world_size=1, workdir=tmp_path / "run1").run(lambda event: None)
    model = config.model
    found = scan_checkpoints(ckpt, model=model)
    assert (found.resume_step, found.incompatible, found.steps, found.files) == (2, None, (1, 2), 2)
    other = dataclasses.replace(model, hidden=2 * model.hidden)
    changed = scan_checkpoints(ckpt, model=other)
    assert changed.resume_step is None
    assert f"model.hidden: {model.hidden} there, {2 * model.hidden} in this job" in str(changed.incompatible)
    # Pods resume without the CLI's scan: the worker itself refuses the other model.
    with pytest.raises(RankFailedError) as failure:
        LocalLauncher(config.model_copy(update={"model": other}), world_size=1,
                      workdir=tmp_path / "run2").run(lambda event: None)
    assert "is of another model" in failure.value.cause
    # A file that does not record its model cannot be vouched for.
    newest = ckpt / "step-00000002" / "rank-0.pt"
    state = torch.load(newest, weights_only=False)
    del state["model_spec"]
    torch.save(state, newest)
    legacy = scan_checkpoints(ckpt, model=model)
    assert legacy.resume_step is None and "does not record its model" in str(legacy.incompatible)


def _common_step(rank: int, world: int, port: int, root: str, steps_of: dict[int, list[int]],
                 out: str) -> None:
    from worker_harness import init_gloo

    from adaptis.worker.state.checkpoint import agree_resume_step

    init_gloo(rank, world, port)
    for step in steps_of[rank]:
        d = Path(root) / f"rank-view-{rank}" / f"step-{step:08d}"
        d.mkdir(parents=True, exist_ok=True)
        torch.save({"savers": list(range(world))}, d / f"rank-{rank}.pt")
    # Each rank sees only its own directory here (as on nodes without a shared volume), so the
    # answer can only come from the collective.
    found = agree_resume_step(Path(root) / f"rank-view-{rank}")
    # What is newer than the agreed step is an incomplete future: removed, so that a later save
    # of the same step number cannot mix with it.
    left = sorted(int(d.name[5:]) for d in (Path(root) / f"rank-view-{rank}").glob("step-*"))
    assert left == [s for s in steps_of[rank] if s <= found], (rank, left)
    Path(out, f"rank-{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


def test_resume_step_is_the_newest_every_rank_has(tmp_path: Path) -> None:
    # Rank 0 saved 2, 4 and 6; rank 1 died before saving 6; rank 2 lost its step 4. The newest
    # step that all three have is 2: neither rank 0's newest (6) nor the newest of anyone's
    # shared by two ranks (4).
    steps_of = {0: [2, 4, 6], 1: [2, 4], 2: [2, 6]}
    out = tmp_path / "out"
    out.mkdir()
    run_ranks(_common_step, world=3, args=(str(tmp_path), steps_of, str(out)), timeout_s=120)
    found = {r: json.loads((out / f"rank-{r}.json").read_text()) for r in range(3)}
    assert found == {0: 2, 1: 2, 2: 2}

