"""Suite-wide pytest options: the real-node tier (``--realnode``).

Tests marked ``realnode`` run pods in real containers on a real kubelet
(``tests/integration/realnode.py``, ``hack/realnode/``): they need root, Debian's containerd
and runc, and a first run builds the kubelet, kube-proxy, CoreDNS and the Dockerfile's images
(hack/README.md says how long).  They run with ``--realnode`` (``make test`` passes it).
Without it they are skipped, and the run ends with a line saying "REAL-NODE TIER NOT RUN", so a
green run without them never looks like a full one.
"""

from __future__ import annotations

import pytest

REALNODE_OPTION = "--realnode"


def pytest_addoption(parser: pytest.Parser) -> None:
    """Register ``--realnode``."""
    parser.addoption(
        REALNODE_OPTION,
        action="store_true",
        default=False,
        help="run the real-node tier: a real kubelet, containerd and the Dockerfile's images "
        "(needs root; see hack/README.md)",
    )


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``realnode`` marker."""
    config.addinivalue_line(
        "markers",
        "realnode: runs pods in real containers on a real kubelet (needs --realnode and root)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the real-node tier unless ``--realnode`` is given (and say so at the end)."""
    if config.getoption(REALNODE_OPTION):
        return
    skip = pytest.mark.skip(reason="real-node tier: pass --realnode (make test does)")
    skipped = 0
    for item in items:
        if "realnode" in item.keywords:
            item.add_marker(skip)
            skipped += 1
    config.stash[_SKIPPED] = skipped


_SKIPPED = pytest.StashKey[int]()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """Say loudly when the real-node tier was collected but not run."""
    skipped = config.stash.get(_SKIPPED, 0)
    if skipped:
        terminalreporter.write_line(
            f"REAL-NODE TIER NOT RUN: {skipped} tests need --realnode (make test passes it)",
            yellow=True,
            bold=True,
        )
