"""One rank's whole run: process group, executor, metrics server, checkpoints, the step loop.

Sits between the CLI (``adaptis worker``, the pods' entry point, and the ranks ``adaptis run``
launches) and the executor. It reports progress as the events of :mod:`adaptis.api.events`, one
JSON line each on stdout (``start`` with the metrics port and the resumed step, ``step`` with the
step's loss, times and bubble ratios, ``done`` with the totals, or ``preempted`` with the step it
checkpointed when SIGTERM stopped it, :mod:`adaptis.worker.run.preemption`), which the local
launcher parses and a pod's log keeps.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TextIO

import torch
import torch.distributed as dist

from adaptis.api.events import DoneEvent, PreemptedEvent, StartEvent, StepEvent, event_line
from adaptis.api.job import WorkerConfig
from adaptis.api.plan import predicted_seconds
from adaptis.worker.data.sources import open_source, shard_position
from adaptis.worker.run.metrics import WorkerMetrics
from adaptis.worker.run.preemption import StopRequest
from adaptis.worker.runtime.components import action_timer
from adaptis.worker.runtime.executor import Executor, StepStats
from adaptis.worker.state.checkpoint import agree_resume_step, load_checkpoint, save_checkpoint

__all__ = ["Emit", "RankEnv", "print_events", "run_worker"]

log = logging.getLogger(__name__)

Emit = Callable[[StartEvent | StepEvent | DoneEvent | PreemptedEvent], None]


@dataclass(frozen=True, slots=True)
class RankEnv:
    """Where this rank sits, as torch's launchers describe it (RANK, WORLD_SIZE, MASTER_*)."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    local_rank: int = 0
    timeout_s: float = 300.0
    metrics_port: int | None = None  # overrides the config's (local ranks share one host)
    device: str | None = None  # "cpu" or "cuda"; None: CUDA when available

    @classmethod
    def from_environ(cls, env: dict[str, str] | None = None) -> RankEnv:
        e = dict(os.environ if env is None else env)
        try:
            return cls(rank=int(e.get("RANK", "0")), world_size=int(e.get("WORLD_SIZE", "1")),
                       master_addr=e.get("MASTER_ADDR", "127.0.0.1"),
                       master_port=int(e.get("MASTER_PORT", "29500")),
                       local_rank=int(e.get("LOCAL_RANK", "0")),
                       timeout_s=float(e.get("ADAPTIS_PG_TIMEOUT", "300")),
                       metrics_port=int(e["ADAPTIS_METRICS_PORT"]) if e.get("ADAPTIS_METRICS_PORT") else None,
                       device=e.get("ADAPTIS_DEVICE") or None)
        except ValueError as err:
            raise ValueError(f"bad rank environment (RANK, WORLD_SIZE, MASTER_PORT): {err}") from None


def metrics_port(config: WorkerConfig, *, env: RankEnv) -> int | None:
    """The port this rank serves metrics on: the environment's (``adaptis run`` gives each
    local rank its own), else the config's base + LOCAL_RANK, since the ranks of one pod share
    its network (the operator declares ports base .. base + N - 1); 0: any, None: off."""
    if env.metrics_port is not None:
        return env.metrics_port
    if not config.metrics_port:
        return config.metrics_port
    return config.metrics_port + env.local_rank


def print_events(stream: TextIO = sys.stdout) -> Emit:
    def emit(event: StartEvent | StepEvent | DoneEvent | PreemptedEvent) -> None:
        stream.write(event_line(event) + "\n")
        stream.flush()

    return emit


def _device(env: RankEnv) -> torch.device:
    if env.device == "cpu":
        return torch.device("cpu")
    if env.device == "cuda" or torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


