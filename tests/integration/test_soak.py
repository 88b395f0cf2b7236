"""The soak's short form (issue 31, item 3; ``bench/soak.py``, whose long form runs by hand).

For a minute and a half jobs are created, suspended, resumed and deleted on a control plane of
the test's own while the operator is killed, kube-apiserver and etcd restart, worker pods are
evicted, preempted by a higher-priority pod and nodes deleted, and API Priority and Fairness
rejects the operator's requests (it runs as the chart's ServiceAccount); then every job must
end consistent with the faults counted against it, no GPU was ever double-booked, no attempt
overlapped another and no deleted job left a pod.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def _soak() -> ModuleType:
    sys.path.insert(0, str(REPO / "bench"))  # as the script runs: its neighbours by plain name
    return importlib.import_module("soak")


def test_the_operator_keeps_its_invariants_while_faults_arrive_together(
        control_plane_bin_dir: Path, tmp_path: Path) -> None:
    soak = _soak()
    figures = soak.soak(binaries=control_plane_bin_dir, minutes=1.5, nodes=6, gpus=8, seed=7,
                        work=tmp_path, settle_s=420)
    assert figures["violations"] == [], figures
    # Each fault really happened (the harness forces the missing ones in the second half).
    injected = {kind: figures.get(kind, 0) for kind in soak.FAULTS}
    assert all(injected.values()), injected
    assert figures["attempts broken"] >= 1, figures
    # The API server really answered the operator 429 (its own rejected-requests counter).
    assert figures["operator requests rejected 429"] >= 1, figures
    # kube-scheduler bound a preemptor onto the GPUs its workers held.
    assert figures["preemptors bound"] >= 1, figures
    assert figures["jobs finished"] >= 3, figures
