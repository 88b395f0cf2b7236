"""The architecture, checked by a machine: the layers, the rooms inside them, no cycles.

import-linter reads the contracts in pyproject.toml (docs/architecture.md explains them): the
layers (cli on top, then operator | worker, then planner, then api), the rooms of the operator
and of the worker, forbidden contracts that keep torch, kopf, the Kubernetes client, numpy and
HTTP out of the pure layers and rooms (and torch.distributed out of the worker's models:
tests/import_contracts.py), and no import cycle at any depth, lazy and TYPE_CHECKING imports
included. (matplotlib, optional, is imported by the timeline inside its function only;
tests/planner checks that.)
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold() -> None:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert exe, "lint-imports (import-linter) is not installed: run scripts/setup.sh"
    proc = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tally = re.search(r"Contracts: (\d+) kept, (\d+) broken", proc.stdout)
    assert tally, proc.stdout
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert (int(tally[1]), int(tally[2])) == (len(contracts), 0), proc.stdout


def test_base_install_needs_no_torch_or_kubernetes() -> None:
    """Planning from the CLI imports neither torch nor the Kubernetes client."""
    code = (
        "import sys, adaptis.cli.plan, adaptis.planner.strategies;"
        "bad = [m for m in ('torch', 'kopf', 'kubernetes') if m in sys.modules];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
