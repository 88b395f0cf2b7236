"""The phases of a step (data, pipeline, post-pipeline) add up to the step, and a delay put in
one phase shows up in that phase: 2 real gloo ranks run the worker loop (run_worker), with a
slow data source on rank 0 and a slow optimizer step on rank 1."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from worker_harness import run_ranks, small_config

from adaptis.api.events import WorkerEvent, event_line, parse_event_line
from adaptis.worker.runtime.executor import StepStats

STEPS = 3
# Delays far above a tiny model's pipeline part (tens of ms; a few hundred on 2 cores shared by
# a dozen busy processes), and each below the other's sum with it, so the bounds below hold on
# a loaded machine and still tell the phases apart.
DATA_SLEEP_S = 1.0  # rank 0's batch fetch; rank 1 waits for it at the common start
POST_SLEEP_S = 0.8  # rank 1's optimizer step; rank 0 waits for it in the stats all-gather
SKEW_S = 0.25  # how much later than the sleeper a waiting rank may enter the phase (loaded CI)


def _phase_ranks(rank: int, world: int, port: int, config_json: str, out_dir: str) -> None:
    import torch

    import adaptis.worker.run.runner as runner_mod
    import adaptis.worker.runtime.components as components_mod
    from adaptis.api.job import WorkerConfig
    from adaptis.worker.run.runner import RankEnv, run_worker

    torch.set_num_threads(1)
    open_source, make_optimizer = runner_mod.open_source, components_mod.make_optimizer

    class SlowSource:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def batch(self, *, position: int, sequences: int) -> Any:
            time.sleep(DATA_SLEEP_S)
            return self.inner.batch(position=position, sequences=sequences)

    def slow_open(*args: Any, **kwargs: Any) -> Any:
        source = open_source(*args, **kwargs)
        return SlowSource(source) if rank == 0 else source

    def slow_optimizer(*args: Any, **kwargs: Any) -> Any:
        opt = make_optimizer(*args, **kwargs)
        if rank == 1:
            step = opt.step

            def slow_step(*a: Any, **k: Any) -> Any:
                time.sleep(POST_SLEEP_S)
                return step(*a, **k)

            opt.step = slow_step  # type: ignore[method-assign]
        return opt

    runner_mod.open_source = slow_open  # type: ignore[assignment]
    components_mod.make_optimizer = slow_optimizer  # type: ignore[assignment]
    events: list[WorkerEvent] = []
    env = RankEnv(rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port,
                  timeout_s=60, device="cpu")
    run_worker(WorkerConfig.model_validate_json(config_json), env=env, emit=events.append)
    (Path(out_dir) / f"events-{rank}.txt").write_text("".join(event_line(e) + "\n" for e in events))


@pytest.fixture(scope="module")
def events(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[WorkerEvent]]:
    out = tmp_path_factory.mktemp("phases")
    config = small_config(steps=STEPS)
    assert config.plan["stages"] and len(config.plan["placement"]) == 2
    run_ranks(_phase_ranks, world=2, args=(config.model_dump_json(), str(out)), timeout_s=180)
    return {r: [e for e in map(parse_event_line, (out / f"events-{r}.txt").read_text().splitlines()) if e is not None]
            for r in range(2)}


@pytest.mark.parametrize("rank", [0, 1])
def test_phases_add_up_to_the_step(rank: int, events: dict[int, list[WorkerEvent]]) -> None:
    steps = [e for e in events[rank] if e.event == "step"]
    (done,) = [e for e in events[rank] if e.event == "done"]
    assert len(steps) == STEPS
    for e in steps:
        # pipeline + post-pipeline is the step from the common start; the clamp at 0 never bites.
        assert e.iteration_seconds + e.post_pipeline_seconds == pytest.approx(e.step_seconds,
                                                                                   abs=1e-9)
        assert e.busy_seconds + e.idle_seconds == pytest.approx(e.iteration_seconds, abs=1e-3)
    # The loop's wall time is the steps' phases plus the bookkeeping between them (a metrics
    # update and an event: well under a millisecond each).
    phases = sum(e.data_seconds + e.step_seconds for e in steps)
    assert phases <= done.seconds + 1e-6
    assert done.seconds - phases < 0.05 * STEPS, (done.seconds, phases)


@pytest.mark.parametrize("rank", [0, 1])
def test_an_injected_delay_shows_up_in_its_phase(rank: int, events: dict[int, list[WorkerEvent]]) -> None:
    for e in (e for e in events[rank] if e.event == "step"):
        # Both ranks: rank 0 fetches slowly, rank 1 waits for it at the common start. Below
        # both delays together: the other delay (or an earlier step's) did not land here too.
        # The waiting rank's phase starts a little after the sleeper's (it left the last
        # collective later), so it may come up short by that skew.
        low = DATA_SLEEP_S - (SKEW_S if rank == 1 else 0.0)
        assert low <= e.data_seconds < DATA_SLEEP_S + POST_SLEEP_S, e
        # Both ranks: rank 1 steps its optimizer slowly, rank 0 waits in the stats all-gather.
        # The phase starts at the slowest rank's pipeline end (the step minus the job's iteration,
        # a max over the ranks), so the sleeper too may come up short by the ranks' skew (1.7 ms
        # seen with two busy loops on the 2 cores).
        low = POST_SLEEP_S - SKEW_S
        assert low <= e.post_pipeline_seconds < POST_SLEEP_S + DATA_SLEEP_S, e
        # Neither delay leaks into the pipeline part.
        assert e.iteration_seconds < min(DATA_SLEEP_S, POST_SLEEP_S), e


@pytest.mark.parametrize(("iteration", "step", "post"), [
    (0.5, 0.6, 0.1),
    (0.5, 0.5, 0.0),
    # A rank whose clock stopped before the last rank's pipeline end (barrier skew): no negative.
    (0.5, 0.4999, 0.0),
])
def test_post_pipeline_time_from_known_timings(iteration: float, step: float, post: float) -> None:
    stats = StepStats(rank=0, loss=0.0, iteration_seconds=iteration, step_seconds=step,
                      busy_seconds=(0.4,), busy_by_kind={}, grad_norm=0.0, sent_bytes=0,
                      received_bytes=0, peak_memory_bytes=0)
    assert stats.post_pipeline_seconds == pytest.approx(post)
