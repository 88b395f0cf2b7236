"""The command the operator puts in a pod of 2 GPUs, run for real: torch's launcher starts two
``adaptis worker`` ranks (gloo on CPU here) that rendezvous through its store, train, and serve
metrics on the base port + LOCAL_RANK."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from worker_harness import free_port, small_config

from adaptis.api.events import parse_event_line
from adaptis.operator.core.records import JobRef
from adaptis.operator.resources.manifests import worker_command

REPO = Path(__file__).resolve().parents[2]


def test_a_two_rank_pod_command_trains_both_ranks(tmp_path: Path) -> None:
    base = free_port()
    config = tmp_path / "worker.json"
    config.write_text(small_config(steps=2, world=2, metrics_port=base).model_dump_json())
    cmd = worker_command(JobRef(name="job", namespace="ns", uid="u"), pod=0, pods=1, per_pod=2)
    assert cmd[:3] == ["python", "-m", "torch.distributed.run"]
    # Here, not in a pod: this interpreter, loopback for rank 0's pod, a free store port.
    cmd[0] = sys.executable
    cmd[cmd.index("--master-addr") + 1] = "127.0.0.1"
    cmd[cmd.index("--master-port") + 1] = str(free_port())
    cmd[cmd.index("--config") + 1] = str(config)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "ADAPTIS_DEVICE": "cpu", "ADAPTIS_TERMINATION_LOG": str(tmp_path / "none"),
           "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    run = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=240, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    events = [e for e in map(parse_event_line, run.stdout.splitlines()) if e is not None]
    starts = {e.rank: e for e in events if e.event == "start"}
    assert sorted(starts) == [0, 1] and {e.world_size for e in starts.values()} == {2}
    assert {r: e.metrics_port for r, e in starts.items()} == {0: base, 1: base + 1}
    assert sorted(e.rank for e in events if e.event == "done") == [0, 1]
