"""Helpers of the Hugging Face parity tests: the model specs of examples/models/, the ranks'
entry point (N pipelined training steps through the executor) and the one-process reference
(a plain ``AutoModelForCausalLM`` given the same initial weights, trained on the same batches)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from worker_harness import init_gloo

from adaptis.api.hf_model import HuggingFaceSpec
from adaptis.api.job import JobSpec, TrainingSpec, WorkerConfig
from adaptis.api.model import HuggingFaceModel
from adaptis.api.plan import Plan

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "examples" / "models"
HF_TRAINING = TrainingSpec(microbatches=4, microbatch_size=2, sequence_length=16, grad_clip=None,
                           seed=3, steps=3)


def hf_model(name: str) -> HuggingFaceModel:
    """The example config ``name`` (examples/models/<name>.json), inline as a job carries it."""
    return HuggingFaceModel(
        huggingface=HuggingFaceSpec(config=json.loads((MODELS / f"{name}.json").read_text())))


def write_hf_cases(path: Path, cases: dict[str, Plan], *, model: HuggingFaceModel,
                   training: TrainingSpec = HF_TRAINING) -> None:
    docs = [{"name": name, "config": WorkerConfig(
        model=model, training=training, plan=plan.model_dump(mode="json")).model_dump(mode="json")}
        for name, plan in cases.items()]
    path.write_text(json.dumps(docs))


def _vocab(model: HuggingFaceModel) -> int:
    return model.vocab_size


def hf_ranks(rank: int, world: int, port: int, cases_file: str, out_dir: str) -> None:
    """Every case: ``training.steps`` steps through the executor; per-step losses, the last
    step's gradients and the final parameters dumped per rank."""
    from adaptis.worker.data.sources import SyntheticTokens
    from adaptis.worker.runtime.executor import Executor

    init_gloo(rank, world, port)
    for case in json.loads(Path(cases_file).read_text()):
        cfg = WorkerConfig.model_validate(case["config"])
        t = cfg.training
        ex = Executor(cfg, rank=rank, world_size=world, device=torch.device("cpu"))
        data = SyntheticTokens(vocab_size=_vocab(cfg.model), sequence_length=t.sequence_length,
                               seed=t.seed)
        per_step = t.microbatches * t.microbatch_size
        losses = [ex.step(data.batch(position=s * per_step, sequences=per_step)).loss
                  for s in range(t.steps)]
        named = ex.named_parameters()
        torch.save({"losses": losses,
                    "grads": {k: (p.grad if p.grad is not None else torch.zeros_like(p)).detach()
                              .clone() for k, p in named.items()},
                    "params": {k: p.detach().clone() for k, p in named.items()}},
                   Path(out_dir) / f"{case['name']}-{rank}.pt")
    dist.destroy_process_group()


def hf_reference(model: HuggingFaceModel, training: TrainingSpec = HF_TRAINING) -> dict[str, Any]:
    """The unpartitioned model trained in one process: a plain AutoModelForCausalLM (made by
    transformers' own constructor) loaded with the stages' seeded initial weights; the same
    microbatches, per-microbatch loss scaling, clipping and optimizer as a pipeline step
    (clipping as the executor's: the norm over the unique parameters in float64, the
    coefficient clip / (norm + 1e-6) when the norm exceeds the clip). With R data-parallel
    replicas of ``m`` microbatches each, pass ``training`` with ``R x m`` microbatches: the
    combined batch."""
    from transformers import AutoModelForCausalLM

    from adaptis.worker.data.sources import SyntheticTokens
    from adaptis.worker.models.hf.stages import build_hf_model, hf_config
    from adaptis.worker.models.zoo import token_loss

    torch.manual_seed(0)
    net = AutoModelForCausalLM.from_config(hf_config(model))
    net.load_state_dict(build_hf_model(model, seed=training.seed).state_dict())
    opt = training.optimizer
    optim = torch.optim.AdamW(net.parameters(), lr=opt.lr, weight_decay=opt.weight_decay)
    data = SyntheticTokens(vocab_size=_vocab(model), sequence_length=training.sequence_length,
                           seed=training.seed)
    m, b = training.microbatches, training.microbatch_size
    params = list(dict.fromkeys(net.parameters()))  # a tied weight once
    losses: list[float] = []
    norms: list[float] = []
    for step in range(training.steps):
        optim.zero_grad(set_to_none=True)
        batch = data.batch(position=step * m * b, sequences=m * b)
        total = 0.0
        for mb in range(m):
            rows = slice(mb * b, (mb + 1) * b)
            loss = token_loss(net(input_ids=batch.inputs[rows]).logits, batch.targets[rows],
                              scale=1.0 / m)
            loss.backward()
            total += float(loss.detach())
        losses.append(total)
        grads = {k: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
                 for k, p in net.named_parameters()}
        norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params
                             if p.grad is not None))
        norms.append(norm)
        if training.grad_clip is not None and norm > training.grad_clip:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(training.grad_clip / (norm + 1e-6))
        optim.step()
    final = {k: p.detach().clone() for k, p in net.named_parameters()}
    return {"losses": losses, "norms": norms, "grads": grads, "params": final}


