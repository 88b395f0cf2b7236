"""The Kubernetes shapes of the worker template's passthrough fields, as ``adaptis run`` (and
every other reader of an AdaPtisJob) meets them."""

from __future__ import annotations

from typing import Any

import pytest

from adaptis.api.crd import structural_schema
from adaptis.api.errors import SpecError
from adaptis.api.job import JobSpec, parse_job
from adaptis.api.pod_fields import ENV_VALUE_SOURCES, MAX_ENV, MAX_VOLUMES, VOLUME_SOURCES


def _job(worker: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "adaptis.io/v1alpha1", "kind": "AdaPtisJob",
            "metadata": {"name": "demo"},
            "spec": {"model": {"vocabSize": 64, "hidden": 8, "heads": 2,
                               "blocks": [{"kind": "dense"}]}, "worker": worker}}


@pytest.mark.parametrize("quantity", [1, "1", "500m", "1.5", "2Gi", "1e3", "+.5", "12Mi"])
def test_kubernetes_quantities_pass(quantity: Any) -> None:
    job = parse_job(_job({"resources": {"limits": {"cpu": quantity}}}))
    assert job.spec.worker.resources == {"limits": {"cpu": quantity}}


@pytest.mark.parametrize("quantity", ["lots", "1.5 Gi", "2GB", 0.5, True, None, [1]])
def test_anything_else_is_not_a_quantity(quantity: Any) -> None:
    with pytest.raises(SpecError, match=r"spec\.worker\.resources\.limits\.cpu: not a quantity"):
        parse_job(_job({"resources": {"limits": {"cpu": quantity}}}))


@pytest.mark.parametrize(("key", "ok"), [
    ("team", True), ("example.com/team", True), ("a.b-c_d", True), ("x" * 63, True),
    ("x" * 64, False), ("Example.com/team", False), ("/team", False), ("team/", False),
    ("-team", False), ("a b", False), ("t\u00e9am", False),
])
def test_label_keys(key: str, ok: bool) -> None:
    if ok:
        assert key in parse_job(_job({"labels": {key: "v"}})).spec.worker.labels
    else:
        with pytest.raises(SpecError, match="not a label key"):
            parse_job(_job({"labels": {key: "v"}}))


@pytest.mark.parametrize(("value", "ok"), [
    ("", True), ("gold", True), ("a-b_c.d", True), ("x" * 63, True), ("x" * 64, False),
    ("-gold", False), ("gold.", False), ("h\u00e9", False), ("a b", False),
])
def test_label_values(value: str, ok: bool) -> None:
    if ok:
        assert parse_job(_job({"nodeSelector": {"k": value}})).spec.worker.node_selector == {
            "k": value}
    else:
        with pytest.raises(SpecError, match="not a label value"):
            parse_job(_job({"nodeSelector": {"k": value}}))


# --- volumes and env value sources: nothing passed on changed (issue 27) ------------------------
# core/v1 VolumeSource and EnvVarSource as k8s.io/api v0.37 declares them (types.go).
KUBERNETES_VOLUME_SOURCES = (
    "awsElasticBlockStore", "azureDisk", "azureFile", "cephfs", "cinder", "configMap", "csi",
    "downwardAPI", "emptyDir", "ephemeral", "fc", "flexVolume", "flocker", "gcePersistentDisk",
    "gitRepo", "glusterfs", "hostPath", "image", "iscsi", "nfs", "persistentVolumeClaim",
    "photonPersistentDisk", "portworxVolume", "projected", "quobyte", "rbd", "scaleIO", "secret",
    "storageos", "vsphereVolume")
KUBERNETES_ENV_SOURCES = ("configMapKeyRef", "fieldRef", "fileKeyRef", "resourceFieldRef",
                          "secretKeyRef")


def _refusal(worker: dict[str, Any]) -> SpecError:
    with pytest.raises(SpecError) as caught:
        parse_job(_job(worker))
    return caught.value


def test_the_sources_are_core_v1s() -> None:
    assert VOLUME_SOURCES == KUBERNETES_VOLUME_SOURCES
    assert ENV_VALUE_SOURCES == KUBERNETES_ENV_SOURCES


@pytest.mark.parametrize("source", KUBERNETES_VOLUME_SOURCES)
def test_every_volume_source_passes_through_as_written(source: str) -> None:
    inner = {"anything": {"the": ["API server", "checks"]}}
    volumes = parse_job(_job({"volumes": [{"name": "v", source: inner}]})).spec.worker.volumes
    assert volumes == [{"name": "v", source: inner}]


