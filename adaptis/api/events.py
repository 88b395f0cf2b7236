"""What a worker rank reports as it trains: its ``start``, ``step``, ``done`` and ``preempted`` events.

Sits in the api layer, the one statement of the wire format between a rank and whoever watches
it: the worker's run loop (:mod:`adaptis.worker.run.runner`) makes these models and writes each
as one JSON line on stdout, prefixed :data:`EVENT_PREFIX` (:func:`event_line`); the local launcher
(:mod:`adaptis.worker.run.launcher`) reads them back (:func:`parse_event_line`) for ``adaptis run``,
its summary and its adaptation loop, and the benches; a pod's log keeps them. The keys are a
contract: a field is never renamed, and the line keeps the field order declared here.

A step event splits the rank's time into phases: ``data_seconds`` (the batch fetch and the wait
for every rank at the step's common start), then the step itself, ``step_seconds`` =
``iteration_seconds`` (the pipeline part: ``busy_seconds`` + ``idle_seconds``) +
``post_pipeline_seconds`` (gradient exchange and reductions, clipping, optimizer).
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

__all__ = ["EVENT_PREFIX", "DoneEvent", "PreemptedEvent", "StartEvent", "StepEvent", "WorkerEvent",
           "event_line", "parse_event_line"]

#: What starts an event line on a rank's stdout (the rest of the line is the event's JSON).
EVENT_PREFIX = "ADAPTIS_EVENT "


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StartEvent(_Event):
    """A rank has built its stages and is about to run its first step."""

    event: Literal["start"] = "start"
    rank: int
    world_size: int
    pid: int
    replica: int
    pipeline_rank: int
    data_parallel: int
    metrics_port: int | None  # None: metrics off
    resumed_step: int  # 0: a fresh start
    resumed_exact: bool | None  # the optimizer state restored too; None: a fresh start
    stages: tuple[int, ...]  # the plan's stages this rank holds
    precision: str
    predicted_bubble_ratio: float | None
    predicted_iteration_seconds: float | None


class StepEvent(_Event):
    """Rank ``rank``'s view of the step just done (the launcher shows rank 0's)."""

    event: Literal["step"] = "step"
    rank: int
    step: int  # steps done, this one included (1-based)
    loss: float  # of the replicas' combined batch
    tokens_per_second: float  # the job's: every replica's tokens
    step_seconds: float  # iteration_seconds + post_pipeline_seconds
    iteration_seconds: float  # the pipeline part, common to the ranks
    data_seconds: float  # before the step's common start
    post_pipeline_seconds: float
    predicted_step_seconds: float | None
    predicted_post_pipeline_seconds: float | None
    bubble_ratio: float  # the job's (every rank's idle time), what the plan predicts
    rank_bubble_ratio: float  # this rank's idle share of the pipeline part
    busy_seconds: float
    idle_seconds: float
    busy_seconds_total: float  # since this process started: the drift detector's input
    grad_norm: float
    reduce_wait_seconds: float  # blocked on the replicas' gradient all-reduce
    tokens: int  # the job's totals so far
    samples: int
    sent_bytes: int
    received_bytes: int
    peak_memory_bytes: int
    lr: float  # the learning rate of this step's optimizer update
    precision: str
    predicted_bubble_ratio: float | None
    predicted_iteration_seconds: float | None


class DoneEvent(_Event):
    """A rank has run its last step."""

    event: Literal["done"] = "done"
    rank: int
    steps: int
    tokens: int
    samples: int
    seconds: float  # the steps' wall time on this rank
    loss: float | None  # the last step's; None: no step was run (resumed at the end)
    bubble_ratio: float | None


class PreemptedEvent(_Event):
    """Every rank agreed to stop (SIGTERM) after ``step``, checkpointed when it has a directory."""

    event: Literal["preempted"] = "preempted"
    rank: int
    step: int
    tokens: int
    samples: int
    checkpoint_dir: str | None  # None: nothing saved


WorkerEvent = Annotated[StartEvent | StepEvent | DoneEvent | PreemptedEvent, Field(discriminator="event")]
_EVENT: TypeAdapter[WorkerEvent] = TypeAdapter(WorkerEvent)


def event_line(event: StartEvent | StepEvent | DoneEvent | PreemptedEvent) -> str:
    """The event as its line on a rank's stdout (no newline): the prefix, then its JSON."""
    return EVENT_PREFIX + json.dumps(event.model_dump(mode="json"))


def parse_event_line(line: str) -> StartEvent | StepEvent | DoneEvent | PreemptedEvent | None:
    """The event of an event line; None for any other line. A line with the prefix that is not
    an event raises ValueError naming what is wrong."""
    if not line.startswith(EVENT_PREFIX):
        return None
    try:
        return _EVENT.validate_json(line[len(EVENT_PREFIX):])
    except ValidationError as err:
        raise ValueError(f"not a worker event: {err}") from None
