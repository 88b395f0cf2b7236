"""Planning off the reconcile workers: each plan in a process of its own, within a budget.

Sits between :class:`~adaptis.operator.control.reconcile.Reconciler` (which asks for a job's plan on
every pass) and :func:`adaptis.operator.scheduling.planning.plan_job` (which does the work). A large
search holds the GIL and gigabytes for as long as it runs; in the operator's own process it
would stall every other job's pass and could get the whole operator OOM-killed. So:

- a pass *requests* the plan of a job's planning inputs and returns at once: with the
  record when it is ready, else :class:`Planning` (the reconciler shows it and moves on);
  a small job (workers x layers x microbatches under ``inline_below``, a fraction of a second
  to plan) is planned right in the pass, so it never queues behind a big one;
- at most ``max_concurrent`` plans run at a time, each in a child process (``forkserver``:
  no fork of the threaded operator) under ``RLIMIT_AS`` = ``memory_bytes``, with the job's
  ``spec.planner.timeLimitSeconds`` as the planner's own deadline (it returns the best plan
  found by then) and a hard kill ``kill_grace_s`` after it; the others wait their turn;
- when a plan ends, ``wake(key)`` (the work queue's ``add``) brings the job back, and that
  pass takes the record;
- a killed planner (time or memory) falls back to the 1F1B baseline, planned the same way
  (cheap: one order, one simulation); if that fails too, the job gets
  :class:`PlanningStopped`, which names spec.planner.timeLimitSeconds and the sizes to shrink.

State is memory only: a restarted operator asks again, which plans again. A request with new
inputs (spec or nodes changed) replaces the old one; a plan already running for the old inputs
finishes within its budget and is dropped.
"""

from __future__ import annotations

import logging
import multiprocessing
import resource
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Protocol

from pydantic import ValidationError
from typing_extensions import override

from adaptis.api.conditions import Reason
from adaptis.api.job import JobSpec
from adaptis.api.plan import StrategyName
from adaptis.api.problem import Link
from adaptis.api.rules import layer_count
from adaptis.operator.core.errors import Unsatisfiable
from adaptis.operator.core.records import NodeProfile, PlanRecord
from adaptis.operator.core.settings import OPERATOR_DEFAULTS
from adaptis.operator.scheduling.planning import Slot, plan_job
from adaptis.planner.errors import PlannerError

__all__ = [
    "InlinePlanner",
    "PlanRequest",
    "PlanRunner",
    "Planner",
    "PlannerLimits",
    "Planning",
    "PlanningStopped",
    "plan_size",
    "planned_reason",
]

log = logging.getLogger(__name__)

Key = Hashable
#: The baseline a stopped planner falls back to: one fixed order and one simulation.
FALLBACK_STRATEGY: StrategyName = "1f1b"
_MIB = 1 << 20


class PlanningStopped(Unsatisfiable):
    """The planner process was stopped (time or memory) and no fallback plan could be made."""

    reason = Reason.PLANNING_BUDGET_EXCEEDED


@dataclass(frozen=True)
class PlanRequest:
    """What :func:`plan_job` needs; picklable, so it crosses into the planner process."""

    spec: JobSpec
    candidates: tuple[NodeProfile, ...]
    name: str
    inter_node: Link
    slots: tuple[Slot, ...] | None = None  # chosen and reserved by the caller (the ledger)
    # (nodes, factors): the running plan's corrected device speeds (adaptation), kept while
    # the plan lands on the same nodes (plan_job).
    speed_correction: tuple[tuple[str, ...], tuple[float, ...]] | None = None


@dataclass(frozen=True)
class Planning:
    """The plan is not ready; ``message`` says whether it runs or waits for a slot."""

    message: str


@dataclass(frozen=True)
class PlannerLimits:
    """Operator-wide planning budget, from the ``adaptis operator`` command line."""

    max_concurrent: int = OPERATOR_DEFAULTS.max_concurrent_plans
    # Address space of one planner process; None: no cap. RLIMIT_AS counts mapped libraries
    # too, about 50 MiB before the first plan; the largest allowed spec peaks near 840 MiB
    # (docs/planning-budget.md).
    memory_bytes: int | None = OPERATOR_DEFAULTS.planner_memory_mib * _MIB
    # After spec.planner.timeLimitSeconds the planner returns its best plan by itself; this is
    # how much longer it may take before it is killed: it overruns by up to one simulation,
    # about 8 s at the largest allowed spec on an idle core (docs/planning-budget.md).
    kill_grace_s: float = OPERATOR_DEFAULTS.planner_kill_grace_seconds
    # False: plan in a thread of this process (no memory cap, no kill; tests and `adaptis run`).
    isolate: bool = True
    # Jobs smaller than this (workers x layers x microbatches) are planned in the pass itself:
    # 8 x 34 x 32 takes 0.2 s (docs/planning-budget.md), less than a process start and wait.
    inline_below: int = 16384


