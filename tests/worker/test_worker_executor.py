"""Executor in one process (a real 1-rank gloo group): plan checks, several stages on one rank
with split B/W against the reference, clipping and the optimizer step, transfer accounting."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch
from worker_harness import SMALL_MODEL, one_rank_group  # noqa: F401 (the fixture)

from adaptis.api.job import TrainingSpec, WorkerConfig
from adaptis.api.plan import Plan
from adaptis.worker.data.sources import SyntheticTokens
from adaptis.worker.errors import PlanMismatchError
from adaptis.worker.runtime import slowdown
from adaptis.worker.runtime.components import action_timer
from adaptis.worker.runtime.executor import (
    Executor,
    activation_bytes,
    parse_plan,
    transfer_bytes,
)
from adaptis.worker.runtime.timers import CudaActionTimer, WallActionTimer
from adaptis.worker.testing import reference_step

TRAIN = TrainingSpec(microbatches=3, microbatch_size=2, sequence_length=8, grad_clip=None, seed=5)
N_LAYERS = 5


pytestmark = pytest.mark.usefixtures("one_rank_group")  # a real 1-rank gloo group (worker_harness)


def _config(plan: Plan, training: TrainingSpec = TRAIN) -> WorkerConfig:
    return WorkerConfig(model=SMALL_MODEL, training=training, plan=plan.model_dump(mode="json"))


def _three_stages_split() -> Plan:
    m = TRAIN.microbatches
    acts = [(k, s, mb) for mb in range(m) for k, s in (("F", 0), ("F", 1), ("F", 2))]
    acts += [(k, s, mb) for mb in reversed(range(m)) for k, s in (("B", 2), ("B", 1), ("B", 0))]
    acts += [("W", s, mb) for mb in range(m) for s in range(3)]
    return Plan(stages=[(0, 2), (2, 3), (3, 5)], placement=[[0, 1, 2]], actions=[acts])


def _mixed_first_stage() -> Plan:
    """The planner's W tail (``Policy.fuse_first_from``): three stages on one rank, stage 0 runs
    B then W for microbatch 0 and fused BW for 1 and 2."""
    m = TRAIN.microbatches
    acts = [("F", s, mb) for mb in range(m) for s in range(3)]
    for mb in reversed(range(m)):
        acts += [("B", 2, mb), ("B", 1, mb), ("B", 0, mb) if mb == 0 else ("BW", 0, mb)]
    acts += [("W", s, mb) for mb in range(m) for s in (1, 2)] + [("W", 0, 0)]
    return Plan(stages=[(0, 2), (2, 3), (3, 5)], placement=[[0, 1, 2]], actions=[acts])


def _step_matches_the_reference(plan: Plan) -> Any:
    """One step of ``plan`` on this rank: the reference's loss and gradients; its stats."""
    ex = Executor(_config(plan), rank=0, world_size=1, device=torch.device("cpu"))
    batch = SyntheticTokens(vocab_size=SMALL_MODEL.vocab_size, sequence_length=8, seed=5).batch(
        position=0, sequences=6)
    stats = ex.step(batch)
    ref = reference_step(SMALL_MODEL, TRAIN, batch=batch)
    assert stats.loss == pytest.approx(ref.loss, rel=1e-6)
    grads = {k: p.grad for k, p in ex.named_parameters().items()}
    for name, g in ref.grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7)
    return stats


def test_stage0_split_then_fused_matches_the_reference() -> None:
    stats = _step_matches_the_reference(_mixed_first_stage())
    assert {"F", "B", "W", "BW"} <= set(stats.busy_by_kind)


def test_three_stages_on_one_rank_match_the_reference() -> None:
    stats = _step_matches_the_reference(_three_stages_split())
    assert set(stats.busy_by_kind) == {"F", "B", "W"} and stats.busy_seconds[0] > 0
    assert stats.sent_bytes == stats.received_bytes == 0  # one rank: nothing crosses
    assert 0.0 <= stats.bubble_ratio < 1.0


