"""The CRD's CEL rules on a real API server: the job-level rules of adaptis.api.rules that CEL can
express refuse a manifest with 422 naming the field, as ``adaptis run`` and the operator do
(tests/api/test_api_rules.py), and a valid job is still admitted. So do the shapes of a volume
and of an env var's valueFrom (issue 27): exactly one source, no unknown key.

Every request is a server-side dry run: the API server defaults, validates (CEL included) and
answers, and nothing is stored.
"""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from controlplane import ControlPlane
from operator_process import install_crd

from adaptis.api.pod_fields import MAX_VOLUMES

pytestmark = pytest.mark.integration


def _job(name: str = "crd-rules") -> dict[str, Any]:
    # 10 layers: embedding, 8 blocks, head.
    return {
        "apiVersion": "adaptis.io/v1alpha1", "kind": "AdaPtisJob",
        "metadata": {"name": name},
        "spec": {
            "model": {"vocabSize": 512, "hidden": 32, "heads": 2,
                      "blocks": [{"kind": "attention", "count": 3},
                                 {"kind": "moe", "count": 2, "experts": 4, "topK": 2},
                                 {"kind": "mamba", "count": 3}]},
            "training": {"steps": 20},
            "parallelism": {"workers": 2},
        },
    }


def _with(name: str = "crd-rules", **spec: dict[str, Any]) -> dict[str, Any]:
    doc = _job(name)
    for key, value in spec.items():
        doc["spec"][key] = {**doc["spec"].get(key, {}), **value}
    return doc


def _hf(**model: Any) -> dict[str, Any]:
    """A Hugging Face model (issue 15): its config.json inline, free-form in the schema."""
    doc = _job()
    config = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
              "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 128,
              "rms_norm_eps": 1e-6, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    doc["spec"]["model"] = {"huggingface": {"config": config}, **model}
    return doc


def _hf_text() -> dict[str, Any]:
    """A text corpus with no tokenizer: the Hugging Face model's weights directory lends it."""
    doc = _hf()
    doc["spec"]["model"]["huggingface"]["weights"] = "/models/tiny"
    doc["spec"]["training"] = {**doc["spec"].get("training", {}), "data": {"source": "text", "path": "/corpus"}}
    return doc


def _moe_top_k(top_k: int) -> dict[str, Any]:
    doc = _job()
    doc["spec"]["model"]["blocks"][1]["topK"] = top_k
    return doc


@pytest.fixture(scope="module")
def namespace(control_plane: ControlPlane) -> Iterator[str]:
    install_crd(control_plane)
    name = control_plane.create_namespace(f"it-crd-{uuid.uuid4().hex[:8]}",
                                          wait_for_default_service_account=False)
    yield name
    control_plane.kubectl("delete", "namespace", name, "--wait=false", check=False)


def _dry_run_create(cp: ControlPlane, doc: dict[str, Any], *, namespace: str) -> Any:
    # -v=6 logs each request with its status code, so the test sees the 422 itself.
    return cp.kubectl("create", "--dry-run=server", "-v=6", "-n", namespace, "-f", "-",
                      input=json.dumps(doc), check=False)


