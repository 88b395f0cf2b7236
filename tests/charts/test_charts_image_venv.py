"""The images' entry points, from a clean virtual environment made as the Dockerfile makes it.

No container engine runs here (nor in CI), so the test builds what the Dockerfile's
`build-operator` stage builds: the files that .dockerignore lets into the build context, then
deploy/install-venv.sh into a fresh venv. The operator image must run `adaptis operator` and must
not contain torch; every package in it must be pinned in deploy/constraints/operator.txt.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import chartkit
import pytest

pytestmark = pytest.mark.slow

DOCKERFILE = chartkit.REPO / "Dockerfile"
DOCKERIGNORE = chartkit.REPO / ".dockerignore"
# Bootstrap tools that `python -m venv` itself puts in every venv (pip is removed afterwards).
BOOTSTRAP = {"pip", "setuptools"}


def _build_context(dest: Path) -> Path:
    """Copy what .dockerignore admits (its `!path` lines; everything else is excluded)."""
    admitted = [line[1:].rstrip("/") for line in DOCKERIGNORE.read_text().splitlines()
                if line.startswith("!")]
    assert admitted, ".dockerignore admits nothing"
    for rel in admitted:
        src = chartkit.REPO / rel
        assert src.exists(), f".dockerignore admits {rel}, which is missing"
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, target)
    return dest


def _pins(extra: str) -> dict[str, str]:
    path = chartkit.REPO / "deploy" / "constraints" / f"{extra}.txt"
    pins = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[re.sub(r"[-_.]+", "-", name.lower())] = version
    return pins


@pytest.fixture(scope="module")
def operator_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("image")
    context = _build_context(root / "src")
    # The Dockerfile's stages run exactly these commands in its build context: the pinned
    # dependencies first (from deploy/ alone), then the package over them (in the final stage,
    # from a bind mount of the source).
    steps = ["--deps-only", "/src"]
    for step in steps:
        assert f"sh deploy/install-venv.sh /opt/adaptis operator {step}" in DOCKERFILE.read_text()
    venv = root / "opt-adaptis"
    for step in steps:
        arg = str(context) if step == "/src" else step
        result = subprocess.run(["sh", "deploy/install-venv.sh", str(venv), "operator", arg],
                                cwd=context, capture_output=True, text=True, timeout=600,
                                check=False)
        assert result.returncode == 0, result.stdout + result.stderr
    return venv


def test_operator_entry_point_runs(operator_venv: Path) -> None:
    result = subprocess.run([str(operator_venv / "bin" / "adaptis"), "operator", "--help"],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    for flag in ("--all-namespaces", "--namespace", "--liveness", "--worker-image"):
        assert flag in result.stdout
    crd = subprocess.run([str(operator_venv / "bin" / "adaptis"), "crd"], capture_output=True,
                         text=True, timeout=120, check=False)
    assert crd.returncode == 0 and "kind: CustomResourceDefinition" in crd.stdout


def test_operator_image_has_no_torch(operator_venv: Path) -> None:
    result = subprocess.run([str(operator_venv / "bin" / "python"), "-c", "import torch"],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode != 0 and "No module named 'torch'" in result.stderr
    # kopf and the Kubernetes client are there.
    ok = subprocess.run([str(operator_venv / "bin" / "python"), "-c",
                         "import kopf, kubernetes, adaptis.operator.control.app"],
                        capture_output=True, text=True, timeout=120, check=False)
    assert ok.returncode == 0, ok.stderr


def test_every_installed_package_is_pinned(operator_venv: Path) -> None:
    listing = subprocess.run(
        [str(operator_venv / "bin" / "python"), "-c",
         "import importlib.metadata as m\n"
         "for d in m.distributions(): print(d.metadata['Name'], d.version)"],
        capture_output=True, text=True, timeout=60, check=True).stdout
    pins = _pins("operator")
    installed = {}
    for line in listing.splitlines():
        name, version = line.split()
        installed[re.sub(r"[-_.]+", "-", name.lower())] = version
    assert "pip" not in installed  # removed: nothing in the image installs at run time
    for name, version in installed.items():
        if name == "adaptis" or name in BOOTSTRAP:
            continue
        assert pins.get(name) == version, f"{name} {version} is not pinned in operator.txt"
    assert "torch" not in installed


def test_operator_venv_is_small(operator_venv: Path) -> None:
    size = sum(p.stat().st_size for p in operator_venv.rglob("*") if p.is_file())
    print(f"operator venv: {size / 2**20:.1f} MiB")
    assert size < 250 * 2**20, f"{size / 2**20:.0f} MiB"  # the worker image is gigabytes


def test_dockerfile_targets_pin_and_drop_root() -> None:
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG PYTHON_IMAGE=python:\d+\.\d+\.\d+-slim-\w+$", text, re.M)
    for target in ("operator", "worker"):
        stage = text.split(f" AS {target}\n", 1)[1].split("\nFROM ", 1)[0]
        assert "USER 10001:10001" in stage, target
        assert 'ENTRYPOINT ["adaptis"]' in stage, target
    # The worker image's torch is the one constraints.txt pins.
    torch_pin = re.search(r"^torch==(\S+)", (chartkit.REPO / "constraints.txt").read_text(), re.M)
    assert torch_pin and _pins("worker")["torch"] == torch_pin.group(1)
    assert "torch" not in _pins("operator")
    # The chart runs the operator as the image's user.
    values_uid = re.search(r"runAsUser: (\d+)",
                           (chartkit.CHART / "templates" / "deployment.yaml").read_text())
    assert values_uid and values_uid.group(1) == "10001"
    assert sys.version_info[:2] == tuple(
        int(x) for x in re.search(r"python:(\d+)\.(\d+)", text).groups())  # type: ignore[union-attr]
