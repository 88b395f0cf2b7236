"""The tenancy ValidatingAdmissionPolicy as `helm template` renders it (SECURITY.md).

What the policy decides is tested on a real API server (tests/integration/
test_tenancy_admission.py); here: it is on by default, bound to the AdaPtisJobs, asks the
authorizer about pods, and carries the admin's allow-lists into its CEL verbatim.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import chartkit
import pytest
from chartkit import by_kind, one


def _variables(policy: Any) -> dict[str, str]:
    return {v["name"]: v["expression"] for v in policy["spec"]["variables"]}


def test_policy_and_binding_are_on_by_default(default_objects: list[dict[str, Any]]) -> None:
    policy = one(default_objects, "ValidatingAdmissionPolicy")
    binding = one(default_objects, "ValidatingAdmissionPolicyBinding")
    assert policy["apiVersion"] == binding["apiVersion"] == "admissionregistration.k8s.io/v1"
    assert binding["spec"]["policyName"] == policy["metadata"]["name"] == "adaptis-tenancy"
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert policy["spec"]["failurePolicy"] == "Fail"
    (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
    assert rule["apiGroups"] == ["adaptis.io"] and rule["resources"] == ["adaptisjobs"]
    assert rule["operations"] == ["CREATE", "UPDATE"]
    # The bar: may the requesting user create pods in the job's namespace?
    bar = " ".join(_variables(policy)["mayCreatePods"].split())
    assert bar == ("authorizer.group('').resource('pods').namespace(object.metadata.namespace) "
                   ".check('create').allowed()")
    # The pod powers, then the ConfigMap the operator reads for the job (its own test below).
    validation, _config_map = policy["spec"]["validations"]
    assert "variables.mayCreatePods" in validation["expression"]
    assert "variables.powers" in validation["messageExpression"]


def test_default_allow_lists(default_objects: list[dict[str, Any]]) -> None:
    variables = _variables(one(default_objects, "ValidatingAdmissionPolicy"))
    assert json.loads(variables["allowedServiceAccounts"]) == ["default", "adaptis-worker"]
    assert json.loads(variables["allowedVolumeTypes"]) == [
        "emptyDir", "configMap", "downwardAPI", "persistentVolumeClaim"]
    assert json.loads(variables["allowedTolerationKeys"]) == ["nvidia.com/gpu"]
    for name in ("allowedNodeSelectorKeys", "allowedPriorityClasses", "allowedLabelKeys",
                 "allowedAnnotationKeys"):
        assert json.loads(variables[name]) == [], name


def test_admin_allow_lists_reach_the_cel(helm_home: Path) -> None:
    objects = chartkit.render(home=helm_home, sets={
        "admission.allowedServiceAccounts": ["trainer", "default"],
        "admission.allowedVolumeTypes": ["emptyDir", "secret"],
        "admission.allowedTolerationKeys": ["dedicated"],
        "admission.allowedNodeSelectorKeys": ["nvidia.com/gpu.product"],
        "admission.allowedPriorityClasses": ["training"],
        "admission.allowedLabelKeys": ["team"],
        "admission.allowedAnnotationKeys": ["example.com/cost-center"],
        "admission.validationActions": ["Warn", "Audit"],
        "worker.serviceAccount.name": "workers",
    })
    variables = _variables(one(objects, "ValidatingAdmissionPolicy"))
    assert json.loads(variables["allowedServiceAccounts"]) == ["default", "workers", "trainer"]
    assert json.loads(variables["allowedVolumeTypes"]) == ["emptyDir", "secret"]
    assert json.loads(variables["allowedTolerationKeys"]) == ["dedicated"]
    assert json.loads(variables["allowedNodeSelectorKeys"]) == ["nvidia.com/gpu.product"]
    assert json.loads(variables["allowedPriorityClasses"]) == ["training"]
    assert json.loads(variables["allowedLabelKeys"]) == ["team"]
    assert json.loads(variables["allowedAnnotationKeys"]) == ["example.com/cost-center"]
    binding = one(objects, "ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["validationActions"] == ["Warn", "Audit"]


def test_a_hugging_face_config_map_is_a_configmap_volume_power(
        default_objects: list[dict[str, Any]]) -> None:
    """spec.model.huggingface.configMap mounts a ConfigMap into the workers: it is counted as
    a configMap volume, allowed by the same allow-list entry. What the policy decides with it
    is tested on a real API server (tests/integration/test_tenancy_admission.py)."""
    policy = one(default_objects, "ValidatingAdmissionPolicy")
    variables = _variables(policy)
    assert variables["hfConfigMap"] == (
        "object.spec.?model.?huggingface.?configMap.?name.orValue('')")
    powers = " ".join(variables["powers"].split())
    assert ("variables.hfConfigMap == '' || 'configMap' in variables.allowedVolumeTypes ? [] : "
            "['spec.model.huggingface.configMap: a configMap volume of the workers ' + "
            "'(admission.allowedVolumeTypes)']") in powers
    # The operator reads it for the job: its creator must be able to get it (no allow-list).
    reads = [" ".join(v["expression"].split()) for v in policy["spec"]["validations"]]
    assert ("variables.hfConfigMap == '' || variables.mayCreatePods || "
            "authorizer.group('').resource('configmaps').namespace(object.metadata.namespace) "
            ".name(variables.hfConfigMap).check('get').allowed()") in reads


def test_policy_can_be_turned_off(helm_home: Path) -> None:
    objects = chartkit.render(home=helm_home, sets={"admission.enabled": False})
    assert not by_kind(objects, "ValidatingAdmissionPolicy")
    assert not by_kind(objects, "ValidatingAdmissionPolicyBinding")


@pytest.mark.parametrize(("sets", "message"), [
    ({"admission.validationActions": ["Deny", "Warn"]}, "validationActions"),
    ({"admission.validationActions": []}, "validationActions"),
    ({"admission.allowedVolumeTypes": ["hostpath"]}, "/admission/allowedVolumeTypes/0"),
    ({"admission.allowedServiceAccounts": ["Power_ful"]}, "/admission/allowedServiceAccounts/0"),
    # A quote would end the CEL string the value is rendered into.
    ({"admission.allowedLabelKeys": ["a' || true || '"]}, "/admission/allowedLabelKeys/0"),
    ({"admission.allowedTolerationKeys": [""]}, "/admission/allowedTolerationKeys/0"),
    ({"admission.allowedNodeSelectorKeys": "kubernetes.io/hostname"}, "allowedNodeSelectorKeys"),
], ids=lambda v: next(iter(v)) if isinstance(v, dict) else None)
def test_bad_admission_values_are_rejected(helm_home: Path, sets: dict[str, Any],
                                           message: str) -> None:
    args = ["template", *chartkit.template_args(sets=sets)]
    result = chartkit.run_helm(args, home=helm_home, check=False)
    assert result.returncode != 0, f"{sets} was accepted"
    assert message in result.stderr, result.stderr
