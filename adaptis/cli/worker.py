"""``adaptis worker --config worker.json``: run one pipeline rank (the worker pods' entry point).

The rank comes from the environment as torch's launchers set it (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, LOCAL_RANK); the operator renders this command into the pods and
``adaptis run`` starts it once per local rank. Progress goes to stdout as ``ADAPTIS_EVENT``
JSON lines, logs to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from pathlib import Path
from types import FrameType

from adaptis.api.errors import SpecError
from adaptis.api.events import DoneEvent, PreemptedEvent
from adaptis.api.job import WorkerConfig


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser("worker", help="run one pipeline rank (the worker pods' entry point)",
                              description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="worker.json (a WorkerConfig document)")
    p.add_argument("--threads", type=int, default=int(os.environ.get("ADAPTIS_TORCH_THREADS", "1")),
                   help="torch intra-op threads of this rank (default: $ADAPTIS_TORCH_THREADS or 1)")
    p.add_argument("--linger-seconds", type=float, default=0.0,
                   help="keep serving metrics this long after the last step")
    p.set_defaults(func=run)


def _load(path: str) -> WorkerConfig:
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as err:
        raise SpecError(f"worker: cannot read {path}: {err.strerror}") from None
    except json.JSONDecodeError as err:
        raise SpecError(f"worker: {path} is not valid JSON: {err}") from None
    try:
        return WorkerConfig.model_validate(doc)
    except ValueError as err:
        raise SpecError(f"worker: {path}: {err}") from None


def _terminate(signum: int, _frame: FrameType | None) -> None:
    # SIGTERM (the launcher, Kubernetes) ends the rank like Ctrl-C does: clean, no traceback.
    raise KeyboardInterrupt(f"signal {signum}")


def run(args: argparse.Namespace) -> int:
    config = _load(args.config)
    from adaptis.worker.errors import WorkerError
    from adaptis.worker.profiling.hardware import configure_host
    from adaptis.worker.run.preemption import EXIT_PREEMPTED
    from adaptis.worker.run.runner import RankEnv, print_events, run_worker

    configure_host(threads=args.threads)
    signal.signal(signal.SIGTERM, _terminate)
    try:
        env = RankEnv.from_environ()
    except ValueError as err:
        raise SpecError(f"worker: {err}") from None
    try:
        done = run_worker(config, env=env, emit=print_events(sys.stdout), linger_s=args.linger_seconds)
    except WorkerError as err:
        print(f"adaptis worker: rank {env.rank}: {err}", file=sys.stderr)
        return 1
    if isinstance(done, PreemptedEvent):  # stopped by SIGTERM after checkpointing a step
        return EXIT_PREEMPTED
    _write_termination_message(done)
    return 0


def _write_termination_message(done: DoneEvent) -> None:
    """Kubernetes shows the file at the pod's terminationMessagePath in the pod status; the
    operator reads the observed bubble ratio from there (small JSON, well under 4 KiB)."""
    path = Path(os.environ.get("ADAPTIS_TERMINATION_LOG", "/dev/termination-log"))
    if not path.is_file() or not os.access(path, os.W_OK):
        return  # the kubelet creates the file in a pod; elsewhere there is nobody to tell
    keys = ("rank", "steps", "loss", "bubble_ratio", "tokens", "seconds")
    doc = done.model_dump(mode="json")
    with contextlib.suppress(OSError):  # not in a pod (e.g. /dev not writable): nothing to report to
        path.write_text(json.dumps({k: doc[k] for k in keys}))
