"""Semantic validation: each broken rule names its field."""

from __future__ import annotations

from typing import Any

import pytest

from adaptis.operator.errors import InvalidJob
from adaptis.operator.validation import validate_job


def _violations(make_job: Any, name: str = "demo", **over: Any) -> tuple[str, ...]:
    try:
        validate_job(name=name, spec_raw={**make_job()["spec"], **over})
    except InvalidJob as err:
        return err.fields
    return ()


def test_a_valid_job_passes(make_job: Any) -> None:
    spec = validate_job(name="demo", spec_raw=make_job()["spec"])
    assert spec.parallelism.workers == 4


@pytest.mark.parametrize(("over", "field"), [
    ({"parallelism": {"workers": 9}}, "spec.parallelism.workers"),
    ({"planner": {"strategy": "zb-v"}, "parallelism": {"workers": 5}}, "spec.planner.strategy"),
    ({"worker": {"env": [{"name": "RANK", "value": "7"}]}}, "spec.worker.env[0].name"),
    ({"metrics": {"port": 29500}}, "spec.metrics.port"),
    ({"worker": {"resources": {"limits": {"nvidia.com/gpu": 2}}}},
     "spec.worker.resources.limits"),
    ({"worker": {"volumes": [{"name": "checkpoints", "emptyDir": {}}]}},
     "spec.worker.volumes[0].name"),
    ({"worker": {"volumeMounts": [{"name": "nope", "mountPath": "/x"}]}},
     "spec.worker.volumeMounts[0].name"),
    ({"checkpoint": {"everySteps": 50}}, "spec.checkpoint.everySteps"),
    ({"model": {"vocabSize": 100, "hidden": 30, "heads": 4, "blocks": [{"kind": "dense"}]}},
     "spec.model"),
    ({"parallelism": {"workers": 0}}, "spec.parallelism.workers"),
])
def test_rules_name_the_field(make_job: Any, over: dict[str, Any], field: str) -> None:
    assert field in _violations(make_job, **over)


def test_names_must_fit_dns_labels(make_job: Any) -> None:
    assert "metadata.name" in _violations(make_job, name="Demo_Job")
    assert "metadata.name" in _violations(make_job, name="x" * 60)
    assert _violations(make_job, name="x" * 50) == ()


def test_all_violations_are_reported_together(make_job: Any) -> None:
    with pytest.raises(InvalidJob) as info:
        validate_job(name="demo", spec_raw={**make_job()["spec"],
                                            "metrics": {"port": 29500},
                                            "parallelism": {"workers": 9}})
    text = str(info.value)
    assert "spec.metrics.port:" in text and "spec.parallelism.workers:" in text
