"""A memory cgroup to run a process under, as a pod's memory limit would (cgroup v1 or v2).

Sits beside operator_process.py: the hostile-tenant tests run the operator in one, so a
decompression bomb that blew its memory up would be OOM-killed as in a pod, and they read the
cgroup's peak to bound what the operator used (its planner processes included: children stay
in their parent's cgroup). Needs root and a writable cgroup file system; :func:`available`
says why not, and the tests fail naming it rather than pass without the limit.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path

_ROOT = Path("/sys/fs/cgroup")


def _v2() -> bool:
    return (_ROOT / "cgroup.controllers").exists()


def _base() -> Path:
    return _ROOT if _v2() else _ROOT / "memory"


def available() -> str | None:
    """None when a memory cgroup can be made here, else why not."""
    base = _base()
    if not base.is_dir():
        return f"no memory cgroup hierarchy at {base}"
    if not os.access(base, os.W_OK):
        return f"{base} is not writable (run as root)"
    return None


class MemoryCgroup:
    """A child cgroup of the memory hierarchy with a limit; a process starts inside it through
    :meth:`command`."""

    def __init__(self, name: str, *, limit_bytes: int) -> None:
        self.path = _base() / name
        self.path.mkdir(exist_ok=True)
        self._write("memory.max" if _v2() else "memory.limit_in_bytes", str(limit_bytes))
        self.limit_bytes = limit_bytes

    def _write(self, name: str, value: str) -> None:
        (self.path / name).write_text(value)

    def _read(self, name: str) -> str:
        return (self.path / name).read_text()

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` started inside this cgroup: a shell writes its own PID into cgroup.procs,
        then execs ``argv`` as that same PID. (Not a ``preexec_fn``: that runs Python between
        fork and exec, unsafe in the threaded test process.)"""
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs"), *argv]

    def pids(self) -> set[int]:
        return {int(line) for line in self._read("cgroup.procs").split()}

    def peak_bytes(self) -> int:
        """The most memory the cgroup's processes held at once (v1: page cache included)."""
        return int(self._read("memory.peak" if _v2() else "memory.max_usage_in_bytes"))

    def oom_kills(self) -> int:
        """Processes the kernel killed for the limit."""
        name = "memory.events" if _v2() else "memory.oom_control"
        for line in self._read(name).splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def remove(self) -> None:
        """Remove the (emptied) cgroup; left behind if a process still runs in it."""
        with contextlib.suppress(OSError):
            self.path.rmdir()
