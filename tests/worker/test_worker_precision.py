"""bf16 and activation recomputation in the executor, in one process (a real 1-rank gloo group).

What is checked: bf16 really runs (every layer's forward under autocast, bf16 between layers,
fp32 master weights and gradients); a plan made for another precision is refused naming both;
recomputation gives the same gradients and keeps far fewer bytes saved for backward (measured
with ``saved_tensors_hooks``: the bytes autograd holds between a forward and its backward).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from worker_harness import SMALL_MODEL, free_port

from adaptis.api.job import TrainingSpec, WorkerConfig
from adaptis.api.plan import Plan
from adaptis.worker.data.sources import Batch, SyntheticTokens
from adaptis.worker.errors import PlanMismatchError
from adaptis.worker.runtime.executor import Executor

M = 3
TRAIN = TrainingSpec(microbatches=M, microbatch_size=2, sequence_length=8, grad_clip=None, seed=5)
STAGES = [(0, 2), (2, 3), (3, 5)]


@pytest.fixture(scope="module", autouse=True)
def one_rank_group() -> Iterator[None]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1, timeout=timedelta(seconds=30))
    yield
    dist.destroy_process_group()


def _plan(recompute: list[bool] | None = None, precision: str | None = None) -> Plan:
    """Three stages on one rank, every forward first (all microbatches in flight), fused BW."""
    acts = [("F", s, mb) for mb in range(M) for s in range(3)]
    acts += [("BW", s, mb) for mb in reversed(range(M)) for s in (2, 1, 0)]
    return Plan(stages=STAGES, placement=[[0, 1, 2]], actions=[acts], recompute=recompute,
                precision=precision)  # type: ignore[arg-type]


def _executor(plan: Plan, precision: str = "fp32") -> Executor:
    training = TRAIN.model_copy(update={"precision": precision})
    config = WorkerConfig(model=SMALL_MODEL, training=training, plan=plan.model_dump(mode="json"))
    return Executor(config, rank=0, world_size=1, device=torch.device("cpu"))


def _batch() -> Batch:
    return SyntheticTokens(vocab_size=SMALL_MODEL.vocab_size, sequence_length=8, seed=5).batch(
        position=0, sequences=M * 2)


def _grads(ex: Executor) -> dict[str, torch.Tensor]:
    return {k: p.grad.detach().clone() for k, p in ex.named_parameters().items()
            if p.grad is not None}


def test_bf16_runs_every_layer_under_autocast_with_bf16_between_layers_and_fp32_masters() -> None:
    ex = _executor(_plan(), precision="bf16")
    seen: list[tuple[str, bool, torch.dtype]] = []

    def record(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        seen.append((type(module).__name__, torch.is_autocast_enabled("cpu"), args[0].dtype))

    for stage in ex.modules:
        for layer in stage.layers:
            layer.register_forward_pre_hook(record)
    stats = ex.step(_batch())
    assert len(seen) == 5 * M
    assert all(autocast for _name, autocast, _dtype in seen), seen
    # Every layer but the embedding (token ids) takes the previous layer's bf16 output,
    # also across the two stage boundaries.
    assert {dtype for name, _a, dtype in seen if name != "Embedding"} == {torch.bfloat16}
    assert all(p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32
               for p in ex.params)
    moments = [s["exp_avg"] for s in ex.optimizer.state.values()]
    assert moments and all(m.dtype == torch.float32 for m in moments)
    fp32 = _executor(_plan()).step(_batch())
    # Same weights and data: close (bf16 rounding at the level of 1e-3) but not the same numbers.
    assert stats.loss == pytest.approx(fp32.loss, rel=2e-3) and stats.loss != fp32.loss


def test_fp32_runs_without_autocast() -> None:
    ex = _executor(_plan(), precision="auto")  # auto on CPU: fp32
    assert ex.precision == "fp32"
    seen: list[bool] = []
    ex.modules[1].layers[0].register_forward_pre_hook(
        lambda m, a: seen.append(torch.is_autocast_enabled("cpu")))
    ex.step(_batch())
    assert seen == [False] * M


def test_a_plan_made_for_another_precision_is_refused_naming_both() -> None:
    with pytest.raises(PlanMismatchError,
                       match="made for precision bf16, but this worker runs fp32"):
        _executor(_plan(precision="bf16"), precision="fp32")
    _executor(_plan(precision="fp32"), precision="auto")  # auto on CPU resolves to the plan's


def _saved_bytes(ex: Executor) -> int:
    """Unique bytes autograd saved for backward over one step (parameters excluded); with every
    forward before any backward, all of them are held at once."""
    params = {p.data_ptr() for p in ex.params}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ex.step(_batch())
    return sum(storages.values())


def test_recompute_gives_the_same_gradients_and_saves_far_fewer_bytes_for_backward() -> None:
    plain, again = _executor(_plan()), _executor(_plan([True, True, True]))
    plain_bytes, again_bytes = _saved_bytes(plain), _saved_bytes(again)
    for name, g in _grads(plain).items():
        torch.testing.assert_close(_grads(again)[name], g, rtol=1e-6, atol=1e-8)
    # What stays per microbatch: each stage's input (int64 token ids, two fp32 hidden states)
    # and the logits the loss saves, outside the stages; the blocks' own activations are gone
    # (measured: 56 kB against 274 kB; the rest is a few scalars of the loss).
    b, s = TRAIN.microbatch_size, TRAIN.sequence_length
    h, v = SMALL_MODEL.hidden, SMALL_MODEL.vocab_size
    kept = M * (b * s * 8 + 2 * b * s * h * 4 + b * s * v * 4)
    assert kept <= again_bytes <= 1.02 * kept, (again_bytes, kept)
    assert plain_bytes > 4 * again_bytes, (plain_bytes, again_bytes)


def test_the_profiler_times_layers_in_the_precision_the_ranks_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from adaptis.api.job import JobSpec
    from adaptis.worker.profiling import profiler
    from adaptis.worker.profiling.job_problem import measure_problem

    seen: list[bool] = []
    build = profiler.build_layer

    def build_and_watch(*args: object, **kwargs: object) -> torch.nn.Module:
        layer = build(*args, **kwargs)  # type: ignore[arg-type]
        layer.register_forward_pre_hook(lambda m, a: seen.append(torch.is_autocast_enabled("cpu")))
        return layer

    monkeypatch.setattr(profiler, "build_layer", build_and_watch)
    spec = JobSpec(model=SMALL_MODEL, training=TRAIN)
    bf16 = measure_problem(spec, devices=1, repeats=1, precision="bf16").expanded_layers()
    assert seen and all(seen)  # every timed forward ran under autocast
    seen.clear()
    fp32 = measure_problem(spec, devices=1, repeats=1).expanded_layers()
    assert seen and not any(seen)
    for h, f in zip(bf16[:-1], fp32[:-1], strict=True):  # bf16 outputs: half the bytes
        assert 2 * h.output_bytes == f.output_bytes > 0
    # The blocks save less (the embedding saves token ids either way).
    for h, f in zip(bf16[1:-1], fp32[1:-1], strict=True):
        assert h.activation_bytes < f.activation_bytes, h.name
