"""Where a rank sits, from the environment torch's launchers (torchrun, the operator's pods,
``adaptis run``) give it, and the metrics port it serves on (several ranks share a pod)."""

from __future__ import annotations

from worker_harness import SMALL_MODEL

from adaptis.api.job import TrainingSpec, WorkerConfig
from adaptis.worker.run.runner import RankEnv, metrics_port


def _config(port: int | None) -> WorkerConfig:
    return WorkerConfig(job_name="t", model=SMALL_MODEL, training=TrainingSpec(),
                        plan={"stages": [[0, 5]], "placement": [[0]], "actions": [[]]},
                        metrics_port=port)


def test_torchrun_environment_is_read() -> None:
    env = RankEnv.from_environ({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                                "MASTER_ADDR": "job-worker-0.job-workers.ns.svc",
                                "MASTER_PORT": "29500"})
    assert (env.rank, env.world_size, env.local_rank, env.master_port) == (5, 8, 1, 29500)
    assert env.metrics_port is None


def test_ranks_of_one_pod_serve_metrics_on_base_plus_local_rank() -> None:
    env = RankEnv.from_environ({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1"})
    assert metrics_port(_config(9400), env=env) == 9401
    assert metrics_port(_config(None), env=env) is None  # off stays off
    assert metrics_port(_config(0), env=env) == 0  # any free port
    # adaptis run gives each local rank a port of its own: that one wins.
    own = RankEnv.from_environ({"LOCAL_RANK": "1", "ADAPTIS_METRICS_PORT": "9500"})
    assert metrics_port(_config(9400), env=own) == 9500
