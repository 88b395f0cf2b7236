"""Processes of the integration-test control plane: start, watch, wait for, stop.

This module sits at the bottom of the test control plane (``controlplane.py`` composes it with
``certs.py``, ``kubeconfig.py``, ``components.py``, ``kubeclient.py`` and ``fakenodes.py``).
It knows nothing about Kubernetes: it picks free loopback ports, runs one binary per
:class:`ManagedProcess` with its output in a log file, polls until a predicate or a health URL
answers, and reports a process that died with the tail of its log.  :class:`ControlPlaneError`
is the error every part of the test control plane raises.
"""

from __future__ import annotations

import logging
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Every component listens on loopback only.
HOST = "127.0.0.1"


class ControlPlaneError(RuntimeError):
    """A control-plane process could not be started, or a wait timed out."""


def free_ports(count: int, host: str = HOST) -> list[int]:
    """Return ``count`` distinct TCP ports that are free on ``host`` right now."""
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def wait_until(
    predicate: Callable[[], T | None],
    *,
    timeout: float,
    interval: float = 0.5,
    what: str = "condition",
) -> T:
    """Call ``predicate`` until it returns a truthy value and return it.

    Exceptions raised by ``predicate`` count as "not yet", except :class:`ControlPlaneError`,
    which is fatal (e.g. the process being waited for has exited) and propagates at once.
    Raises :class:`ControlPlaneError` naming ``what`` (and the last exception) after ``timeout``
    seconds.
    """
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            result = predicate()
            if result:
                return result
        except ControlPlaneError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure means "not yet"
            last_error = exc
        if time.monotonic() >= deadline:
            detail = f": last error: {last_error!r}" if last_error else ""
            raise ControlPlaneError(f"timed out after {timeout:.0f}s waiting for {what}{detail}")
        time.sleep(interval)


def tail(path: Path, lines: int = 40) -> str:
    """Return the last ``lines`` lines of a text file ('' if it does not exist)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` asking Linux to SIGTERM the child when the test process dies (no
    orphans on a crash); None where there is no prctl. libc is loaded here, in the parent: the
    child only makes the one foreign call, no import and no lock between fork and exec."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except OSError:
        return None
    pr_set_pdeathsig, sigterm = 1, int(signal.SIGTERM)

    def in_child() -> None:
        prctl(pr_set_pdeathsig, sigterm)

    return in_child


@dataclass
class ManagedProcess:
    """One control-plane process and its log file."""

    name: str
    args: list[str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = field(default=None, repr=False)

    def start(self, env: Mapping[str, str]) -> None:
        """Start the process with stdout and stderr going to its log file."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        self._log.write(f"$ {' '.join(self.args)}\n".encode())
        self._log.flush()
        logger.info("starting %s (log %s)", self.name, self.log_path)
        self.popen = subprocess.Popen(  # binaries we built, fixed arguments
            self.args,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=dict(env),
            start_new_session=True,
            # prctl has no spawn-time spelling in subprocess; in_child imports nothing and takes
            # no lock of ours (above).
            preexec_fn=_die_with_parent(),  # noqa: PLW1509 - one libc call, loaded beforehand
        )

    @property
    def running(self) -> bool:
        """True while the process is alive."""
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the process log."""
        return tail(self.log_path, lines)

    def check_alive(self) -> None:
        """Raise :class:`ControlPlaneError` with the log tail if the process has exited."""
        if self.popen is not None and self.popen.poll() is not None:
            raise ControlPlaneError(
                f"{self.name} exited with code {self.popen.returncode}; "
                f"last lines of {self.log_path}:\n{self.log_tail()}"
            )

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the process, SIGKILL it after ``grace`` seconds, and close its log."""
        if self.popen is not None and self.popen.poll() is None:
            logger.info("stopping %s (pid %d)", self.name, self.popen.pid)
            self.popen.terminate()
            try:
                self.popen.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop in %.0fs, killing it", self.name, grace)
                self.popen.kill()
                self.popen.wait(timeout=grace)
        if self._log is not None:
            self._log.close()


def wait_healthy(
    process: ManagedProcess,
    url: str,
    *,
    timeout: float,
    context: ssl.SSLContext | None = None,
) -> None:
    """Wait until ``url`` answers 200, failing at once (with its log) if ``process`` exits.

    Raises :class:`ControlPlaneError` with the tail of the process log after ``timeout``
    seconds.
    """
    started = time.monotonic()

    def healthy() -> bool:
        process.check_alive()
        try:
            with urllib.request.urlopen(url, timeout=5, context=context) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError, ssl.SSLError):
            return False

    try:
        wait_until(healthy, timeout=timeout, interval=0.3, what=f"{process.name} health")
    except ControlPlaneError as exc:
        if not process.running:
            raise
        raise ControlPlaneError(
            f"{process.name} did not become healthy at {url} in {timeout:.0f}s; "
            f"last lines of {process.log_path}:\n{process.log_tail()}"
        ) from exc
    logger.info("%s healthy after %.1fs", process.name, time.monotonic() - started)


def insecure_ssl_context() -> ssl.SSLContext:
    """A TLS context that accepts any server certificate (for health probes only)."""
    # controller-manager and scheduler serve /healthz with a throw-away self-signed cert.
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context