@pytest.mark.parametrize(("volume", "index"), [
    ({"name": "v", "bogus": {}}, 0),
    ({"name": "v", "emptyDir": {}, "persistentVolumeClam": {"claimName": "c"}}, 1),
])
def test_an_unknown_volume_key_is_refused_naming_it(volume: dict[str, Any], index: int) -> None:
    volumes = [{"name": "ok", "emptyDir": {}}] * index + [volume]
    err = _refusal({"volumes": volumes})
    (bad,) = set(volume) - {"name", "emptyDir"}
    field = f"spec.worker.volumes[{index}].{bad}"
    assert err.fields == (field,)
    assert f"{field}: not a volume source; one of awsElasticBlockStore, " in str(err)
    assert "persistentVolumeClaim" in str(err)


@pytest.mark.parametrize(("volume", "message"), [
    ({"name": "v"}, "no volume source beside name: give exactly one of awsElasticBlockStore"),
    ({"name": "v", "emptyDir": {}, "secret": {"secretName": "s"}},
     "2 volume sources (emptyDir, secret): keep exactly one"),
])
def test_a_volume_needs_exactly_one_source(volume: dict[str, Any], message: str) -> None:
    err = _refusal({"volumes": [{"name": "ok", "emptyDir": {}}, volume]})
    assert err.fields == ("spec.worker.volumes[1]",)
    assert f"spec.worker.volumes[1]: {message}" in str(err)


def test_a_null_source_is_refused_not_defaulted_to_empty_dir() -> None:
    # The API server would take {"persistentVolumeClaim": null} for a volume with no source
    # and make it an emptyDir.
    err = _refusal({"volumes": [{"name": "v", "persistentVolumeClaim": None}]})
    assert err.fields == ("spec.worker.volumes[0].persistentVolumeClaim",)


@pytest.mark.parametrize("source", KUBERNETES_ENV_SOURCES)
def test_every_env_value_source_passes_through_as_written(source: str) -> None:
    env = [{"name": "A", "valueFrom": {source: {"name": "n", "key": "k"}}}]
    assert parse_job(_job({"env": env})).spec.worker.env == env


def test_an_unknown_value_source_is_refused_naming_it() -> None:
    err = _refusal({"env": [{"name": "A", "value": "1"},
                            {"name": "B", "valueFrom": {"secretKeyref": {"name": "s"}}}]})
    field = "spec.worker.env[1].valueFrom.secretKeyref"
    assert err.fields == (field,)
    assert (f"{field}: not a value source; one of configMapKeyRef, fieldRef, fileKeyRef, "
            "resourceFieldRef, secretKeyRef") in str(err)


@pytest.mark.parametrize(("value_from", "message"), [
    ({}, "no value source: give exactly one of configMapKeyRef, fieldRef"),
    ({"fieldRef": {"fieldPath": "metadata.name"}, "secretKeyRef": {"name": "s", "key": "k"}},
     "2 value sources (fieldRef, secretKeyRef): keep exactly one"),
])
def test_value_from_needs_exactly_one_source(value_from: dict[str, Any], message: str) -> None:
    err = _refusal({"env": [{"name": "A", "valueFrom": value_from}]})
    assert err.fields == ("spec.worker.env[0].valueFrom",)
    assert f"spec.worker.env[0].valueFrom: {message}" in str(err)


def test_the_crd_schema_refuses_the_same() -> None:
    """The CRD carries the shapes: each source's object is kept as it is, no other key is in
    the schema (the API server refuses it under strict field validation, prunes it otherwise),
    and a CEL rule asks for exactly one source."""
    worker = structural_schema(JobSpec)["properties"]["worker"]["properties"]
    for schema, keys, required in (
            (worker["volumes"]["items"], KUBERNETES_VOLUME_SOURCES, ["name"]),
            (worker["env"]["items"]["properties"]["valueFrom"], KUBERNETES_ENV_SOURCES, None)):
        assert "x-kubernetes-preserve-unknown-fields" not in schema
        assert schema.get("required") == required
        sources = {k: v for k, v in schema["properties"].items() if k != "name"}
        assert tuple(sources) == keys
        assert all(s["type"] == "object" and s["x-kubernetes-preserve-unknown-fields"]
                   for s in sources.values())
        (rule,) = schema["x-kubernetes-validations"]
        assert rule["rule"] == ("[" + ", ".join(f"has(self.{k})" for k in keys)
                                + "].exists_one(x, x)")
        assert "exactly one" in rule["message"]


@pytest.mark.parametrize(("field", "entry", "most"), [
    ("volumes", lambda i: {"name": f"v{i}", "emptyDir": {}}, MAX_VOLUMES),
    ("env", lambda i: {"name": f"V{i}", "value": "1"}, MAX_ENV),
])
def test_the_lists_of_sources_are_bounded(field: str, entry: Any, most: int) -> None:
    # As the CRD bounds them (its CEL rules on their items need a bound).
    assert len(getattr(parse_job(_job({field: [entry(i) for i in range(most)]})).spec.worker,
                       field)) == most
    err = _refusal({field: [entry(i) for i in range(most + 1)]})
    assert err.fields == (f"spec.worker.{field}",)
    assert f"at most {most} items" in str(err)
