"""Hugging Face models under tensor parallelism: T=2 x P=2 (4 gloo processes) trains as the
plain ``AutoModelForCausalLM`` trains in one process.

Each decoder layer is sharded by the model's own ``base_model_tp_plan`` (q/k/v and the MLP's
gate/up column-parallel, o_proj and down_proj row-parallel), the embedding and LM head
vocabulary-parallel with torch's ``loss_parallel``; tiny Llama and tiny Gemma (its scaled
embedding, tied head) from examples/models/, three AdamW steps with clipping that binds,
under the adaptis and zb-v plans. Tolerances as the zoo's tensor-parallel test
(tests/worker/test_worker_tensor_parallel.py says why): losses within 1e-5 relative, norms
1e-4, weights after the steps within atol 5e-4. A MoE model (packed experts) is refused with
the field named (tests/api/test_api_rules.py's table has the dense cases' refusals).
"""

from __future__ import annotations

import pytest
import torch
from hf_harness import HF_DP_TRAINING, hf_model, hf_reference, train_hf_cases

from adaptis.api.job import JobSpec
from adaptis.api.rules import job_violations

pytest.importorskip("transformers")

PIPELINE, TENSOR = 2, 2
MODELS = ("tiny-llama", "tiny-gemma")
CASES = {"adaptis": ("adaptis", 0, "fp32"), "zb-v": ("zb-v", 0, "fp32")}


@pytest.fixture(scope="module", params=MODELS)
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    torch.set_num_threads(1)
    name = request.param
    model = hf_model(name)
    ranks = train_hf_cases(model, CASES, tmp=tmp_path_factory.mktemp(name), pipeline=PIPELINE, tensor=TENSOR)
    ref = hf_reference(model, HF_DP_TRAINING)
    return name, ref, ranks


@pytest.mark.parametrize("case", list(CASES))
def test_tensor_parallel_trains_as_the_model_itself(case: str, trained) -> None:
    name, ref, results = trained
    ranks = results[case]
    assert ref["norms"][-1] > HF_DP_TRAINING.grad_clip, "clipping must bind to be tested"
    for r in ranks:
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5), f"{name} {case}"
        assert r["norms"] == pytest.approx(ref["norms"], rel=1e-4), f"{name} {case}"
    held: set[str] = set()
    for r, rank in enumerate(ranks):
        for name_held, w in rank["weights"].items():
            # A tied head held apart from its embedding is named lm_head.weight; the plain
            # model names the one tied weight once.
            tied = name_held == "lm_head.weight" and name_held not in ref["params"]
            k = "model.embed_tokens.weight" if tied else name_held
            held.add(k)
            torch.testing.assert_close(w, ref["params"][k], rtol=1e-4, atol=5e-4,
                                       msg=lambda m, k=k, r=r: f"{name} {case} rank {r} weight {k}: {m}")
        # The projections hold half their rows or columns: the model's plan was applied.
        for k, (mine, whole) in rank["numels"].items():
            if k.endswith(("q_proj.weight", "o_proj.weight", "down_proj.weight", "embed_tokens.weight")):
                assert mine * TENSOR == whole, f"{name} {case} rank {r} {k}: {mine} of {whole}"
    assert held == set(ref["params"]), f"{name} {case}: every parameter held"


def test_a_moe_model_is_refused_naming_the_field() -> None:
    spec = JobSpec(model=hf_model("tiny-qwen2-moe"),
                   parallelism={"workers": 2, "gpusPerWorker": 2, "tensorParallel": 2})
    assert [f for f, _ in job_violations(name="moe", spec=spec)] == ["spec.parallelism.tensorParallel"]