def test_clipping_bounds_the_update_and_training_lowers_the_loss() -> None:
    clipped = TRAIN.model_copy(update={"grad_clip": 1e-3})
    ex = Executor(_config(_three_stages_split(), clipped), rank=0, world_size=1, device=torch.device("cpu"))
    src = SyntheticTokens(vocab_size=SMALL_MODEL.vocab_size, sequence_length=8, seed=5)
    before = {k: p.detach().clone() for k, p in ex.named_parameters().items()}
    stats = ex.step(src.batch(position=0, sequences=6))
    assert stats.grad_norm > 1e-3
    total = sum(float(p.grad.double().pow(2).sum()) for p in ex.params if p.grad is not None) ** 0.5
    assert total == pytest.approx(1e-3, rel=1e-3)  # the gradients were scaled to the bound
    assert any(not torch.equal(before[k], p) for k, p in ex.named_parameters().items())
    free = Executor(_config(_three_stages_split(), TRAIN.model_copy(update={"grad_clip": 1.0})), rank=0,
                    world_size=1, device=torch.device("cpu"))
    losses = [free.step(src.batch(position=0, sequences=6)).loss for _ in range(6)]
    assert losses[-1] < losses[0]


def test_plans_that_do_not_fit_the_model_or_world_are_rejected() -> None:
    short = Plan(stages=[(0, 4)], placement=[[0]],
                 actions=[[(k, 0, mb) for k in ("F", "BW") for mb in range(3)]])
    with pytest.raises(PlanMismatchError, match="model has 5"):
        Executor(_config(short), rank=0, world_size=1, device=torch.device("cpu"))
    two = Plan(stages=[(0, 2), (2, 5)], placement=[[0], [1]],
               actions=[[("F", 0, mb) for mb in range(3)] + [("BW", 0, mb) for mb in range(3)],
                        [("F", 1, mb) for mb in range(3)] + [("BW", 1, mb) for mb in range(3)]])
    with pytest.raises(PlanMismatchError, match="devices"):
        Executor(_config(two), rank=0, world_size=1, device=torch.device("cpu"))
    with pytest.raises(PlanMismatchError):
        Executor(WorkerConfig(model=SMALL_MODEL, training=TRAIN, plan={"stages": "nonsense"}),
                 rank=0, world_size=1, device=torch.device("cpu"))


def test_the_worker_reads_the_packed_plan_the_operator_writes() -> None:
    # The operator's ConfigMap carries the actions packed (adaptis.api.plan_packing).
    plan = _three_stages_split()
    packed = WorkerConfig(model=SMALL_MODEL, training=TRAIN, plan=plan.packed())
    assert "actions" not in packed.plan
    assert parse_plan(packed, world_size=1) == plan
    broken = WorkerConfig(model=SMALL_MODEL, training=TRAIN,
                          plan={**plan.packed(), "actionsPacked": "apk1:AAAA"})
    with pytest.raises(PlanMismatchError, match="corrupt packed plan"):
        Executor(broken, rank=0, world_size=1, device=torch.device("cpu"))


def test_transfer_bytes_count_cross_rank_boundaries_only() -> None:
    plan = Plan(stages=[(0, 1), (1, 3), (3, 4), (4, 5)], placement=[[0, 3], [1, 2]],
                actions=[[("F", 0, 0), ("F", 3, 0), ("BW", 3, 0), ("BW", 0, 0)],
                         [("F", 1, 0), ("F", 2, 0), ("B", 2, 0), ("W", 2, 0), ("B", 1, 0), ("W", 1, 0)]])
    # rank 0: F0 sends, F3 receives, BW3 sends a gradient back, BW0 receives one.
    assert transfer_bytes(plan, rank=0, activation_bytes=10) == (20, 20)
    # rank 1: F1 receives, F2 sends; B2 receives, B1 sends (1->2 stays on the rank).
    assert transfer_bytes(plan, rank=1, activation_bytes=10) == (20, 20)
    # The first and last stages apart: stage 0 receives no input and sends no gradient back.
    two = Plan(stages=[(0, 2), (2, 5)], placement=[[0], [1]],
               actions=[[("F", 0, 0), ("BW", 0, 0)], [("F", 1, 0), ("BW", 1, 0)]])
    assert [transfer_bytes(two, rank=r, activation_bytes=10) for r in (0, 1)] == [(10, 10), (10, 10)]


