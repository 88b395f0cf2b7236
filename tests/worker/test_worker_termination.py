"""The worker's termination message is what the operator reads the observed bubble ratio from."""

from __future__ import annotations

from pathlib import Path

import pytest

from adaptis.api.events import DoneEvent
from adaptis.cli.worker import _write_termination_message
from adaptis.operator.resources.status import _bubble_ratio


def test_termination_message_round_trips_to_the_operator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "termination-log"
    log.touch()  # the kubelet creates it before the container starts
    monkeypatch.setenv("ADAPTIS_TERMINATION_LOG", str(log))
    _write_termination_message(DoneEvent(rank=1, steps=3, loss=5.5, bubble_ratio=0.125, tokens=10, seconds=1.0,
                                         samples=4))
    text = log.read_text()
    assert len(text.encode()) < 4096
    assert _bubble_ratio([text]) == 0.125


def test_no_termination_log_outside_a_pod(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADAPTIS_TERMINATION_LOG", str(tmp_path / "log"))
    _write_termination_message(DoneEvent(rank=0, steps=1, loss=1.0, bubble_ratio=0.5, tokens=1, seconds=1.0,
                                         samples=1))  # must not raise
    assert not (tmp_path / "log").exists()
