"""Device check (a script, not a test): the worker on the GPU machines' torch (2.11) and CUDA.

    python tests/worker/worker_device_check.py

1. The adapter on this torch: parity of 1f1b, zb-h1, zb-v and a hand-written 6-stages-on-2-ranks
   plan on 2 gloo ranks (CPU) against single-process training.
2. CUDA: a 1-rank NCCL executor step on the GPU (CUDA-event action timing) against the
   single-process reference on the same GPU.
3. CUDA: the block options (grouped-query attention through SDPA's enable_gqa, rope, swiglu,
   widths, MoE aux loss, a two-chunk Mamba scan) on the GPU against the same model on the CPU,
   and the chunked Mamba block's peak memory at 4096 and 8192 tokens (linear: ratio ~2).
Prints one JSON line per check; exits non-zero on any failure.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch


def _compare(grads: dict, ref: dict, *, rtol: float, atol: float) -> float:
    worst = 0.0
    for k, g in ref.items():
        diff = (grads[k].float().cpu() - g.float().cpu()).abs().max().item()
        worst = max(worst, diff)
        torch.testing.assert_close(grads[k].float().cpu(), g.float().cpu(), rtol=rtol, atol=atol)
    return worst


def check_gloo_parity() -> dict:
    import worker_harness as h

    from adaptis.planner.strategies import plan_strategy
    from adaptis.worker.data.sources import SyntheticTokens
    from adaptis.worker.profiling.job_problem import estimate_problem
    from adaptis.worker.testing import reference_step

    t = h.PARITY_TRAINING
    plans = {n: plan_strategy(estimate_problem(h.job_spec(), devices=2), n).plan for n in ("1f1b", "zb-h1", "zb-v")}
    plans["hand"] = h.topological_plan(stages=[(0, 1), (1, 3), (3, 4), (4, 6), (6, 9), (9, 10)],
                                       placement=[[0, 3, 4], [1, 2, 5]], microbatches=8, split=True, defer_w=True)
    tmp = Path(tempfile.mkdtemp())
    h.write_cases(tmp / "cases.json", plans)
    h.run_ranks(h.parity_ranks, world=2, args=(str(tmp / "cases.json"), str(tmp)), timeout_s=240)
    data = SyntheticTokens(vocab_size=h.PARITY_MODEL.vocab_size, sequence_length=t.sequence_length, seed=t.seed)
    ref = reference_step(h.PARITY_MODEL, t, batch=data.batch(position=0, sequences=t.microbatches * t.microbatch_size))
    worst = {}
    for name in plans:
        merged = {}
        for r in range(2):
            res = torch.load(tmp / f"{name}-{r}.pt")
            assert abs(res["loss"] - ref.loss) <= 1e-5 * abs(ref.loss), (name, res["loss"], ref.loss)
            merged.update(res["grads"])
        worst[name] = _compare(merged, ref.grads, rtol=1e-4, atol=1e-6)
    return {"check": "gloo-parity", "ok": True, "max_abs_grad_diff": worst}


def check_cuda_step() -> dict:
    import socket
    from datetime import timedelta

    import torch.distributed as dist
    from worker_harness import PARITY_MODEL, PARITY_TRAINING

    from adaptis.api.job import WorkerConfig
    from adaptis.api.plan import Plan
    from adaptis.worker.data.sources import SyntheticTokens
    from adaptis.worker.models.zoo import build_model, layer_parameters, token_loss

    if not torch.cuda.is_available():
        return {"check": "cuda-step", "ok": False, "reason": "no CUDA"}
    from adaptis.worker.runtime.executor import Executor

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    t = PARITY_TRAINING
    m = t.microbatches
    acts = [("F", 0, mb) for mb in range(m)] + [("BW", 0, mb) for mb in range(m)]
    plan = Plan(stages=[(0, 10)], placement=[[0]], actions=[acts])
    cfg = WorkerConfig(model=PARITY_MODEL, training=t, plan=plan.model_dump(mode="json"))
    dev = torch.device("cuda", 0)
    ex = Executor(cfg, rank=0, world_size=1, device=dev)
    batch = SyntheticTokens(vocab_size=PARITY_MODEL.vocab_size, sequence_length=t.sequence_length,
                            seed=t.seed).batch(position=0, sequences=m * t.microbatch_size)
    stats = ex.step(batch)
    grads = {k: p.grad.detach() for k, p in ex.named_parameters().items() if p.grad is not None}
    net = build_model(PARITY_MODEL, seed=t.seed).to(dev)
    total = 0.0
    for mb in range(m):
        rows = slice(mb * t.microbatch_size, (mb + 1) * t.microbatch_size)
        loss = token_loss(net(batch.inputs[rows].to(dev)), batch.targets[rows].to(dev), scale=1.0 / m)
        loss.backward()
        total += float(loss)
    ref = {k: p.grad for k, p in layer_parameters(net).items() if p.grad is not None}
    worst = _compare(grads, ref, rtol=1e-3, atol=1e-5)
    dist.destroy_process_group()
    assert abs(stats.loss - total) < 1e-4, (stats.loss, total)
    assert stats.busy_seconds[0] > 0 and stats.busy_by_kind.get("F", 0) > 0
    return {"check": "cuda-step", "ok": True, "loss": stats.loss, "ref_loss": total, "max_abs_grad_diff": worst,
            "busy_by_kind": stats.busy_by_kind, "iteration_seconds": stats.iteration_seconds,
            "peak_memory_bytes": stats.peak_memory_bytes}


def check_cuda_blocks(device: str = "cuda") -> dict:
    from test_worker_blocks_parity import MODEL, TRAINING

    from adaptis.api.job import BlockSpec
    from adaptis.api.model import ZooModel
    from adaptis.worker.data.sources import SyntheticTokens
    from adaptis.worker.models.zoo import build_layer, build_model, layer_parameters, set_aux_loss_scale, token_loss

    if device == "cuda" and not torch.cuda.is_available():
        return {"check": "cuda-blocks", "ok": False, "reason": "no CUDA"}
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device(device)
    batch = SyntheticTokens(vocab_size=MODEL.vocab_size, sequence_length=TRAINING.sequence_length,
                            seed=TRAINING.seed).batch(position=0, sequences=2)
    grads = {}
    for where in ("cpu", dev):
        net = build_model(MODEL, seed=TRAINING.seed).to(where)
        set_aux_loss_scale([net], scale=0.5)
        token_loss(net(batch.inputs.to(where)), batch.targets.to(where), scale=0.5).backward()
        grads[str(where)] = {k: p.grad for k, p in layer_parameters(net).items()}
    worst = _compare(grads[str(dev)], grads["cpu"], rtol=1e-3, atol=1e-5)
    mamba = ZooModel(vocab_size=128, hidden=256, heads=8, blocks=[BlockSpec(kind="mamba")])
    block = build_layer(mamba, index=1, seed=0).to(dev)
    peak = {}
    for seq in (4096, 8192):
        x = torch.randn(1, seq, 256, device=dev, requires_grad=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        y = block(x)
        if dev.type == "cuda":
            peak[seq] = torch.cuda.max_memory_allocated() - base
        y.sum().backward()
        del x, y
    ratio = peak[8192] / peak[4096] if peak else None
    assert ratio is None or ratio < 2.5, f"Mamba forward peak {peak}: ratio {ratio}"
    return {"check": "cuda-blocks", "ok": True, "max_abs_grad_diff": worst,
            "mamba_forward_peak_bytes": peak, "ratio": ratio}


def main() -> int:
    print(json.dumps({"torch": torch.__version__, "python": sys.version.split()[0],
                      "cuda": torch.cuda.is_available()}), flush=True)
    failed = 0
    for check in (check_gloo_parity, check_cuda_step, check_cuda_blocks):
        start = time.perf_counter()
        try:
            result = check()
        except Exception as err:  # noqa: BLE001 - report every check
            result = {"check": check.__name__, "ok": False, "error": repr(err)[:2000],
                      "trace": traceback.format_exc()[-3000:]}
        result["seconds"] = round(time.perf_counter() - start, 1)
        failed += not result.get("ok")
        print(json.dumps(result), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
