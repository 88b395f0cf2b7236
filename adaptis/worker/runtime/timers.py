"""How a rank times its compute actions: the :class:`ActionTimer` protocol and the device clocks.

Sits under the torch adapter (:mod:`adaptis.worker.runtime.pipelining`), which times each
compute call through a timer so busy and idle time per rank are measured, not inferred, and
beside the executor (:mod:`adaptis.worker.runtime.executor`), which opens a timer's step and
collects it. The clocks here are the wall clock (exact on CPU, where compute is synchronous)
and CUDA events (summed at the step's end, without a sync per action). The testing slowdown
(:mod:`adaptis.worker.runtime.slowdown`) and the action trace (:mod:`adaptis.worker.runtime.trace`)
wrap a clock by composition: each holds the timer it wraps and answers the same protocol
(:func:`adaptis.worker.runtime.executor.action_timer` composes a rank's).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol

import torch

__all__ = ["ActionTimer", "CudaActionTimer", "WallActionTimer", "device_timer"]


class ActionTimer(Protocol):
    """Accumulates busy seconds per action kind over one step."""

    def reset(self, *, step: int) -> None:
        """Forget the last step's times: step ``step`` (1-based; 0: not counted) begins."""

    def measure(self, kind: str) -> AbstractContextManager[None]:
        """Time the action run inside the ``with`` block as one of kind ``kind``."""

    def collect(self) -> dict[str, float]:
        """Busy seconds per kind since the last reset (waits for the device where needed)."""


class WallActionTimer:
    """Wall-clock timing: exact on CPU, where compute is synchronous."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def reset(self, *, step: int) -> None:  # noqa: ARG002 - ActionTimer's signature; wall and CUDA timers need no step
        self.seconds.clear()

    @contextmanager
    def measure(self, kind: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[kind] = self.seconds.get(kind, 0.0) + time.perf_counter() - start

    def collect(self) -> dict[str, float]:
        return dict(self.seconds)


class CudaActionTimer:
    """CUDA events around each action; summed at :meth:`collect` without per-action syncs."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    def reset(self, *, step: int) -> None:  # noqa: ARG002 - ActionTimer's signature; wall and CUDA timers need no step
        self.seconds.clear()
        self._events.clear()

    @contextmanager
    def measure(self, kind: str) -> Iterator[None]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            yield
        finally:
            end.record()
            self._events.append((kind, start, end))

    def collect(self) -> dict[str, float]:
        if self._events:
            self._events[-1][2].synchronize()
            for kind, start, end in self._events:
                self.seconds[kind] = self.seconds.get(kind, 0.0) + start.elapsed_time(end) / 1e3
            self._events.clear()
        return dict(self.seconds)



def device_timer(device: torch.device) -> ActionTimer:
    """The clock of ``device``: CUDA events on a GPU, the wall clock on CPU."""
    return CudaActionTimer() if device.type == "cuda" else WallActionTimer()