class Planner(Protocol):
    """What the reconciler asks for a plan."""

    def request(self, key: Key, *, inputs: str, request: PlanRequest) -> PlanRecord | Planning:
        """The record for ``inputs``, or :class:`Planning`; raises :class:`Unsatisfiable`,
        :class:`PlannerError` or :class:`ValidationError` when no plan can be made."""
        ...

    def forget(self, key: Key) -> None:
        """The job is gone: drop what is kept for it."""
        ...


PlanFunction = Callable[..., PlanRecord]  # plan_job's signature


def _plan(plan: PlanFunction, request: PlanRequest, *, strategy: str | None) -> PlanRecord:
    return plan(request.spec, request.candidates, name=request.name,
                inter_node=request.inter_node, slots=request.slots,
                time_limit_s=float(request.spec.planner.time_limit_seconds), strategy=strategy,
                **({"speed_correction": request.speed_correction}
                   if request.speed_correction else {}))


class InlinePlanner(Planner):
    """Plans in the caller's thread (the reconciler's) within the spec's time limit only."""

    def __init__(self, plan: PlanFunction = plan_job) -> None:
        self._plan = plan

    @override
    def request(self, key: Key, *, inputs: str, request: PlanRequest) -> PlanRecord | Planning:
        # Plans every time it is asked: neither the key nor the inputs are kept.
        return _plan(self._plan, request, strategy=None)

    @override
    def forget(self, key: Key) -> None:
        pass  # nothing kept


def plan_size(spec: JobSpec) -> int:
    """workers x layers (blocks, embedding, head) x microbatches: what planning time grows with."""
    layers = layer_count(spec.model)
    return spec.parallelism.workers * layers * spec.training.microbatches


def planned_reason(record: PlanRecord) -> tuple[str, str, str]:
    """(reason, message suffix, event type) of the Planned=True condition of ``record``."""
    if record.budget_reason is None:
        return Reason.PLANNED, "", "Normal"
    event = "Warning" if record.budget_reason == Reason.BASELINE_FALLBACK else "Normal"
    return record.budget_reason, f"; {record.budget_note}", event


# --- the child process ----------------------------------------------------------------------
def _child(conn: Connection, plan: PlanFunction, *, request: PlanRequest, strategy: str | None,
           memory_bytes: int | None) -> None:
    """Entry point of a planner process: plan, send ("ok", record JSON) or (kind, message)."""
    if memory_bytes is not None:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    try:
        message: tuple[str, str] = ("ok", _plan(plan, request, strategy=strategy).model_dump_json())
    except MemoryError:
        message = ("stopped", f"it ran out of its memory cap ({(memory_bytes or 0) // _MIB} MiB)")
    except Unsatisfiable as err:
        message = ("unsatisfiable", str(err))
    except (PlannerError, ValidationError) as err:
        message = ("planner", str(err))
    try:
        conn.send(message)
    except MemoryError:  # pickling a big record can be the last straw
        conn.send(("stopped", f"it ran out of its memory cap ({(memory_bytes or 0) // _MIB} MiB)"))
    finally:
        conn.close()


