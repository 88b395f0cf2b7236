"""The hardware profiler: the JSON document, the link fit, and a real 2-rank gloo measurement."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from adaptis.api.measured_hardware import parse_measured_hardware
from adaptis.worker.errors import WorkerError
from adaptis.worker.profiling.hardware import REFERENCE_TFLOPS, fit_link, load_hardware, measure_hardware
from adaptis.worker.run.launcher import free_port

REPO = Path(__file__).resolve().parents[2]


def test_single_process_document_has_the_device_and_no_links(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    profile = measure_hardware(device=torch.device("cpu"), repeats=2, matmul_size=128)
    doc = json.loads(profile.to_json())
    dev = doc["device"]
    assert dev["name"].startswith("CPU") and dev["precision"] == "float32"
    assert dev["matmul_tflops"] > 0 and dev["memory_bytes"] > 2**28
    assert dev["speed"] == pytest.approx(dev["matmul_tflops"] / REFERENCE_TFLOPS, rel=1e-3)
    assert doc["links"] == {}
    # The flat keys the operator plans from, and the operator's strict schema holds.
    assert doc["tflops"] == dev["matmul_tflops"] and doc["memory_bytes"] == dev["memory_bytes"]
    assert parse_measured_hardware(profile.to_json()).tflops == dev["matmul_tflops"]
    assert len(profile.to_json().encode()) < 4096
    (tmp_path / "hw.json").write_text(profile.to_json())
    assert load_hardware(tmp_path / "hw.json").device.matmul_tflops == dev["matmul_tflops"]


def test_fit_link_recovers_latency_and_bandwidth() -> None:
    sizes = [1e3, 1e5, 1e6, 1e7]
    link = fit_link(sizes, [20e-6 + n / 5e9 for n in sizes])
    assert link.latency_s == pytest.approx(20e-6, rel=1e-6)
    assert link.bandwidth_bytes_per_s == pytest.approx(5e9, rel=1e-6)
    with pytest.raises(WorkerError):
        fit_link([1.0], [1.0])


def test_unreadable_hardware_file_is_a_worker_error(tmp_path: Path) -> None:
    (tmp_path / "hw.json").write_text('{"device": {}}')
    with pytest.raises(WorkerError, match="not a hardware profile"):
        load_hardware(tmp_path / "hw.json")


def test_two_gloo_ranks_measure_their_link_through_the_cli(tmp_path: Path) -> None:
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "adaptis", "profile", "--hardware", "--repeats", "2",
             "-o", str(tmp_path / f"hw{rank}.json")],
            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    try:
        for p in procs:
            results.append(p.communicate(timeout=150))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_out, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err[-2000:]
    docs = [json.loads((tmp_path / f"hw{r}.json").read_text()) for r in (0, 1)]
    for r in (0, 1):  # with links too, what the operator would store passes its schema
        parse_measured_hardware((tmp_path / f"hw{r}.json").read_text())
    link = docs[0]["links"]["intra_node"]
    assert link["bandwidth_bytes_per_s"] > 1e6 and link["latency_s"] >= 0
    assert docs[0]["links"] == docs[1]["links"]  # rank 0 measured, every rank reports it
    assert docs[0]["ranks_per_node"] == 2 and "inter_node" not in docs[0]["links"]
    assert docs[0]["intra_node_bandwidth"] == link["bandwidth_bytes_per_s"]
    assert json.loads(results[0][0].strip().splitlines()[-1]) == docs[0]  # printed as written
