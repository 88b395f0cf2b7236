"""Sequence parallelism (``spec.parallelism.sequenceParallel``): T=2 x P=2 (4 gloo processes)
trains as one process trains the combined batch, and what it shards on the sequence really is
``s / T`` tokens on each rank.

The parity model is the tensor-parallel test's (every zoo block: Mamba, attention, MoE, dense,
and a tied vocabulary-parallel embedding and head), its tolerances too
(tests/worker/test_worker_tensor_parallel.py says why): losses within 1e-5 relative, grad norms
within 1e-4, the first step's gradients within rtol 1e-4 / atol 1e-6, the weights after three
AdamW steps with clipping that binds within atol 5e-4.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from worker_harness import (
    DP_TRAINING,
    PARITY_MODEL,
    assert_bf16_near_fp32,
    dp_parity_ranks,
    init_gloo,
    job_spec,
    run_ranks,
    write_dp_cases,
)

from adaptis.api.job import WorkerConfig
from adaptis.api.plan import Plan
from adaptis.planner.strategies import plan_strategy
from adaptis.worker.data.sources import SyntheticTokens
from adaptis.worker.profiling.job_problem import estimate_problem
from adaptis.worker.testing import reference_step, reference_train

PIPELINE, TENSOR, STEPS = 2, 2, 3


def _plan(name: str) -> Plan:
    outcome = plan_strategy(estimate_problem(job_spec(training=DP_TRAINING), devices=PIPELINE), name)
    assert outcome.plan is not None, f"{name}: {outcome.result.reason}"
    return outcome.plan


@pytest.mark.parametrize("strategy", ["adaptis", "zb-v"])
def test_sequence_parallel_trains_as_one_process(strategy: str, tmp_path: Path) -> None:
    write_dp_cases(tmp_path / "cases.json", {"sp": (_plan(strategy), 0)}, replicas=1, steps=STEPS,
                   tensor=TENSOR, sequence=True)
    run_ranks(dp_parity_ranks, world=PIPELINE * TENSOR, args=(str(tmp_path / "cases.json"), str(tmp_path)),
              timeout_s=600)
    torch.set_num_threads(1)
    t = DP_TRAINING
    source = SyntheticTokens(vocab_size=PARITY_MODEL.vocab_size, sequence_length=t.sequence_length, seed=t.seed)
    reference = reference_train(PARITY_MODEL, t, source=source, steps=STEPS)
    batch = source.batch(position=0, sequences=t.microbatches * t.microbatch_size)
    first = reference_step(PARITY_MODEL, t, batch=batch)
    assert reference.norms[-1] > t.grad_clip, "clipping must bind to be tested"
    ranks = [torch.load(tmp_path / f"sp-{r}.pt") for r in range(PIPELINE * TENSOR)]
    for r, rank in enumerate(ranks):
        assert rank["losses"] == pytest.approx(reference.losses, rel=1e-5), f"rank {r}"
        assert rank["norms"] == pytest.approx(reference.norms, rel=1e-4), f"rank {r}"
        for k, g in rank["first_grads"].items():
            torch.testing.assert_close(g, first.grads[k], rtol=1e-4, atol=1e-6,
                                       msg=lambda m, k=k, r=r: f"rank {r} grad {k}: {m}")
        for k, w in rank["weights"].items():
            torch.testing.assert_close(w, reference.weights[k], rtol=1e-4, atol=5e-4,
                                       msg=lambda m, k=k, r=r: f"rank {r} weight {k}: {m}")
    assert set().union(*(rank["weights"] for rank in ranks)) == set(reference.weights)


def test_bf16_under_sequence_parallelism_stays_within_a_tenth_of_a_percent_of_fp32(tmp_path: Path) -> None:
    """The sequence-parallel norms and collectives under autocast: every step's loss within
    0.1 % of one fp32 process's, and really bf16 (not fp32's numbers)."""
    assert_bf16_near_fp32(tmp_path, plan=_plan("adaptis"), pipeline=PIPELINE, tensor=TENSOR, steps=STEPS, sequence=True)


def _shape_ranks(rank: int, world: int, port: int, config_file: str, out_dir: str) -> None:
    """One step through the executor, recording the local shape of every norm's input and of
    every stage's input and output (what the pipeline sends and receives)."""
    from adaptis.worker.runtime.dtensors import local
    from adaptis.worker.runtime.executor import Executor

    init_gloo(rank, world, port)
    cfg = WorkerConfig.model_validate_json(Path(config_file).read_text())
    ex = Executor(cfg, rank=rank, world_size=world, device=torch.device("cpu"))
    seen: dict[str, set[tuple[int, ...]]] = {}

    def record(key: str, t: torch.Tensor) -> None:
        seen.setdefault(key, set()).add(tuple(local(t).shape))

    for sid, stage in zip(ex.stage_ids, ex.modules, strict=True):
        def boundary(_m: torch.nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor, sid: int = sid) -> None:
            record(f"stage{sid}.in", args[0])
            record(f"stage{sid}.out", out)

        stage.register_forward_hook(boundary)
        for name, mod in stage.named_modules():
            if isinstance(mod, torch.nn.RMSNorm) and ".ssm." not in f".{name}":  # the mixer's runs whole
                mod.register_forward_pre_hook(lambda _m, args, key=f"stage{sid}.{name}": record(key, args[0]))
    t = cfg.training
    data = SyntheticTokens(vocab_size=PARITY_MODEL.vocab_size, sequence_length=t.sequence_length, seed=t.seed)
    ex.step(data.batch(position=0, sequences=t.microbatches * t.microbatch_size))
    Path(out_dir, f"shapes-{rank}.json").write_text(json.dumps(
        {"shapes": {k: sorted(v) for k, v in seen.items()}, "num_stages": len(ex.plan.stages)}))
    dist.destroy_process_group()


