"""Tensor parallelism: T=2 x P=2 (4 gloo processes) and R=2 x P=2 x T=2 (8) train as one
process trains the combined batch.

The parity model has every zoo block (Mamba, attention, MoE, dense) and a tied embedding and
head, which tensor parallelism shards on the vocabulary (the head's loss is torch's
``loss_parallel``). Three AdamW steps with clipping that binds, under the adaptis, i1f1b and
zb-v plans, and with ZeRO-1 across replicas. Tolerances: losses within 1e-5 relative and grad
norms within 1e-4, as the data-parallel test; the first step's gradients within rtol 1e-4 /
atol 1e-6 (a sharded matmul sums in another order, and the vocabulary-parallel softmax reduces
its max and sum over shards); weights after the steps within atol 5e-4, i.e. 5 % of one AdamW
step (lr 0.01): AdamW's first steps move each weight by about lr x sign(gradient), so a weight
whose gradient is within float32 noise of zero moves by a noisy fraction of lr, as under any
reassociation (the later steps' gradients are taken at those weights, so the first step's are
the tight check).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from worker_harness import (
    DP_TRAINING,
    PARITY_MODEL,
    assert_bf16_near_fp32,
    dp_parity_ranks,
    job_spec,
    resume_ranks,
    run_ranks,
    write_dp_cases,
)

from adaptis.api.job import WorkerConfig
from adaptis.api.mesh import Mesh
from adaptis.api.plan import Plan
from adaptis.planner.strategies import plan_strategy
from adaptis.worker.data.sources import SyntheticTokens
from adaptis.worker.errors import PlanMismatchError
from adaptis.worker.profiling.job_problem import estimate_problem
from adaptis.worker.runtime.replicas import world_mesh
from adaptis.worker.testing import ReferenceResult, TrainedReference, reference_step, reference_train

PIPELINE, TENSOR, STEPS = 2, 2, 3
#: (replicas, cases: name -> (plan strategy, ZeRO stage))
MESHES: dict[str, tuple[int, dict[str, tuple[str, int]]]] = {
    "tp2xpp2": (1, {"adaptis": ("adaptis", 0), "i1f1b": ("i1f1b", 0), "zb-v": ("zb-v", 0)}),
    "dp2xpp2xtp2": (2, {"adaptis": ("adaptis", 0), "zb-v-zero1": ("zb-v", 1)}),
}


def test_mesh_ranks_tensor_innermost() -> None:
    mesh = Mesh(pods=4, per_pod=2, replicas=2, tensor=2)
    assert (mesh.world, mesh.pipeline) == (8, 2)
    assert [(mesh.replica(r), mesh.pipeline_rank(r), mesh.tensor_rank(r)) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert mesh.tensor_ranks(replica=1, pipeline_rank=0) == [4, 5]
    assert mesh.pipeline_ranks(0, tensor_rank=1) == [1, 3]
    assert mesh.replica_ranks(1, tensor_rank=1) == [3, 7]
    assert {mesh.pod(r) for r in mesh.tensor_ranks(replica=0, pipeline_rank=1)} == {1}
    assert all(mesh.rank(replica=mesh.replica(r), pipeline_rank=mesh.pipeline_rank(r),
                         tensor_rank=mesh.tensor_rank(r)) == r for r in range(8))


def test_tensor_group_must_stay_in_its_pod() -> None:
    with pytest.raises(ValueError, match="tensorParallel: 2 does not divide the 3 ranks of a worker pod"):
        Mesh(pods=2, per_pod=3, tensor=2)
    with pytest.raises(PlanMismatchError, match="data_parallel 1 x tensor_parallel 4 does not divide the world size 6"):
        world_mesh(world_size=6, data_parallel=1, tensor_parallel=4)


def _plan(name: str) -> Plan:
    outcome = plan_strategy(estimate_problem(job_spec(training=DP_TRAINING), devices=PIPELINE), name)
    assert outcome.plan is not None, f"{name}: {outcome.result.reason}"
    return outcome.plan


@pytest.fixture(scope="module", params=list(MESHES))
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
            ) -> tuple[str, dict[str, list[dict]], TrainedReference, ReferenceResult]:
    mesh = request.param
    replicas, cases = MESHES[mesh]
    tmp = tmp_path_factory.mktemp(mesh)
    write_dp_cases(tmp / "cases.json", {c: (_plan(s), z) for c, (s, z) in cases.items()},
                   replicas=replicas, steps=STEPS, tensor=TENSOR)
    world = replicas * PIPELINE * TENSOR
    run_ranks(dp_parity_ranks, world=world, args=(str(tmp / "cases.json"), str(tmp)), timeout_s=600)
    torch.set_num_threads(1)
    t = DP_TRAINING.model_copy(update={"microbatches": DP_TRAINING.microbatches * replicas})
    source = SyntheticTokens(vocab_size=PARITY_MODEL.vocab_size, sequence_length=t.sequence_length, seed=t.seed)
    reference = reference_train(PARITY_MODEL, t, source=source, steps=STEPS)
    batch = source.batch(position=0, sequences=t.microbatches * t.microbatch_size)
    first = reference_step(PARITY_MODEL, t, batch=batch)
    results = {c: [torch.load(tmp / f"{c}-{r}.pt") for r in range(world)] for c in cases}
    return mesh, results, reference, first


Trained = tuple[str, dict[str, list[dict]], TrainedReference, ReferenceResult]


def test_tensor_parallel_trains_as_one_process(trained: Trained) -> None:
    mesh, results, reference, first = trained
    assert reference.norms[-1] > DP_TRAINING.grad_clip, "clipping must bind to be tested"
    for case, ranks in results.items():
        for r in ranks:  # every rank reports the combined batch's loss and the whole model's norm
            assert r["losses"] == pytest.approx(reference.losses, rel=1e-5), f"{mesh} {case}"
            assert r["norms"] == pytest.approx(reference.norms, rel=1e-4), f"{mesh} {case}"
        for r, rank in enumerate(ranks):  # each rank's shards, gathered whole, are the reference's
            for k, g in rank["first_grads"].items():
                torch.testing.assert_close(g, first.grads[k], rtol=1e-4, atol=1e-6,
                                           msg=lambda m, k=k, r=r, c=case: f"{mesh} {c} rank {r} grad {k}: {m}")
            for k, w in rank["weights"].items():
                torch.testing.assert_close(w, reference.weights[k], rtol=1e-4, atol=5e-4,
                                           msg=lambda m, k=k, r=r, c=case: f"{mesh} {c} rank {r} weight {k}: {m}")
        held = set().union(*(rank["weights"] for rank in ranks))
        assert held == set(reference.weights), f"{mesh} {case}: every parameter is held"


#: Parameters left whole on every tensor rank (computed in full on the replicated activation).
REPLICATED = ("norm", "ssm.", "router")


def test_tensor_ranks_hold_shards(trained: Trained) -> None:
    """Attention, MLPs, experts, embedding and head are split in T; norms, Mamba and the router
    are whole: the memory a rank holds is what the planner is told."""
    mesh, results, _reference, _first = trained
    for case, ranks in results.items():
        for r, rank in enumerate(ranks):
            for k, (mine, whole) in rank["numels"].items():
                want = whole if any(part in k for part in REPLICATED) else whole // TENSOR
                assert mine == want, f"{mesh} {case} rank {r} {k}: holds {mine} of {whole}"


@pytest.mark.parametrize("degrees", [(2, 1), (1, 2)], ids=["tp2-to-tp1", "tp1-to-tp2"])
def test_a_checkpoint_resumes_at_another_tensor_degree(degrees: tuple[int, int], tmp_path: Path) -> None:
    """Two steps at one degree, checkpointed (the shards gathered whole, by name), the third
    at the other: the losses and weights of one uninterrupted process."""
    plan = _plan("adaptis").model_dump(mode="json")
    training = DP_TRAINING.model_copy(update={"steps": STEPS})
    files = []
    for t in degrees:
        path = tmp_path / f"tp{t}.json"
        path.write_text(WorkerConfig(model=PARITY_MODEL, training=training, plan=plan,
                                     tensor_parallel=t).model_dump_json())
        files.append(path)
    ckpt = tmp_path / "ckpt"
    for (t, path, steps, out) in zip(degrees, files, ("0:2", f"2:{STEPS}"), ("a", "b"), strict=True):
        run_ranks(resume_ranks, world=PIPELINE * t, args=(str(path), str(ckpt), str(tmp_path / out), steps),
                  timeout_s=600)
    assert {f.name for f in (ckpt / "step-00000002").iterdir()} == {"rank-0.pt", f"rank-{degrees[0]}.pt"}
    torch.set_num_threads(1)
    source = SyntheticTokens(vocab_size=PARITY_MODEL.vocab_size, sequence_length=training.sequence_length,
                             seed=training.seed)
    reference = reference_train(PARITY_MODEL, training, source=source, steps=STEPS)
    before, after = (torch.load(tmp_path / f"{out}-0.pt") for out in ("a", "b"))
    assert before["losses"] + after["losses"] == pytest.approx(reference.losses, rel=1e-5)
    for r in range(PIPELINE * degrees[1]):
        for k, w in torch.load(tmp_path / f"b-{r}.pt")["weights"].items():
            torch.testing.assert_close(w, reference.weights[k], rtol=1e-4, atol=5e-4,
                                       msg=lambda m, k=k, r=r: f"{degrees} rank {r} weight {k}: {m}")


def test_bf16_under_tensor_parallelism_stays_within_a_tenth_of_a_percent_of_fp32(tmp_path: Path) -> None:
    """T=2 x P=2 in bf16 (autocast over the sharded matmuls and the vocabulary-parallel loss,
    fp32 masters): every step's loss within 0.1 % of one fp32 process's, and really bf16 (not
    the fp32 numbers)."""
    assert_bf16_near_fp32(tmp_path, plan=_plan("adaptis"), pipeline=PIPELINE, tensor=TENSOR, steps=STEPS)
