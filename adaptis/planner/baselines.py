"""The baseline strategies AdaPtis is measured against, written as data (per-device action lists).

Sits in the planner layer next to the joint search: ``adaptis plan --compare`` scores every
entry of :data:`BASELINES` with :mod:`adaptis.planner.simulator`. Each is the strategy of the
strategy table (docs/problem.md), written as its authors run it, because a weak
yardstick would make our speedup a lie:

- ``gpipe``: Megatron partition, one stage per device, all F then all (fused) backward;
- ``1f1b``: PipeDream-flush: device ``d`` warms up with ``p-1-d`` forwards, then alternates;
- ``i1f1b``: Megatron's interleaved 1F1B, looped chunks, the best chunk count ``v >= 2``;
- ``zb-h1``: Zero Bubble H1: B/W split under 1F1B's peak memory (``p`` microbatches in
  flight), W deferred into the cool-down gaps;
- ``zb-v``: Zero Bubble V: ``2p`` stages, device ``d`` holds ``d`` and ``2p-1-d``, B/W split,
  memory of 1F1B's first device (``p`` microbatches through a device's layers) everywhere;
- ``balanced``: :func:`balanced_partition` by profiled cost and device speed, then 1F1B.

The two Zero Bubble strategies take the fastest of the paper's handcrafted order and two
memory-bounded greedy orders (:func:`zero_bubble_actions`): the handcrafted ones reach the
closed forms on uniform stages, the greedy ones adapt to uneven stages and short memory,
as the ZB authors' own automatic scheduler does; that greedy lives in
:mod:`adaptis.planner.zero_bubble` and is re-exported here.

The ones that try several orders or chunk counts and keep the fastest take a ``deadline`` (a
:func:`time.monotonic` value): past it they stop trying and keep the best tried so far, the
first always (``adaptis plan --time-limit``, ``spec.planner.timeLimitSeconds``).

When the model has fewer layers than a strategy needs stages, it runs on the first
``layers // chunks`` devices and the rest stay idle (as one would run Megatron there).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from functools import partial
from typing import Protocol

from adaptis.api.plan import Action, Plan, StrategyName
from adaptis.planner.costs import Costs
from adaptis.planner.errors import OutOfTime, PlannerError
from adaptis.planner.partition import balanced_partition, megatron_partition
from adaptis.planner.simulator import simulate
from adaptis.planner.zero_bubble import Actions, zero_bubble_actions

__all__ = [
    "BASELINES",
    "Baseline",
    "balanced",
    "gpipe",
    "gpipe_actions",
    "interleaved_1f1b",
    "interleaved_actions",
    "one_f_one_b",
    "one_f_one_b_actions",
    "zb_h1",
    "zb_h1_actions",
    "zb_v",
    "zb_v_actions",
    "zero_bubble_actions",
]

log = logging.getLogger(__name__)

class Baseline(Protocol):
    """A baseline strategy: the plan of ``costs``; past ``deadline`` it tries nothing more."""

    def __call__(self, costs: Costs, *, deadline: float | None = None) -> Plan: ...

# Megatron users pick small chunk counts: each chunk adds a pipeline hop per microbatch.
_MAX_CHUNKS = 16


def _pipeline_devices(costs: Costs, *, chunks: int, strategy: StrategyName) -> int:
    """Devices a strategy can use: one ``chunks``-stage share per device, each stage >= 1 layer."""
    p = min(costs.devices, costs.layers // chunks)
    if p < 1:
        raise PlannerError(
            f"{strategy}: needs at least {chunks} layers ({chunks} chunks on a device), "
            f"the model has {costs.layers}"
        )
    if p < costs.devices:
        log.info("%s: %d layers fill only %d of %d devices", strategy, costs.layers, p, costs.devices)
    return p


def _placement(costs: Costs, owned: list[list[int]]) -> list[list[int]]:
    """``owned`` for the used devices, then empty lists for the idle ones."""
    return owned + [[] for _ in range(costs.devices - len(owned))]


def _plan(
    costs: Costs, *, stages: list[tuple[int, int]], owned: list[list[int]], actions: Actions, strategy: StrategyName
) -> Plan:
    # Generated here, checked by the simulator: skip pydantic's per-action validation.
    return Plan.model_construct(
        stages=[(lo, hi) for lo, hi in stages],
        placement=_placement(costs, owned),
        actions=[list(a) for a in actions] + [[] for _ in range(costs.devices - len(actions))],
        strategy=strategy,
        microbatches=costs.microbatches,
    )


# --- schedules of one stage per device --------------------------------------------------------
def gpipe_actions(*, devices: int, microbatches: int) -> Actions:
    """Stage ``d`` on device ``d``: every forward, then every fused backward, in microbatch order."""
    m = microbatches
    return [[("F", d, i) for i in range(m)] + [("BW", d, i) for i in range(m)] for d in range(devices)]


def one_f_one_b_actions(*, devices: int, microbatches: int, split: bool = False) -> Actions:
    """PipeDream-flush: ``p-1-d`` warm-up forwards on device ``d``, then F/BW pairs, then drain.

    ``split`` writes each BW as B then W, same order: the gradient leaves after B.
    """
    p, m = devices, microbatches

    def back(d: int, i: int) -> list[Action]:
        return [("B", d, i), ("W", d, i)] if split else [("BW", d, i)]

    out: Actions = []
    for d in range(p):
        warm = min(p - 1 - d, m)
        acts: list[Action] = [("F", d, i) for i in range(warm)]
        for i in range(m - warm):
            acts += [("F", d, warm + i), *back(d, i)]
        for i in range(m - warm, m):
            acts += back(d, i)
        out.append(acts)
    return out


def gpipe(costs: Costs, *, deadline: float | None = None) -> Plan:  # noqa: ARG001 - one plan: nothing to cut
    """GPipe with Megatron's partition: all forwards, then all (fused) backwards."""
    p = _pipeline_devices(costs, chunks=1, strategy="gpipe")
    stages = megatron_partition(costs, stages_count=p)
    acts = gpipe_actions(devices=p, microbatches=costs.microbatches)
    return _plan(costs, stages=stages, owned=[[d] for d in range(p)], actions=acts, strategy="gpipe")


