"""promtool: the recording rules and alerts are valid and behave as their names say."""

from __future__ import annotations

import subprocess
from pathlib import Path

import chartkit

RULES_TEST = Path(__file__).resolve().parent / "rules_test.yaml"


def test_promtool_checks_the_rules() -> None:
    result = subprocess.run([str(chartkit.debian_tool("promtool")), "check", "rules",
                             str(chartkit.RULES_FILE)], capture_output=True, text=True,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 13 rules found" in result.stdout


def test_promtool_unit_tests_pass() -> None:
    # rules_test.yaml names the rules file relative to itself (promtool's convention).
    result = subprocess.run([str(chartkit.debian_tool("promtool")), "test", "rules",
                             str(RULES_TEST)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr
