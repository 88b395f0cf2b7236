"""The worker's event lines: the models in adaptis.api.events, as the ranks write them and the
launcher reads them back."""

from __future__ import annotations

import json

import pytest

from adaptis.api.events import (
    EVENT_PREFIX,
    DoneEvent,
    PreemptedEvent,
    StartEvent,
    StepEvent,
    event_line,
    parse_event_line,
)

DONE = DoneEvent(rank=1, steps=3, tokens=192, samples=12, seconds=1.5, loss=5.25, bubble_ratio=None)


def test_an_event_line_is_the_prefix_then_the_json_keys_in_declared_order() -> None:
    line = event_line(DONE)
    assert line == EVENT_PREFIX + json.dumps({"event": "done", "rank": 1, "steps": 3, "tokens": 192, "samples": 12,
                                              "seconds": 1.5, "loss": 5.25, "bubble_ratio": None})


@pytest.mark.parametrize("event", [
    DONE,
    PreemptedEvent(rank=0, step=2, tokens=64, samples=4, checkpoint_dir=None),
    StartEvent(rank=0, world_size=2, pid=7, replica=0, pipeline_rank=0, data_parallel=1, metrics_port=None,
               resumed_step=0, resumed_exact=None, stages=(0, 2), precision="fp32", predicted_bubble_ratio=0.1,
               predicted_iteration_seconds=None),
])
def test_every_kind_round_trips_through_its_line(event: StartEvent | DoneEvent | PreemptedEvent) -> None:
    assert parse_event_line(event_line(event) + "\n") == event


def test_a_step_event_reads_back_as_a_step_event() -> None:
    fields = {name: 0 for name in StepEvent.model_fields if name not in ("event", "precision")}
    step = StepEvent(**fields, precision="bf16")
    back = parse_event_line(event_line(step))
    assert isinstance(back, StepEvent) and back == step


def test_other_lines_are_not_events_and_a_bad_event_line_is_refused() -> None:
    assert parse_event_line("[rank0] some log line") is None
    with pytest.raises(ValueError, match="not a worker event"):
        parse_event_line(EVENT_PREFIX + '{"event": "done", "rank": 0}')  # the totals missing
    with pytest.raises(ValueError, match="not a worker event"):
        parse_event_line(EVENT_PREFIX + json.dumps({**DONE.model_dump(), "stray": 1}))


def test_events_are_frozen() -> None:
    with pytest.raises(ValueError):
        DONE.steps = 4  # type: ignore[misc]
