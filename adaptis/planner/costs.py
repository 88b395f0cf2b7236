"""Costs: the planning problem flattened into plain tuples the planner's hot loops can use.

Sits between ``adaptis.api.problem`` (parsed, validated, user-facing) and the simulator and
search (which evaluate thousands of candidate plans and must not touch pydantic objects).
Times stay in the problem's ``time_unit``; link latency and bandwidth are converted to it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate

from adaptis.api.problem import TIME_UNIT_SECONDS, Link, Problem, TimeUnit
from adaptis.planner.tensor_parallel import sharded_layers

__all__ = ["Costs", "StageCosts"]


@dataclass(frozen=True, slots=True)
class StageCosts:
    """Per-stage sums for one partition (speed-1 times; bytes)."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    weight: tuple[float, ...]
    fused: tuple[float, ...]  # a BW action: B and W in one pass
    activation_bytes: tuple[float, ...]
    param_bytes: tuple[float, ...]
    output_bytes: tuple[float, ...]  # what the stage's last layer sends on

    def held_by(self, owner: list[int], *, devices: int) -> tuple[list[float], list[float]]:
        """Per device: the parameter bytes of its stages, and the activation bytes one
        microbatch keeps through them (``owner[s]``: stage s's device)."""
        params, activations = [0.0] * devices, [0.0] * devices
        for s, d in enumerate(owner):
            params[d] += self.param_bytes[s]
            activations[d] += self.activation_bytes[s]
        return params, activations


