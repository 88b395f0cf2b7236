"""Checkpoint and resume with an idle rank (a plan that gives a rank no stage and no action).

Real gloo ranks through the local launcher. A run under a plan that idles the middle rank is
stopped by a SIGTERM to the idle rank alone (the others learn it through the stop agreement,
which the idle rank joins), every rank checkpoints the agreed step (the idle one an empty share,
so the checkpoint is complete), and the run resumes under a plan that idles the *last* rank
instead. Its losses equal the uninterrupted run's within the data-parallel parity tolerance.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from worker_harness import SMALL_MODEL, topological_plan

from adaptis.api.events import WorkerEvent
from adaptis.api.job import BlockSpec, TrainingSpec, WorkerConfig
from adaptis.planner.drift import idle_devices
from adaptis.worker.errors import PreemptedError
from adaptis.worker.run.launcher import LocalLauncher

TOLERANCE = 1e-5
# Smooth (no top-1 routing): two plans' summation orders must not flip an expert choice.
MODEL = dataclasses.replace(SMALL_MODEL, blocks=[BlockSpec(kind="mamba"), BlockSpec(kind="attention"),
                                                  BlockSpec(kind="dense")])
STEPS = 12
IDLE_MIDDLE = topological_plan(stages=[(0, 2), (2, 5)], placement=[[0], [], [1]], microbatches=4,
                               split=True, defer_w=False, lag=1)
IDLE_LAST = topological_plan(stages=[(0, 3), (3, 5)], placement=[[1], [0], []], microbatches=4,
                             split=False, defer_w=False, lag=2)


def _config(plan: Any, *, checkpoint_dir: Path | None = None) -> WorkerConfig:
    training = TrainingSpec(steps=STEPS, microbatches=4, microbatch_size=1, sequence_length=16, seed=1,
                            optimizer={"name": "adamw", "lr": 0.01, "weight_decay": 0.01})
    return WorkerConfig(job_name="idle", model=MODEL, training=training,
                        plan=plan.model_dump(mode="json", exclude_none=True),
                        checkpoint_dir=str(checkpoint_dir) if checkpoint_dir else None)


def _losses(events: list[WorkerEvent]) -> dict[int, float]:
    return {e.step: e.loss for e in events if e.event == "step" and e.rank == 0}


def test_an_idle_rank_stops_checkpoints_and_resumes_under_another_idle_plan(tmp_path: Path) -> None:
    assert idle_devices(IDLE_MIDDLE) == [1] and idle_devices(IDLE_LAST) == [2]
    ref_events: list[WorkerEvent] = []
    LocalLauncher(_config(IDLE_MIDDLE), world_size=3, workdir=tmp_path / "ref").run(ref_events.append)
    ref = _losses(ref_events)
    assert sorted(ref) == list(range(1, STEPS + 1))
    idle_steps = [e for e in ref_events if e.event == "step" and e.rank == 1]
    assert len(idle_steps) == STEPS and all(e.busy_seconds == 0.0 for e in idle_steps), idle_steps[:1]

    ckpt = tmp_path / "ckpt"
    pids: dict[int, int] = {}
    first: list[WorkerEvent] = []

    def term_idle_rank_after_step_2(event: WorkerEvent) -> None:
        first.append(event)
        if event.event == "start":
            pids[event.rank] = event.pid
        if event.event == "step" and event.rank == 0 and event.step == 2:
            os.kill(pids[1], signal.SIGTERM)  # the idle rank only: the others learn it by the agreement

    with pytest.raises(PreemptedError) as stopped:
        LocalLauncher(_config(IDLE_MIDDLE, checkpoint_dir=ckpt), world_size=3,
                      workdir=tmp_path / "a").run(term_idle_rank_after_step_2)
    at = stopped.value.step
    assert at is not None and 2 <= at < STEPS
    preempted = sorted((e.rank, e.step) for e in first if e.event == "preempted")
    assert preempted == [(0, at), (1, at), (2, at)], "one agreed step"
    assert sorted(f.name for f in (ckpt / f"step-{at:08d}").iterdir()) == ["rank-0.pt", "rank-1.pt", "rank-2.pt"]

    second: list[WorkerEvent] = []
    LocalLauncher(_config(IDLE_LAST, checkpoint_dir=ckpt), world_size=3, workdir=tmp_path / "b").run(second.append)
    (start,) = {(e.resumed_step, e.resumed_exact) for e in second if e.event == "start"}
    assert start == (at, True)
    resumed = _losses(second)
    assert sorted(resumed) == list(range(at + 1, STEPS + 1))
    for step, loss in sorted(resumed.items()):
        assert loss == pytest.approx(ref[step], rel=TOLERANCE), f"step {step}"