@pytest.mark.parametrize(("doc", "field"), [
    (_with(parallelism={"workers": 40}), "spec.parallelism.workers"),
    (_with(parallelism={"workers": 4, "dataParallel": 3}), "spec.parallelism.dataParallel"),
    (_with(parallelism={"workers": 3, "gpusPerWorker": 4}), "spec.parallelism.workers"),
    (_with(parallelism={"workers": 6}, planner={"strategy": "zb-v"}), "spec.planner.strategy"),
    (_with(parallelism={"workers": 6}, planner={"strategy": "i1f1b"}), "spec.planner.strategy"),
    (_with(checkpoint={"everySteps": 50}), "spec.checkpoint.everySteps"),
    (_moe_top_k(8), "spec.model.blocks[1].topK"),
    (_with("j" * 55), "metadata.name"),
    (_hf(blocks=[{"kind": "dense"}]), "spec.model"),
    (_hf(huggingface={"config": {"model_type": "llama"}, "path": "/m"}), "spec.model.huggingface"),
    # With a tokenizer, so that the missing path is the one error (kubectl lists several on
    # lines of their own, after the "is invalid" line).
    (_with(training={"data": {"source": "text", "tokenizer": "/tok"}}), "spec.training.data.path"),
    (_with(training={"data": {"source": "token-file", "path": "/t", "tokenizer": "/tok"}}),
     "spec.training.data.tokenizer"),
    (_with(training={"data": {"source": "text", "path": "/corpus"}}), "spec.training.data.tokenizer"),
    (_with(parallelism={"workers": 2, "gpusPerWorker": 3, "tensorParallel": 2}),
     "spec.parallelism.tensorParallel"),
    (_with(parallelism={"workers": 3, "gpusPerWorker": 2, "tensorParallel": 2, "dataParallel": 2}),
     "spec.parallelism.dataParallel"),
], ids=["workers>layers", "dp-divides", "gpu-ranks>layers", "zb-v", "i1f1b", "everySteps>steps", "topK>experts",
        "name-too-long", "hf+blocks", "hf-config+path", "text-without-path", "tokenizer-without-text",
        "text-without-tokenizer", "tp-leaves-pod", "dp-x-tp-divides"])
def test_api_server_refuses_with_422_naming_the_field(
        control_plane: ControlPlane, namespace: str, doc: dict[str, Any], field: str) -> None:
    result = _dry_run_create(control_plane, doc, namespace=namespace)
    assert result.returncode != 0, result.stdout
    assert "422" in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "is invalid" in line]
    assert errors and field in errors[-1], result.stderr[-3000:]


@pytest.mark.parametrize("doc", [
    _job(),
    _with(parallelism={"workers": 10}),  # one rank per layer
    _with(parallelism={"workers": 20, "dataParallel": 2}),  # 2 replicas x 10 ranks
    _with(parallelism={"workers": 5, "gpusPerWorker": 2}),  # 10 ranks, one per layer
    _with(parallelism={"workers": 5, "gpusPerWorker": 4, "tensorParallel": 2}),  # 10 positions of 2
    _with(parallelism={"workers": 5}, planner={"strategy": "zb-v"}),  # two layers per rank
    _with(checkpoint={"everySteps": 20}),
    _with("j" * 54),  # <name>-worker-1 is exactly 63 characters
    copy.deepcopy({**_job(), "spec": {"model": _job()["spec"]["model"]}}),  # defaults only
    _hf(),  # the config kept as given (nested objects, floats), the zoo's defaults harmless
    _with(training={"data": {"source": "text", "path": "/corpus", "tokenizer": "/tok", "cacheDir": "/c"}}),
    _hf_text(),
], ids=["base", "workers=layers", "dp-exact", "gpu-ranks=layers", "tp-ranks=layers", "zb-v-exact", "everySteps=steps",
        "name-63", "defaults", "huggingface", "text-corpus", "hf-text-default-tokenizer"])
def test_api_server_admits_the_boundary_cases(
        control_plane: ControlPlane, namespace: str, doc: dict[str, Any]) -> None:
    result = _dry_run_create(control_plane, doc, namespace=namespace)
    assert result.returncode == 0, result.stderr[-3000:]


# --- volumes and env value sources (issue 27): nothing passed on changed -----------------------
def _worker(**worker: Any) -> dict[str, Any]:
    doc = _job()
    doc["spec"]["worker"] = worker
    return doc


