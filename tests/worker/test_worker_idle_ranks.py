"""Plans that idle a rank (no stage, no action) run on real gloo ranks and equal single-process
training: the idle rank stays out of torch's pipelining group but joins every collective.

Tolerances as tests/worker/test_worker_parity.py (float32: loss 1e-5 relative, gradients rtol
1e-4 / atol 1e-6, grad norm 1e-4).
"""

from __future__ import annotations

import pytest
import torch
from worker_harness import (
    DP_TRAINING,
    PARITY_MODEL,
    dp_parity_ranks,
    parity_ranks,
    parity_reference,
    run_ranks,
    selected_cases,
    topological_plan,
    write_cases,
    write_dp_cases,
)

from adaptis.api.plan import Plan
from adaptis.api.rules import layer_count
from adaptis.planner.drift import idle_devices
from adaptis.worker.data.sources import SyntheticTokens
from adaptis.worker.testing import reference_train

N_LAYERS = 10  # embedding + 8 blocks + head
STAGES = [(0, 3), (3, 7), (7, 10)]


def _idle_plans() -> dict[str, Plan]:
    return {
        # Middle rank idle: stages 0 and 2 (embedding and tied head) on rank 0, stage 1 on rank 2.
        "idle-middle": topological_plan(stages=STAGES, placement=[[0, 2], [], [1]], microbatches=8,
                                        split=True, defer_w=False, lag=1),
        # Last rank idle, fused backward.
        "idle-last": topological_plan(stages=STAGES, placement=[[0], [1, 2], []], microbatches=8,
                                      split=False, defer_w=False, lag=2),
    }


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    tmp = tmp_path_factory.mktemp("idle")
    everything = _idle_plans()
    chosen = selected_cases(request, cases=list(everything), needs=lambda p: [p["name"]] if "name" in p else None)
    plans = {name: everything[name] for name in chosen}
    write_cases(tmp / "cases.json", plans)
    run_ranks(parity_ranks, world=3, args=(str(tmp / "cases.json"), str(tmp)), timeout_s=240)
    return {name: [torch.load(tmp / f"{name}-{r}.pt") for r in range(3)] for name in plans}


@pytest.fixture(scope="module")
def reference() -> tuple[float, dict[str, torch.Tensor], float]:
    return parity_reference()


def test_plans_idle_a_rank() -> None:
    assert idle_devices(_idle_plans()["idle-middle"]) == [1]
    assert idle_devices(_idle_plans()["idle-last"]) == [2]


@pytest.mark.parametrize("name", ["idle-middle", "idle-last"])
def test_idle_rank_plan_equals_single_process(name: str, results, reference) -> None:
    ref_loss, ref_grads, ref_norm = reference
    ranks = results[name]
    idle = idle_devices(_idle_plans()[name])[0]
    assert ranks[idle]["grads"] == {}, "the idle rank holds no parameter"
    assert ranks[idle]["busy"][idle] == 0.0, "the idle rank reports zero busy time"
    for r in ranks:
        assert r["loss"] == pytest.approx(ref_loss, rel=1e-5)
        assert r["norm"] == pytest.approx(ref_norm, rel=1e-4)
    merged: dict[str, torch.Tensor] = {}
    for r in ranks:
        merged.update(r["grads"])
    assert set(merged) == set(ref_grads)
    for k, g in ref_grads.items():
        torch.testing.assert_close(merged[k], g, rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"{name} {k}: {m}")


# --- data parallel: the idle pipeline position is idle in every replica ----------------------

DP_REPLICAS, DP_PIPELINE, DP_STEPS = 2, 2, 2


@pytest.fixture(scope="module")
def dp_results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    tmp = tmp_path_factory.mktemp("idledp")
    # Pipeline rank 0 idle, all stages on rank 1 (the tied pair on one rank).
    plan = topological_plan(stages=[(0, 4), (4, 10)], placement=[[], [0, 1]], microbatches=DP_TRAINING.microbatches,
                            split=True, defer_w=True)
    cases = {f"idle-first-zero{zero}": (plan, zero)
             for zero in selected_cases(request, cases=[0, 1], needs=lambda p: [p["zero"]] if "zero" in p else None)}
    write_dp_cases(tmp / "cases.json", cases, replicas=DP_REPLICAS, steps=DP_STEPS)
    world = DP_REPLICAS * DP_PIPELINE
    run_ranks(dp_parity_ranks, world=world, args=(str(tmp / "cases.json"), str(tmp)), timeout_s=300)
    return {case: [torch.load(tmp / f"{case}-{r}.pt") for r in range(world)] for case in cases}


@pytest.mark.parametrize("zero", [0, 1])
def test_idle_rank_with_replicas_trains_as_one_process(zero: int, dp_results) -> None:
    torch.set_num_threads(1)
    t = DP_TRAINING.model_copy(update={"microbatches": DP_TRAINING.microbatches * DP_REPLICAS})
    source = SyntheticTokens(vocab_size=PARITY_MODEL.vocab_size, sequence_length=t.sequence_length, seed=t.seed)
    ref = reference_train(PARITY_MODEL, t, source=source, steps=DP_STEPS)
    ranks = dp_results[f"idle-first-zero{zero}"]
    for r in ranks:
        assert r["losses"] == pytest.approx(ref.losses, rel=1e-5)
        assert r["norms"] == pytest.approx(ref.norms, rel=1e-4)
    for replica in range(DP_REPLICAS):
        idle, busy = ranks[replica * DP_PIPELINE], ranks[replica * DP_PIPELINE + 1]
        assert idle["weights"] == {} and idle["optimizer_state"] == 0
        for k, w in ref.weights.items():
            torch.testing.assert_close(busy["weights"][k], w, rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


# --- a Hugging Face model (tied Gemma): the tied pair across the busy ranks, the middle idle --


def test_idle_rank_with_a_hugging_face_model_equals_the_model_itself(tmp_path) -> None:
    pytest.importorskip("transformers")
    from hf_harness import hf_model, hf_ranks, hf_reference, write_hf_cases

    torch.set_num_threads(1)
    model = hf_model("tiny-gemma")
    n = layer_count(model)
    plan = topological_plan(stages=[(0, n // 2), (n // 2, n)], placement=[[0], [], [1]], microbatches=4,
                            split=True, defer_w=False, lag=1)
    write_hf_cases(tmp_path / "cases.json", {"idle": plan}, model=model)
    run_ranks(hf_ranks, world=3, args=(str(tmp_path / "cases.json"), str(tmp_path)), timeout_s=300)
    ranks = [torch.load(tmp_path / f"idle-{r}.pt") for r in range(3)]
    ref = hf_reference(model)
    assert ranks[1]["params"] == {}
    for r in ranks:
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    merged: dict[str, torch.Tensor] = {}
    for r in ranks:
        for key, v in r["params"].items():
            k = "model.embed_tokens.weight" if key == "lm_head.weight" and key not in ref["params"] else key
            if k in merged:  # the tied weight on ranks 0 and 2: equal copies
                torch.testing.assert_close(v, merged[k], rtol=1e-4, atol=1e-6)
            merged[k] = v
    assert set(merged) == set(ref["params"])
    for k, want in ref["params"].items():
        torch.testing.assert_close(merged[k], want, rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
