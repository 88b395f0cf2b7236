"""Hugging Face models under data parallel and bf16: R=2 replicas of a 2-rank pipeline (4 gloo
processes) train exactly as one plain ``AutoModelForCausalLM`` trains the combined batch.

For tiny Llama and tiny Qwen2-MoE (a dense layer, three MoE layers with a shared expert) from
examples/models/: three AdamW steps with clipping that binds, under the planner's adaptis and
zb-v plans (zb-v with ZeRO-1), against the model itself in one process given the same initial
weights (tests/worker/hf_harness.py). Tolerances as the zoo's data-parallel test
(tests/worker/test_worker_data_parallel.py; float32, the only differences are summation
order): losses within 1e-5 relative, grad norms within 1e-4, the last step's averaged
gradients within rtol 1e-4 / atol 1e-6, the final weights within rtol 1e-4 / atol 1e-5.

bf16 (one more case per model, 1f1b, the same 4 ranks): every step's loss within 0.1 % of the
fp32 model's (the zoo's bf16 tolerance, tests/worker/test_worker_precision_ranks.py, which
says why), and not equal to it (bf16 did compute). A Hugging Face stage runs whole under
autocast, rounded to bf16 at its end (adaptis/worker/models/precision.py).
"""

from __future__ import annotations

import pytest
import torch
from hf_harness import HF_DP_TRAINING, hf_model, hf_reference, train_hf_cases

pytest.importorskip("transformers")

REPLICAS, PIPELINE = 2, 2
MODELS = ("tiny-llama", "tiny-qwen2-moe")
# case -> (strategy, ZeRO stage, precision)
CASES = {"adaptis": ("adaptis", 0, "fp32"), "zb-v-zero1": ("zb-v", 1, "fp32"),
         "1f1b-bf16": ("1f1b", 0, "bf16")}


@pytest.fixture(scope="module", params=MODELS)
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(the model's name, the one-process reference on the combined batch, each case's ranks)."""
    torch.set_num_threads(1)
    name = request.param
    model = hf_model(name)
    ranks = train_hf_cases(model, CASES, tmp=tmp_path_factory.mktemp(name), pipeline=PIPELINE,
                           replicas=REPLICAS)
    combined = HF_DP_TRAINING.model_copy(
        update={"microbatches": HF_DP_TRAINING.microbatches * REPLICAS})
    ref = hf_reference(model, combined)
    return name, ref, ranks


def _replica(ranks: list[dict], replica: int, what: str) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for r in ranks[replica * PIPELINE:(replica + 1) * PIPELINE]:
        merged.update(r[what])
    return merged


@pytest.mark.parametrize("case", [c for c, (_s, _z, p) in CASES.items() if p == "fp32"])
def test_replicas_train_as_the_model_itself_on_the_combined_batch(case: str, trained) -> None:
    name, ref, results = trained
    ranks = results[case]
    assert ref["norms"][-1] > HF_DP_TRAINING.grad_clip, "clipping must bind to be tested"
    for r in ranks:  # every rank reports the combined batch's loss and the same norm
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5), f"{name} {case}"
        assert r["norms"] == pytest.approx(ref["norms"], rel=1e-4), f"{name} {case}"
    for replica in range(REPLICAS):
        grads, weights = _replica(ranks, replica, "grads"), _replica(ranks, replica, "weights")
        assert set(weights) == set(ref["params"]), f"{name} {case}: every parameter once"
        for k, g in ref["grads"].items():
            torch.testing.assert_close(grads[k], g, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, k=k: f"{name} {case} grad {k}: {m}")
        for k, w in ref["params"].items():
            torch.testing.assert_close(weights[k], w, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, k=k: f"{name} {case} weight {k}: {m}")
    for p in range(PIPELINE):  # replicas are bit-identical (same reduced gradients, same update)
        for k, w in ranks[p]["weights"].items():
            assert torch.equal(w, ranks[PIPELINE + p]["weights"][k]), f"{name} {case}: {k}"


def test_bf16_tracks_the_fp32_model_within_a_tenth_of_a_percent(trained) -> None:
    name, ref, results = trained
    ranks = results["1f1b-bf16"]
    for r in ranks:
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-3), name
        assert r["losses"] != ref["losses"], f"{name}: bf16 must compute differently from fp32"
    for p in range(PIPELINE):
        for k, w in ranks[p]["weights"].items():
            assert w.dtype == torch.float32, f"{name}: fp32 master weights ({k})"
            assert torch.equal(w, ranks[PIPELINE + p]["weights"][k]), f"{name}: replicas {k}"
