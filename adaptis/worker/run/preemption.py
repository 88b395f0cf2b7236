"""Graceful stop: on SIGTERM the ranks agree at a step boundary, checkpoint that step and exit.

Sits beside the run loop (:mod:`adaptis.worker.run.runner`). Kubernetes deletes a pod with SIGTERM
and a grace period (30 s by default) before SIGKILL; the operator's gang restart, a re-plan
and ``adaptis run``'s Ctrl-C all stop ranks that way. A rank that merely dies loses the steps
since its last periodic checkpoint; instead, the signal only sets a flag, and after every step
the ranks all-reduce it (one scalar MAX: a signal to any rank stops all of them at the same
step, which a per-rank check could not guarantee, and the checkpoint must be of one step on
every rank). They then write the checkpoint of that step, report a ``preempted`` event and
exit with :data:`EXIT_PREEMPTED`, so whoever restarts them (with the same plan or another,
see :mod:`adaptis.worker.state.checkpoint`) loses nothing.

The cost is one one-integer all-reduce per step (gloo on CPU, measured on 2 cores at load 16:
median 0.11-0.13 ms with 2 ranks, 0.5-1.6 ms with 4; bench/stop_agreement.py); a step must be shorter
than the grace period for the stop to land in time.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["EXIT_PREEMPTED", "StopRequest"]

log = logging.getLogger(__name__)

#: Exit status of a rank stopped gracefully: sysexits' EX_TEMPFAIL ("try again later"),
#: distinct from a crash (1), bad input (2) and a kill by signal (128 + n).
EXIT_PREEMPTED = getattr(os, "EX_TEMPFAIL", 75)


class StopRequest:
    """SIGTERM -> a flag the ranks agree on at the next step boundary. Use as a context
    manager around the step loop: the previous handler is restored after it."""

    def __init__(self, *, device: torch.device) -> None:
        self.device = device
        self.requested = False
        self._previous: Any = None

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if not self.requested:
            log.warning("signal %d: stopping at the next step boundary, after a checkpoint", signum)
        self.requested = True

    def __enter__(self) -> StopRequest:
        # Signal handlers can only be set from the main thread (a test may run ranks in threads).
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def agreed(self, group: dist.ProcessGroup | None = None) -> bool:
        """Collective (every rank, after every step): whether any rank was asked to stop."""
        flag = torch.tensor([1 if self.requested else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())
