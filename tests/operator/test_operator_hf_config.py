"""A Hugging Face config named by ConfigMap (spec.model.huggingface.configMap), on the
in-memory API: the operator reads it to plan, the worker pods mount it, the worker reads the
mounted file; a missing ConfigMap or key keeps the job waiting with a growing delay, a bad
config fails it naming the field. (The tenancy policy's view of it: tests/charts and
tests/integration/test_tenancy_admission.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from adaptis.api import hf_model
from adaptis.api.errors import SpecError
from adaptis.api.hf_model import CONFIG_MAP_MOUNT, HuggingFaceSpec, hf_layout
from adaptis.api.job import WorkerConfig
from adaptis.operator.control.reconcile import Reconciler
from adaptis.operator.resources.hf_config import HF_CONFIG_VOLUME, RETRY_MAX_S, retry_after

REPO = Path(__file__).resolve().parents[2]
LLAMA = json.loads((REPO / "examples" / "models" / "tiny-llama.json").read_text())


def _job(make_job: Any, *, key: str | None = None) -> dict[str, Any]:
    ref = {"name": "llama-config", **({"key": key} if key else {})}
    body = make_job()
    body["spec"]["model"] = {"huggingface": {"configMap": ref}}
    return body


def _config_map(data: dict[str, str], name: str = "llama-config") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": "ns"}, "data": data}


def _cond(job: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in job["status"]["conditions"] if c["type"] == type_)


def test_a_missing_config_map_keeps_the_job_waiting_then_it_plans_and_mounts_it(
        cluster: Any, make_job: Any, clock: Any, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    cluster.add_job(_job(make_job))
    rec = Reconciler(cluster, clock=clock)
    first = rec.reconcile("ns", "demo")
    job = cluster.job()
    assert job["status"]["phase"] == "Pending" and not cluster.pods()
    planned = _cond(job, "Planned")
    assert (planned["status"], planned["reason"]) == ("False", "ConfigMapNotFound")
    assert planned["message"].startswith("spec.model.huggingface.configMap.name: ConfigMap "
                                         "ns/llama-config does not exist")
    assert job["status"]["message"] == planned["message"]
    assert first.requeue_after == 2.0
    clock.advance(30)  # nothing watches ConfigMaps: each look comes later than the last
    assert rec.reconcile("ns", "demo").requeue_after == 30.0
    clock.advance(600)
    assert rec.reconcile("ns", "demo").requeue_after == RETRY_MAX_S
    # One warning event, not one a look.
    assert [e[1:3] for e in cluster.events] == [("Warning", "ConfigMapNotFound")]

    cluster.create(_config_map({"config.json": json.dumps(LLAMA)}))
    rec.reconcile("ns", "demo")
    job = cluster.job()
    assert job["status"]["phase"] == "Planned" and _cond(job, "Planned")["status"] == "True"
    pods = cluster.pods()
    assert len(pods) == 4
    for pod in pods:  # the key, as config.json, read-only where the worker reads it
        volume = next(v for v in pod["spec"]["volumes"] if v["name"] == HF_CONFIG_VOLUME)
        assert volume["configMap"] == {"name": "llama-config",
                                       "items": [{"key": "config.json", "path": "config.json"}]}
        mount = next(m for m in pod["spec"]["containers"][0]["volumeMounts"]
                     if m["name"] == HF_CONFIG_VOLUME)
        assert mount == {"name": HF_CONFIG_VOLUME, "mountPath": CONFIG_MAP_MOUNT,
                         "readOnly": True}
    # The worker's configuration names the ConfigMap, not a copy of its content...
    worker_json = cluster.objects[("ConfigMap", "ns", "demo-config")]["data"]["worker.json"]
    worker = WorkerConfig.model_validate_json(worker_json)
    assert worker.model.huggingface is not None
    assert worker.model.huggingface.config is None and worker.model.huggingface.path is None
    # ... and reads the mounted file: the layers the plan was made for.
    mounted = tmp_path / "mount"
    mounted.mkdir()
    (mounted / "config.json").write_text(json.dumps(LLAMA))
    monkeypatch.setattr(hf_model, "CONFIG_MAP_MOUNT", str(mounted))
    layers = hf_layout(worker.model.huggingface).layer_count
    assert layers == LLAMA["num_hidden_layers"] + 2
    assert max(hi for _lo, hi in worker.plan["stages"]) == layers


def test_an_edited_config_map_replans(cluster: Any, make_job: Any, clock: Any) -> None:
    cluster.create(_config_map({"config.json": json.dumps(LLAMA)}))
    cluster.add_job(_job(make_job))
    rec = Reconciler(cluster, clock=clock)
    rec.reconcile("ns", "demo")
    deeper = {**LLAMA, "num_hidden_layers": 10}
    cluster.objects[("ConfigMap", "ns", "llama-config")]["data"]["config.json"] = (
        json.dumps(deeper))
    rec.reconcile("ns", "demo")
    cluster.finish_deletions()
    rec.reconcile("ns", "demo")
    worker = json.loads(cluster.objects[("ConfigMap", "ns", "demo-config")]["data"][
        "worker.json"])
    assert max(hi for _lo, hi in worker["plan"]["stages"]) == 12  # 10 decoder layers + 2


def test_a_missing_key_waits_naming_the_keys_there(cluster: Any, make_job: Any,
                                                   clock: Any) -> None:
    cluster.create(_config_map({"model.json": "{}"}))
    cluster.add_job(_job(make_job))
    assert Reconciler(cluster, clock=clock).reconcile("ns", "demo").requeue_after == 2.0
    message = _cond(cluster.job(), "Planned")["message"]
    assert message.startswith("spec.model.huggingface.configMap.key: ConfigMap "
                              "ns/llama-config has no text key 'config.json' (its keys: "
                              "model.json)"), message
    assert cluster.job()["status"]["phase"] == "Pending"


@pytest.mark.parametrize("text,says", [
    ("{not json", "is not JSON"),
    ("[" * 200_000, "is nested too deeply"),  # a tenant's crafted ConfigMap: no crash
    ('{"hidden_size": ' + "9" * 5000 + "}", "is not JSON"),  # past Python's int digits
    ("[1, 2]", "must hold a JSON object (a config.json), not list"),
    (json.dumps({**LLAMA, "model_type": "t5"}),
     "ConfigMap ns/llama-config key 'config.json': model_type: 't5' is not supported"),
])
def test_a_bad_config_fails_the_job_naming_the_config_map(cluster: Any, make_job: Any,
                                                          clock: Any, text: str,
                                                          says: str) -> None:
    cluster.create(_config_map({"config.json": text}))
    cluster.add_job(_job(make_job))
    Reconciler(cluster, clock=clock).reconcile("ns", "demo")
    job = cluster.job()
    assert job["status"]["phase"] == "Failed"
    failed = _cond(job, "Failed")
    assert failed["reason"] == "InvalidSpec"
    assert failed["message"].startswith("spec.model.huggingface.configMap: "), failed["message"]
    assert says in failed["message"], failed["message"]
    assert not cluster.pods()


def test_the_operators_volume_name_is_reserved(cluster: Any, make_job: Any) -> None:
    cluster.create(_config_map({"config.json": json.dumps(LLAMA)}))
    body = _job(make_job)
    body["spec"]["worker"] = {"volumes": [{"name": HF_CONFIG_VOLUME, "emptyDir": {}}]}
    cluster.add_job(body)
    Reconciler(cluster).reconcile("ns", "demo")
    assert (f"spec.worker.volumes[0].name: '{HF_CONFIG_VOLUME}' is reserved"
            in cluster.job()["status"]["message"])


def test_the_spec_takes_exactly_one_source_and_a_default_key() -> None:
    spec = HuggingFaceSpec.model_validate({"configMap": {"name": "cfg"}})
    assert spec.config_map is not None and spec.config_map.key == "config.json"
    for both in ({"configMap": {"name": "cfg"}, "config": LLAMA},
                 {"configMap": {"name": "cfg"}, "path": "/x"}, {}):
        with pytest.raises(ValueError, match=r"exactly one of config .* path .* and configMap"):
            HuggingFaceSpec.model_validate(both)
    with pytest.raises(ValueError, match="name"):
        HuggingFaceSpec.model_validate({"configMap": {"name": "Not_A_Name"}})


def test_outside_a_pod_a_config_map_spec_says_where_to_give_the_config(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hf_model, "CONFIG_MAP_MOUNT", str(tmp_path / "absent"))
    with pytest.raises(SpecError, match=r"spec.model.huggingface.configMap: cannot read .*"
                       r"the ConfigMap 'cfg' is read in the cluster.*give config or path"):
        hf_layout(HuggingFaceSpec.model_validate({"configMap": {"name": "cfg"}}))


def test_the_retry_delay_doubles_within_bounds() -> None:
    assert [retry_after(w) for w in (0, 1, 2, 4, 8, 40, 1000)] == [2, 2, 2, 4, 8, 40, 60]