@dataclass(frozen=True, slots=True)
class Costs:
    """Everything the planner needs, as tuples indexed by layer or by device."""

    time_unit: TimeUnit
    microbatches: int
    names: tuple[str, ...]
    kinds: tuple[str | None, ...]
    forward: tuple[float, ...]
    backward: tuple[float, ...]
    weight: tuple[float, ...]
    fused: tuple[float, ...]  # fused backward per layer (B + W unless profiled apart)
    activation_bytes: tuple[float, ...]
    param_bytes: tuple[float, ...]
    output_bytes: tuple[float, ...]
    speed: tuple[float, ...]
    memory: tuple[float, ...]  # math.inf when unbounded
    node: tuple[int, ...]
    # (latency, time per byte) in time_unit; None: free.
    intra: tuple[float, float] | None
    inter: tuple[float, float] | None
    overhead: float = 0.0  # time_unit added to every action, whatever the device's speed
    # torch's split weight pass: parameter groups per layer, and the time of one walk through
    # each layer's autograd graph (empty: none; see stage_costs).
    groups: tuple[float, ...] = ()
    walk: tuple[float, ...] = ()
    # Data parallel: replicas of the pipeline, the link of their gradient all-reduce ((latency,
    # time per byte) in time_unit; None: free), and per layer its gradient bytes and the
    # optimizer step's time on a device of speed 1 (empty: none).
    replicas: int = 1
    replica_link: tuple[float, float] | None = None
    grad_bytes: tuple[float, ...] = ()
    optimizer: tuple[float, ...] = ()
    # What the search minimises (Problem.objective): "auto" is the step where replicas > 1.
    objective: str = "auto"

    @classmethod
    def from_problem(cls, problem: Problem) -> Costs:
        """The problem's costs, each layer's as one rank of a device holds and computes it
        (under tensor parallelism, :mod:`adaptis.planner.tensor_parallel`)."""
        layers = problem.expanded_layers()
        devices = problem.device_specs()
        nodes: dict[str, int] = {}
        unit = TIME_UNIT_SECONDS[problem.time_unit]
        rank = sharded_layers(layers, degree=problem.tensor_parallel, link=problem.network.tensor_link,
                              unit_seconds=unit, sequence=problem.sequence_parallel)

        def link(spec: Link | None) -> tuple[float, float] | None:
            if spec is None:
                return None
            return (spec.latency_s / unit, 1.0 / (spec.bandwidth_bytes_per_s * unit))

        return cls(
            time_unit=problem.time_unit,
            microbatches=problem.microbatches,
            names=tuple(lay.name for lay in layers),
            kinds=tuple(lay.kind for lay in layers),
            forward=tuple(r.forward for r in rank),
            backward=tuple(r.backward for r in rank),
            weight=tuple(r.weight for r in rank),
            fused=tuple(r.fused for r in rank),
            activation_bytes=tuple(r.activation_bytes for r in rank),
            param_bytes=tuple(r.param_bytes for r in rank),
            output_bytes=tuple(r.output_bytes for r in rank),
            speed=tuple(dev.speed for dev in devices),
            memory=tuple(math.inf if dev.memory_bytes is None else dev.memory_bytes for dev in devices),
            node=tuple(nodes.setdefault(dev.node, len(nodes)) for dev in devices),
            intra=link(problem.network.intra_node),
            inter=link(problem.network.inter_node),
            overhead=problem.action_overhead_s / unit,
            groups=tuple(float(lay.weight_groups or 0) for lay in layers),
            walk=tuple(lay.graph_walk or 0.0 for lay in layers),
            replicas=problem.data_parallel,
            replica_link=link(problem.network.replica_link),
            grad_bytes=tuple(r.grad_bytes for r in rank),
            optimizer=tuple(r.optimizer for r in rank),
            objective=problem.objective,
        )

    @property
    def by_step(self) -> bool:
        """Whether the search scores a candidate by its step (Problem.objective), not its iteration."""
        return self.objective == "step" or (self.objective == "auto" and self.replicas > 1)

    @property
    def layers(self) -> int:
        return len(self.forward)

    @property
    def devices(self) -> int:
        return len(self.speed)

    def transfer_time(self, src: int, dst: int, *, nbytes: float) -> float:
        """latency + bytes / bandwidth of the link between two devices; 0 on the same one."""
        if src == dst:
            return 0.0
        lk = self.intra if self.node[src] == self.node[dst] else self.inter
        if lk is None:
            return 0.0
        return lk[0] + nbytes * lk[1]

    def stage_costs(self, stages: list[tuple[int, int]] | tuple[tuple[int, int], ...],
                    recompute: list[bool] | tuple[bool, ...] | None = None) -> StageCosts:
        """Sum layer costs over each ``[lo, hi)`` stage (prefix sums: O(layers + stages)).

        The first stage's input is token ids: it has no input gradient to compute, and torch's
        pipelining runtime runs its whole backward in W (its B does nothing). So its B time
        moves into its W; nothing downstream ever waits for it.

        A split W (every other stage's) pays torch's graph walks on top of its layers' weight
        time: the weight pass makes one autograd call per parameter group, and each call walks
        the graph of every earlier layer of the stage, so a stage ``[lo, hi)`` adds
        ``sum(groups[j] * sum(walk[lo:j]) for j in range(lo, hi))``, quadratic in its depth.

        ``recompute[s]`` (a plan's activation recomputation, see :meth:`_recomputed`): the
        stage's backward runs its forward again, and only its input stays in flight.
        """

        def sums(values: tuple[float, ...]) -> tuple[float, ...]:
            pre = [0.0, *accumulate(values)]
            return tuple(pre[hi] - pre[lo] for lo, hi in stages)

        backward = sums(self.backward)
        weight = sums(self.weight)
        if any(self.walk) and any(self.groups):
            weight = tuple(w + x for w, x in zip(weight, self._walks(stages), strict=True))
        fused = sums(self.fused)
        if stages:
            weight = (fused[0], *weight[1:])  # the first stage's W is its whole backward
            backward = (0.0, *backward[1:])
        out = StageCosts(
            forward=sums(self.forward),
            backward=backward,
            weight=weight,
            fused=fused,
            activation_bytes=sums(self.activation_bytes),
            param_bytes=sums(self.param_bytes),
            output_bytes=tuple(self.output_bytes[hi - 1] for _, hi in stages),
        )
        if recompute and any(recompute):
            return self._recomputed(out, stages=stages, recompute=recompute)
        return out

    def _recomputed(self, sc: StageCosts, *,
                    stages: list[tuple[int, int]] | tuple[tuple[int, int], ...],
                    recompute: list[bool] | tuple[bool, ...]) -> StageCosts:
        """A recomputed stage's costs: its backward (fused BW, or B, which runs first on a split
        one) pays its forward again; per microbatch in flight it holds only its input (the
        previous layer's output; the first stage's token ids are counted as nothing); and the
        recomputation's working set, one microbatch's full activations, is counted with the
        parameters, held all iteration: an upper bound, since it really lives only during that
        stage's backward. Plans only mark stages with fused backwards (Plan.check)."""
        def pick(values: tuple[float, ...], changed: list[float]) -> tuple[float, ...]:
            return tuple(c if r else v for v, c, r in zip(values, changed, recompute, strict=True))

        held = [self.output_bytes[lo - 1] if lo > 0 else 0.0 for lo, _hi in stages]
        return StageCosts(
            forward=sc.forward,
            backward=pick(sc.backward, [b + f for b, f in zip(sc.backward, sc.forward, strict=True)]),
            weight=sc.weight,
            fused=pick(sc.fused, [b + f for b, f in zip(sc.fused, sc.forward, strict=True)]),
            activation_bytes=pick(sc.activation_bytes, held),
            param_bytes=pick(sc.param_bytes, [p + a - h for p, a, h in
                                              zip(sc.param_bytes, sc.activation_bytes, held, strict=True)]),
            output_bytes=sc.output_bytes,
        )

    def _walks(self, stages: list[tuple[int, int]] | tuple[tuple[int, int], ...]) -> tuple[float, ...]:
        # sum_j g_j * (P_j - P_lo), P the prefix sums of walk: O(1) a stage from two more prefix sums.
        pre_walk = [0.0, *accumulate(self.walk)]
        pre_g = [0.0, *accumulate(self.groups)]
        pre_gp = [0.0, *accumulate(g * p for g, p in zip(self.groups, pre_walk, strict=False))]
        return tuple((pre_gp[hi] - pre_gp[lo]) - pre_walk[lo] * (pre_g[hi] - pre_g[lo]) for lo, hi in stages)

    def allreduce_time(self, nbytes: float) -> float:
        """Ring all-reduce of ``nbytes`` across the replicas: 2(R-1) steps, each one latency and
        nbytes / R over the replica link, so 2(R-1) latency + 2(R-1)/R nbytes / bandwidth; 0
        with one replica or a free link."""
        r = self.replicas
        if r <= 1 or self.replica_link is None or nbytes <= 0:
            return 0.0
        latency, per_byte = self.replica_link
        return 2 * (r - 1) * latency + 2 * (r - 1) / r * nbytes * per_byte

    def stage_sums(
        self, values: tuple[float, ...], stages: list[tuple[int, int]]
    ) -> tuple[float, ...]:
        """``values`` (per layer; empty: zeros) summed over each ``[lo, hi)`` stage."""
        if not values:
            return tuple(0.0 for _ in stages)
        pre = [0.0, *accumulate(values)]
        return tuple(pre[hi] - pre[lo] for lo, hi in stages)

    def layer_work(self) -> tuple[float, ...]:
        """F + B + W of each layer: the balancing weight of partitions."""
        return tuple(f + b + w for f, b, w in zip(self.forward, self.backward, self.weight, strict=True))

    def least_backward(self) -> tuple[float, ...]:
        """The cheaper way to run each layer's backward: split B + W, or fused."""
        return tuple(min(b + w, fu) for b, w, fu in zip(self.backward, self.weight, self.fused, strict=True))
