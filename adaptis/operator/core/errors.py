"""The operator layer's error vocabulary.

Nothing here reaches kopf as an exception: the reconciler turns each of these into a status
condition and an Event, because a user meets them through ``kubectl describe``, not a log.
"""

from __future__ import annotations

from collections.abc import Sequence

from adaptis.api.conditions import Reason

__all__ = ["InvalidJob", "OperatorError", "PlanTooLarge", "Unsatisfiable"]


class OperatorError(Exception):
    """Base of the operator's own failures."""


class InvalidJob(OperatorError):
    """A manifest that passed the schema but breaks a rule the schema cannot express.

    ``fields`` are the dotted paths at fault (``spec.parallelism.workers``); the message names
    them too, one violation per line.
    """

    def __init__(self, message: str, *, fields: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.fields: tuple[str, ...] = tuple(fields)


class Unsatisfiable(OperatorError):
    """No placement exists on the candidate nodes (too few GPUs, no node matches, no memory)."""

    reason = Reason.UNSATISFIABLE  # the Planned condition's reason; subclasses say more

class PlanTooLarge(OperatorError):
    """A plan whose ConfigMap, packed, still exceeds the API server's size limit: the message
    names the spec fields to shrink."""
