"""Large structurally valid plans for the operator's storage tests (planning one for real at
64 ranks x 4096 microbatches takes about a minute), and the operator's stored plan record."""

from __future__ import annotations

from typing import Any

from adaptis.api.plan import Plan
from adaptis.operator.core.records import PlanRecord
from adaptis.operator.scheduling.plan_store import ANNOTATION_JOB, LABEL_ROLE, RECORD_KEY, ROLE_PLAN


def split_backward_plan(*, devices: int, microbatches: int) -> Plan:
    """One stage per device, F, B and W per microbatch in a 1F1B-like order."""
    actions: list[list[tuple[str, int, int]]] = []
    for d in range(devices):
        warm = min(devices - d - 1, microbatches)
        acts: list[tuple[str, int, int]] = [("F", d, m) for m in range(warm)]
        for m in range(microbatches):
            if warm + m < microbatches:
                acts.append(("F", d, warm + m))
            acts += [("B", d, m), ("W", d, m)]
        actions.append(acts)
    return Plan(stages=[(d, d + 1) for d in range(devices)],
                placement=[[d] for d in range(devices)], actions=actions,
                strategy="zb-h1", microbatches=microbatches)


def stored_record(cluster: Any, *, job: str = "demo", namespace: str = "ns",
                  operator_namespace: str = "adaptis-system") -> PlanRecord | None:
    """The plan record the operator keeps for ``namespace/job`` in its own namespace."""
    for cm in cluster.list_config_maps(operator_namespace, selector={LABEL_ROLE: ROLE_PLAN}):
        if (cm["metadata"].get("annotations") or {}).get(ANNOTATION_JOB) == f"{namespace}/{job}":
            return PlanRecord.model_validate_json(cm["data"][RECORD_KEY])
    return None
