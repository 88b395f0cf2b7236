"""The Kubernetes shapes of the worker template's passthrough fields, as ``adaptis run`` (and
every other reader of an AdaPtisJob) meets them."""

from __future__ import annotations

from typing import Any

import pytest

from adaptis.api.errors import SpecError
from adaptis.api.job import parse_job


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
