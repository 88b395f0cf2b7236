"""The measured timeline of a rank: when each of its compute actions started and ended.

Sits beside the executor's action timers (:mod:`adaptis.worker.runtime.timers`), one of which it
wraps, as :mod:`adaptis.worker.runtime.slowdown` does. With ``ADAPTIS_TRACE=DIR`` in its environment
(``adaptis run --trace DIR``), each rank writes ``DIR/rank-R.json`` at the end of every step: the
step's timed calls in order, ``[kind, start, end]`` in ``time.perf_counter()`` seconds. That clock
is the host's monotonic clock, one for all its processes, so the local ranks' files line up on one
time axis; the file left is the last step's. :mod:`adaptis.cli.trace_report` lines the calls up with
the plan's actions and its prediction.

CPU only: a CUDA action's host-side time is its launch, not its run, so on a GPU the trace is
not written (and says so once).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from adaptis.worker.runtime.timers import ActionTimer

__all__ = ["ENV", "TracedTimer", "rank_trace_path", "traced"]

log = logging.getLogger(__name__)

ENV = "ADAPTIS_TRACE"


def rank_trace_path(directory: Path, *, rank: int) -> Path:
    return directory / f"rank-{rank}.json"


class TracedTimer:
    """``inner``'s timing, each call also recorded; the step's calls written at :meth:`collect`
    (which the executor calls once a step, after the pipeline part)."""

    def __init__(self, inner: ActionTimer, *, path: Path) -> None:
        self.inner = inner
        self.path = path
        self.calls: list[tuple[str, float, float]] = []
        self._step = 0

    def reset(self, *, step: int) -> None:
        self._step = step
        self.inner.reset(step=step)
        self.calls.clear()

    def collect(self) -> dict[str, float]:
        self.path.write_text(json.dumps({"step": self._step, "calls": self.calls}))
        return self.inner.collect()

    @contextmanager
    def measure(self, kind: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            with self.inner.measure(kind):
                yield
        finally:
            self.calls.append((kind, start, time.perf_counter()))


def traced(timer: ActionTimer, *, rank: int, environ: dict[str, str], device: torch.device) -> ActionTimer:
    """``timer``, traced into ``environ``'s :data:`ENV` directory when set; else ``timer``."""
    directory = environ.get(ENV)
    if not directory:
        return timer
    if device.type != "cpu":
        log.warning("%s: the action trace is CPU only (a CUDA action's host time is its launch); not traced", ENV)
        return timer
    path = rank_trace_path(Path(directory), rank=rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    return TracedTimer(timer, path=path)
