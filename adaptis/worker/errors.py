"""The worker layer's error vocabulary (models, executor, checkpoints, the local launcher)."""

from __future__ import annotations

__all__ = ["CheckpointError", "DataError", "PlanMismatchError", "PreemptedError", "RankFailedError",
           "TorchApiError", "WorkerError"]


class WorkerError(Exception):
    """The worker cannot do what its configuration asks."""


class PlanMismatchError(WorkerError):
    """The plan does not fit the model or the world (layer count, devices, microbatches)."""


class TorchApiError(WorkerError):
    """The installed torch lacks a private name or argument that the pipelining adapter uses."""


class DataError(WorkerError):
    """The data source cannot deliver a batch (missing or too small token file)."""


class CheckpointError(WorkerError):
    """A checkpoint cannot be written or does not match the job it is loaded into."""


class PreemptedError(WorkerError):
    """A local run's ranks were stopped (SIGTERM) and exited gracefully after checkpointing
    ``step`` (None: they stopped before agreeing on one); rerunning resumes from there."""

    def __init__(self, message: str, *, step: int | None) -> None:
        super().__init__(message)
        self.step = step


class RankFailedError(WorkerError):
    """A rank of a local run exited abnormally; ``rank`` and ``cause`` say which and why."""

    def __init__(self, message: str, *, rank: int, cause: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.cause = cause
