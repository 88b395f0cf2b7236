"""The final summary of ``adaptis run``: measured against predicted, the step split into its
phases, as one JSON document (``--json``) or printed for a person.

Sits beside :mod:`adaptis.cli.run`, which trains and hands its step events here.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from adaptis.api.events import StepEvent
from adaptis.api.plan import Plan, predicted_seconds

__all__ = ["fmt", "pct", "print_summary", "summary"]


def summary(name: str, *, strategy: str, plan: Plan, workers: int, steps: list[StepEvent],
             mesh: tuple[int, int, int], reduce: list[tuple[float, float]],
             seconds: float, workdir: Path,
             ports: list[Any], checkpoints: tuple[Path, int, int]) -> dict[str, Any]:
    """Losses and throughput are the job's: the loss of the replicas' combined batch (every
    rank reports the same), tokens/s of every replica together."""
    steady = steps[1:] or steps  # the first step pays one-off costs (allocator, threads)
    replicas, pipeline, zero = mesh
    predicted = predicted_seconds(plan.predicted)
    wait, total = sum(w for w, _ in reduce), sum(t for _, t in reduce)
    return {
        "job": name, "strategy": strategy, "workers": workers, "precision": plan.precision,
        "data_parallel": replicas, "pipeline_ranks": pipeline, "ranks": replicas * pipeline, "zero_stage": zero,
        # Share of the ranks' step time spent blocked on the replicas' gradient all-reduce.
        "reduce_wait_share": wait / total if replicas > 1 and total > 0 else None,
        "stages": len(plan.stages), "placement": plan.placement,
        "steps": steps[-1].step if steps else 0,
        "first_loss": steps[0].loss if steps else None,
        "final_loss": steps[-1].loss if steps else None,
        "tokens_per_second": statistics.mean(s.tokens_per_second for s in steady) if steady else None,
        "measured_bubble_ratio": statistics.mean(s.bubble_ratio for s in steady) if steady else None,
        "predicted_bubble_ratio": predicted["bubble_ratio"],
        "measured_iteration_seconds": statistics.mean(s.iteration_seconds for s in steady) if steady else None,
        "predicted_iteration_seconds": predicted["iteration_seconds"],
        "train_seconds": seconds,
        "metrics_ports": ports,
        "workdir": str(workdir),
        "checkpoint_dir": str(checkpoints[0]),
        "checkpoint_every": checkpoints[1],
        "resumed_from_step": checkpoints[2] or None,  # None: started fresh
        **_phases(steady, predicted=predicted),
    }


def _phases(steady: list[StepEvent], *, predicted: dict[str, float | None]) -> dict[str, Any]:
    """The measured step (pipeline + post-pipeline part, what the plan's step time predicts) and
    the rank's time split into phases, seconds and share, from rank 0's step events: the data
    phase, the pipeline part and the post-pipeline part are common to the ranks (each ends at a
    collective), and the job's bubble ratio splits the pipeline part into busy and bubble (the
    mean over the ranks of their idle time). ``predicted``: the plan's, in seconds."""
    out: dict[str, Any] = {"predicted_step_seconds": predicted["step_seconds"],
                           "predicted_post_pipeline_seconds": predicted["post_pipeline_seconds"],
                           "measured_step_seconds": None, "phases": None}
    if not steady:
        return out
    pipeline = statistics.mean(s.iteration_seconds for s in steady)
    bubble = statistics.mean(s.iteration_seconds * s.bubble_ratio for s in steady)
    parts = {"pipeline_busy": pipeline - bubble, "bubble": bubble,
             "post_pipeline": statistics.mean(s.post_pipeline_seconds for s in steady),
             "data": statistics.mean(s.data_seconds for s in steady)}
    total = sum(parts.values())
    out["measured_step_seconds"] = statistics.mean(s.step_seconds for s in steady)
    out["phases"] = {k: {"seconds": v, "share": v / total if total > 0 else 0.0} for k, v in parts.items()}
    return out


def print_summary(s: dict[str, Any]) -> None:
    print(f"done: {s['steps']} steps of {s['job']} with {s['strategy']} on {s['workers']} workers "
          f"in {s['train_seconds']:.1f} s")
    print(f"  loss            {s['first_loss']:.4f} -> {s['final_loss']:.4f}" if s["steps"] else "  no steps run")
    print(f"  tokens/s        {s['tokens_per_second'] or 0:.0f}")
    if s["data_parallel"] > 1:
        zero = ", ZeRO-1" if s["zero_stage"] else ""
        print(f"  data parallel   {s['data_parallel']} replicas x {s['pipeline_ranks']} pipeline ranks"
              f"{zero}; loss of the combined batch; {pct(s['reduce_wait_share'])} of the step "
              "waiting on the gradient all-reduce")
    print(f"  bubble ratio    measured {pct(s['measured_bubble_ratio'])}, predicted {pct(s['predicted_bubble_ratio'])}")
    print(f"  iteration       measured {fmt(s['measured_iteration_seconds'], 's')}, "
          f"predicted {fmt(s['predicted_iteration_seconds'], 's')}")
    if s["phases"]:
        _print_phases(s)
    ad = s.get("adaptation") or {}
    if ad.get("history") or ad.get("suggestion"):
        print(f"  adaptation      {ad['policy']}: {len(ad['history'])} re-plans"
              + (f"; suggested at step {ad['suggestion']['step']}: {ad['suggestion']['reason']}"
                 if ad.get("suggestion") else ""))
    print(f"  logs            {s['workdir']}/rank-*.log")
    every = f"every {s['checkpoint_every']} steps" if s["checkpoint_every"] else "none saved (--checkpoint-every 0)"
    began = "started fresh" if s["resumed_from_step"] is None else f"resumed from step {s['resumed_from_step']}"
    print(f"  checkpoints     {s['checkpoint_dir']} ({every}); {began}")


def _print_phases(s: dict[str, Any]) -> None:
    ph = s["phases"]

    def part(key: str) -> str:
        return f"{fmt(ph[key]['seconds'], 's'):>10} {pct(ph[key]['share']):>6}"

    pipe = {"seconds": ph["pipeline_busy"]["seconds"] + ph["bubble"]["seconds"],
            "share": ph["pipeline_busy"]["share"] + ph["bubble"]["share"]}
    print(f"  step            measured {fmt(s['measured_step_seconds'], 's')}, "
          f"predicted {fmt(s['predicted_step_seconds'], 's')} (pipeline + post-pipeline); "
          "share of the training time:")
    print(f"    pipeline      {fmt(pipe['seconds'], 's'):>10} {pct(pipe['share']):>6}  "
          f"(busy {fmt(ph['pipeline_busy']['seconds'], 's')}, bubble {fmt(ph['bubble']['seconds'], 's')})")
    print(f"    post-pipeline {part('post_pipeline')}  (predicted "
          f"{fmt(s['predicted_post_pipeline_seconds'], 's')})")
    print(f"    data          {part('data')}  (before the step: batch fetch, wait for every rank)")


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def fmt(x: float | None, unit: str) -> str:
    if x is None:
        return "n/a"
    return f"{x * 1e3:.1f} m{unit}" if abs(x) < 1 else f"{x:.3f} {unit}"
