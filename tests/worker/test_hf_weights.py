"""Weights of a Hugging Face model out and in: trained on 2 ranks -> ``adaptis export`` ->
``AutoModelForCausalLM.from_pretrained`` gives the trained model (its weights equal the
one-process reference's after the same steps, the same logits); and the exported directory
read back as ``spec.model.huggingface.weights`` into partitioned stages gives those logits too.
Tied Gemma, planned 1f1b on 2 ranks: the embedding and the tied head live on different ranks."""

from __future__ import annotations

import pytest
import torch
from hf_harness import HF_TRAINING, hf_checkpoint_ranks, hf_model, hf_reference, write_hf_cases
from worker_harness import job_spec, run_ranks

from adaptis.planner.strategies import plan_strategy
from adaptis.worker.profiling.job_problem import estimate_problem

pytest.importorskip("transformers")


def test_trained_checkpoint_exports_loads_and_reads_back(tmp_path, monkeypatch, capsys) -> None:
    from transformers import AutoModelForCausalLM

    from adaptis.cli import main
    from adaptis.worker.models.hf.stages import build_hf_stages

    torch.set_num_threads(1)
    model = hf_model("tiny-gemma")
    training = HF_TRAINING.model_copy(update={"steps": 2})
    plan = plan_strategy(estimate_problem(job_spec(model, training), devices=2), "1f1b").plan
    assert plan is not None
    write_hf_cases(tmp_path / "cases.json", {"1f1b": plan}, model=model, training=training)
    ckpt = tmp_path / "checkpoints"
    run_ranks(hf_checkpoint_ranks, world=2, args=(str(tmp_path / "cases.json"), str(ckpt)),
              timeout_s=300)
    job = tmp_path / "job.yaml"
    job.write_text(f"apiVersion: adaptis.io/v1alpha1\nkind: AdaPtisJob\nmetadata: {{name: g}}\n"
                   f"spec: {{model: {model.wire().model_dump_json(by_alias=True, exclude_none=True)}}}\n")
    out = tmp_path / "exported"
    assert main(["export", str(job), "--checkpoint", str(ckpt), "-o", str(out)]) == 0
    assert "from_pretrained" in capsys.readouterr().out

    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ref = hf_reference(model, training)
    initial = hf_reference(model, training.model_copy(update={"steps": 1}))["params"]
    got = dict(loaded.named_parameters())
    for k, want in ref["params"].items():
        torch.testing.assert_close(got[k], want, rtol=1e-4, atol=1e-6, msg=k)
    assert any(not torch.equal(got[k], initial[k]) for k in initial), "trained, not initial"

    ids = torch.randint(256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = loaded(input_ids=ids).logits
        back = model.with_huggingface(model.huggingface.model_copy(update={"weights": str(out)}))
        first, second = build_hf_stages(back, stages=[(0, 2), (2, 6)], seed=99)
        torch.testing.assert_close(second(first(ids)), logits, rtol=1e-5, atol=1e-6)
