"""The plan (output of the planner, input of the workers) and the comparison report.

A plan is data, as in the Zero Bubble scheduler: ``stages`` (contiguous layer ranges),
``placement`` (stages per device) and per-device ``actions`` (``[kind, stage, microbatch]``)
in the order each device runs them. :meth:`Plan.check` verifies the structural rules of the
contract against a problem's size; the planner's simulator checks timing and memory. The
actions may also come packed (``actionsPacked``, :mod:`adaptis.api.plan_packing`), the form
the operator stores in a job's ConfigMap: :meth:`Plan.packed` writes it, validation reads both.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Annotated, Any, Literal, NewType, TypeGuard, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, model_validator

from adaptis.api.errors import SpecError, from_validation_error
from adaptis.api.plan_packing import CRD_LIMITS, pack_actions, unpack_actions
from adaptis.api.problem import TIME_UNIT_SECONDS, TimeUnit

__all__ = [
    "Action",
    "ActionKind",
    "Comparison",
    "MicrobatchId",
    "PACKED_ACTIONS",
    "Plan",
    "StageId",
    "StrategyName",
    "StrategyResult",
    "STRATEGY_NAMES",
    "is_strategy_name",
    "load_plan",
    "predicted_seconds",
]

StageId = NewType("StageId", int)
MicrobatchId = NewType("MicrobatchId", int)

ActionKind = Literal["F", "B", "W", "BW"]
#: ``(kind, stage, microbatch)``; serialised as a JSON list ``["F", 0, 3]``.
Action = tuple[ActionKind, Annotated[int, Field(ge=0)], Annotated[int, Field(ge=0)]]

#: The strategies, the one list of their names: spec.planner.strategy, the CLI's --strategy, the
#: planner (adaptis and the keys of planner.baselines.BASELINES, in this order) and the docs'
#: table (api.reference.STRATEGIES) are typed by it or checked against it.
StrategyName = Literal["adaptis", "gpipe", "1f1b", "i1f1b", "zb-h1", "zb-v", "balanced"]
#: The key of a plan document that carries the actions packed instead of as ``actions``.
PACKED_ACTIONS = "actionsPacked"

STRATEGY_NAMES: tuple[StrategyName, ...] = get_args(StrategyName)


def is_strategy_name(name: str) -> TypeGuard[StrategyName]:
    """Whether ``name`` is one of :data:`STRATEGY_NAMES`."""
    return name in STRATEGY_NAMES


class Predicted(BaseModel):
    """What the performance model predicts for a plan (optional extension of the contract)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    iteration_time: float = Field(
        ge=0, description="Predicted time of one iteration, in time_unit."
    )
    bubble_ratio: float = Field(ge=0, le=1, description="Predicted idle fraction of device time.")
    time_unit: TimeUnit = Field(
        default="ms", description="Unit of iteration_time (the problem's time_unit)."
    )
    peak_memory_bytes: list[float] = Field(
        default_factory=list, description="peak_memory_bytes[d]: simulated peak of device d."
    )
    post_pipeline_time: float | None = Field(
        default=None, ge=0,
        description="Predicted time after the pipeline's last action until the step ends: "
        "gradient reductions across data-parallel replicas not hidden by the cooldown, the tied "
        "embedding exchange, clipping and the optimizer step, in time_unit. None: not modelled.",
    )
    step_time: float | None = Field(
        default=None, ge=0,
        description="Predicted time of a whole training step (iteration_time + "
        "post_pipeline_time), in time_unit; what a step measures. None: not modelled.",
    )


def predicted_seconds(predicted: Predicted | None) -> dict[str, float | None]:
    """A plan's predictions in seconds (the bubble ratio as it is), keyed as the worker's
    metrics take them; None where the plan has none (a plan may not model the post-pipeline
    part)."""
    if predicted is None:
        return {"bubble_ratio": None, "iteration_seconds": None, "step_seconds": None,
                "post_pipeline_seconds": None}
    unit = TIME_UNIT_SECONDS[predicted.time_unit]

    def seconds(value: float | None) -> float | None:
        return None if value is None else value * unit

    return {"bubble_ratio": predicted.bubble_ratio,
            "iteration_seconds": seconds(predicted.iteration_time),
            "step_seconds": seconds(predicted.step_time),
            "post_pipeline_seconds": seconds(predicted.post_pipeline_time)}

