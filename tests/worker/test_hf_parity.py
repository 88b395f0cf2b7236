"""Parity of Hugging Face models: pipelined training equals the model itself in one process.

For the tiny configs of examples/models/ (Llama, Qwen2-MoE, the Bamba Mamba/attention hybrid,
Gemma with tied embeddings), three AdamW steps of pipelined training on 2 real gloo ranks,
under the planner's adaptis or 1f1b plan, its zb-v plan and (Llama) its i1f1b plan (for tied
Gemma: 1f1b puts embedding and head on two ranks, zb-v's V puts them on one, sharing one
Parameter; both are checked), equal a plain ``AutoModelForCausalLM`` trained in one process on
the same batches from the same initial weights: every step's loss within 1e-5 relative, the
last step's gradients and the final parameters within rtol 1e-4 / atol 1e-6 (as
tests/worker/test_worker_parity.py; float32, the only differences are summation order). The MoE
auxiliary loss is off in both (``output_router_logits`` false): the loss is the language-model
loss alone.
"""

from __future__ import annotations

import pytest
import torch
from hf_harness import HF_TRAINING, hf_model, hf_ranks, hf_reference, write_hf_cases
from worker_harness import job_spec, run_ranks

from adaptis.planner.strategies import plan_strategy
from adaptis.worker.profiling.job_problem import estimate_problem

pytest.importorskip("transformers")

CASES = {
    "tiny-llama": ("adaptis", "i1f1b", "zb-v"),
    "tiny-qwen2-moe": ("1f1b", "zb-v"),
    "tiny-bamba": ("adaptis", "zb-v"),
    "tiny-gemma": ("1f1b", "zb-v"),
}


def _results(name: str, tmp_path) -> dict[str, list[dict]]:
    model = hf_model(name)
    spec = job_spec(model, HF_TRAINING)
    plans = {}
    for strategy in CASES[name]:
        outcome = plan_strategy(estimate_problem(spec, devices=2), strategy)
        assert outcome.plan is not None, f"{strategy}: {outcome.result.reason}"
        plans[strategy] = outcome.plan
    if name == "tiny-gemma":  # the tied weight both across ranks and within one
        owner = {s: [p.stage_device()[0], p.stage_device()[-1]] for s, p in plans.items()}
        assert owner["1f1b"][0] != owner["1f1b"][1] and owner["zb-v"][0] == owner["zb-v"][1]
    write_hf_cases(tmp_path / "cases.json", plans, model=model)
    run_ranks(hf_ranks, world=2, args=(str(tmp_path / "cases.json"), str(tmp_path)), timeout_s=300)
    return {s: [torch.load(tmp_path / f"{s}-{r}.pt") for r in range(2)] for s in plans}


@pytest.mark.parametrize("name", list(CASES))
def test_pipelined_training_equals_the_model_itself(name: str, tmp_path) -> None:
    torch.set_num_threads(1)
    ref = hf_reference(hf_model(name))
    for strategy, ranks in _results(name, tmp_path).items():
        for r in ranks:
            assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5), strategy
        for what in ("grads", "params"):
            merged: dict[str, torch.Tensor] = {}
            for r in ranks:
                for key, v in r[what].items():
                    tied = key == "lm_head.weight" and "lm_head.weight" not in ref[what]
                    k = "model.embed_tokens.weight" if tied else key  # tied, held on two ranks: equal copies
                    if k in merged:
                        torch.testing.assert_close(v, merged[k], rtol=1e-4, atol=1e-6)
                    merged[k] = v
            assert set(merged) == set(ref[what]), f"{strategy}: every parameter once"
            for k, want in ref[what].items():
                torch.testing.assert_close(merged[k], want, rtol=1e-4, atol=1e-6,
                                           msg=lambda m, k=k, s=strategy, w=what: f"{s} {w} {k}: {m}")