def one_f_one_b(costs: Costs, *, deadline: float | None = None) -> Plan:  # noqa: ARG001 - one plan: nothing to cut
    """1F1B (PipeDream-flush) with Megatron's partition and a fused backward."""
    p = _pipeline_devices(costs, chunks=1, strategy="1f1b")
    stages = megatron_partition(costs, stages_count=p)
    acts = one_f_one_b_actions(devices=p, microbatches=costs.microbatches)
    return _plan(costs, stages=stages, owned=[[d] for d in range(p)], actions=acts, strategy="1f1b")


def balanced(costs: Costs, *, deadline: float | None = None) -> Plan:  # noqa: ARG001 - one plan: nothing to cut
    """1F1B on the partition that balances F+B+W per device speed (partition-only adaptation)."""
    p = _pipeline_devices(costs, chunks=1, strategy="balanced")
    stages = balanced_partition(costs, stages_count=p, speeds=costs.speed[:p])
    acts = one_f_one_b_actions(devices=p, microbatches=costs.microbatches)
    return _plan(costs, stages=stages, owned=[[d] for d in range(p)], actions=acts, strategy="balanced")


def zb_h1_actions(*, devices: int, microbatches: int) -> Actions:
    """The handcrafted ZB-H1 order: 1F1B with B/W split, device ``d``'s W lagging ``d`` steps.

    Warm-up ``p-1-d`` forwards, then steps of F, B(i), W(i-d): deferring W lets B run down
    the pipeline at B's speed, and the ``d`` deferred W fill device ``d``'s cool-down gaps.
    In flight: at most ``p`` microbatches on every device, 1F1B's peak.
    """
    p, m = devices, microbatches
    out: Actions = []
    for d in range(p):
        warm = min(p - 1 - d, m)
        acts: list[Action] = [("F", d, i) for i in range(warm)]
        for i in range(m):
            if warm + i < m:
                acts.append(("F", d, warm + i))
            acts.append(("B", d, i))
            if i >= d:
                acts.append(("W", d, i - d))
        acts += [("W", d, i) for i in range(max(0, m - d), m)]
        out.append(acts)
    return out


