"""Semantic validation: each broken rule names its field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from adaptis.api.model import MAX_BLOCKS
from adaptis.operator.core.errors import InvalidJob
from adaptis.operator.resources.validation import validate_job


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


# The six specs of issue 11 that the operator accepted, then failed to create pods for on every
# pass (an exception loop): each is now InvalidSpec naming its field, before anything exists.
SIX = [
    pytest.param("x" * 253, {}, "metadata.name", id="253-character name"),
    pytest.param("demo", {"worker": {"labels": {"team": "h\u00e9"}}}, "spec.worker.labels.team",
                 id="non-ASCII label value"),
    pytest.param("demo", {"worker": {"env": [{"name": ["A"], "value": "1"}]}},
                 "spec.worker.env[0].name", id="env name as a list"),
    pytest.param("demo", {"worker": {"resources": {"limits": "lots"}}},
                 "spec.worker.resources.limits", id="limits: lots"),
    pytest.param("demo", {"worker": {"tolerations": [{"key": 5, "operator": "Exists"}]}},
                 "spec.worker.tolerations[0].key", id="integer toleration key"),
    pytest.param("demo", {"worker": {"volumes": [{"name": "data", "emptyDir": {}}],
                                     "volumeMounts": [{"name": {"a": 1}, "mountPath": "/d"}]}},
                 "spec.worker.volumeMounts[0].name", id="mount name as a mapping"),
]


@pytest.mark.parametrize(("name", "over", "field"), SIX)
def test_the_six_looping_specs_fail_once_naming_the_field(
        cluster: Any, make_job: Any, name: str, over: dict[str, Any], field: str) -> None:
    from adaptis.operator.control.reconcile import Reconciler

    cluster.add_job(make_job(name, spec=over))
    rec = Reconciler(cluster)
    result = rec.reconcile("ns", name)  # no exception: nothing for the work queue to retry
    job = cluster.job(name)
    failed = next(c for c in job["status"]["conditions"] if c["type"] == "Failed")
    assert job["status"]["phase"] == "Failed" and failed["reason"] == "InvalidSpec"
    assert failed["message"].startswith(field + ":"), failed["message"]
    assert (name, "Warning", "InvalidSpec") in [e[:4 - 1] for e in cluster.events]
    assert result.requeue_after is None and cluster.objects == {}
    # Resyncs change nothing and create nothing.
    calls = len(cluster.calls)
    rec.reconcile("ns", name)
    assert [c for c in cluster.calls[calls:] if c != "get_job"] == []


@pytest.mark.parametrize(("over", "field", "needle"), [
    ({"resources": {"requests": {"cpu": 0.5}}}, "spec.worker.resources.requests.cpu",
     "not a quantity"),
    ({"resources": {"limits": {"memory": "lots"}}}, "spec.worker.resources.limits.memory",
     "not a quantity"),
    ({"labels": {"bad key!": "a"}}, "spec.worker.labels.bad key!", "not a label key"),
    ({"labels": {"team": "x" * 64}}, "spec.worker.labels.team", "not a label value"),
    ({"nodeSelector": {"zone": "a b"}}, "spec.worker.nodeSelector.zone", "not a label value"),
    ({"annotations": {"/x": "any value"}}, "spec.worker.annotations./x", "not a label key"),
    ({"env": [{"name": "A=B"}]}, "spec.worker.env[0].name", "pattern"),
    ({"env": [{"name": "A", "valu": "typo"}]}, "spec.worker.env[0].valu", "unknown key"),
    ({"tolerations": [{"key": "k", "operator": "Maybe"}]}, "spec.worker.tolerations[0].operator",
     "'Exists' or 'Equal'"),
    ({"volumes": [{"name": "Data", "emptyDir": {}}]}, "spec.worker.volumes[0].name", "pattern"),
    ({"volumeMounts": [{"name": "checkpoints"}]}, "spec.worker.volumeMounts[0].mountPath",
     "required"),
])
def test_passthrough_fields_have_kubernetes_shapes(make_job: Any, over: dict[str, Any],
                                                   field: str, needle: str) -> None:
    with pytest.raises(InvalidJob) as err:
        validate_job(name="demo", spec_raw={**make_job()["spec"], "worker": over})
    assert field in err.value.fields and needle in str(err.value), str(err.value)


def test_well_formed_passthrough_fields_reach_the_pod_unchanged(make_job: Any) -> None:
    worker = {
        "resources": {"requests": {"cpu": 2, "memory": "4Gi"}, "limits": {"memory": "8Gi"}},
        "env": [{"name": "HF_HOME", "value": "/cache"},
                {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "t"}}}],
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml",
                         "effect": "NoSchedule"}, {"operator": "Exists"}],
        "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "d"}}],
        "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True}],
        "labels": {"team": "a", "example.com/tier": "gold"},
        "annotations": {"example.com/note": "any text, even é"},
        "nodeSelector": {"topology.kubernetes.io/zone": "zone-a"},
    }
    spec = validate_job(name="demo", spec_raw={**make_job()["spec"], "worker": worker})
    dumped = spec.worker.model_dump(by_alias=True, exclude_none=True, exclude_defaults=True)
    assert dumped == worker


def _message(make_job: Any, **over: Any) -> str:
    with pytest.raises(InvalidJob) as err:
        validate_job(name="demo", spec_raw={**make_job()["spec"], **over})
    return str(err.value)


@pytest.mark.parametrize(("over", "line"), [
    ({"worker": {"env": [{"name": "RANK", "value": "7"}]}},
     "spec.worker.env[0].name: RANK is set by the operator for each rank"),
    ({"worker": {"resources": {"requests": {"nvidia.com/gpu": 1}}}},
     "spec.worker.resources.requests: nvidia.com/gpu comes from "
     "spec.parallelism.gpusPerWorker; remove it here"),
    ({"worker": {"volumeMounts": [{"name": "nope", "mountPath": "/x"}]}},
     "spec.worker.volumeMounts[0].name: 'nope' is not in spec.worker.volumes"),
    ({"worker": {"volumes": [{"name": "shm", "emptyDir": {}}],
                 "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm/"}]}},
     "spec.worker.volumeMounts[0].mountPath: /dev/shm is the operator's memory-backed shared "
     "memory, sized by resources.limits.memory"),
    ({"worker": {"env": [{"name": "PET_RDZV_ENDPOINT", "value": "evil:29400"}]}},
     "spec.worker.env[0].name: PET_RDZV_ENDPOINT is set by the operator for each rank"),
    ({"worker": {"env": [{"name": "NCCL_DEBUG", "value": "INFO"},
                         {"name": "LOCAL_WORLD_SIZE", "value": "8"}]}},
     "spec.worker.env[1].name: LOCAL_WORLD_SIZE is set by the operator for each rank"),
    ({"worker": {"resources": {"limits": {"nvidia.com/mig-1g.10gb": 1}}}},
     "spec.worker.resources.limits: nvidia.com/mig-1g.10gb is a MIG slice; the operator plans "
     "and reserves whole GPUs only: use spec.parallelism.gpusPerWorker"),
    ({"worker": {"volumes": [{"name": "dshm", "emptyDir": {}}]}},
     "spec.worker.volumes[0].name: 'dshm' is reserved"),
])
def test_the_operators_own_rules_say_what_and_how_to_fix(
        make_job: Any, over: dict[str, Any], line: str) -> None:
    # The message becomes the Failed condition and the Event the user reads: it names the
    # offending value and the field to use instead, not only the field.
    assert line in _message(make_job, **over).splitlines()


@pytest.mark.parametrize(("volume", "says"), [
    ({"emptyDir": {}}, "required key is missing"),
    ({"name": "", "emptyDir": {}}, "String should have at least 1 character (got '')"),
])
def test_a_volume_without_a_name_is_refused_by_the_schema(make_job: Any, volume: dict[str, Any], says: str) -> None:
    assert _message(make_job, worker={"volumes": [volume]}) == f"spec.worker.volumes[0].name: {says}"


def test_schema_errors_are_one_line_each_and_keep_the_users_value(make_job: Any) -> None:
    text = _message(make_job, worker={"env": [{"name": "A=B"}], "labels": {"team": "spec: a"}})
    lines = text.splitlines()
    assert len(lines) == 2 and all(line.startswith("spec.worker.") for line in lines), text
    # Only the leading "spec: " becomes "spec.": a value that contains it is quoted as given.
    assert lines[1].startswith("spec.worker.labels.team: ") and "(got 'spec: a')" in lines[1]


LLAMA = json.loads((Path(__file__).resolve().parents[2] / "examples" / "models" / "tiny-llama.json").read_text())
FROM_CONFIG_MAP = {"huggingface": {"configMap": {"name": "llama-config"}}}


def test_a_config_map_spec_with_no_reader_is_refused_naming_the_field(make_job: Any) -> None:
    # Only the operator can read a ConfigMap: a caller without one is told to give the config inline.
    with pytest.raises(InvalidJob) as err:
        validate_job(name="demo", spec_raw={**make_job()["spec"], "model": FROM_CONFIG_MAP})
    assert err.value.fields == ("spec.model.huggingface.configMap",)
    assert str(err.value) == ("spec.model.huggingface.configMap: no ConfigMap can be read here; "
                              "give config inline")


def test_a_config_map_spec_is_checked_and_returned_with_the_config_it_holds(make_job: Any) -> None:
    read: list[str] = []

    def reader(config: dict[str, Any] | str) -> Any:
        text = config if isinstance(config, str) else json.dumps(config)
        return lambda name: read.append(name) or {"data": {"config.json": text}}

    spec_raw = {**make_job()["spec"], "model": FROM_CONFIG_MAP}
    spec = validate_job(name="demo", spec_raw=spec_raw, namespace="team-a", read_config_map=reader(LLAMA))
    assert read == ["llama-config"]
    assert spec.model.huggingface is not None and spec.model.huggingface.config == LLAMA
    # A rule the held config breaks names the field the user wrote and where the config is,
    # in the job's own namespace.
    with pytest.raises(InvalidJob) as err:
        validate_job(name="demo", spec_raw=spec_raw, namespace="team-a",
                     read_config_map=reader({**LLAMA, "num_hidden_layers": MAX_BLOCKS + 1}))
    assert err.value.fields == ("spec.model.huggingface.configMap",)
    assert str(err.value).startswith("spec.model.huggingface.configMap: ConfigMap team-a/llama-config "
                                     "key 'config.json': num_hidden_layers: the model has "), str(err.value)
    # So does a config that is not one at all.
    with pytest.raises(InvalidJob) as err:
        validate_job(name="demo", spec_raw=spec_raw, namespace="team-a", read_config_map=reader("{not json"))
    assert str(err.value).startswith("spec.model.huggingface.configMap: ConfigMap team-a/llama-config "
                                     "key 'config.json' is not JSON"), str(err.value)
