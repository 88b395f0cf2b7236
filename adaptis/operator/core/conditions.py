"""Status conditions and the times they carry, as every Kubernetes controller writes them.

Sits at the bottom of the operator layer (:mod:`adaptis.operator.core`), under the pass state
(:mod:`adaptis.operator.core.passes`), which sets the job's conditions through
:func:`set_condition`, and the status arithmetic (:mod:`adaptis.operator.resources.status`).
A condition keeps its ``lastTransitionTime`` while its status holds; times are RFC 3339 in UTC,
to the second.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import UTC, datetime

from adaptis.api.conditions import ConditionType
from adaptis.api.job import Condition

__all__ = ["condition_true", "now_rfc3339", "parse_time", "set_condition"]


def now_rfc3339(now: datetime | None = None) -> str:
    return (now or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        return datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    except ValueError:
        return None


def set_condition(
    conditions: Sequence[Condition],
    *,
    type_: str,
    status: str,
    reason: str,
    message: str = "",
    now: str,
) -> list[Condition]:
    """Conditions with ``type_`` set; its transition time moves only when its status changes."""
    out: list[Condition] = []
    found = False
    for c in conditions:
        if c.type != type_:
            out.append(c)
            continue
        found = True
        moved = c.status != status
        out.append(Condition(
            type=type_, status=status, reason=reason, message=message,  # type: ignore[arg-type]
            last_transition_time=now if moved or not c.last_transition_time
            else c.last_transition_time,
        ))
    if not found:
        out.append(Condition(type=type_, status=status, reason=reason,  # type: ignore[arg-type]
                             message=message, last_transition_time=now))
    return out


def condition_true(conditions: Iterable[Condition], type_: ConditionType) -> bool:
    return any(c.type == type_ and c.status == "True" for c in conditions)