def zb_v_actions(*, devices: int, microbatches: int) -> Actions:
    """The handcrafted ZB-V order of the Zero Bubble paper (device ``d``: stages ``d``, ``2p-1-d``).

    Phases on device ``d`` (chunk 0 is stage ``d``, chunk 1 is stage ``2p-1-d``): ``2(p-d)-1``
    chunk-0 forwards; ``d`` pairs (F chunk 1, F chunk 0); ``p-d`` triples F, B, W on chunk 1;
    then steady blocks F, B, W on chunk 0 and F, B, W on chunk 1 until every F ran; cool-down
    ``d`` pairs (B chunk 0, B chunk 1), ``p-d`` pairs (B, W chunk 0), then the W left, chunk
    1 first. The phases assume ``m >= 2p-1``: for fewer, the order is built for ``2p-1`` and
    the missing microbatches dropped (nothing real depends on them, so it stays deadlock-free).
    """
    p, m = devices, microbatches
    n = max(m, 2 * p - 1)
    out: Actions = []
    for d in range(p):
        c0, c1 = d, 2 * p - 1 - d
        nxt = {("F", c0): 0, ("F", c1): 0, ("B", c0): 0, ("B", c1): 0, ("W", c0): 0, ("W", c1): 0}
        acts: list[Action] = []

        def run(*ops: tuple[str, int], acts: list[Action] = acts, nxt: dict[tuple[str, int], int] = nxt) -> None:
            for kind, s in ops:
                acts.append((kind, s, nxt[(kind, s)]))  # type: ignore[arg-type]
                nxt[(kind, s)] += 1

        for _ in range(2 * (p - d) - 1):
            run(("F", c0))
        for _ in range(d):
            run(("F", c1), ("F", c0))
        for _ in range(p - d):
            run(("F", c1), ("B", c1), ("W", c1))
        while nxt[("F", c1)] < nxt[("F", c0)] or nxt[("F", c0)] < n:
            if nxt[("F", c0)] < n:
                run(("F", c0))
            run(("B", c0), ("W", c0), ("F", c1), ("B", c1), ("W", c1))
        for _ in range(d):
            run(("B", c0), ("B", c1))
        for _ in range(p - d):
            run(("B", c0), ("W", c0))
        while nxt[("W", c1)] < nxt[("B", c1)]:
            run(("W", c1))
        while nxt[("W", c0)] < nxt[("B", c0)]:
            run(("W", c0))
        out.append([a for a in acts if a[2] < m])
    return out


