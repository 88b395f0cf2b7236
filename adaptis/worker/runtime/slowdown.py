"""A testing knob: make one rank's compute slower from a given step on, as a throttled GPU would.

Sits beside the executor's action timers (:mod:`adaptis.worker.runtime.timers`), one of which it
wraps. The closed loop
of :mod:`adaptis.cli.adapt` (docs/adaptation.md) needs a device that drifts while a job runs,
on demand and reproducibly, on any machine: ``ADAPTIS_SLOWDOWN=RANK:FACTOR@STEP[,...]`` (or
``adaptis run --slowdown``) makes global rank RANK, from training step STEP (1-based, as the
step events count) on, sleep ``(FACTOR - 1) x`` the duration after each of its compute actions
(F, B, W and the loss). The sleep is *inside* the timed action, so the rank's busy counter grows
by FACTOR, exactly as it would on a device FACTOR times slower: the drift detector must see it
in the busy time, not only in the neighbours' idle time.

Not for production: it only ever makes a run slower. A malformed value stops the rank (and
``adaptis run`` before it starts anything) with a :class:`ValueError` naming the entry and the
expected form.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from adaptis.worker.runtime.timers import ActionTimer

__all__ = ["ENV", "Slowdown", "SlowedTimer", "parse_slowdown", "slowed"]

ENV = "ADAPTIS_SLOWDOWN"
_FORM = "RANK:FACTOR@STEP (e.g. 1:3@5: rank 1 three times slower from step 5 on), comma-separated"


@dataclass(frozen=True, slots=True)
class Slowdown:
    """Rank ``rank`` computes ``factor`` times slower from step ``step`` on."""

    rank: int
    factor: float
    step: int

    def __str__(self) -> str:
        return f"{self.rank}:{self.factor:g}@{self.step}"


def parse_slowdown(text: str) -> dict[int, Slowdown]:
    """``RANK:FACTOR@STEP[,...]`` -> slowdown by rank; ValueError naming the bad entry."""
    out: dict[int, Slowdown] = {}
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        try:
            rank_s, rest = entry.split(":", 1)
            factor_s, step_s = rest.split("@", 1)
            item = Slowdown(rank=int(rank_s), factor=float(factor_s), step=int(step_s))
        except ValueError:
            raise ValueError(f"{ENV}: bad entry {entry!r}: expected {_FORM}") from None
        if item.rank < 0 or item.step < 1:
            raise ValueError(f"{ENV}: bad entry {entry!r}: the rank must be >= 0 and the step >= 1")
        if not (math.isfinite(item.factor) and 1.0 <= item.factor <= 100.0):
            raise ValueError(f"{ENV}: bad entry {entry!r}: the factor must be between 1 and 100 "
                             "(a slowdown; 1: none)")
        if item.rank in out:
            raise ValueError(f"{ENV}: rank {item.rank} appears twice; give each rank one entry")
        out[item.rank] = item
    return out


class SlowedTimer:
    """``inner``'s timing, with each action stretched by the factor from the slowdown's step on
    (the step :meth:`reset` opens)."""

    def __init__(self, inner: ActionTimer, *, slowdown: Slowdown,
                 sync: Callable[[], None] | None = None) -> None:
        self.inner = inner
        self.slowdown = slowdown
        self._sync = sync  # waits for the device, so the action's duration is known on the host
        self._step = 0

    def reset(self, *, step: int) -> None:
        self._step = step
        self.inner.reset(step=step)

    def collect(self) -> dict[str, float]:
        return self.inner.collect()

    @contextmanager
    def measure(self, kind: str) -> Iterator[None]:
        with self.inner.measure(kind):
            if self._step < self.slowdown.step:
                yield
                return
            start = time.perf_counter()
            yield
            if self._sync is not None:
                self._sync()
            time.sleep((self.slowdown.factor - 1.0) * (time.perf_counter() - start))


def slowed(timer: ActionTimer, *, rank: int, environ: dict[str, str],
           sync: Callable[[], None] | None = None) -> ActionTimer:
    """``timer``, slowed when ``environ``'s :data:`ENV` names ``rank``; else ``timer`` itself."""
    spec = parse_slowdown(environ.get(ENV, "")).get(rank)
    if spec is None or spec.factor == 1.0:
        return timer
    return SlowedTimer(timer, slowdown=spec, sync=sync)
