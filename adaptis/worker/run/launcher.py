"""Launch a job's ranks as local processes and watch them (the engine of ``adaptis run``).

Sits between ``adaptis run`` and ``adaptis worker``: it writes the ``worker.json`` the ranks
read, starts one ``python -m adaptis worker`` per rank with the environment torch's launchers
use (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), parses their ``ADAPTIS_EVENT`` lines and
hands each event (:mod:`adaptis.api.events`) to a callback. A rank that exits abnormally stops all the others and raises
:class:`RankFailedError` naming the rank and the cause (the last line of its log). Ctrl-C
stops every rank (SIGTERM, then SIGKILL after a grace period) and re-raises. Ranks that all
stop gracefully (SIGTERM: checkpoint, event ``preempted``, exit status
:data:`~adaptis.worker.run.preemption.EXIT_PREEMPTED`) raise :class:`PreemptedError` with the step.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from adaptis.api.events import DoneEvent, PreemptedEvent, StartEvent, StepEvent, parse_event_line
from adaptis.api.job import WorkerConfig
from adaptis.worker.errors import PreemptedError, RankFailedError
from adaptis.worker.run.preemption import EXIT_PREEMPTED

__all__ = ["LocalLauncher", "OnEvent", "caused_by_peer", "free_port"]

log = logging.getLogger(__name__)

Event = StartEvent | StepEvent | DoneEvent | PreemptedEvent
OnEvent = Callable[[Event], None]

_GRACE_S = 5.0
# Lines that say "a peer went away": the symptom on the surviving ranks, not the cause.
_PEER_GONE = ("connection closed by peer", "connection reset", "broken pipe", "signal 15", "keyboardinterrupt")


def caused_by_peer(cause: str) -> bool:
    """A rank's failure that only follows another's: its peer's exit closed their connection,
    or it was stopped. The rank that failed of itself is the one to report."""
    text = cause.lower()
    return any(s in text for s in _PEER_GONE)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalLauncher:
    """``world_size`` local ranks of one worker configuration, logs under ``workdir``."""

    def __init__(self, config: WorkerConfig, *, world_size: int, workdir: Path, threads: int = 1,
                 linger_s: float = 0.0, metrics_base: int | None = None, device: str = "cpu",
                 python: str = sys.executable, env: dict[str, str] | None = None) -> None:
        self.config = config
        self.world_size = world_size
        self.workdir = workdir
        self.threads = threads
        self.linger_s = linger_s
        self.python = python
        # Ranks on one host cannot share a port: rank r gets base + r (0: each any free port).
        self.metrics_base = metrics_base
        self.device = device  # "cuda": rank r uses GPU r (LOCAL_RANK)
        self.env = dict(env or {})  # on top of this process's environment (e.g. ADAPTIS_SLOWDOWN)
        self.processes: list[subprocess.Popen[str]] = []

    def log_path(self, rank: int) -> Path:
        return self.workdir / f"rank-{rank}.log"

    def run(self, on_event: OnEvent) -> list[DoneEvent]:
        """Run every rank to completion; returns the ``done`` events, by rank."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        cfg_path = self.workdir / "worker.json"
        cfg_path.write_text(self.config.model_dump_json(indent=2))
        port = free_port()
        events: queue.Queue[tuple[int, Event]] = queue.Queue()
        readers = []
        try:
            for rank in range(self.world_size):
                env = dict(os.environ, **self.env, RANK=str(rank), WORLD_SIZE=str(self.world_size),
                           LOCAL_RANK=str(rank if self.device == "cuda" else 0), MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(port), PYTHONUNBUFFERED="1", ADAPTIS_DEVICE=self.device)
                if self.metrics_base is not None:
                    env["ADAPTIS_METRICS_PORT"] = str(self.metrics_base + rank if self.metrics_base else 0)
                cmd = [self.python, "-m", "adaptis", "worker", "--config", str(cfg_path),
                       "--threads", str(self.threads), "--linger-seconds", str(self.linger_s)]
                logf = open(self.log_path(rank), "w")  # noqa: SIM115 - closed with the process
                proc = subprocess.Popen(  # noqa: S603 - our own worker module, a fixed argument list
                    cmd, env=env, stdout=subprocess.PIPE, stderr=logf, text=True,
                    start_new_session=True)  # our Ctrl-C handling, not the tty's
                logf.close()
                self.processes.append(proc)
                t = threading.Thread(target=_read_events, args=(rank, proc.stdout), kwargs={"out": events},
                                     daemon=True)
                t.start()
                readers.append(t)
            return self._watch(events, on_event, readers=readers)
        except BaseException:
            self.stop()
            raise

    def _watch(self, events: queue.Queue[tuple[int, Event]], on_event: OnEvent, *,
               readers: list[threading.Thread]) -> list[DoneEvent]:
        done: dict[int, DoneEvent] = {}
        preempted: set[int] = set()

        def take(rank: int, event: Event) -> None:
            if isinstance(event, DoneEvent):
                done[rank] = event
            elif isinstance(event, PreemptedEvent):
                preempted.add(event.step)
            on_event(event)

        def drain() -> None:  # the ranks exited: their last lines, then what is queued
            for t in readers:
                t.join(timeout=2)
            while not events.empty():
                take(*events.get())

        while True:
            try:
                take(*events.get(timeout=0.2))
                continue
            except queue.Empty:
                pass
            codes = [p.poll() for p in self.processes]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0, EXIT_PREEMPTED)]
            if failed:
                time.sleep(0.5)  # let the other ranks' symptoms land before blaming one
                self.stop()
                raise self._failure(failed)
            if EXIT_PREEMPTED in codes and None not in codes:
                drain()
                step = max(preempted, default=None)
                raise PreemptedError(f"the ranks stopped gracefully after step {step} (SIGTERM); "
                                     "rerun to resume from its checkpoint", step=step)
            if all(c == 0 for c in codes):
                drain()
                return [done[r] for r in sorted(done)]

    def _failure(self, failed: list[int]) -> RankFailedError:
        causes = {r: _cause(self.log_path(r), self.processes[r].returncode) for r in failed}
        primary = [r for r in failed if not caused_by_peer(causes[r])]
        rank = (primary or failed)[0]
        return RankFailedError(
            f"rank {rank} failed: {causes[rank]} (log: {self.log_path(rank)})", rank=rank, cause=causes[rank])

    def request_stop(self) -> None:
        """SIGTERM every rank still running and return: :meth:`run` goes on watching them end
        (a re-plan stops the ranks this way, from the event callback)."""
        for p in self.processes:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        """SIGTERM every rank still running, SIGKILL those still there after the grace period."""
        for p in self.processes:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + _GRACE_S
        for p in self.processes:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _read_events(rank: int, stream: IO[str] | None, *, out: queue.Queue[tuple[int, Event]]) -> None:
    if stream is None:
        return
    for line in stream:
        try:
            event = parse_event_line(line)
        except ValueError as err:
            log.warning("rank %d: unreadable event line %r: %s", rank, line[:200], err)
            continue
        if event is not None:
            out.put((rank, event))


def _cause(log_path: Path, code: int | None) -> str:
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        return f"killed by signal {name}"
    try:
        lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        lines = []
    # The last non-log line is the exception (``XError: message``) or the CLI's one-line error.
    for line in reversed(lines):
        if not line.startswith(("[rank", "W1", "E1", "I1")) and "Traceback" not in line:
            return f"{line} (exit status {code})"
    return f"exit status {code}"
