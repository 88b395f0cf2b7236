"""The architecture, checked by a machine: operator and worker -> planner -> api.

import-linter reads the contracts in pyproject.toml: the layers contract (cli on top, then
operator | worker, then planner, then api) and a forbidden contract that keeps torch, kopf,
the Kubernetes client and numpy out of the api and planner layers. (matplotlib, optional, is
imported by the timeline inside its function only; tests/planner checks that.)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold() -> None:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert exe, "lint-imports (import-linter) is not installed: run scripts/setup.sh"
    proc = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 kept, 0 broken" in proc.stdout, proc.stdout


def test_base_install_needs_no_torch_or_kubernetes() -> None:
    """Planning from the CLI imports neither torch nor the Kubernetes client."""
    code = (
        "import sys, adaptis.cli.plan, adaptis.planner.strategies;"
        "bad = [m for m in ('torch', 'kopf', 'kubernetes') if m in sys.modules];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