@pytest.mark.parametrize(("busy", "iteration", "rank", "pipeline", "own"), [
    # Three ranks, a 10 s step: busy 10, 8, 6 s -> idle 0 + 2 + 4 of 30 rank-seconds.
    ((10.0, 8.0, 6.0), 10.0, 2, 0.2, 0.4),
    ((10.0, 8.0, 6.0), 10.0, 0, 0.2, 0.0),
    # No idle time at all, and a rank whose clock ran past the barrier (busy > iteration).
    ((4.0, 4.0), 4.0, 1, 0.0, 0.0),
    ((5.0, 3.0), 4.0, 0, 0.0, 0.0),
    # An empty step reports no bubble rather than dividing by zero.
    ((0.0, 0.0), 0.0, 0, 0.0, 0.0),
])
def test_bubble_ratios_from_known_timings(busy: tuple[float, ...], iteration: float, rank: int,
                                          pipeline: float, own: float) -> None:
    from adaptis.worker.runtime.executor import StepStats

    stats = StepStats(rank=rank, loss=0.0, iteration_seconds=iteration, step_seconds=iteration,
                      busy_seconds=busy, busy_by_kind={}, grad_norm=0.0, sent_bytes=0,
                      received_bytes=0, peak_memory_bytes=0)
    assert stats.bubble_ratio == pytest.approx(pipeline)
    assert stats.rank_bubble_ratio == pytest.approx(own)


def test_a_plan_made_for_another_precision_is_refused() -> None:
    plan = _three_stages_split()
    bf16 = Plan(stages=plan.stages, placement=plan.placement, actions=plan.actions, precision="bf16")
    # training.precision auto is fp32 on a CPU.
    with pytest.raises(PlanMismatchError, match=r"made for precision bf16, but this worker runs fp32 "
                                                r"\(training.precision auto on cpu\); plan again"):
        Executor(_config(bf16), rank=0, world_size=1, device=torch.device("cpu"))
    fp32 = Plan(stages=plan.stages, placement=plan.placement, actions=plan.actions, precision="fp32")
    assert Executor(_config(fp32), rank=0, world_size=1, device=torch.device("cpu")).precision == "fp32"


def test_each_step_uses_the_schedules_rate_for_its_step() -> None:
    # Linear warm-up over 2 steps then linear decay to 0.1 x lr at the last of 7 steps:
    # 1/3 and 2/3 of 0.03, then 0.03, 0.03 - 1 x 0.027/4, ..., 0.003 at step 6.
    opt = TRAIN.optimizer.model_copy(update={"lr": 0.03, "schedule": "linear", "warmup_steps": 2,
                                             "min_lr_ratio": 0.1})
    training = TRAIN.model_copy(update={"optimizer": opt, "steps": 7})
    ex = Executor(_config(_three_stages_split(), training), rank=0, world_size=1, device=torch.device("cpu"))
    batch = SyntheticTokens(vocab_size=SMALL_MODEL.vocab_size, sequence_length=8, seed=5).batch(
        position=0, sequences=6)
    assert ex.step(batch).learning_rate == pytest.approx(0.01)  # set at construction: step 0
    for step, rate in ((1, 0.02), (2, 0.03), (3, 0.03 - 0.027 / 4), (6, 0.003)):
        assert ex.set_learning_rate(step=step) == pytest.approx(rate)
        assert [g["lr"] for g in ex.optimizer.param_groups] == [pytest.approx(rate)]
    assert ex.step(batch).learning_rate == pytest.approx(0.003)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_the_optimizer_is_the_one_the_job_names_over_every_parameter_once(name: str) -> None:
    opt = TRAIN.optimizer.model_copy(update={"name": name, "weight_decay": 0.25})
    ex = Executor(_config(_three_stages_split(), TRAIN.model_copy(update={"optimizer": opt})), rank=0,
                  world_size=1, device=torch.device("cpu"))
    assert type(ex.optimizer) is {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}[name]
    (group,) = ex.optimizer.param_groups
    assert group["weight_decay"] == 0.25
    # The tied embedding and head on one rank are one Parameter, under two names, optimized once.
    named = ex.named_parameters()
    assert named["0.weight"] is named["4.proj.weight"]
    assert len(group["params"]) == len({id(p) for p in named.values()}) == len(named) - 1
    assert {id(p) for p in group["params"]} == {id(p) for p in named.values()}


