"""Large structurally valid plans for the operator's storage tests (planning one for real at
64 ranks x 4096 microbatches takes about a minute)."""

from __future__ import annotations

from adaptis.api.plan import Plan


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
