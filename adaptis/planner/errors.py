"""The planner layer's error vocabulary."""

from __future__ import annotations

__all__ = ["DeadlockError", "LayoutError", "OutOfTime", "PlannerError"]


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


class LayoutError(PlannerError):
    """A layout search's argument admits no layout; ``argument`` names it (``gpus``,
    ``global_batch``, ...), the message says why and what would fit."""

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(f"{argument}: {message}")
        self.argument = argument
