"""From a job and its candidate nodes to a plan: device choice, planning problem, planner call.

Sits between :mod:`adaptis.operator.profiling.nodes` (what the nodes are) and the reconciler (which
writes the result into the ConfigMap and the pods). Steps:

1. cut every candidate node into worker *slots* (``gpusPerWorker`` GPUs each);
2. choose ``workers`` slots, topology first: the narrowest domain (host, then clique, rack,
   zone, ...) that holds enough slots, the fastest nodes within it, ranks ordered along the
   topology so consecutive stages talk over the nearest link;
3. build :class:`adaptis.api.problem.Problem` (layers from :mod:`adaptis.planner.estimate`;
   one device per GPU of ONE pipeline replica, ``data_parallel`` replicas, by the mesh rules
   of :mod:`adaptis.api.mesh`) and call the planner's strategy, plus I-1F1B for the
   speedup figure;
4. return a :class:`PlanRecord`, which the reconciler keeps in the operator's namespace
   (:mod:`adaptis.operator.scheduling.plan_store`) so that it re-plans only when the spec or a
   planned node changes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from adaptis.api.conditions import Reason
from adaptis.api.job import JobSpec, resolve_precision
from adaptis.api.mesh import Mesh, pipeline_devices, replicas_share_nodes
from adaptis.api.problem import DeviceList, Link, Network, Problem
from adaptis.operator.core.errors import Unsatisfiable
from adaptis.operator.core.records import NodeProfile, PlanRecord
from adaptis.operator.core.settings import DEFAULT_INTER_NODE
from adaptis.operator.profiling.nodes import parse_quantity
from adaptis.planner.drift import scaled_speeds
from adaptis.planner.estimate import device_speed
from adaptis.planner.hf_estimate import estimate_model_layers
from adaptis.planner.strategies import Outcome, compare, plan_strategy

__all__ = [
    "Slot",
    "build_problem",
    "choose_slots",
    "correct_speeds",
    "count_slots",
    "plan_job",
    "spec_hash",
]

log = logging.getLogger(__name__)

_INTRA_LATENCY_S = 5e-6
_MAX_REASON = 300
# Spec fields that change neither the plan nor the pods: toggling them never re-plans.
# spec.adaptation too: turning a running job's policy from suggest to auto must not restart it
# (a re-plan it then applies is the adaptation loop's own, kept in the ConfigMap).
_LIFECYCLE_FIELDS = frozenset(
    {"suspend", "backoff_limit", "active_deadline_seconds", "ttl_seconds_after_finished",
     "adaptation"}
)


@dataclass(frozen=True, slots=True)
class Slot:
    """``gpusPerWorker`` GPUs (or CPU cores) of one node: room for one worker pod, which runs
    one rank per GPU (one on CPU). ``speed`` and ``memory_bytes`` are one rank's: one GPU's."""

    node: NodeProfile
    index: int
    speed: float
    memory_bytes: float | None


def spec_hash(spec: JobSpec) -> str:
    """Digest of the spec fields that shape the plan and the pods (lifecycle fields excluded,
    and the planner's time limit: a new budget never restarts a running job)."""
    exclude: dict[str, Any] = dict.fromkeys(_LIFECYCLE_FIELDS, True)
    exclude["planner"] = {"time_limit_seconds"}
    data = spec.model_dump(mode="json", exclude=exclude)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def _cpu_request(resources: Mapping[str, Any] | None) -> float:
    requests = (resources or {}).get("requests") or (resources or {}).get("limits") or {}
    try:
        return max(parse_quantity(requests["cpu"]), 1e-3)
    except (KeyError, ValueError):
        return 1.0


def _slot_shape(node: NodeProfile, *, spec: JobSpec, free_gpus: int | None
                ) -> tuple[int, float, float | None]:
    """How many worker pods one node can hold (on its ``free_gpus`` when given), and the speed
    and usable memory of one of their ranks (one GPU: a pod of N GPUs runs N ranks)."""
    gpw = spec.parallelism.gpus_per_worker
    if gpw > 0:
        count = (node.gpus if free_gpus is None else min(node.gpus, free_gpus)) // gpw
        memory = (None if node.gpu_memory_bytes is None
                  else node.gpu_memory_bytes * (1.0 - spec.planner.memory_headroom))
        return count, device_speed(node.gpu_tflops), memory
    cores = _cpu_request(spec.worker.resources)
    count = max(1, int(node.cpus // cores)) if node.cpus else 1
    return count, device_speed(node.gpu_tflops * cores), None


def node_slots(node: NodeProfile, *, spec: JobSpec, free_gpus: int | None = None) -> list[Slot]:
    """The worker pods one node can hold (on its ``free_gpus`` when given), with the speed and
    usable memory of one of their ranks (one GPU: a pod of N GPUs runs N ranks)."""
    count, speed, memory = _slot_shape(node, spec=spec, free_gpus=free_gpus)
    return [Slot(node=node, index=i, speed=speed, memory_bytes=memory) for i in range(count)]


def count_slots(candidates: Sequence[NodeProfile], *, spec: JobSpec,
                free: Mapping[str, int] | None = None) -> int:
    """How many ranks the candidates hold: all of their GPUs, or only ``free[node]`` of each."""
    return sum(_slot_shape(n, spec=spec, free_gpus=None if free is None else free.get(n.name, 0))[0]
               for n in candidates)


def choose_slots(candidates: Sequence[NodeProfile], *, spec: JobSpec,
                 free: Mapping[str, int] | None = None) -> list[Slot]:
    """``workers`` slots, in rank order, using only ``free[node]`` GPUs of each node when given;
    raise :class:`Unsatisfiable` when there are too few."""
    want = spec.parallelism.workers
    # A node's slots are made only once chosen: at a thousand nodes of 8 GPUs, building all of
    # them for every admission was most of its cost. Nodes with no room take no part.
    shapes = {n.name: _slot_shape(n, spec=spec,
                                  free_gpus=None if free is None else free.get(n.name, 0))
              for n in candidates}
    total = sum(shape[0] for shape in shapes.values())
    if total < want:
        gpw = spec.parallelism.gpus_per_worker
        what = f"{gpw} GPU(s) each" if gpw else "CPU"
        raise Unsatisfiable(
            f"spec.parallelism.workers: {want} workers ({what}) need {want} slots; the "
            f"{len(candidates)} candidate node(s) offer {total}"
        )
    roomy = [n for n in candidates if shapes[n.name][0] > 0]
    depth = max((len(n.topology) for n in candidates), default=0)
    # Narrowest domain first: a single host, then the deepest topology level up to the root.
    levels: list[int | None] = [None, *range(depth, -1, -1)]
    for level in levels:
        groups: dict[tuple[str, ...], list[NodeProfile]] = {}
        for n in roomy:
            key = (n.name,) if level is None else n.topology[:level]
            groups.setdefault(key, []).append(n)
        best: tuple[float, tuple[str, ...]] | None = None
        chosen: list[Slot] = []
        for key, nodes in groups.items():
            if sum(shapes[n.name][0] for n in nodes) < want:
                continue
            slots = _fastest(nodes, shapes=shapes, want=want)
            score = -sum(s.speed for s in slots)
            if best is None or (score, key) < best:
                best, chosen = (score, key), slots
        if chosen:
            return sorted(chosen, key=lambda s: (s.node.topology, s.node.name, s.index))
    raise Unsatisfiable("no topology domain holds enough slots")  # unreachable: root holds all


def _fastest(nodes: Sequence[NodeProfile], *,
             shapes: Mapping[str, tuple[int, float, float | None]], want: int) -> list[Slot]:
    # Whole nodes, fastest first, so ranks share nodes (and their fast links) where they can.
    ordered = sorted(nodes, key=lambda n: (-shapes[n.name][1], n.topology, n.name))
    out: list[Slot] = []
    for n in ordered:
        count, speed, memory = shapes[n.name]
        for i in range(min(count, want - len(out))):
            out.append(Slot(node=n, index=i, speed=speed, memory_bytes=memory))
        if len(out) == want:
            break
    return out


def job_precision(spec: JobSpec) -> str:
    """The precision the job's ranks resolve ``training.precision`` to: its pods get GPUs when
    ``gpusPerWorker`` > 0 (bf16 under auto), CPUs otherwise (fp32 under auto)."""
    return resolve_precision(spec.training.precision, cuda=spec.parallelism.gpus_per_worker > 0)


def build_problem(
    spec: JobSpec, slots: Sequence[Slot], *, inter_node: Link = DEFAULT_INTER_NODE, name: str
) -> Problem:
    """The planning problem of a job on the chosen slots (slot w is worker pod w): device p is
    pipeline rank p, one GPU, the slowest of the replicas' at p (adaptis.api.mesh)."""
    # Activations of 2 bytes an element in bf16, 4 in fp32: the precision the ranks will run.
    layers = estimate_model_layers(spec.model, spec.training,
                             element_bytes=2 if job_precision(spec) == "bf16" else 4)
    mesh = Mesh.of(spec)
    if len(slots) != mesh.pods:
        raise Unsatisfiable(f"spec.parallelism.workers: {mesh.pods} worker pods, "
                            f"{len(slots)} slots chosen")
    nodes = [s.node.name for s in slots]
    devices = pipeline_devices(mesh, nodes=nodes, speeds=[s.speed for s in slots],
                               memory=[s.memory_bytes for s in slots])
    # One intra-node link for the whole problem: the slowest one of the nodes used.
    intra = Link(bandwidth_bytes_per_s=min(s.node.intra_node_bandwidth for s in slots),
                 latency_s=_INTRA_LATENCY_S)
    replica_link = None
    if mesh.replicas > 1:
        replica_link = intra if replicas_share_nodes(mesh, nodes=nodes) else inter_node
    return Problem(
        name=name,
        time_unit="ms",
        microbatches=spec.training.microbatches,
        layers=layers,
        devices=DeviceList(list=devices),
        data_parallel=mesh.replicas,
        # A device is a tensor group inside one pod: its all-reduces run over the intra-node link.
        tensor_parallel=mesh.tensor,
        sequence_parallel=spec.parallelism.sequence_parallel and mesh.tensor > 1,
        network=Network(intra_node=intra, inter_node=inter_node, data_parallel=replica_link),
    )


def correct_speeds(problem: Problem, factors: Sequence[float]) -> Problem:
    """``problem`` with pipeline device d's speed times ``factors[d]`` (adaptation's measured
    corrections, :mod:`adaptis.operator.adaptation.loop`); unchanged when there are none."""
    if not factors:
        return problem
    if len(factors) != problem.device_count:
        raise Unsatisfiable(f"{len(factors)} corrected device speeds for {problem.device_count} devices")
    return scaled_speeds(problem, factors=factors)


def plan_job(
    spec: JobSpec,
    candidates: Sequence[NodeProfile],
    *,
    name: str,
    inter_node: Link = DEFAULT_INTER_NODE,
    slots: Sequence[Slot] | None = None,
    time_limit_s: float | None = None,
    strategy: str | None = None,
    speed_correction: tuple[tuple[str, ...], tuple[float, ...]] | None = None,
) -> PlanRecord:
    """Plan on ``slots`` (chosen, and reserved, by the caller; by default
    :func:`choose_slots` of all the candidates' GPUs); raise :class:`Unsatisfiable` when no
    feasible plan exists.

    ``time_limit_s``: the planner's deadline (it keeps the best plan found by then);
    ``strategy``: instead of spec.planner.strategy (a fallback; the record still belongs to
    the spec); ``speed_correction``: (nodes, factors) of the running plan's corrected device
    speeds, applied only when the chosen slots are on those same nodes, in that order (a
    measured slowness belongs to its node: after a node change it no longer holds)."""
    if slots is None:
        slots = choose_slots(candidates, spec=spec)
    problem = build_problem(spec, slots, inter_node=inter_node, name=name)
    factors: tuple[float, ...] = ()
    if speed_correction is not None and tuple(s.node.name for s in slots) == speed_correction[0]:
        factors = speed_correction[1]
        problem = correct_speeds(problem, factors)
    fallback = strategy is not None
    strategy = strategy or spec.planner.strategy
    outcome, baseline = _solve(problem, strategy=strategy, time_limit_s=time_limit_s)
    if outcome.plan is None or not outcome.result.feasible:
        raise Unsatisfiable(f"spec.planner.strategy: {strategy} finds no feasible plan on "
                            f"{Mesh.of(spec).pipeline} device(s): {_short_reason(outcome)}")
    if baseline is None and strategy != "i1f1b" and not fallback:  # a fallback has no time left for a yardstick
        baseline = plan_strategy(problem, "i1f1b", time_limit_s=time_limit_s)
    iteration = float(outcome.result.iteration_time or 0.0)
    step = outcome.result.step_time
    speedup = 1.0 if strategy == "i1f1b" else _speedup(iteration, baseline=baseline)
    # The precision the costs were made for: the workers check it.
    plan = outcome.plan.model_copy(update={"precision": job_precision(spec)})
    if plan.strategy is None:
        plan = plan.model_copy(update={"strategy": strategy})
    used = {s.node.name: s.node for s in slots}
    mesh = Mesh.of(spec)
    log.info("%s: planned %s on %d ranks (%d replicas x %d) in %d pods over %d nodes: %d stages, "
             "%.4g s/iteration", name, strategy, mesh.world, mesh.replicas, mesh.pipeline,
             len(slots), len(used), len(plan.stages), iteration / 1e3)
    return PlanRecord(
        spec_hash=spec_hash(spec),
        plan=plan,
        nodes=[s.node.name for s in slots],
        hostnames=[s.node.hostname for s in slots],
        gpus=[s.node.gpu_product for s in slots],
        ranks_per_pod=mesh.per_pod,
        data_parallel=mesh.replicas,
        tensor_parallel=mesh.tensor,
        node_fingerprints={n: p.fingerprint() for n, p in sorted(used.items())},
        strategy=strategy,
        predicted_iteration_seconds=iteration / 1e3,
        predicted_bubble_ratio=float(outcome.result.bubble_ratio or 0.0),
        predicted_step_seconds=None if step is None else step / 1e3,
        predicted_speedup_over_i1f1b=speedup,
        device_speed=list(factors),
        budget_reason=None if outcome.result.cut_short is None else Reason.TIME_LIMIT_REACHED.value,
        budget_note=None if outcome.result.cut_short is None else
        f"spec.planner.timeLimitSeconds ({time_limit_s:g} s) ran out: {outcome.result.cut_short}",
    )


def _solve(problem: Problem, *, strategy: str, time_limit_s: float | None) -> tuple[Outcome, Outcome | None]:
    """The strategy's outcome, and I-1F1B's when the same run gave it (the joint search scores
    every baseline anyway)."""
    if strategy == "adaptis":
        _, outcomes = compare(problem, time_limit_s=time_limit_s, bound=False)
        return outcomes["adaptis"], outcomes["i1f1b"]
    return plan_strategy(problem, strategy, time_limit_s=time_limit_s), None


def _short_reason(outcome: Outcome) -> str:
    """Why no plan was found, cut to keep status and events readable (one line per device)."""
    reason = outcome.result.reason or "no reason given"
    if len(reason) > _MAX_REASON:
        reason = reason[:_MAX_REASON].rsplit(";", 1)[0] + "; ..."
    return reason


def _speedup(iteration: float, *, baseline: Outcome | None) -> float | None:
    """I-1F1B's iteration time over ``iteration``, rounded; None without a feasible, finite one."""
    if baseline is None or not baseline.result.feasible or not baseline.result.iteration_time or iteration <= 0:
        return None
    speedup = float(baseline.result.iteration_time) / iteration
    return round(speedup, 4) if math.isfinite(speedup) else None