def test_one_rank_step_reports_its_own_timings_and_memory() -> None:
    import resource
    import time

    ex = Executor(_config(_three_stages_split()), rank=0, world_size=1, device=torch.device("cpu"))
    assert ex.saves_checkpoint and ex.checkpoint_rank == 0 and ex.holds_first and ex.holds_last
    batch = SyntheticTokens(vocab_size=SMALL_MODEL.vocab_size, sequence_length=8, seed=5).batch(
        position=0, sequences=6)
    before = time.perf_counter()
    stats = ex.step(batch)
    took = time.perf_counter() - before
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert before < ex.started_at < time.perf_counter()
    assert stats.rank == 0 and stats.reduce_wait_seconds == 0.0
    # One rank: the pipeline part is its busy time and some bookkeeping; the step adds the
    # optimizer and the stats exchange.
    (busy,) = stats.busy_seconds
    assert busy == pytest.approx(sum(stats.busy_by_kind.values()))
    assert 0 < busy < stats.iteration_seconds < stats.step_seconds < took
    assert 10 * 2**20 < stats.peak_memory_bytes <= rss  # bytes: a torch process has tens of MiB


def test_an_activation_is_microbatch_by_sequence_by_hidden_elements() -> None:
    # 2 sequences of 8 tokens, hidden 16: 256 elements of 4 bytes; 3 x 5 x 7 of 2 bytes in bf16.
    assert activation_bytes(TRAIN, hidden=16, dtype=torch.float32) == 1024
    odd = TRAIN.model_copy(update={"microbatch_size": 3, "sequence_length": 5})
    assert activation_bytes(odd, hidden=7, dtype=torch.bfloat16) == 210


def test_zero_1_over_a_single_replica_is_the_plain_optimizer() -> None:
    config = WorkerConfig(model=SMALL_MODEL, training=TRAIN, plan=_three_stages_split().model_dump(mode="json"),
                          zero_stage=1)
    ex = Executor(config, rank=0, world_size=1, device=torch.device("cpu"))
    assert type(ex.optimizer) is torch.optim.AdamW and ex.reducer is None and ex.saves_checkpoint


def test_a_tied_hugging_face_model_on_one_rank_names_and_trains_its_shared_weight_once() -> None:
    from hf_harness import hf_model

    gemma = hf_model("tiny-gemma")  # 6 layers: embedding, 4 decoder layers, the tied head
    training = TrainingSpec(microbatches=2, microbatch_size=2, sequence_length=8, grad_clip=None, seed=3)
    acts = [("F", s, mb) for mb in range(2) for s in (0, 1)] + [("BW", s, mb) for mb in range(2) for s in (1, 0)]
    plan = Plan(stages=[(0, 3), (3, 6)], placement=[[0, 1]], actions=[acts])
    ex = Executor(WorkerConfig(model=gemma, training=training, plan=plan.model_dump(mode="json")), rank=0,
                  world_size=1, device=torch.device("cpu"))
    named = ex.named_parameters()
    assert "model.embed_tokens.weight" in named and "lm_head.weight" not in named
    assert len(named) == len(ex.params)  # every Parameter under one name, optimized once
    batch = SyntheticTokens(vocab_size=256, sequence_length=8, seed=3).batch(position=0, sequences=4)
    before = named["model.embed_tokens.weight"].detach().clone()
    stats = ex.step(batch)
    assert 0 < stats.loss < 2 * math.log(256)  # about ln(vocabulary) at initialisation
    assert not torch.equal(before, named["model.embed_tokens.weight"])


def test_the_gradient_norm_is_summed_in_double_precision() -> None:
    # The norm decides whether clipping binds: it is the float64 norm of the gradients as they
    # are (no clipping here), to double rounding; a float32 sum is off by ~1e-7 of it.
    ex = Executor(_config(_three_stages_split()), rank=0, world_size=1, device=torch.device("cpu"))
    batch = SyntheticTokens(vocab_size=SMALL_MODEL.vocab_size, sequence_length=8, seed=5).batch(
        position=0, sequences=6)
    stats = ex.step(batch)
    squares = [float(p.grad.double().pow(2).sum()) for p in ex.params if p.grad is not None]
    assert stats.grad_norm == pytest.approx(math.sqrt(math.fsum(squares)), rel=1e-12)


