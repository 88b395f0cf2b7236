"""The CRD's CEL rules on a real API server: the job-level rules of adaptis.api.rules that CEL can
express refuse a manifest with 422 naming the field, as ``adaptis run`` and the operator do
(tests/api/test_api_rules.py), and a valid job is still admitted.

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
], ids=["workers>layers", "dp-divides", "gpu-ranks>layers", "zb-v", "i1f1b", "everySteps>steps", "topK>experts", "name-too-long",
        "hf+blocks", "hf-config+path", "text-without-path", "tokenizer-without-text",
        "text-without-tokenizer"])
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
    _with(parallelism={"workers": 5}, planner={"strategy": "zb-v"}),  # two layers per rank
    _with(checkpoint={"everySteps": 20}),
    _with("j" * 54),  # <name>-worker-1 is exactly 63 characters
    copy.deepcopy({**_job(), "spec": {"model": _job()["spec"]["model"]}}),  # defaults only
    _hf(),  # the config kept as given (nested objects, floats), the zoo's defaults harmless
    _with(training={"data": {"source": "text", "path": "/corpus", "tokenizer": "/tok", "cacheDir": "/c"}}),
    _hf_text(),
], ids=["base", "workers=layers", "dp-exact", "gpu-ranks=layers", "zb-v-exact", "everySteps=steps", "name-63", "defaults",
        "huggingface", "text-corpus", "hf-text-default-tokenizer"])
def test_api_server_admits_the_boundary_cases(
        control_plane: ControlPlane, namespace: str, doc: dict[str, Any]) -> None:
    result = _dry_run_create(control_plane, doc, namespace=namespace)
    assert result.returncode == 0, result.stderr[-3000:]
