"""The gloo test harness itself (tests/worker/worker_harness.py): a rank that raises fails the
test at once with its traceback, while its peers still wait in a collective."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist
from worker_harness import init_gloo, run_ranks


def _rank_one_raises(rank: int, world: int, port: int) -> None:
    init_gloo(rank, world, port, timeout_s=120.0)
    if rank == 1:
        raise ValueError("rank one's own error")
    dist.barrier()  # rank 0 waits here for a peer that never comes


def test_a_rank_that_raises_fails_the_run_before_the_deadline() -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 failed:.*ValueError: rank one's own error"):
        run_ranks(_rank_one_raises, world=2, args=(), timeout_s=90)
    # Not the 90 s deadline (nor gloo's 120 s): the traceback is read as soon as it is written.
    assert time.monotonic() - start < 80
