"""Parity of the block zoo's features under a pipeline split: grouped-query attention, rotary
positions, swiglu MLPs of set widths, the MoE load-balancing loss (in a middle stage, which never
sees the final loss) and the chunked Mamba scan over several chunks. Two gloo ranks, a split
(B then W) planned schedule and a hand-written non-contiguous one; the reference adds the aux
losses to its loss explicitly, the pipeline attaches their gradients in the backward."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from worker_harness import (
    job_spec,
    parity_ranks,
    run_ranks,
    topological_plan,
    write_cases,
)

from adaptis.api.job import BlockSpec, TrainingSpec
from adaptis.api.model import ZooModel
from adaptis.planner.strategies import plan_strategy
from adaptis.worker.data.sources import SyntheticTokens
from adaptis.worker.profiling.job_problem import estimate_problem
from adaptis.worker.testing import reference_step

MODEL = ZooModel(
    vocab_size=128, hidden=32, heads=4, kv_heads=2, positions="rope", rope_theta=1000.0,
    mlp="swiglu", ffn_hidden=48, tie_embeddings=True,
    blocks=[BlockSpec(kind="mamba", count=2), BlockSpec(kind="attention"),
            BlockSpec(kind="moe", count=2, experts=4, top_k=2, ffn_hidden=24, aux_loss_coef=0.1),
            BlockSpec(kind="dense", ffn_hidden=40)],
)
# 80 tokens: two chunks of the Mamba scan (64 + 16), so its carried state crosses the split too.
TRAINING = TrainingSpec(microbatches=4, microbatch_size=1, sequence_length=80, grad_clip=None,
                        seed=5)
N_LAYERS = 8  # embedding + 6 blocks + head; the MoE blocks are layers 4 and 5


def _batch():
    data = SyntheticTokens(vocab_size=MODEL.vocab_size, sequence_length=TRAINING.sequence_length,
                           seed=TRAINING.seed)
    return data.batch(position=0, sequences=TRAINING.microbatches * TRAINING.microbatch_size)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    tmp = tmp_path_factory.mktemp("blocks-parity")
    planned = plan_strategy(estimate_problem(job_spec(MODEL, TRAINING), devices=2), "zb-h1").plan
    assert planned is not None
    plans = {
        "zb-h1": planned,
        # The MoE blocks alone in middle stages on both ranks; split backward, W deferred.
        "hand-split-moe-middle": topological_plan(
            stages=[(0, 3), (3, 4), (4, 5), (5, 6), (6, 8)], placement=[[0, 2, 4], [1, 3]],
            microbatches=TRAINING.microbatches, split=True, defer_w=True),
    }
    write_cases(tmp / "cases.json", plans, model=MODEL, training=TRAINING)
    run_ranks(parity_ranks, world=2, args=(str(tmp / "cases.json"), str(tmp)), timeout_s=240)
    return {name: [torch.load(tmp / f"{name}-{r}.pt") for r in range(2)] for name in plans}


@pytest.mark.parametrize("name", ["zb-h1", "hand-split-moe-middle"])
def test_pipelined_features_equal_the_reference(name: str, ranks: dict[str, list[dict]]) -> None:
    torch.set_num_threads(1)
    ref = reference_step(MODEL, TRAINING, batch=_batch())
    merged: dict[str, torch.Tensor] = {}
    for r in ranks[name]:
        assert r["loss"] == pytest.approx(ref.loss, rel=1e-5)  # token loss only, aux excluded
        merged.update(r["grads"])
    assert set(merged) == set(ref.grads)
    for k, g in ref.grads.items():
        torch.testing.assert_close(merged[k], g, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, k=k: f"{name} {k}: {m}")


def test_the_aux_loss_changes_the_reference_gradients() -> None:
    """Guards the parity test from passing vacuously: the aux term moves the routers' and the
    earlier layers' gradients."""
    torch.set_num_threads(1)
    off = dataclasses.replace(MODEL, blocks=[
        b.model_copy(update={"aux_loss_coef": 0.0}) for b in MODEL.blocks])
    with_aux = reference_step(MODEL, TRAINING, batch=_batch())
    without = reference_step(off, TRAINING, batch=_batch())
    assert with_aux.loss == without.loss
    for k in ("4.moe.router.weight", "5.moe.router.weight", "1.ssm.in_proj.weight"):
        assert (with_aux.grads[k] - without.grads[k]).abs().max() > 1e-6, k
