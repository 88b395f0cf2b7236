"""Fixtures of the chart tests: a private helm home and the chart rendered once per session."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:  # chartkit sits beside this file; works with importlib mode too
    sys.path.insert(0, str(_HERE))

import chartkit  # noqa: E402


@pytest.fixture(scope="session")
def helm_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("helm-home")


@pytest.fixture(scope="session")
def default_objects(helm_home: Path) -> list[dict[str, Any]]:
    """The chart rendered with its default values."""
    return chartkit.render(home=helm_home)


@pytest.fixture(scope="session")
def full_objects(helm_home: Path) -> list[dict[str, Any]]:
    """The chart rendered with every option on (fixtures/values-full.yaml)."""
    return chartkit.render(home=helm_home, values=[chartkit.FULL_VALUES])