@pytest.mark.parametrize(("doc", "field"), [
    (_worker(volumes=[{"name": "ok", "emptyDir": {}}, {"name": "v", "bogus": {}}]),
     "spec.worker.volumes[1].bogus"),
    (_worker(volumes=[{"name": "v", "emptyDir": {}, "persistentVolumeClam": {"claimName": "c"}}]),
     "spec.worker.volumes[0].persistentVolumeClam"),
    (_worker(env=[{"name": "A", "valueFrom": {"secretKeyref": {"name": "s", "key": "k"}}}]),
     "spec.worker.env[0].valueFrom.secretKeyref"),
], ids=["bogus-volume", "misspelt-second-source", "misspelt-value-source"])
def test_kubectl_apply_refuses_an_unknown_source_naming_it(
        control_plane: ControlPlane, namespace: str, doc: dict[str, Any], field: str) -> None:
    # kubectl validates strictly by default: the key is not in the CRD's schema, and the API
    # server refuses it (400) instead of pruning it.
    result = control_plane.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-",
                                   input=json.dumps(doc), check=False)
    assert result.returncode != 0, result.stdout
    assert f'unknown field "{field}"' in result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize(("doc", "field", "message"), [
    (_worker(volumes=[{"name": "v"}]), "spec.worker.volumes[0]", "exactly one source"),
    (_worker(volumes=[{"name": "v", "emptyDir": {}, "secret": {"secretName": "s"}}]),
     "spec.worker.volumes[0]", "exactly one source"),
    # A client that does not validate strictly: the unknown key is pruned, and the volume is
    # left with no source, which the CEL rule refuses (the pod would have had an emptyDir).
    (_worker(volumes=[{"name": "v", "persistentVolumeClam": {"claimName": "c"}}]),
     "spec.worker.volumes[0]", "exactly one source"),
    (_worker(env=[{"name": "A", "valueFrom": {}}]), "spec.worker.env[0].valueFrom",
     "valueFrom needs exactly one of"),
    (_worker(env=[{"name": "A", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"},
                                              "secretKeyRef": {"name": "s", "key": "k"}}}]),
     "spec.worker.env[0].valueFrom", "valueFrom needs exactly one of"),
], ids=["no-source", "two-sources", "pruned-source", "no-value-source", "two-value-sources"])
def test_a_source_needs_to_be_exactly_one_even_unvalidated(
        control_plane: ControlPlane, namespace: str, doc: dict[str, Any], field: str,
        message: str) -> None:
    result = control_plane.kubectl("create", "--dry-run=server", "--validate=false", "-v=6",
                                   "-n", namespace, "-f", "-", input=json.dumps(doc),
                                   check=False)
    assert result.returncode != 0, result.stdout
    assert "422" in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "is invalid" in line]
    assert errors and f"{field}: Invalid value" in errors[-1], result.stderr[-3000:]
    assert message in errors[-1], errors[-1]


def test_each_source_keeps_what_it_holds(control_plane: ControlPlane, namespace: str) -> None:
    """Inside a source the keys are the pod's (the API server checks them when the operator
    creates the pods): the CRD keeps them as written."""
    volumes = [{"name": "data", "persistentVolumeClaim": {"claimName": "c", "readOnly": True}},
               {"name": "p", "projected": {"sources": [{"configMap": {"name": "x"}},
                                                       {"downwardAPI": {"items": []}}]}},
               {"name": "s", "emptyDir": {"sizeLimit": "1Gi", "medium": "Memory"}}]
    env = [{"name": "A", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
           {"name": "B", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k",
                                                           "optional": True}}}]
    result = control_plane.kubectl("create", "--dry-run=server", "-o", "json", "-n", namespace,
                                   "-f", "-", input=json.dumps(_worker(volumes=volumes, env=env)),
                                   check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    worker = json.loads(result.stdout)["spec"]["worker"]
    assert (worker["volumes"], worker["env"]) == (volumes, env)


def test_the_lists_of_sources_are_bounded(control_plane: ControlPlane, namespace: str) -> None:
    """The CEL rules on the items need a bounded list (the API server refuses the CRD
    otherwise); the bound itself refuses a longer list, naming it."""
    volumes = [{"name": f"v{i}", "emptyDir": {}} for i in range(MAX_VOLUMES + 1)]
    result = _dry_run_create(control_plane, _worker(volumes=volumes), namespace=namespace)
    assert result.returncode != 0 and "422" in result.stderr, result.stderr[-3000:]
    # kubectl lists the errors on lines of their own (the bound, and that CEL did not run).
    bound = f"* spec.worker.volumes: Too many: {MAX_VOLUMES + 1}: must have at most {MAX_VOLUMES}"
    assert bound in result.stderr, result.stderr[-3000:]
    result = _dry_run_create(control_plane, _worker(volumes=volumes[:MAX_VOLUMES]),
                             namespace=namespace)
    assert result.returncode == 0, result.stderr[-3000:]
