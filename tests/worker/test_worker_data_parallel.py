"""Data parallel x pipeline: R=2 replicas of a 2-rank pipeline (4 gloo processes) train
exactly as one process trains the replicas' combined batch.

Several steps of AdamW with clipping that binds, for the adaptis, i1f1b and zb-v plans, with
and without ZeRO-1. Tolerances as the single-replica parity test (float32; the only
differences are summation order): losses within 1e-5 relative, gradients within rtol 1e-4 /
atol 1e-6, grad norms within 1e-4; weights after the steps within rtol 1e-4 / atol 1e-5
(AdamW divides by the root of the second moment, which magnifies reassociation noise of the
smallest gradients a little). Plus fast unit tests of the mesh rank arithmetic and the data
shard positions.
"""

from __future__ import annotations

import pytest
import torch
from worker_harness import (
    DP_TRAINING,
    PARITY_MODEL,
    dp_parity_ranks,
    job_spec,
    run_ranks,
    selected_cases,
    write_dp_cases,
)

from adaptis.api.plan import Plan
from adaptis.planner.strategies import plan_strategy
from adaptis.worker.data.sources import SyntheticTokens, shard_position
from adaptis.worker.errors import PlanMismatchError
from adaptis.worker.profiling.job_problem import estimate_problem
from adaptis.worker.runtime.replicas import world_mesh
from adaptis.worker.testing import TrainedReference, reference_train

REPLICAS, PIPELINE, STEPS = 2, 2, 3
PLANS = ("adaptis", "i1f1b", "zb-v")
CASES = {f"{name}-zero{zero}": (name, zero) for name in PLANS for zero in (0, 1)}


def test_mesh_ranks_pipeline_innermost() -> None:
    mesh = world_mesh(world_size=6, data_parallel=2)
    assert (mesh.replicas, mesh.pipeline) == (2, 3)
    assert mesh.pipeline_ranks(1) == [3, 4, 5]
    assert mesh.replica_ranks(1) == [1, 4]
    assert [(mesh.replica(r), mesh.pipeline_rank(r)) for r in range(6)] == [
        (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert all(mesh.rank(replica=mesh.replica(r), pipeline_rank=mesh.pipeline_rank(r)) == r
               for r in range(6))
    with pytest.raises(PlanMismatchError, match="data_parallel 4 does not divide the world size 6"):
        world_mesh(world_size=6, data_parallel=4)


def test_shards_tile_the_stream() -> None:
    per_step, replicas = 8, 3
    read = []
    for step in range(4):
        for r in range(replicas):
            start = shard_position(position=step * replicas * per_step, replica=r, sequences=per_step)
            read.extend(range(start, start + per_step))
    assert read == list(range(4 * replicas * per_step))  # each sequence once, in order
    # The replicas' batches are the combined batch's rows, in replica order.
    data = SyntheticTokens(vocab_size=512, sequence_length=8, seed=5)
    whole = data.batch(position=24, sequences=2 * per_step)
    second = data.batch(position=shard_position(position=24, replica=1, sequences=per_step), sequences=per_step)
    assert torch.equal(whole.inputs[per_step:], second.inputs)


@pytest.fixture(scope="module")
def reference() -> TrainedReference:
    torch.set_num_threads(1)
    t = DP_TRAINING.model_copy(update={"microbatches": DP_TRAINING.microbatches * REPLICAS})
    source = SyntheticTokens(vocab_size=PARITY_MODEL.vocab_size, sequence_length=t.sequence_length, seed=t.seed)
    return reference_train(PARITY_MODEL, t, source=source, steps=STEPS)


def _plan(name: str) -> Plan:
    outcome = plan_strategy(estimate_problem(job_spec(training=DP_TRAINING), devices=PIPELINE), name)
    assert outcome.plan is not None, f"{name}: {outcome.result.reason}"
    return outcome.plan


def _cases_read(params: dict[str, object]) -> list[str] | None:
    """The cases a test with these parameters reads: its own, or a plan's two (the ZeRO test)."""
    if "case" in params:
        return [str(params["case"])]
    if "name" in params:
        return [f"{params['name']}-zero{zero}" for zero in (0, 1)]
    return None


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    tmp = tmp_path_factory.mktemp("dp")
    chosen = selected_cases(request, cases=list(CASES), needs=_cases_read)
    write_dp_cases(tmp / "cases.json", {case: (_plan(CASES[case][0]), CASES[case][1]) for case in chosen},
                   replicas=REPLICAS, steps=STEPS)
    run_ranks(dp_parity_ranks, world=REPLICAS * PIPELINE, args=(str(tmp / "cases.json"), str(tmp)),
              timeout_s=300)
    return {case: [torch.load(tmp / f"{case}-{r}.pt") for r in range(REPLICAS * PIPELINE)] for case in chosen}


@pytest.mark.parametrize("case", list(CASES))
def test_replicas_train_as_one_process(case: str, results: dict[str, list[dict]],
                                       reference: TrainedReference) -> None:
    ranks = results[case]
    for r in ranks:  # every rank reports the combined batch's loss and the same norm
        assert r["losses"] == pytest.approx(reference.losses, rel=1e-5)
        assert r["norms"] == pytest.approx(reference.norms, rel=1e-4)
    assert reference.norms[-1] > DP_TRAINING.grad_clip, "clipping must bind to be tested"
    for replica in range(REPLICAS):
        grads: dict[str, torch.Tensor] = {}
        weights: dict[str, torch.Tensor] = {}
        for r in ranks[replica * PIPELINE:(replica + 1) * PIPELINE]:
            grads.update(r["grads"])
            weights.update(r["weights"])
        assert set(weights) == set(reference.weights), "each replica must hold every parameter"
        for k, g in reference.grads.items():
            torch.testing.assert_close(grads[k], g, rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"{case} grad {k}: {m}")
        for k, w in reference.weights.items():
            torch.testing.assert_close(weights[k], w, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, k=k: f"{case} weight {k}: {m}")
    for r in ranks:  # every stage's reduction was launched by the runtime, during the step
        assert all(done == stages for done, stages in r["overlapped"]), f"{case}: {r['overlapped']}"
        # ... and each step reports the time it then blocked finishing it: never none (writing
        # the averaged gradients back alone takes some), what the run summary's share is made of.
        assert all(w > 0 for w in r["waits"]), f"{case}: reduce waits {r['waits']}"
    # Replicas are bit-identical to each other (same reduced gradients, same update).
    for p in range(PIPELINE):
        for k, w in ranks[p]["weights"].items():
            assert torch.equal(w, ranks[PIPELINE + p]["weights"][k]), f"{case}: replicas differ in {k}"


@pytest.mark.parametrize("name", PLANS)
def test_zero1_shards_the_optimizer_state(name: str, results: dict[str, list[dict]]) -> None:
    for p in range(PIPELINE):
        full = results[f"{name}-zero0"][p]["optimizer_state"]
        shards = [results[f"{name}-zero1"][r * PIPELINE + p]["optimizer_state"] for r in range(REPLICAS)]
        assert sum(shards) == full, f"{name} pipeline rank {p}: the shards must partition the state"
        assert max(shards) < 0.75 * full, f"{name} pipeline rank {p}: shards {shards} of {full}"
