"""Admission of a job onto free GPUs: keep a cached placement, choose new slots, or queue.

Sits between the reconciler (which turns the outcome into phase, conditions and Events) and
:mod:`adaptis.operator.scheduling.capacity` (the ledger) and
:mod:`adaptis.operator.scheduling.planning` (slot choice). Each function runs its
read-choose-reserve inside the ledger's critical section, so that what it returns is already held
for the job.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from adaptis.api.conditions import Reason
from adaptis.api.job import JobSpec
from adaptis.operator.core.records import NodeProfile, PlanRecord
from adaptis.operator.scheduling.capacity import CapacityLedger, JobKey, QueueOrder
from adaptis.operator.scheduling.inventory import Inventory
from adaptis.operator.scheduling.planning import Slot, choose_slots, count_slots

__all__ = ["Waiting", "admit", "hold_placement"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Waiting:
    """Not admitted: why, in words for the status and Event."""

    reason: Reason  # WaitingForCapacity | BehindStarvedJob
    message: str


def _free(ledger: CapacityLedger, inventory: Inventory, *, key: JobKey,
          candidates: Sequence[NodeProfile], own: Sequence[Mapping[str, Any]] = ()
          ) -> dict[str, int]:
    ignore = frozenset((str((p.get("metadata") or {}).get("namespace")),
                        str((p.get("metadata") or {}).get("name"))) for p in own)
    return ledger.free_gpus(allocatable={c.name: c.gpus for c in candidates},
                            holds=inventory.gpu_holds(pods=ignore), job=key, ignore=ignore)


def hold_placement(ledger: CapacityLedger, inventory: Inventory, *, key: JobKey, record: PlanRecord,
                   candidates: Sequence[NodeProfile], gpus_per_worker: int,
                   by_kueue: bool = False) -> bool:
    """Reserve the GPUs of a cached plan if they are still free (the job's own pods count as
    free to it); False: another pod or job holds some of them now, so plan again.
    ``by_kueue``: Kueue admits the job (spec.queueName), the plan stands and nothing is
    reserved: its pods count once Kueue lets them be scheduled."""
    if by_kueue:
        return True
    need = record.gpus_by_node(gpus_per_worker=gpus_per_worker)
    with ledger.admission():
        if ledger.reservation(key) == need:
            # Held since it was admitted: what took them since is the scheduler's to refuse
            # (and then the unschedulable re-plan's), not a reason to queue a running job on
            # a pod list a few seconds old.
            return True
        free = _free(ledger, inventory, key=key, candidates=candidates)
        if any(gpus > free.get(node, 0) for node, gpus in need.items()):
            return False
        ledger.reserve(key, need)
    return True


def admit(ledger: CapacityLedger, inventory: Inventory, *, key: JobKey, spec: JobSpec,
          candidates: Sequence[NodeProfile], created: str,
          own: Sequence[Mapping[str, Any]] = ()) -> list[Slot] | Waiting:
    """Slots on free GPUs, reserved for the job, or why it waits (it is then queued).
    ``own``: the job's profiler pods, whose GPUs are its own (they go once it is planned).

    A job with ``spec.queueName`` is Kueue's to queue: it never waits here and holds no
    reservation (its gated pods hold nothing; admitted, they count like anyone's pods). Its
    slots are free GPUs when there are enough, else any of the candidates': if they are taken
    when Kueue admits it, the unschedulable re-plan moves it.

    Raises :class:`~adaptis.operator.core.errors.Unsatisfiable` when the candidates could not hold
    the job even if they were empty.
    """
    workers = spec.parallelism.workers
    gpw = spec.parallelism.gpus_per_worker
    if count_slots(candidates, spec=spec) < workers:
        choose_slots(candidates, spec=spec)  # raises Unsatisfiable with the counts
    order = QueueOrder.of(key, priority=inventory.priority(spec.worker.priority_class_name),
                          created=created)
    if spec.queue_name:
        with ledger.admission():
            free = _free(ledger, inventory, key=key, candidates=candidates, own=own)
        fits = count_slots(candidates, spec=spec, free=free) >= workers
        return choose_slots(candidates, spec=spec, free=free if fits else None)
    with ledger.admission():
        free = _free(ledger, inventory, key=key, candidates=candidates, own=own)
        blocker = ledger.blocker(key, order=order)
        if blocker is None and count_slots(candidates, spec=spec, free=free) >= workers:
            slots = choose_slots(candidates, spec=spec, free=free)
            held: dict[str, int] = {}
            for slot in slots:
                held[slot.node.name] = held.get(slot.node.name, 0) + gpw
            ledger.reserve(key, held)
            return slots
        ledger.enqueue(key, order=order, gpus=workers * gpw)
        place, waiting = ledger.position(key, order=order)
    need = f"{workers * gpw} GPUs ({workers} workers x {gpw})"
    if blocker is not None:
        (ns, name), gpus, waited = blocker
        return Waiting(reason=Reason.BEHIND_STARVED_JOB,
                       message=f"needs {need}; queued behind {ns}/{name}, which needs {gpus} "
                       f"GPUs and has waited {waited:.0f}s, longer than the operator's "
                       f"--queue-strict-after-seconds: nothing behind it starts first")
    usable = sum(free.get(c.name, 0) // gpw for c in candidates) * gpw
    return Waiting(reason=Reason.WAITING_FOR_CAPACITY,
                   message=f"needs {need}; {usable} free on {len(candidates)} candidate "
                   f"node(s) in whole workers; {place} of {waiting} waiting (priority, then "
                   f"creation time)")

