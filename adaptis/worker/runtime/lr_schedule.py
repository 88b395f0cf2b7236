"""The learning rate of each step: the job's schedule as a function of the step alone.

Sits under the executor (:mod:`adaptis.worker.runtime.executor`), which sets the optimizer's rate
before every step from :func:`learning_rate`. Nothing is kept between steps, so a run resumed
from the checkpoint of step ``n`` continues the very curve an uninterrupted run follows (no
scheduler state to save). The curve is torchtitan's: linear warm-up from 0 to ``lr`` over
``warmupSteps`` steps, then ``lr`` (constant) or a decay over the remaining steps down to
``lr x minLrRatio`` (cosine or linear).
"""

from __future__ import annotations

import math

from adaptis.api.job import OptimizerSpec

__all__ = ["learning_rate"]


def learning_rate(spec: OptimizerSpec, *, step: int, total_steps: int) -> float:
    """The rate of the optimizer step that makes step ``step + 1`` (``step`` counts the steps
    done before it, 0-based), for a run of ``total_steps``.

    Warm-up step ``k`` (0-based) uses ``lr x (k + 1) / (warmup + 1)``: never 0, so the first step
    already moves the weights, and the rate reaches ``lr`` at the first step after warm-up. The
    decay goes from ``lr`` at the first step after warm-up to ``lr x minLrRatio`` at the last step
    (a run with a single step after warm-up takes it at ``lr``).
    """
    peak = spec.lr
    warmup = spec.warmup_steps
    if step < warmup:
        return peak * (step + 1) / (warmup + 1)
    if spec.schedule == "constant":
        return peak
    floor = peak * spec.min_lr_ratio
    span = total_steps - 1 - warmup
    progress = min(1.0, (step - warmup) / span) if span > 0 else 0.0
    if spec.schedule == "linear":
        return floor + (peak - floor) * (1.0 - progress)
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
