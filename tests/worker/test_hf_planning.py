"""Planning a Hugging Face job: ``adaptis run --dry-run`` on the realistic manifests (16 GPUs)
and the measured profile of the real layer kinds of a tiny hybrid."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from adaptis.api.job import JobSpec, TrainingSpec
from adaptis.cli import main
from adaptis.worker.profiling.module_timing import ProfileSettings

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name,layers", [("hf-llama-8b", 34), ("hf-qwen3-moe-30b-a3b", 50)])
def test_dry_run_plans_a_realistic_config_for_16_gpus(name: str, layers: int, capsys) -> None:
    assert main(["run", str(REPO / "examples" / f"{name}.yaml"), "--dry-run", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["devices"], out["layers"]) == (16, layers)
    covered = [i for st in out["stages"] for i in range(*st["layers"])]
    assert sorted(covered) == list(range(layers))
    assert {st["device"] for st in out["stages"]} == set(range(16))
    assert 0 < out["predicted_bubble_ratio"] < 1 and out["predicted_iteration_seconds"] > 0


def test_measured_profile_times_each_real_layer_kind_once() -> None:
    from adaptis.worker.profiling.hf_profile import profile_hf_layers

    config = json.loads((REPO / "examples" / "models" / "tiny-bamba.json").read_text())
    spec = JobSpec.model_validate({"model": {"huggingface": {"config": config}},
                                   "training": TrainingSpec(microbatch_size=1,
                                                            sequence_length=16).model_dump()})
    profiles = profile_hf_layers(spec, settings=ProfileSettings(warmup=0, repeats=1))
    assert [p.kind for p in profiles] == ["embedding", "mamba", "attention", "mamba",
                                          "attention", "head"]
    assert all(p.forward_s > 0 for p in profiles)
    assert profiles[1].forward_s == profiles[3].forward_s  # one measurement per kind
    assert profiles[1].param_bytes != profiles[2].param_bytes  # Mamba vs attention modules
    assert profiles[-1].backward_s > 0 and profiles[0].backward_s == 0  # tokens take no grad


@pytest.mark.parametrize("name", ["hf-llama-8b", "hf-qwen3-moe-30b-a3b"])
def test_estimated_parameters_match_the_real_model(name: str) -> None:
    """The estimate's parameter bytes (16 a parameter with AdamW) add up to the parameters of
    the real model transformers builds from the config (on the meta device: no memory)."""
    from adaptis.api.job import load_job
    from adaptis.planner.hf_estimate import estimate_model_layers
    from adaptis.worker.models.hf.stages import _skeleton

    spec = load_job(REPO / "examples" / f"{name}.yaml").spec
    estimated = sum(layer.param_bytes for layer in estimate_model_layers(spec.model,
                                                                         spec.training)) / 16
    real = sum(p.numel() for p in _skeleton(spec.model)[0].parameters())
    assert estimated == pytest.approx(real, rel=0.002)  # norms are all it leaves out


def test_measured_profile_times_the_real_modules_in_the_precision_the_ranks_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16: every timed forward runs under autocast (fp32 weights), what leaves a layer is
    bf16 (half the bytes) and a decoder layer saves less for backward; fp32: no autocast.
    128 tokens a microbatch: fewer, and the bf16 copies of the weights autocast saves for
    backward (measured: 74 kB a layer of this config) outweigh the halved activations."""
    from adaptis.worker.profiling import hf_profile
    from adaptis.worker.profiling.job_problem import measure_problem

    seen: list[tuple[bool, torch.dtype]] = []
    build = hf_profile.build_hf_stages

    def build_and_watch(*args: object, **kwargs: object) -> list:
        stages = build(*args, **kwargs)  # type: ignore[arg-type]
        for stage in stages:
            stage.register_forward_hook(lambda m, a, out: seen.append(
                (torch.is_autocast_enabled("cpu"), next(m.parameters()).dtype)))
        return stages

    monkeypatch.setattr(hf_profile, "build_hf_stages", build_and_watch)
    config = json.loads((REPO / "examples" / "models" / "tiny-qwen2-moe.json").read_text())
    spec = JobSpec.model_validate({"model": {"huggingface": {"config": config}},
                                   "training": TrainingSpec(microbatch_size=2,
                                                            sequence_length=64).model_dump()})
    bf16 = measure_problem(spec, devices=1, repeats=1, precision="bf16").expanded_layers()
    assert seen and all(autocast and dtype == torch.float32 for autocast, dtype in seen), seen
    seen.clear()
    fp32 = measure_problem(spec, devices=1, repeats=1).expanded_layers()
    assert seen and not any(autocast for autocast, _dtype in seen)
    for h, f in zip(bf16[:-1], fp32[:-1], strict=True):  # bf16 outputs: half the bytes
        assert 2 * h.output_bytes == f.output_bytes > 0, h.name
    for h, f in zip(bf16[1:-1], fp32[1:-1], strict=True):  # dense and MoE layers save less
        assert h.activation_bytes < f.activation_bytes, h.name


def test_measured_profile_has_the_step_after_the_pipeline_and_the_gradient_bytes() -> None:
    """Each layer's optimizer step (the post-pipeline step the planner predicts) and its
    gradient bytes (what replicas all-reduce) are measured on the real modules, as the zoo's
    profiler does: without them `adaptis run` predicted 0 ms of post-pipeline step."""
    from adaptis.worker.profiling.hf_profile import measure_hf_problem

    config = json.loads((REPO / "examples" / "models" / "tiny-llama.json").read_text())
    spec = JobSpec.model_validate({"model": {"huggingface": {"config": config}},
                                   "training": TrainingSpec(microbatch_size=1,
                                                            sequence_length=16).model_dump()})
    layers = measure_hf_problem(spec, devices=2, repeats=1).expanded_layers()
    assert all(layer.optimizer is not None and layer.optimizer > 0 for layer in layers)
    for layer in layers:  # fp32 gradients: 4 bytes a parameter; AdamW holds 16 a parameter
        assert layer.gradient_bytes == layer.param_bytes / 4, layer.name
    assert all(layer.graph_walk is not None and layer.graph_walk > 0
               for layer in layers[1:-1])  # the split weight pass walks the decoder layers