class Plan(BaseModel):
    """Partition, placement and schedule: everything a worker needs to run an iteration."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    stages: list[tuple[Annotated[int, Field(ge=0)], Annotated[int, Field(ge=1)]]] = Field(
        min_length=1, description="stages[s] = [first_layer, end_layer) in the expanded layers."
    )
    placement: list[list[Annotated[int, Field(ge=0)]]] = Field(
        min_length=1, description="placement[d]: the stage indices on device d."
    )
    actions: list[list[Action]] = Field(description="actions[d]: device d's work, in order.")
    # Optional extensions (the contract allows new optional keys).
    strategy: str | None = Field(default=None, description="The strategy that made the plan.")
    microbatches: int | None = Field(
        default=None, ge=1, description="Microbatches per iteration the plan schedules."
    )
    predicted: Predicted | None = Field(
        default=None, description="What the performance model predicts for this plan."
    )
    precision: Literal["bf16", "fp32"] | None = Field(
        default=None,
        description="The compute precision the plan's costs were measured or estimated in; a "
        "worker running another precision refuses the plan. None: not recorded.",
    )
    recompute: list[bool] | None = Field(
        default=None,
        description="recompute[s]: stage s keeps only its input per microbatch in flight and "
        "recomputes its forward in the backward (activation checkpointing). A recomputed stage "
        "must run fused backwards (BW). None: no stage recomputes.",
    )

    @model_validator(mode="before")
    @classmethod
    def _unpack(cls, data: Any, info: ValidationInfo) -> Any:
        # The packed wire form of the same actions (adaptis.api.plan_packing): unpacked here so
        # that every reader (operator cache, worker, load_plan) gets one model either way. A
        # reader that knows how large the plan may be passes PackLimits as the validation
        # context's "pack_limits" (the CRD's maxima otherwise).
        if isinstance(data, dict) and PACKED_ACTIONS in data:
            if "actions" in data:
                raise ValueError(f"give either actions or {PACKED_ACTIONS}, not both")
            packed = data[PACKED_ACTIONS]
            if not isinstance(packed, str):
                raise ValueError(f"{PACKED_ACTIONS} must be a string (got {type(packed).__name__})")
            data = {k: v for k, v in data.items() if k != PACKED_ACTIONS}
            limits = (info.context or {}).get("pack_limits", CRD_LIMITS)
            data["actions"] = unpack_actions(packed, limits=limits)
        return data

    def packed(self) -> dict[str, Any]:
        """The plan as a JSON document whose actions are packed: small at any size."""
        doc = self.model_dump(mode="json", exclude_none=True, exclude={"actions"})
        doc[PACKED_ACTIONS] = pack_actions(self.actions)
        return doc

    # --- derived views --------------------------------------------------------------------
    @property
    def device_count(self) -> int:
        return len(self.placement)

    def stage_device(self) -> list[int]:
        """``stage_device()[s]``: the device that holds stage ``s``."""
        owner = [-1] * len(self.stages)
        for d, stages in enumerate(self.placement):
            for s in stages:
                owner[s] = d
        return owner

    def check(self, *, layers: int, microbatches: int, devices: int) -> None:
        """Raise :class:`SpecError` unless the plan obeys the contract's structural rules."""
        errors: list[str] = []
        pos = 0
        for s, (lo, hi) in enumerate(self.stages):
            if lo != pos or hi <= lo:
                errors.append(f"plan: stages[{s}]: expected [{pos}, >{pos}), got [{lo}, {hi})")
            pos = hi
        if pos != layers:
            errors.append(f"plan: stages: cover layers [0, {pos}) but the model has {layers}")
        if len(self.placement) != devices:
            errors.append(f"plan: placement: {len(self.placement)} devices, problem has {devices}")
        if len(self.actions) != len(self.placement):
            errors.append("plan: actions: need one list per device of placement")
        seen = Counter(s for stages in self.placement for s in stages)
        for s in range(len(self.stages)):
            if seen[s] != 1:
                errors.append(f"plan: placement: stage {s} is placed {seen[s]} times, expected 1")
        extra = sorted(s for s in seen if s >= len(self.stages))
        if extra:
            errors.append(f"plan: placement: unknown stages {extra}")
        if errors:
            raise SpecError("\n".join(errors))
        owner = self.stage_device()
        n_st = len(self.stages)
        slots = {"F": 0, "B": 1, "W": 2, "BW": 3}
        # counts[(s * microbatches + mb) * 4 + slot]: how often each action appears.
        counts = [0] * (n_st * microbatches * 4)
        for d, acts in enumerate(self.actions):
            for i, (kind, s, mb) in enumerate(acts):
                if s >= n_st or owner[s] != d:
                    errors.append(f"plan: actions[{d}][{i}]: stage {s} is not on device {d}")
                elif mb >= microbatches:
                    errors.append(f"plan: actions[{d}][{i}]: microbatch {mb} >= {microbatches}")
                else:
                    counts[(s * microbatches + mb) * 4 + slots[kind]] += 1
                if len(errors) > 20:
                    break
        for k in range(0, len(counts), 4):
            f, b, w, bw = counts[k : k + 4]
            if f == 1 and ((bw == 1 and b == w == 0) or (bw == 0 and b == w == 1)):
                continue
            s, mb = divmod(k // 4, microbatches)
            errors.append(
                f"plan: actions: stage {s} microbatch {mb} runs F x{f}, B x{b}, W x{w}, BW x{bw}; "
                "expected F once and either B and W once or BW once"
            )
            if len(errors) > 20:
                break
        if not errors and self.recompute is not None:
            errors.extend(self._recompute_errors(self.recompute))
        if errors:
            raise SpecError("\n".join(errors[:20]))

    def _recompute_errors(self, recompute: list[bool]) -> list[str]:
        """Recompute needs one flag per stage, and fused backwards on the stages it marks: torch's
        split weight pass makes one autograd call per parameter group and each call re-runs a
        checkpointed forward, so a split backward would recompute the stage many times over."""
        if len(recompute) != len(self.stages):
            return [f"plan: recompute: {len(recompute)} flags, the plan has {len(self.stages)} "
                    "stages; give one per stage"]
        split = sorted({s for acts in self.actions for kind, s, _mb in acts
                        if kind in ("B", "W") and recompute[s]})
        return [f"plan: recompute: stage {s} recomputes but runs split B/W actions; a recomputed "
                "stage must run fused BW (or set recompute[s] false)" for s in split]

    def to_json(self) -> str:
        return self.model_dump_json(exclude_none=True)


def load_plan(path: str | Path) -> Plan:
    p = Path(path)
    try:
        return Plan.model_validate(json.loads(p.read_text()))
    except OSError as err:
        raise SpecError(f"plan: cannot read {p}: {err.strerror}") from None
    except json.JSONDecodeError as err:
        raise SpecError(f"plan: {p} is not valid JSON: {err}") from None
    except ValidationError as err:
        raise from_validation_error(err, what="plan") from None


class StrategyResult(BaseModel):
    """One row of ``adaptis plan --compare --json``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    feasible: bool = Field(description="false: the strategy cannot run this problem (see reason).")
    reason: str | None = Field(default=None, description="Why the strategy is infeasible.")
    iteration_time: float | None = Field(
        default=None, description="Predicted time of one iteration, in time_unit."
    )
    bubble_ratio: float | None = Field(
        default=None, description="Predicted idle fraction of device time."
    )
    peak_memory_bytes: list[float] | None = Field(
        default=None, description="peak_memory_bytes[d]: simulated peak of device d."
    )
    post_pipeline_time: float | None = Field(
        default=None, description="Predicted time after the pipeline until the step ends "
        "(exposed gradient all-reduce, optimizer), in time_unit."
    )
    step_time: float | None = Field(
        default=None, description="Predicted time of a whole step (iteration_time + "
        "post_pipeline_time), in time_unit."
    )
    stages: int | None = Field(default=None, description="Number of pipeline stages.")
    placement: list[list[int]] | None = Field(
        default=None, description="placement[d]: the stage indices on device d."
    )
    search_seconds: float | None = Field(
        default=None, description="Wall time the strategy took to plan, in seconds."
    )
    cut_short: str | None = Field(
        default=None,
        description="Set when planning stopped at its time limit (adaptis plan --time-limit, "
        "spec.planner.timeLimitSeconds): which plan that left, the best the joint search found "
        "in time or the best baseline. Unset: the search ran to its end.",
    )


class Comparison(BaseModel):
    """The whole ``--compare --json`` document."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = Field(default=None, description="The problem's name.")
    time_unit: str = Field(description="Unit of every time in the document (the problem's).")
    lower_bound: float = Field(
        description="An iteration time no plan can beat, in time_unit: the largest of all "
        "work spread over all devices, the heaviest layer's work on the fastest device, and "
        "critical paths of one microbatch (adaptis.planner.strategies.lower_bound)."
    )
    strategies: dict[str, StrategyResult] = Field(
        description="Result of each strategy run, by name, in the order they ran."
    )

    def payload(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_none=True)
