"""bf16, the learning-rate schedule and recomputation on real ranks (2 processes, gloo).

- bf16 against fp32: the same job trained 8 steps both ways through the local launcher; the
  bf16 loss curve must track fp32's within 0.1 % at every step. Why 0.1 %: bf16 keeps 8
  significant bits (a rounding of up to 2^-9 = 0.2 % of each value), but the loss averages
  64 tokens' cross-entropies computed in fp32 from bf16 logits, so the roundings mostly cancel,
  and the fp32 master weights keep the updates from drifting: the curves measured at most
  0.012 % apart (torch 2.11, CPU). 0.1 % is 8x that, and a loss computed in bf16 (its
  resolution near 5.5 is 0.03) leaves it at the first step. What it cannot tell: bf16 master
  weights, which over 8 steps of lr 3e-3 stayed as close (measured; the unit test in
  test_worker_precision.py checks the masters are fp32). bf16 sends half the bytes.
- The schedule: every step event reports the rate the step used, and a run resumed from a
  checkpoint continues the same losses and rates.
- Recompute: one step with recomputed stages gives the same gradients as without, on both ranks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from worker_harness import SMALL_MODEL, parity_ranks, run_ranks, small_config, topological_plan

from adaptis.api.events import WorkerEvent
from adaptis.api.job import WorkerConfig
from adaptis.worker.run.launcher import LocalLauncher
from adaptis.worker.runtime.lr_schedule import learning_rate

STEPS = 8


def _config(precision: str, *, checkpoint_dir: str | None = None) -> WorkerConfig:
    base = small_config(steps=STEPS, checkpoint_dir=checkpoint_dir,
                        checkpoint_every=4 if checkpoint_dir else 0)
    optimizer = base.training.optimizer.model_copy(update={
        "lr": 3e-3, "schedule": "cosine", "warmup_steps": 2, "min_lr_ratio": 0.1})
    training = base.training.model_copy(update={"precision": precision, "optimizer": optimizer})
    return base.model_copy(update={"training": training})


def _steps(events: list[WorkerEvent]) -> dict[int, WorkerEvent]:
    return {e.step: e for e in events if e.event == "step" and e.rank == 0}


def test_bf16_tracks_fp32_reports_the_rate_and_resumes_the_same_curve(tmp_path: Path) -> None:
    runs: dict[str, dict[int, WorkerEvent]] = {}
    for precision in ("fp32", "bf16"):
        events: list[WorkerEvent] = []
        ckpt = str(tmp_path / "ckpt") if precision == "bf16" else None
        LocalLauncher(_config(precision, checkpoint_dir=ckpt), world_size=2,
                      workdir=tmp_path / precision).run(events.append)
        runs[precision] = _steps(events)
        assert sorted(runs[precision]) == list(range(1, STEPS + 1))
    fp32, bf16 = runs["fp32"], runs["bf16"]
    assert {e.precision for e in bf16.values()} == {"bf16"}
    assert {e.precision for e in fp32.values()} == {"fp32"}
    for step in fp32:
        assert bf16[step].loss == pytest.approx(fp32[step].loss, rel=1e-3), f"step {step}"
    assert bf16[STEPS].loss < bf16[1].loss and fp32[STEPS].loss < fp32[1].loss
    assert any(bf16[s].loss != fp32[s].loss for s in fp32)  # bf16 did compute differently
    assert bf16[1].sent_bytes * 2 == fp32[1].sent_bytes > 0
    spec = _config("bf16").training.optimizer
    for step, event in bf16.items():
        assert event.lr == pytest.approx(learning_rate(spec, step=step - 1, total_steps=STEPS))
    assert bf16[1].lr < bf16[3].lr and bf16[3].lr == pytest.approx(3e-3)
    assert bf16[STEPS].lr == pytest.approx(3e-4)  # the floor, lr x minLrRatio, at the last step
    gaps = {s: abs(bf16[s].loss / fp32[s].loss - 1) for s in fp32}
    print(f"bf16 vs fp32 relative loss gap per step: {gaps}")

    shutil.rmtree(tmp_path / "ckpt" / "step-00000008")  # resume from step 4
    again: list[WorkerEvent] = []
    LocalLauncher(_config("bf16", checkpoint_dir=str(tmp_path / "ckpt")), world_size=2,
                  workdir=tmp_path / "again").run(again.append)
    assert {e.resumed_step for e in again if e.event == "start"} == {4}
    resumed = _steps(again)
    assert sorted(resumed) == [5, 6, 7, 8]
    for step, event in resumed.items():
        assert event.lr == bf16[step].lr
        assert event.loss == pytest.approx(bf16[step].loss, rel=1e-6, abs=1e-7), step


def test_recompute_gives_the_same_gradients_on_two_ranks(tmp_path: Path) -> None:
    training = small_config(steps=1).training.model_copy(update={"grad_clip": None})
    base = topological_plan(stages=[(0, 2), (2, 3), (3, 5)], placement=[[0, 2], [1]],
                            microbatches=training.microbatches, split=False, defer_w=False, lag=1)
    cases = []
    for precision in ("fp32", "bf16"):
        for name, flags in (("plain", None), ("recompute", [True, True, True])):
            plan = base.model_copy(update={"recompute": flags})
            config = WorkerConfig(
                model=SMALL_MODEL, training=training.model_copy(update={"precision": precision}),
                plan=plan.model_dump(mode="json", exclude_none=True))
            cases.append({"name": f"{precision}-{name}", "config": config.model_dump(mode="json")})
    cases_file = tmp_path / "cases.json"
    cases_file.write_text(json.dumps(cases))
    run_ranks(parity_ranks, world=2, args=(str(cases_file), str(tmp_path)), timeout_s=240)
    for precision in ("fp32", "bf16"):
        for rank in (0, 1):
            plain = torch.load(tmp_path / f"{precision}-plain-{rank}.pt")
            again = torch.load(tmp_path / f"{precision}-recompute-{rank}.pt")
            assert again["loss"] == pytest.approx(plain["loss"], rel=1e-6)
            assert plain["grads"] and plain["grads"].keys() == again["grads"].keys()
            for name, g in plain["grads"].items():
                torch.testing.assert_close(
                    again["grads"][name], g, rtol=1e-6, atol=1e-8,
                    msg=lambda m, n=name, p=precision, r=rank: f"{p} rank {r} {n}: {m}")
