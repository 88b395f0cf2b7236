"""kopf wiring: which events queue which job."""

from __future__ import annotations

from adaptis.operator.control.handlers import build_registry, wants_reconcile
from adaptis.operator.control.workqueue import WorkQueue


def test_status_echoes_do_not_requeue_but_spec_changes_do() -> None:
    echo = {"metadata": {"generation": 3}, "status": {"observedGeneration": 3}}
    change = {"metadata": {"generation": 4}, "status": {"observedGeneration": 3}}
    assert not wants_reconcile("MODIFIED", echo)
    assert wants_reconcile("MODIFIED", change)
    assert wants_reconcile(None, echo)  # the initial listing after an operator restart
    assert wants_reconcile("ADDED", echo)


def test_registry_watches_jobs_and_pods_without_finalizers() -> None:
    q: WorkQueue[tuple[str, str]] = WorkQueue(lambda k: None)
    registry = build_registry(q)
    watched = sorted(
        (h.selector.group or "", h.selector.any_name or "") if h.selector else ("", "")
        for h in registry._watching.get_all_handlers()
    )
    # Nodes are the inventory's informer's (one watch of them, not two).
    assert watched == [("", "pods"), ("adaptis.io", "adaptisjobs")]
    # No change handlers (create/update/delete) means kopf never adds a finalizer or writes
    # its progress annotations onto the jobs.
    assert list(registry._changing.get_all_handlers()) == []
    assert list(registry._spawning.get_all_handlers()) == []