def run_worker(config: WorkerConfig, *, env: RankEnv, emit: Emit,
               linger_s: float = 0.0) -> DoneEvent | PreemptedEvent:
    """Train this rank to ``config.training.steps``; returns the final ``done`` event.

    ``linger_s``: keep serving metrics that long after the last step, so a scrape (Prometheus,
    a test) sees the final values before the process exits."""
    device = _device(env)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank, world_size=env.world_size, timeout=timedelta(seconds=env.timeout_s),
    )
    metrics: WorkerMetrics | None = None
    try:
        # The testing knobs (a slowdown, a trace) are the timer's, from this process's environment.
        timer = action_timer(rank=env.rank, device=device, environ=os.environ)
        executor = Executor(config, rank=env.rank, world_size=env.world_size, device=device, timer=timer)
        metrics = WorkerMetrics(job=config.job_name, rank=env.rank)
        forecast = predicted_seconds(executor.plan.predicted)
        metrics.set_prediction(**forecast)
        want = metrics_port(config, env=env)
        port = metrics.serve(port=want) if want is not None else None
        # SIGTERM during the steps stops the ranks at a step boundary, after a checkpoint.
        with StopRequest(device=device) as stop:
            done = _loop(config, env=env, executor=executor, metrics=metrics, emit=emit, port=port,
                         forecast=forecast, stop=stop)
        if isinstance(done, PreemptedEvent):
            return done
        if linger_s > 0 and port is not None:
            _linger(linger_s, rank=env.rank)
        return done
    finally:
        if metrics is not None:
            metrics.close()
        dist.destroy_process_group()


def _linger(seconds: float, *, rank: int) -> None:
    """Keep serving the final metrics; a stop meanwhile (SIGTERM, Ctrl-C) ends only the wait:
    the training is complete, so the rank still exits as done."""
    try:
        time.sleep(seconds)
    except KeyboardInterrupt:
        log.info("rank %d stopped while lingering after its last step", rank)


@dataclass
class _Progress:
    """Where training stands: steps done, the data position and the job's counters (every
    replica's sequences), as a checkpoint records them."""

    step: int = 0
    position: int = 0
    tokens: int = 0
    samples: int = 0

    def advance(self, *, samples: int, tokens: int) -> None:
        self.step += 1
        self.position += samples
        self.tokens += tokens
        self.samples += samples

    def save(self, ckpt: str, *, executor: Executor) -> None:
        save_checkpoint(ckpt, executor=executor, step=self.step, position=self.position, tokens=self.tokens,
                        samples=self.samples)


def _loop(config: WorkerConfig, *, env: RankEnv, executor: Executor, metrics: WorkerMetrics,
          emit: Emit, port: int | None, forecast: dict[str, float | None],
          stop: StopRequest) -> DoneEvent | PreemptedEvent:
    t = config.training
    per_step = t.microbatches * t.microbatch_size  # sequences of one replica
    # Counters and the data position are the job's: every replica's sequences.
    samples_per_step = per_step * executor.mesh.replicas
    tokens_per_step = samples_per_step * t.sequence_length
    ckpt = config.checkpoint_dir
    now, exact = _resume(config, rank=env.rank, executor=executor, metrics=metrics)
    model = config.model
    source = (open_source(t.data, vocab_size=model.vocab_size, sequence_length=t.sequence_length, seed=t.seed,
                          tokenizer_dirs=model.file_dirs, model_eos=model.eos_token_id)
              if executor.holds_first or executor.holds_last else None)
    emit(StartEvent(rank=env.rank, world_size=env.world_size, pid=os.getpid(), replica=executor.replica,
                    pipeline_rank=executor.pipeline_rank, data_parallel=executor.mesh.replicas,
                    metrics_port=port, resumed_step=now.step, resumed_exact=exact,
                    stages=tuple(executor.stage_ids), precision=executor.precision,
                    predicted_bubble_ratio=forecast["bubble_ratio"],
                    predicted_iteration_seconds=forecast["iteration_seconds"]))
    started = time.perf_counter()
    last: StepStats | None = None
    # The data phase runs from here (the end of the previous step's bookkeeping and checkpoint)
    # to the step's common start: the batch fetch, then the wait for every rank at the barrier.
    data_start = time.perf_counter()
    busy_total = 0.0
    while now.step < t.steps:
        batch = source.batch(position=shard_position(position=now.position, replica=executor.replica,
                                                     sequences=per_step),
                             sequences=per_step) if source is not None else None
        executor.set_learning_rate(step=now.step)  # from the step alone: a resume continues the curve
        last = executor.step(batch, number=now.step + 1)
        busy_total += last.busy_seconds[env.rank]
        data_seconds = executor.started_at - data_start
        now.advance(samples=samples_per_step, tokens=tokens_per_step)
        metrics.record(last, tokens=tokens_per_step, samples=samples_per_step, data_seconds=data_seconds)
        emit(_step_event(last, rank=env.rank, now=now, tokens=tokens_per_step, data_seconds=data_seconds,
                         busy_total=busy_total, precision=executor.precision,
                         predicted=forecast))
        saved = bool(ckpt and config.checkpoint_every and now.step % config.checkpoint_every == 0)
        if saved and executor.joins_checkpoint:
            now.save(ckpt, executor=executor)
        if now.step < t.steps and stop.agreed():
            return _preempted(ckpt, executor=executor, emit=emit, saved=saved, now=now)
        data_start = time.perf_counter()
    done = DoneEvent(rank=env.rank, steps=now.step, tokens=now.tokens, samples=now.samples,
                     seconds=time.perf_counter() - started, loss=last.loss if last else None,
                     bubble_ratio=last.bubble_ratio if last else None)
    emit(done)
    return done


