"""Specs the operator once retried in a loop (issue 11), on a real control plane.

The six specs of the issue are refused by the API server at ``kubectl apply`` (the CRD is
generated from the typed models), naming the field. Specs the schema lets through but the
operator's models or the API server's pod validation refuse (a bad label key, a volume source
the pod schema rejects, a misspelt key inside a volume source or an env var's valueFrom that
strict field validation refuses, a mount path that clashes with the operator's) fail once with
``InvalidSpec`` naming the field, and the operator does not loop on them: its error passes stay
at zero and its passes stay few over many resync periods.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from operator_process import install_crd
from test_operator_e2e import Operator

pytestmark = pytest.mark.integration

NS = "operator-refusals"
POOL = {"adaptis.io/test-pool": "operator-refusals"}


def _job(name: str, worker: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "adaptis.io/v1alpha1", "kind": "AdaPtisJob",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"model": {"vocabSize": 512, "hidden": 32, "heads": 2,
                               "blocks": [{"kind": "attention", "count": 4}]},
                     "training": {"steps": 2, "microbatches": 4, "sequenceLength": 16},
                     "parallelism": {"workers": 2, "gpusPerWorker": 1},
                     "planner": {"strategy": "1f1b"},
                     "worker": {"nodeSelector": dict(POOL),
                                "annotations": {"adaptis.io/fake-run-seconds": "30"},
                                **worker}}}


class RefusalsOperator(Operator):
    def __init__(self, cp: Any, log_path: Path) -> None:
        super().__init__(cp, log_path)
        self.namespace = NS

    def events(self, name: str) -> list[dict[str, Any]]:
        return [e for e in super().events(name)
                if e["reason"] == "InvalidSpec" and e["type"] == "Warning"]


@pytest.fixture(scope="module")
def operator(control_plane: Any,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[RefusalsOperator]:
    cp = control_plane
    install_crd(cp)
    cp.create_namespace(NS)
    cp.add_fake_gpu_node("refusals-h100-0", product="NVIDIA-H100-80GB-HBM3", gpu_count=2,
                         zone="refusals-zone", rack="rack-r", labels=POOL)
    op = RefusalsOperator(cp, tmp_path_factory.mktemp("operator") / "operator.log")
    op.start()
    try:
        yield op
    finally:
        op.stop()


# The six of the issue: each one refused at apply, the message naming the field.
REFUSED_AT_APPLY = [
    ("x" * 253, {}, "metadata.name"),
    ("label-value", {"labels": {"team": "h\u00e9"}}, "spec.worker.labels.team"),
    ("env-name", {"env": [{"name": ["A"], "value": "1"}]}, "spec.worker.env[0].name"),
    ("limits", {"resources": {"limits": "lots"}}, "spec.worker.resources.limits"),
    ("toleration", {"tolerations": [{"key": 5, "operator": "Exists"}]},
     "spec.worker.tolerations[0].key"),
    ("mount-name", {"volumes": [{"name": "data", "emptyDir": {}}],
                    "volumeMounts": [{"name": {"a": 1}, "mountPath": "/d"}]},
     "spec.worker.volumeMounts[0].name"),
]
# Past the schema: the operator's models (a label key) or the pod's validation refuse them.
FAILED_BY_THE_OPERATOR = [
    ("label-key", {"labels": {"bad key!": "a"}}, "spec.worker.labels.bad key!"),
    ("size-limit", {"volumes": [{"name": "data", "emptyDir": {"sizeLimit": "lots"}}]},
     "spec.worker.volumes"),
    # A misspelt key inside a source (issue 27): the API server kept it unknown, and would have
    # dropped it but for the operator's fieldValidation=Strict (the claim without its name
    # would then be refused for that, and a misspelt optional key not at all).
    ("claim-key", {"volumes": [{"name": "scratch", "emptyDir": {}},
                               {"name": "data", "persistentVolumeClaim": {"claimNme": "x"}}]},
     'spec.worker.volumes: volume "data": persistentVolumeClaim.claimNme is not a field'),
    ("env-key", {"env": [{"name": "POD", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.name", "apiVersoin": "v1"}}}]},
     'spec.worker.env: env var "POD": valueFrom.fieldRef.apiVersoin is not a field'),
    ("mount-path", {"volumes": [{"name": "data", "emptyDir": {}}],
                    "volumeMounts": [{"name": "data", "mountPath": "/etc/adaptis"}]},
     "spec.worker.volumeMounts"),
]


def test_specs_that_looped_are_refused_or_fail_once_naming_the_field(
        operator: RefusalsOperator) -> None:
    cp = operator.cp
    for name, worker, field in REFUSED_AT_APPLY:
        result = cp.kubectl("apply", "-f", "-", input=json.dumps(_job(name, worker)),
                            check=False)
        assert result.returncode != 0, f"{name}: accepted: {result.stdout}"
        assert field in result.stderr or (field == "metadata.name"
                                          and "metadata.name" in result.stderr), result.stderr

    for name, worker, _ in FAILED_BY_THE_OPERATOR:
        cp.apply(_job(name, worker))
    for name, _, field in FAILED_BY_THE_OPERATOR:
        operator.wait(f"{name} Failed", operator.phase_is(name, "Failed"), timeout=90)
        failed = operator.condition(name, "Failed")
        assert failed is not None and failed["reason"] == "InvalidSpec", failed
        assert failed["message"].startswith(field), failed["message"]
        assert [p for p in operator.pods(name)
                if not p["metadata"].get("deletionTimestamp")] == [], name
        if name in {"size-limit", "claim-key", "env-key"}:
            # refused by the dry-run of rank 0's pod: nothing created
            gone = cp.kubectl("get", "configmap", f"{name}-config", "-n", NS, check=False)
            assert gone.returncode != 0 and "NotFound" in gone.stderr, gone.stdout
        (event,) = operator.wait(f"{name}: one InvalidSpec event",
                                 lambda n=name: operator.events(n))
        assert event["message"].startswith(field), event["message"]

    # No loop: over four resync periods (3 s each) no pass fails and each job gets at most a
    # pass per resync (before the fix: ~26 failing passes per job in 90 s).
    before = operator.scrape()
    time.sleep(12.0)  # a span of resyncs to count passes over, not a wait for a condition
    after = operator.scrape()
    errors = 'adaptis_operator_reconciles_total{result="error"}'
    ok = 'adaptis_operator_reconciles_total{result="ok"}'
    assert after.get(errors, 0) == 0, operator.log_tail()
    assert after[ok] - before[ok] <= 6 * len(FAILED_BY_THE_OPERATOR), (before, after)
    for name, _, _ in FAILED_BY_THE_OPERATOR:
        assert operator.status(name)["phase"] == "Failed"
