"""Why a plan does not fit, in one bounded sentence a person can read (issue 32 item 4).

Sits at the bottom of the planner layer, beside :mod:`adaptis.planner.errors`: the simulator
(a plan over memory, a plan that deadlocks) and :mod:`adaptis.planner.strategies` (no plan
at all) word their reasons here. A reason names the worst device and how many devices share
its fault, never one clause per device: on 128 devices the per-device list was about 10 KB on
one line, which the CLI printed whole and the operator's condition cut mid-clause. Every
reason made here is at most :data:`MAX_REASON_CHARS` long, below the operator's cut
(``adaptis/operator/planning.py``: 300 characters, after its own prefix is not counted),
and has no ``"; "`` inside a device's clause, so the CLI's first-clause view stays whole.
"""

from __future__ import annotations

from collections.abc import Sequence

from adaptis.planner.costs import Costs

__all__ = ["MAX_REASON_CHARS", "blocked_devices", "memory_lever", "over_memory", "show_bytes"]

#: The longest reason this module makes, prefixes of the strategies' included.
MAX_REASON_CHARS = 280
_EPS = 1e-9
_SHOWN_BLOCKED = 3  # devices a deadlock names before "and N more"


def show_bytes(x: float) -> str:
    """Bytes as a person reads them: GB (decimal, as devices are sold) from 1 GB, else bytes."""
    if x >= 1e9:
        return f"{x / 1e9:.1f} GB"
    if x >= 1e6:
        return f"{x / 1e6:.1f} MB"
    return f"{x:.4g} bytes"


def over_memory(peaks: Sequence[float], memory: Sequence[float]) -> str | None:
    """The worst device over its memory (by need / capacity) and how many are over; None if
    every device fits."""
    over = [d for d, (p, c) in enumerate(zip(peaks, memory, strict=True)) if p > c * (1 + _EPS)]
    if not over:
        return None

    def ratio(d: int) -> float:
        return peaks[d] / memory[d] if memory[d] > 0 else float("inf")

    worst = max(over, key=ratio)  # the first of equal ratios: the lowest device index
    share = ("the only device over memory" if len(over) == 1
             else f"the worst of all {len(over)} devices, each over memory" if len(over) == len(peaks)
             else f"the worst of {len(over)} of the {len(peaks)} devices over memory")
    return (f"device {worst} needs {show_bytes(peaks[worst])}, has {show_bytes(memory[worst])} "
            f"({ratio(worst):.2f}x), {share}")


def memory_lever(costs: Costs) -> str:
    """What would make a plan fit, from the problem alone (the planner has already tried
    recomputation and the memory-driven cut when it says this)."""
    params = sum(costs.param_bytes)
    room = sum(costs.memory)
    if params > room:
        return (f"the parameters alone need {show_bytes(params)}, all devices together have "
                f"{show_bytes(room)}: add devices or memory")
    # A layer's parameters and one microbatch's activations: even recomputing, its backward
    # rebuilds them all at once (the working set Costs.stage_costs counts for recomputation).
    alone = [p + a for p, a in zip(costs.param_bytes, costs.activation_bytes, strict=True)]
    big = max(range(costs.layers), key=lambda i: alone[i])
    if alone[big] > max(costs.memory):
        return (f"layer {big} alone needs {show_bytes(alone[big])}, more than any device has: "
                "more memory per device or a shorter sequence")
    return "add devices or memory per device, or shorten the sequence (fewer activations)"


def blocked_devices(stuck: Sequence[int], waiting: Sequence[object]) -> str:
    """A deadlock's devices: the first few and what each waits on, then how many more."""
    shown = ", ".join(f"device {d} waits on {waiting[d]}" for d in stuck[:_SHOWN_BLOCKED])
    rest = len(stuck) - _SHOWN_BLOCKED
    return f"{shown} and {rest} more" if rest > 0 else shown