def _resume(config: WorkerConfig, *, rank: int, executor: Executor,
            metrics: WorkerMetrics) -> tuple[_Progress, bool | None]:
    """Where to start: the newest checkpoint every rank has, loaded into the executor and the
    metrics, and whether it restored the optimizer state too (None: a fresh start)."""
    ckpt = config.checkpoint_dir
    found = agree_resume_step(ckpt) if ckpt else None
    if found is None:
        return _Progress(), None
    resumed = load_checkpoint(ckpt, executor=executor, step=found)
    metrics.restore(steps=resumed.step, tokens=resumed.tokens, samples=resumed.samples)
    log.info("rank %d resumed from the checkpoint of step %d", rank, resumed.step)
    return _Progress(step=resumed.step, position=resumed.position, tokens=resumed.tokens,
                     samples=resumed.samples), resumed.exact


def _step_event(last: StepStats, *, rank: int, now: _Progress, tokens: int, data_seconds: float,
                busy_total: float, precision: str, predicted: dict[str, float | None]) -> StepEvent:
    """Rank ``rank``'s event of the step just done (the launcher prints rank 0's)."""
    return StepEvent(
        rank=rank, step=now.step, loss=last.loss, tokens_per_second=tokens / last.step_seconds,
        step_seconds=last.step_seconds, iteration_seconds=last.iteration_seconds, data_seconds=data_seconds,
        post_pipeline_seconds=last.post_pipeline_seconds, predicted_step_seconds=predicted["step_seconds"],
        predicted_post_pipeline_seconds=predicted["post_pipeline_seconds"], bubble_ratio=last.bubble_ratio,
        rank_bubble_ratio=last.rank_bubble_ratio, busy_seconds=last.busy_seconds[rank],
        idle_seconds=last.idle_seconds,
        # Since this process started, as adaptis_busy_seconds_total: the drift detector's input.
        busy_seconds_total=busy_total, grad_norm=last.grad_norm, reduce_wait_seconds=last.reduce_wait_seconds,
        tokens=now.tokens, samples=now.samples, sent_bytes=last.sent_bytes, received_bytes=last.received_bytes,
        peak_memory_bytes=last.peak_memory_bytes, lr=last.learning_rate, precision=precision,
        predicted_bubble_ratio=predicted["bubble_ratio"], predicted_iteration_seconds=predicted["iteration_seconds"])


def _preempted(ckpt: str | None, *, executor: Executor, emit: Emit, saved: bool, now: _Progress) -> PreemptedEvent:
    """Every rank agreed to stop after ``now.step``: checkpoint it (unless just done) and say so."""
    if ckpt and not saved and executor.joins_checkpoint:
        now.save(ckpt, executor=executor)
    event = PreemptedEvent(rank=executor.rank, step=now.step, tokens=now.tokens, samples=now.samples,
                           checkpoint_dir=ckpt or None)
    if not ckpt:
        log.warning("rank %d stopped after step %d without a checkpoint (no checkpoint directory)",
                    executor.rank, now.step)
    emit(event)
    return event
