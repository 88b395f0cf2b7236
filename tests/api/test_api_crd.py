"""The generated CRD: in sync with crds/, structural, documented, bounded."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from adaptis.api.crd import CRD_FILENAME, crd_manifest, crd_yaml
from adaptis.api.job import API_VERSION, GROUP, KIND, VERSION, AdaPtisJob, JobStatus

REPO = Path(__file__).resolve().parents[2]


def _walk(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = [(path, node)]
    for name, sub in (node.get("properties") or {}).items():
        out += _walk(sub, f"{path}.{name}")
    if "items" in node:
        out += _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        out += _walk(node["additionalProperties"], f"{path}.*")
    return out


def _schema() -> dict[str, Any]:
    return crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_checked_in_crd_matches_the_models() -> None:
    path = REPO / "crds" / CRD_FILENAME
    assert path.read_text() == crd_yaml(), "crds/ drifted: run `adaptis crd -o crds/...yaml`"


def test_cli_check_detects_drift(tmp_path: Path) -> None:
    stale = tmp_path / "crd.yaml"
    stale.write_text(crd_yaml().replace("minimum: 1", "minimum: 2", 1))
    run = subprocess.run([sys.executable, "-m", "adaptis", "crd", "--check", str(stale)],
                         capture_output=True, text=True, cwd=REPO, check=False)
    assert run.returncode == 1 and "out of date" in run.stderr
    out = subprocess.run([sys.executable, "-m", "adaptis", "crd"], capture_output=True,
                         text=True, cwd=REPO, check=True).stdout
    assert yaml.safe_load(out)["metadata"]["name"] == "adaptisjobs.adaptis.io"


def test_schema_is_structural_and_every_field_is_described() -> None:
    for path, node in _walk(_schema()):
        assert not {"$ref", "anyOf", "oneOf", "allOf", "title", "$defs"} & set(node), path
        assert ("type" in node or node.get("x-kubernetes-preserve-unknown-fields")
                or node.get("x-kubernetes-int-or-string")), path
        if path.count(".") and not path.endswith(("[]", ".*")) and path != ".metadata":
            assert node.get("description"), f"{path} has no description"
        if node.get("exclusiveMinimum") is not None:
            assert node["exclusiveMinimum"] is True and "minimum" in node, path


def test_bounds_enums_nullable_and_pass_through_objects() -> None:
    nodes = dict(_walk(_schema()))
    assert nodes[".spec.parallelism.properties.workers".replace(".properties", "")]["minimum"] == 1
    workers = nodes[".spec.parallelism.workers"]
    assert workers["minimum"] == 1 and workers["maximum"] == 128
    assert nodes[".spec.planner.strategy"]["enum"][0] == "adaptis"
    assert nodes[".spec.training.gradClip"]["nullable"] is True
    assert nodes[".spec.training.gradClip"]["exclusiveMinimum"] is True
    # The passthrough fields have core/v1's shapes; only what a volume's source and an env
    # var's value source hold passes through as it is (issue 27: no other key is kept).
    for field in ("volumes[].persistentVolumeClaim", "env[].valueFrom.secretKeyRef"):
        assert nodes[f".spec.worker.{field}"]["x-kubernetes-preserve-unknown-fields"] is True
    for field in ("resources", "env[]", "env[].valueFrom", "tolerations[]", "volumes[]",
                  "volumeMounts[]"):
        assert "x-kubernetes-preserve-unknown-fields" not in nodes[f".spec.worker.{field}"]
    assert nodes[".spec.worker.volumes[].name"]["type"] == "string"
    assert nodes[".spec.worker.tolerations[].key"]["type"] == "string"
    assert nodes[".spec.worker.env[].name"]["type"] == "string"
    assert nodes[".spec.worker.volumeMounts[].name"]["type"] == "string"
    quantity = nodes[".spec.worker.resources.limits.*"]
    assert quantity["x-kubernetes-int-or-string"] is True and "pattern" in quantity
    for field in ("nodeSelector", "labels"):
        value = nodes[f".spec.worker.{field}"]["additionalProperties"]
        assert value["type"] == "string" and value["maxLength"] == 63 and "pattern" in value
    # The zoo's fields or huggingface (issue 15): a CEL rule, not `required`, says which.
    assert "required" not in nodes[".spec.model"]
    assert any("has(self.huggingface)" in r["rule"]
               for r in nodes[".spec.model"]["x-kubernetes-validations"])
    rules = nodes[".spec.model"]["x-kubernetes-validations"]
    assert "hidden % self.heads" in rules[0]["rule"]


def test_names_subresource_and_printer_columns() -> None:
    crd = crd_manifest()
    names = crd["spec"]["names"]
    assert (names["plural"], names["kind"], names["shortNames"]) == (
        "adaptisjobs", "AdaPtisJob", ["apj"])
    version = crd["spec"]["versions"][0]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert list(columns) == ["Phase", "Ready", "Stages", "Bubble", "Observed", "Speedup", "Age"]
    aliases = {f.alias for f in JobStatus.model_fields.values()}
    for name, path in columns.items():
        if path.startswith(".status."):
            assert path.removeprefix(".status.") in aliases, name


def test_api_version_is_the_group_and_version() -> None:
    """API_VERSION is written as a literal (the model's type): it must still be group/version."""
    assert f"{GROUP}/{VERSION}" == API_VERSION
    fields = AdaPtisJob.model_fields
    assert (fields["api_version"].default, fields["kind"].default) == (API_VERSION, KIND)