def _forward_calls(ex: Executor) -> list[int]:
    """A counter per layer of this rank's stages, counting each forward the layer runs."""
    calls = [0] * sum(len(m.layers) for m in ex.modules)
    layers = [layer for m in ex.modules for layer in m.layers]
    for i, layer in enumerate(layers):
        layer.register_forward_hook(lambda *_a, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


@pytest.mark.parametrize("recompute", [None, [False, True]])
def test_only_the_stages_the_plan_recomputes_run_their_forward_twice(recompute: list[bool] | None) -> None:
    # Fused backwards (a recomputed stage must fuse them): the forward once per microbatch, and
    # once more in the backward of a recomputed stage. Stage 0 is the embedding, stage 1 the
    # 3 blocks and the head.
    m = TRAIN.microbatches
    acts = [("F", s, mb) for mb in range(m) for s in (0, 1)] + [("BW", s, mb) for mb in range(m) for s in (1, 0)]
    plan = Plan(stages=[(0, 1), (1, 5)], placement=[[0, 1]], actions=[acts], recompute=recompute)
    ex = Executor(_config(plan), rank=0, world_size=1, device=torch.device("cpu"))
    calls = _forward_calls(ex)
    ex.step(SyntheticTokens(vocab_size=SMALL_MODEL.vocab_size, sequence_length=8, seed=5).batch(
        position=0, sequences=6))
    # (torch stops a recomputation once it has what the backward needs: the head, last, may
    # not run again.)
    assert calls[0] == m
    if recompute:
        assert max(calls[1:]) == 2 * m and min(calls[1:]) >= m, calls
    else:
        assert calls[1:] == [m] * 4


def test_the_slowdown_knob_slows_the_rank_it_names_only() -> None:
    from adaptis.worker.runtime.slowdown import Slowdown, SlowedTimer

    cpu = torch.device("cpu")
    timer = action_timer(rank=0, device=cpu, environ={"ADAPTIS_SLOWDOWN": "0:3@2"})
    assert isinstance(timer, SlowedTimer) and timer.slowdown == Slowdown(rank=0, factor=3.0, step=2)
    assert not isinstance(action_timer(rank=0, device=cpu, environ={"ADAPTIS_SLOWDOWN": "1:3@2"}), SlowedTimer)
    ex = Executor(_config(_three_stages_split()), rank=0, world_size=1, device=cpu, timer=timer)
    assert ex.timer is timer


def test_the_action_trace_goes_to_this_ranks_file(tmp_path) -> None:
    from adaptis.worker.runtime.trace import rank_trace_path

    cpu = torch.device("cpu")
    timer = action_timer(rank=0, device=cpu, environ={"ADAPTIS_TRACE": str(tmp_path)})
    ex = Executor(_config(_three_stages_split()), rank=0, world_size=1, device=cpu, timer=timer)
    ex.step(SyntheticTokens(vocab_size=SMALL_MODEL.vocab_size, sequence_length=8, seed=5).batch(
        position=0, sequences=6), number=4)
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == [rank_trace_path(tmp_path, rank=0).name]
    assert json.loads(rank_trace_path(tmp_path, rank=0).read_text())["step"] == 4


def test_a_slowed_gpu_rank_waits_for_its_device_before_stretching_an_action() -> None:
    """A GPU action returns before its kernels finish: the slowdown synchronizes to learn how
    long it took (else it stretches only the launch); on CPU the action is done when it returns."""
    environ = {slowdown.ENV: "1:2@1"}
    # Builds without a GPU: the events come per action.
    gpu = action_timer(rank=1, device=torch.device("cuda"), environ=environ)
    assert isinstance(gpu, slowdown.SlowedTimer) and isinstance(gpu.inner, CudaActionTimer)
    assert gpu._sync is torch.cuda.synchronize
    cpu = action_timer(rank=1, device=torch.device("cpu"), environ=environ)
    assert isinstance(cpu, slowdown.SlowedTimer) and isinstance(cpu.inner, WallActionTimer)
    assert cpu._sync is None
    plain = action_timer(rank=0, device=torch.device("cpu"), environ=environ)
    assert isinstance(plain, WallActionTimer)  # not slowed