def _memory_caps(
    costs: Costs, *, stages: list[tuple[int, int]], owned: list[list[int]], want: int, least: list[int]
) -> list[int]:
    """Chunk activations each device may hold: ``want``, fewer where memory is short.

    Never below ``least[d]`` (what the strategy's textbook form needs there): a plan that
    does not fit even so is left for the simulator to report infeasible.
    """
    sc = costs.stage_costs(stages)
    caps = []
    for d, mine in enumerate(owned):
        room = costs.memory[d] - sum(sc.param_bytes[s] for s in mine)
        unit = max(sc.activation_bytes[s] for s in mine)
        fit = want if unit <= 0 or math.isinf(room) else max(0, int(min(want, room // unit)))
        caps.append(max(least[d], min(want, fit)))
    return caps


def _fastest(costs: Costs, plans: Iterable[Callable[[], Plan]], *, deadline: float | None) -> Plan:
    """The plan that fits in memory and runs fastest (the fastest overall if none fits).

    ``plans`` are made one at a time (each may take seconds on a large problem); once
    ``deadline`` has passed no further one is made, and the best of those tried wins.
    """
    best: tuple[tuple[bool, float], Plan] | None = None
    for make in plans:
        if best is not None and deadline is not None and time.monotonic() >= deadline:
            log.info("%s: time limit reached, keeping the best order tried", best[1].strategy)
            break
        try:
            plan = make()
        except OutOfTime:
            if best is None:
                raise
            log.info("%s: time limit reached while making an order", best[1].strategy)
            break
        sim = simulate(costs, plan)
        key = (not sim.feasible, sim.iteration_time)
        if best is None or key < best[0]:
            best = (key, plan)
    if best is None:
        raise PlannerError("no order to try (internal error)")
    return best[1]


def _greedy_orders(
    costs: Costs, *, stages: list[tuple[int, int]], owned: list[list[int]], caps: list[int],
    deadline: float | None,
) -> list[Callable[[], Actions]]:
    """The eager-W and lazy-W greedy orders: the ZB heuristics try both kinds of gap filling."""
    return [
        partial(zero_bubble_actions, costs, stages=stages, owned=owned, caps=caps, lazy_w=lazy,
                deadline=deadline)
        for lazy in (False, True)
    ]


def _plan_of(costs: Costs, *, stages: list[tuple[int, int]], owned: list[list[int]],
             order: Callable[[], Actions], strategy: StrategyName) -> Plan:
    return _plan(costs, stages=stages, owned=owned, actions=order(), strategy=strategy)


def zb_h1(costs: Costs, *, deadline: float | None = None) -> Plan:
    """Zero Bubble H1: 1F1B's partition and peak memory (``p`` microbatches), B/W split.

    The handcrafted order of :func:`zb_h1_actions` reaches the paper's bubble
    ``(p-1)(F+B-W)`` on uniform stages; on uneven stages the memory-bounded greedy of
    :func:`zero_bubble_actions` (``p`` microbatches per device, fewer where memory is short,
    never fewer than 1F1B's ``p-d``) may do better, and 1F1B's own order with B/W split
    (W right after its B) makes sure ZB-H1 is never slower than 1F1B. The fastest order
    that fits is used.
    """
    p = _pipeline_devices(costs, chunks=1, strategy="zb-h1")
    stages = megatron_partition(costs, stages_count=p)
    owned = [[d] for d in range(p)]
    caps = _memory_caps(costs, stages=stages, owned=owned, want=p, least=[p - d for d in range(p)])
    m = costs.microbatches
    orders: list[Callable[[], Actions]] = [
        lambda: zb_h1_actions(devices=p, microbatches=m),
        lambda: one_f_one_b_actions(devices=p, microbatches=m, split=True),
        *_greedy_orders(costs, stages=stages, owned=owned, caps=caps, deadline=deadline),
    ]
    return _fastest(costs, (partial(_plan_of, costs, stages=stages, owned=owned, order=o,
                                    strategy="zb-h1") for o in orders), deadline=deadline)


def zb_v(costs: Costs, *, deadline: float | None = None) -> Plan:
    """Zero Bubble V: V-shaped placement of ``2p`` Megatron stages, B/W split.

    Every device may hold ``p`` microbatches through both its chunks (``2p`` chunk
    activations, fewer where memory is short), the peak of 1F1B's first device, as in the
    ZB-V paper. The order is the memory-bounded greedy of :func:`zero_bubble_actions`, which
    with F = B = W settles into ZB-V's steady pattern and leaves only the unavoidable gap
    before the first input reaches each device.
    """
    p = _pipeline_devices(costs, chunks=2, strategy="zb-v")
    stages = megatron_partition(costs, stages_count=2 * p)
    owned = [[d, 2 * p - 1 - d] for d in range(p)]
    caps = _memory_caps(costs, stages=stages, owned=owned, want=2 * p, least=[2] * p)
    orders: list[Callable[[], Actions]] = [
        lambda: zb_v_actions(devices=p, microbatches=costs.microbatches),
        *_greedy_orders(costs, stages=stages, owned=owned, caps=caps, deadline=deadline),
    ]
    return _fastest(costs, (partial(_plan_of, costs, stages=stages, owned=owned, order=o,
                                    strategy="zb-v") for o in orders), deadline=deadline)


# --- Megatron interleaved 1F1B -----------------------------------------------------------------
def interleaved_actions(*, devices: int, chunks: int, microbatches: int) -> Actions:
    """Megatron's interleaved 1F1B on looped chunks (chunk ``k`` of device ``d`` is stage ``k*p+d``).

    Forwards walk Megatron's schedule table: groups of ``p`` microbatches, each group through
    chunk 0, then chunk 1, ...; backwards walk the same table with the chunks reversed.
    Device ``d`` warms up with ``2(p-1-d) + (v-1)p`` forwards (Megatron's formula), then
    alternates one forward and one fused backward, then drains.

    Megatron requires ``m % p == 0``; its later table with a shorter last group deadlocks
    here for some ``m`` (e.g. p=5, m=7). Otherwise we build the order for ``m`` rounded up to
    a multiple of ``p`` and drop the microbatches that do not exist: no real action depends
    on a dropped one, so the order stays deadlock-free, and the warm-up keeps Megatron's shape.
    """
    p, v, m = devices, chunks, microbatches
    padded = -(-m // p) * p
    table = [(mb, k) for lo in range(0, padded, p) for k in range(v) for mb in range(lo, lo + p)]
    total = padded * v
    out: Actions = []
    for d in range(p):
        fwd: list[Action] = [("F", k * p + d, mb) for mb, k in table]
        bwd: list[Action] = [("BW", (v - 1 - k) * p + d, mb) for mb, k in table]
        warm = min(2 * (p - 1 - d) + (v - 1) * p, total)
        acts = fwd[:warm]
        for i in range(total - warm):
            acts += [fwd[warm + i], bwd[i]]
        acts += bwd[total - warm:]
        out.append([a for a in acts if a[2] < m])
    return out


def _chunk_candidates(costs: Costs, *, devices: int) -> list[int]:
    """Chunk counts ``v >= 2`` that leave every stage a layer (at most :data:`_MAX_CHUNKS`)."""
    return [v for v in range(2, _MAX_CHUNKS + 1) if v * devices <= costs.layers]


def interleaved_1f1b(costs: Costs, *, deadline: float | None = None) -> Plan:
    """Megatron interleaved 1F1B with the best chunk count ``v >= 2`` the layers allow.

    "Best": every ``v`` that leaves each stage a layer (up to 16) is simulated, the fastest
    plan that fits in memory wins (the fastest overall if none fits). Megatron itself wants
    the layers per device to divide by ``v``; we also try the uneven ``v`` (split by
    :func:`megatron_partition`'s remainder rule), which can only make the baseline stronger.
    """
    p = _pipeline_devices(costs, chunks=2, strategy="i1f1b")

    def chunked(v: int) -> Plan:
        stages = megatron_partition(costs, stages_count=v * p)
        owned = [[k * p + d for k in range(v)] for d in range(p)]
        acts = interleaved_actions(devices=p, chunks=v, microbatches=costs.microbatches)
        return _plan(costs, stages=stages, owned=owned, actions=acts, strategy="i1f1b")

    # Fewest chunks first: Megatron's usual choice, and the cheapest to simulate.
    return _fastest(costs, (partial(chunked, v) for v in _chunk_candidates(costs, devices=p)),
                    deadline=deadline)


BASELINES: dict[StrategyName, Baseline] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "i1f1b": interleaved_1f1b,
    "zb-h1": zb_h1,
    "zb-v": zb_v,
    "balanced": balanced,
}
