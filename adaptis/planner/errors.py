"""The planner layer's error vocabulary."""

from __future__ import annotations

__all__ = ["DeadlockError", "OutOfTime", "PlannerError"]


class PlannerError(Exception):
    """The planner cannot do what was asked (an unknown strategy, an impossible request)."""


class DeadlockError(PlannerError):
    """A plan's action lists wait on each other: no device can make progress.

    ``waiting[d]`` is the action device ``d`` is blocked on (or None when it has finished).
    """

    def __init__(self, message: str, *, waiting: tuple[object, ...] = ()) -> None:
        super().__init__(message)
        self.waiting = waiting


class OutOfTime(PlannerError):
    """The caller's deadline passed in the middle of a step (one list schedule).

    Raised only inside the planner and caught by whoever set the deadline
    (:mod:`adaptis.planner.search`), which keeps the best plan found before it.
    """
