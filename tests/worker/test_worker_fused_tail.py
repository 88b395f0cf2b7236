"""The planner's W-tail plans (``Policy.fuse_first_from``): stage 0 runs split B/W for its
first microbatches and fused BW for the last ones, in one plan; the executor (a real 1-rank
gloo group) must give the reference's loss and gradients."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from worker_harness import SMALL_MODEL, free_port

from adaptis.api.job import TrainingSpec, WorkerConfig
from adaptis.api.plan import Plan
from adaptis.worker.data import SyntheticTokens
from adaptis.worker.executor import Executor
from adaptis.worker.reference import reference_step

TRAIN = TrainingSpec(microbatches=3, microbatch_size=2, sequence_length=8, grad_clip=None, seed=5)


@pytest.fixture(scope="module", autouse=True)
def one_rank_group() -> Iterator[None]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    yield
    dist.destroy_process_group()


def _mixed_first_stage() -> Plan:
    """Three stages on one rank; stage 0: B then W for microbatch 0, BW for 1 and 2."""
    m = TRAIN.microbatches
    acts = [("F", s, mb) for mb in range(m) for s in range(3)]
    for mb in reversed(range(m)):
        acts += [("B", 2, mb), ("B", 1, mb), ("B", 0, mb) if mb == 0 else ("BW", 0, mb)]
    acts += [("W", s, mb) for mb in range(m) for s in (1, 2)] + [("W", 0, 0)]
    return Plan(stages=[(0, 2), (2, 3), (3, 5)], placement=[[0, 1, 2]], actions=[acts])


def test_stage0_split_then_fused_matches_the_reference() -> None:
    plan = _mixed_first_stage()
    config = WorkerConfig(model=SMALL_MODEL, training=TRAIN, plan=plan.model_dump(mode="json"))
    ex = Executor(config, rank=0, world_size=1, device=torch.device("cpu"))
    batch = SyntheticTokens(vocab_size=SMALL_MODEL.vocab_size, sequence_length=8, seed=5).batch(
        position=0, sequences=6)
    stats = ex.step(batch)
    ref = reference_step(SMALL_MODEL, TRAIN, batch=batch)
    assert stats.loss == pytest.approx(ref.loss, rel=1e-6)
    grads = {k: p.grad for k, p in ex.named_parameters().items()}
    for name, g in ref.grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7)
    assert {"F", "B", "W", "BW"} <= set(stats.busy_by_kind)