class PlanRunner:
    """Runs plans in the background within :class:`PlannerLimits`; see the module docstring."""

    def __init__(self, *, limits: PlannerLimits = PlannerLimits(),
                 wake: Callable[[Any], None] | None = None, plan: PlanFunction = plan_job) -> None:
        self._limits = limits
        self._wake = wake
        self._plan = plan
        self._lock = threading.Lock()
        self._entries: dict[Key, tuple[str, Future[PlanRecord]]] = {}
        self._pool = ThreadPoolExecutor(max_workers=max(1, limits.max_concurrent),
                                        thread_name_prefix="adaptis-plan")
        self._context = multiprocessing.get_context("forkserver")
        # The server imports the planner once; every plan then forks from it in milliseconds.
        self._context.set_forkserver_preload(["adaptis.operator.scheduling.planning", __name__])

    def request(self, key: Key, *, inputs: str, request: PlanRequest) -> PlanRecord | Planning:
        if plan_size(request.spec) < self._limits.inline_below:
            return _plan(self._plan, request, strategy=None)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry[0] == inputs:
                future = entry[1]
                if not future.done():
                    return Planning(self._message(future, request.spec))
                del self._entries[key]
                done = future
            else:
                done = None
                future = self._pool.submit(self._plan_within_budget, request)
                self._entries[key] = (inputs, future)
                waiting = Planning(self._message(future, request.spec))
        if done is not None:
            return done.result()  # the record, or the planner's exception: raised to the caller
        future.add_done_callback(lambda _: self._done(key))  # outside the lock: may run now
        return waiting

    def forget(self, key: Key) -> None:
        """Drop a job's plan (the job is gone); a running one finishes within its budget."""
        with self._lock:
            self._entries.pop(key, None)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _message(self, future: Future[PlanRecord], spec: JobSpec) -> str:
        limit = spec.planner.time_limit_seconds
        # A plan just submitted may not have reached its thread yet: a free slot takes it.
        busy = sum(1 for _, f in self._entries.values() if f.running() and f is not future)
        if future.running() or busy < self._limits.max_concurrent:
            return (f"planning in a separate process (spec.planner.timeLimitSeconds: {limit}); "
                    "the job continues when the plan is ready")
        return (f"waiting for one of the operator's {self._limits.max_concurrent} planner "
                f"slot(s); then up to spec.planner.timeLimitSeconds ({limit} s)")

    def _done(self, key: Key) -> None:
        # A done-callback, so the result is set before the job's next pass asks for it (a
        # wake from inside the task could be answered "still planning", and nothing would
        # wake the job again until the resync).
        with self._lock:
            current = key in self._entries
        if self._wake is not None and current:
            self._wake(key)

    def _plan_within_budget(self, request: PlanRequest) -> PlanRecord:
        stopped = self._execute(request, strategy=None)
        if isinstance(stopped, PlanRecord):
            return stopped
        spec = request.spec
        log.warning("%s: the planner was stopped (%s); falling back to %s",
                    request.name, stopped, FALLBACK_STRATEGY)
        fallback = self._execute(request, strategy=FALLBACK_STRATEGY)
        if isinstance(fallback, PlanRecord):
            return fallback.model_copy(update={
                "budget_reason": Reason.BASELINE_FALLBACK.value,
                "budget_note": f"the planner was stopped ({stopped}); running the "
                               f"{FALLBACK_STRATEGY} baseline instead"})
        raise PlanningStopped(
            f"spec.planner.timeLimitSeconds: planning {spec.parallelism.workers} workers x "
            f"{layer_count(spec.model)} layers x {spec.training.microbatches} "
            f"microbatches was stopped ({stopped}), and so was the {FALLBACK_STRATEGY} "
            "fallback; shrink spec.training.microbatches, spec.parallelism.workers or "
            "spec.model.blocks, or raise spec.planner.timeLimitSeconds")

    def _execute(self, request: PlanRequest, *, strategy: str | None) -> PlanRecord | str:
        """The record, or why the planner was stopped; the planner's own errors are raised."""
        if not self._limits.isolate:
            return _plan(self._plan, request, strategy=strategy)
        limit = float(request.spec.planner.time_limit_seconds) + self._limits.kill_grace_s
        receive, send = self._context.Pipe(duplex=False)
        proc = self._context.Process(
            target=_child, args=(send, self._plan),
            kwargs={"request": request, "strategy": strategy, "memory_bytes": self._limits.memory_bytes},
            name=f"adaptis-plan {request.name}", daemon=True)
        proc.start()
        send.close()  # ours: the child's end closing is how we see it die
        message: tuple[str, str] | None = None
        timed_out = False
        try:
            if receive.poll(limit):
                message = receive.recv()
            else:
                timed_out = True
        except EOFError:
            pass  # died without a word: the kernel's OOM killer, a signal
        finally:
            receive.close()
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5.0)
        if timed_out:
            return (f"it ran past spec.planner.timeLimitSeconds "
                    f"({request.spec.planner.time_limit_seconds} s) + "
                    f"{self._limits.kill_grace_s:g} s")
        if message is None:
            code = proc.exitcode
            return (f"the planner process was killed by signal {-code}"
                    if code is not None and code < 0
                    else f"the planner process exited with status {code} without a plan")
        kind, text = message
        if kind == "ok":
            return PlanRecord.model_validate_json(text)
        if kind == "stopped":
            return text
        if kind == "unsatisfiable":
            raise Unsatisfiable(text)
        raise PlannerError(text)