def test_activations_between_stages_and_into_norms_are_sharded_on_the_sequence(tmp_path: Path) -> None:
    """Every norm's input, and every hidden activation a stage receives or sends, is this
    rank's ``[b, s/T, h]``; the token ids in and the vocabulary-sharded logits out are whole
    on the sequence."""
    config = tmp_path / "sp.json"
    config.write_text(WorkerConfig(model=PARITY_MODEL, training=DP_TRAINING.model_copy(update={"steps": 1}),
                                   plan=_plan("adaptis").model_dump(mode="json"), tensor_parallel=TENSOR,
                                   sequence_parallel=True).model_dump_json())
    run_ranks(_shape_ranks, world=PIPELINE * TENSOR, args=(str(config), str(tmp_path)), timeout_s=300)
    b, s, h = DP_TRAINING.microbatch_size, DP_TRAINING.sequence_length, PARITY_MODEL.hidden
    part = [b, s // TENSOR, h]
    norms = 0
    for r in range(PIPELINE * TENSOR):
        got = json.loads((tmp_path / f"shapes-{r}.json").read_text())
        n = got["num_stages"]
        for key, shapes in got["shapes"].items():
            sid = int(key.split(".", 1)[0].removeprefix("stage"))
            if key.endswith(".in") and sid == 0:
                assert shapes == [[b, s]], f"rank {r} {key}: token ids stay whole"
            elif key.endswith(".out") and sid == n - 1:
                assert shapes == [[b, s, PARITY_MODEL.vocab_size // TENSOR]], f"rank {r} {key}"
            else:  # a stage boundary or a norm's input
                assert shapes == [part], f"rank {r} {key}: {shapes}, not {part}"
                norms += "norm" in key
    per_block = {"mamba": 1, "dense": 1, "attention": 2, "moe": 2}  # pre-norms of each kind
    model_norms = sum(per_block[c.kind] * c.count for c in PARITY_MODEL.blocks) + 1  # + the head's
    assert norms == TENSOR * model_norms, "every norm of the model was seen, on every tensor rank"
