"""``bench/tensor_parallel.py`` keeps running: its dry runs at a tiny scale, the paper shapes
through the API's rules, and the measured part's bookkeeping (no ranks started, no timings)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    sys.path.insert(0, str(ROOT / "bench"))  # the bench scripts import each other by name
    try:
        import tensor_parallel

        return tensor_parallel
    finally:
        sys.path.remove(str(ROOT / "bench"))


def test_tiny_dry_runs_plan_and_tensor_parallel_halves_the_memory(bench: ModuleType) -> None:
    from tensor_parallel_dry import dry_runs, dry_table

    rows = dry_runs(scale="tiny", time_limit_s=10)
    by = {(r["shape"], r["strategy"]): r for r in rows}
    assert all("iteration" in r for r in rows), [r.get("reason") for r in rows]
    assert all(r["fits"] for r in rows)
    for strategy in ("adaptis", "i1f1b", "1f1b"):
        t2, t1 = by["tiny PP2 x TP2", strategy], by["tiny PP2 x TP1", strategy]
        assert t2["layer_state"] == pytest.approx(t1["layer_state"] / 2)  # every layer split
        assert t2["peak"] < t1["peak"]
    for shape in ("tiny PP2 x TP2", "tiny PP2 x TP1"):
        ours = by[shape, "adaptis"]["iteration"]
        assert ours <= by[shape, "i1f1b"]["iteration"] and ours <= by[shape, "1f1b"]["iteration"]
    table = dry_table(rows)
    assert sum(line.startswith("| tiny PP2") for line in table) == 6
    assert any("adaptis" in line and "x i1f1b" in line for line in table)


def test_the_paper_shapes_pass_the_api_rules_and_estimate_a_tensor_rank(bench: ModuleType) -> None:
    from tensor_parallel_dry import SHAPES, problem

    from adaptis.planner.costs import Costs

    for name, shape in SHAPES["paper"].items():
        prob = problem(name, shape)  # check_job raises a SpecError naming the field it refuses
        assert prob.tensor_parallel == shape.tensor and prob.data_parallel == shape.replicas
    t8, t1 = (Costs.from_problem(problem(k, SHAPES["paper"][k]))
              for k in ("llama3-70b PP8 x TP8 (64 GPUs)", "llama3-70b PP8 x TP1 (8 GPUs)"))
    block = 1  # the first attention block: its state / 8, its forward / 8 plus two NVLink all-reduces
    assert t8.param_bytes[block] == pytest.approx(t1.param_bytes[block] / 8)
    assert t1.forward[block] / 8 < t8.forward[block] < t1.forward[block] / 4


def test_measured_problems_are_marked_by_kind_and_the_shares_read(bench: ModuleType, tmp_path: Path) -> None:
    from adaptis.api.job import load_job
    from adaptis.worker.profiling.job_problem import estimate_problem

    est = estimate_problem(load_job(bench.EXAMPLE).spec, devices=2)  # Mamba, attention, MoE blocks
    base = est.model_copy(update={"layers": [lay.model_copy(update={"tensor_split": None, "tensor_all_reduces": None})
                                             for lay in est.expanded_layers()], "tensor_parallel": 1})
    link = {"bandwidth_bytes_per_s": 1e9, "latency_s": 1e-4}
    marked = bench.config_problem(base, devices=1, degree=2, link=link, marked=True)
    plain = bench.config_problem(base, devices=1, degree=2, link=None, marked=False)
    assert marked.tensor_parallel == 2 and marked.device_count == 1 and marked.network.tensor is not None
    kinds = {lay.kind: (lay.tensor_split, lay.tensor_all_reduces) for lay in marked.expanded_layers()}
    assert kinds == {"embedding": (1.0, 1), "mamba": (0.0, 0), "attention": (1.0, 2), "moe": (1.0, 2),
                     "head": (1.0, 0)}
    assert plain.network.tensor is None and all(lay.tensor_split is None for lay in plain.expanded_layers())
    compile(bench.SITECUSTOMIZE, "sitecustomize.py", "exec")
    assert bench.collective_share(tmp_path) is None
    for rank, secs in ((0, 1.0), (1, 3.0)):
        (tmp_path / f"rank-{rank}-1.json").write_text(
            json.dumps({"seconds": secs, "calls": 10, "first": 0.0, "last": 10.0}))
    assert bench.collective_share(tmp_path) == (pytest.approx(0.2), 10, pytest.approx(0.2))
