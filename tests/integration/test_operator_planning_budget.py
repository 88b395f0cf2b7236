"""Planning within a budget, on the real control plane: big plans never hold up a small job.

The operator runs as a user runs it (``adaptis operator``, defaults: one planner slot). Three
large valid jobs (16 ranks x 4096 blocks x 64 microbatches, a 32000-token vocabulary: 2.4 s
of planning each unbounded on an idle core, where 1 s cuts the search: bench/planning_budget.py) are applied with
``spec.planner.timeLimitSeconds: 1`` (the least; sizes whose plans need far longer do not fit
a ConfigMap yet), then a trivial job. Each large pass hands its plan to the planner process and
returns (an Event ``Planning`` says so); the three plans run one after the other. The trivial
job, planned in its own pass, must be Running within a few seconds, and every large job must
end Planned with the condition saying its plan is the best found within the limit.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from operator_process import OperatorProcess, install_crd

NS = "plan-budget"
BIG_POOL = {"adaptis.io/test-pool": "plan-budget-big"}
SMALL_POOL = {"adaptis.io/test-pool": "plan-budget-small"}
LIMIT_S = 1
# The small job's apply-to-Running deadline: pods created and bound, kwok's Running seen.
SMALL_S = 10


def _job(name: str, *, pool: dict[str, str], blocks: int, workers: int, microbatches: int,
         vocab: int = 512, seq: int = 16, **extra: Any) -> dict[str, Any]:
    return {
        "apiVersion": "adaptis.io/v1alpha1", "kind": "AdaPtisJob",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "model": {"vocabSize": vocab, "hidden": 64, "heads": 2,
                      "blocks": [{"kind": "attention", "count": blocks}]},
            "training": {"steps": 2, "microbatches": microbatches, "sequenceLength": seq},
            "parallelism": {"workers": workers, "gpusPerWorker": 1},
            "worker": {"nodeSelector": dict(pool),
                       "annotations": {"adaptis.io/fake-run-seconds": "600"}},
            **extra,
        },
    }


@pytest.fixture(scope="module")
def operator(control_plane: Any, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[OperatorProcess]:
    cp = control_plane
    install_crd(cp)
    cp.create_namespace(NS)
    for i in range(6):  # 3 x 16 GPUs
        cp.add_fake_gpu_node(f"budget-big-{i}", gpu_count=8, zone="budget-zone",
                             rack="budget-rack", labels=BIG_POOL)
    cp.add_fake_gpu_node("budget-small-0", gpu_count=2, zone="budget-zone", rack="budget-rack",
                         labels=SMALL_POOL)
    op = OperatorProcess(cp, Path(tmp_path_factory.mktemp("budget")) / "operator.log",
                         namespace=NS)
    op.start()
    try:
        yield op
    finally:
        op.stop()


def _condition(op: OperatorProcess, name: str, type_: str) -> dict[str, Any] | None:
    return next((c for c in op.status(name).get("conditions", []) if c["type"] == type_), None)


def _events(op: OperatorProcess, name: str, reason: str) -> list[dict[str, Any]]:
    items = op.cp.get_json("events", "-n", NS, "--field-selector",
                           f"involvedObject.name={name}")["items"]
    return [e for e in items if e["reason"] == reason]


def test_small_job_runs_while_large_ones_plan_within_their_limit(
        operator: OperatorProcess) -> None:
    bigs = [f"big-{i}" for i in range(3)]
    for name in bigs:
        operator.cp.apply(_job(name, pool=BIG_POOL, blocks=4096, workers=16, microbatches=64,
                               vocab=32000, seq=512, planner={"strategy": "adaptis", "timeLimitSeconds": LIMIT_S}))
    t0 = time.monotonic()
    operator.cp.apply(_job("small", pool=SMALL_POOL, blocks=6, workers=2, microbatches=4))
    operator.wait("the small job Running",
                  lambda: operator.status("small").get("phase") == "Running", timeout=SMALL_S)
    took = time.monotonic() - t0

    for name in bigs:
        planned = operator.wait(
            f"{name} Planned",
            lambda name=name: (c := _condition(operator, name, "Planned"))
            and c["status"] == "True" and c,
            timeout=60)
        assert planned["reason"] in {"TimeLimitReached", "BaselineFallback"}, planned
        assert (f"spec.planner.timeLimitSeconds ({LIMIT_S} s) ran out" in planned["message"]
                or "the planner was stopped" in planned["message"]), planned
        # Its pass returned while the plan ran in the planner process.
        # (an Event while it waits for the planner slot, one when a pass sees it plan).
        events = _events(operator, name, "Planning")
        assert events and all("spec.planner.timeLimitSeconds" in e["message"] for e in events)
    assert took < SMALL_S, took
    for name in bigs:
        operator.wait(f"{name}'s 16 pods",
                      lambda name=name: len(operator.cp.get_json(
                          "pods", "-n", NS, "-l", f"adaptis.io/job={name}")["items"]) == 16,
                      timeout=60)
