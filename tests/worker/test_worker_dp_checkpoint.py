"""Checkpoints under data parallelism: 2 replicas x 2 pipeline ranks (4 real processes through
the local launcher) stopped after step 2 and rerun to step 4 continue the loss curve of an
uninterrupted run exactly, with and without ZeRO-1; replica 0 alone writes without ZeRO,
every rank (its optimizer shard) with it; the data position and counters are the job's."""

from __future__ import annotations

from pathlib import Path

import pytest
from worker_harness import small_config

from adaptis.api.events import WorkerEvent
from adaptis.worker.run.launcher import LocalLauncher

STEPS, REPLICAS = 4, 2


def _config(*, steps: int, zero: int = 0, checkpoint_dir: str | None = None):
    base = small_config(steps=steps, checkpoint_dir=checkpoint_dir, checkpoint_every=2 if checkpoint_dir else 0)
    return base.model_copy(update={"data_parallel": REPLICAS, "zero_stage": zero})


def _run(config, workdir: Path) -> list[WorkerEvent]:
    events: list[WorkerEvent] = []
    LocalLauncher(config, world_size=2 * REPLICAS, workdir=workdir).run(events.append)
    return events


def _losses(events: list[WorkerEvent]) -> dict[int, dict[int, float]]:
    out: dict[int, dict[int, float]] = {}
    for e in events:
        if e.event == "step":
            out.setdefault(e.step, {})[e.rank] = e.loss
    return out


def test_data_parallel_runs_resume_exactly(tmp_path: Path) -> None:
    ref = _losses(_run(_config(steps=STEPS), tmp_path / "ref"))
    assert sorted(ref) == list(range(1, STEPS + 1))
    for step, by_rank in ref.items():  # every rank reports the combined batch's loss
        assert len(set(by_rank.values())) == 1 and len(by_rank) == 2 * REPLICAS, f"step {step}: {by_rank}"
    for zero, files in ((0, ["rank-0.pt", "rank-1.pt"]),
                        (1, ["rank-0.pt", "rank-1.pt", "rank-2.pt", "rank-3.pt"])):
        ckpt = tmp_path / f"ckpt-zero{zero}"
        _run(_config(steps=2, zero=zero, checkpoint_dir=str(ckpt)), tmp_path / f"first-{zero}")
        assert sorted(f.name for f in (ckpt / "step-00000002").iterdir()) == files
        second = _run(_config(steps=STEPS, zero=zero, checkpoint_dir=str(ckpt)), tmp_path / f"second-{zero}")
        assert {e.resumed_step for e in second if e.event == "start"} == {2}
        resumed = _losses(second)
        assert sorted(resumed) == [3, 4]
        for step, by_rank in resumed.items():
            for rank, loss in by_rank.items():
                assert loss == pytest.approx(ref[step][0], rel=1e-5), f"zero {zero} step {step} rank {rank}"
        done = [e for e in second if e.event == "done"]
        # The job's counters: every replica's sequences (4 microbatches of 1 x 16 tokens each).
        assert {e.tokens for e in done} == {STEPS * REPLICAS * 4 * 16}