def hf_checkpoint_ranks(rank: int, world: int, port: int, cases_file: str, ckpt_dir: str) -> None:
    """The first case: ``training.steps`` steps through the executor, then each rank's
    checkpoint (adaptis.worker.state.checkpoint) as the runner writes it."""
    from adaptis.worker.data.sources import SyntheticTokens
    from adaptis.worker.runtime.executor import Executor
    from adaptis.worker.state.checkpoint import save_checkpoint

    init_gloo(rank, world, port)
    case = json.loads(Path(cases_file).read_text())[0]
    cfg = WorkerConfig.model_validate(case["config"])
    t = cfg.training
    ex = Executor(cfg, rank=rank, world_size=world, device=torch.device("cpu"))
    data = SyntheticTokens(vocab_size=_vocab(cfg.model), sequence_length=t.sequence_length,
                           seed=t.seed)
    per_step = t.microbatches * t.microbatch_size
    for s in range(t.steps):
        ex.step(data.batch(position=s * per_step, sequences=per_step))
    save_checkpoint(ckpt_dir, executor=ex, step=t.steps, position=t.steps * per_step,
                    tokens=0, samples=0)
    dist.destroy_process_group()


HF_DP_TRAINING = TrainingSpec(microbatches=4, microbatch_size=2, sequence_length=16, seed=3,
                              grad_clip=0.5, steps=3,
                              optimizer={"name": "adamw", "lr": 0.01, "weight_decay": 0.01})


def train_hf_cases(model: HuggingFaceModel, cases: dict[str, tuple[str, int, str]], *, tmp: Path,
                   pipeline: int, replicas: int = 1, tensor: int = 1) -> dict[str, list[dict[str, Any]]]:
    """``cases``: name -> (strategy, ZeRO stage, precision), each planned on the estimate of
    ``pipeline`` devices and trained by ``replicas x pipeline x tensor`` gloo ranks
    (worker_harness.dp_parity_ranks); each case's per-rank dumps."""
    from worker_harness import dp_parity_ranks, run_ranks

    from adaptis.planner.strategies import plan_strategy
    from adaptis.worker.profiling.job_problem import estimate_problem

    planned = {}
    for case, (strategy, zero, precision) in cases.items():
        problem = estimate_problem(JobSpec(model=model, training=HF_DP_TRAINING), devices=pipeline,
                                   precision=precision)
        outcome = plan_strategy(problem, strategy)
        assert outcome.plan is not None, f"{strategy}: {outcome.result.reason}"
        planned[case] = (outcome.plan, zero, precision)
    write_hf_dp_cases(tmp / "cases.json", planned, model=model, replicas=replicas, tensor=tensor)
    world = replicas * pipeline * tensor
    run_ranks(dp_parity_ranks, world=world, args=(str(tmp / "cases.json"), str(tmp)), timeout_s=600)
    return {case: [torch.load(tmp / f"{case}-{r}.pt") for r in range(world)] for case in cases}


def write_hf_dp_cases(path: Path, cases: dict[str, tuple[Plan, int, str]], *, model: HuggingFaceModel,
                      replicas: int, training: TrainingSpec = HF_DP_TRAINING, tensor: int = 1) -> None:
    """``cases``: name -> (plan of one pipeline replica, ZeRO stage, precision); the ranks run
    them with worker_harness.dp_parity_ranks."""
    docs = [{"name": name, "config": WorkerConfig(
        model=model, training=training.model_copy(update={"precision": precision}),
        plan=plan.model_dump(mode="json"), data_parallel=replicas, tensor_parallel=tensor,
        zero_stage=zero).model_dump(mode="json")}
        for name, (plan, zero, precision) in cases.items()]
    path.write_text(json.dumps(docs))
