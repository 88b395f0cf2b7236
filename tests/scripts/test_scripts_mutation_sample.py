"""bench/mutation.py's sampled score (the 95 % Wilson interval it prints for ``--sample``) and its
cross-rank step's map of functions to multi-process tests (bench/mutation_ranks.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _mutation():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("bench_mutation", ROOT / "bench" / "mutation.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("caught", "n", "low", "high"), [
    # By hand: centre (p + z^2/2n) / (1 + z^2/n), half-width z / (1 + z^2/n) x
    # sqrt(p (1 - p) / n + z^2 / 4n^2), z = 1.96.
    (67, 80, 0.7416, 0.9025),
    (0, 10, 0.0, 0.2775),  # all survived: the interval still reaches above 0
    (10, 10, 0.7225, 1.0),  # all caught: a sample of 10 cannot promise more than 72 %
    (50, 100, 0.4038, 0.5962),
])
def test_the_wilson_interval_of_known_proportions(caught: int, n: int, low: float, high: float) -> None:
    assert _mutation().wilson(caught, n) == (pytest.approx(low, abs=1e-4), pytest.approx(high, abs=1e-4))


def test_an_empty_sample_promises_nothing() -> None:
    assert _mutation().wilson(0, 0) == (0.0, 1.0)


def test_the_quick_run_plans_every_core_module_once() -> None:
    mutation = _mutation()
    assert list(mutation.QUICK) == list(mutation.MODULES)
    assert all(n is None or n > 0 for n in mutation.QUICK.values())


def test_the_whole_score_weights_each_module_by_its_mutants() -> None:
    # By hand: a module of 100 run in full, 80 caught; one of 300, a sample of 30, 27 caught:
    # (80 + 300 x 0.9) / 400 = 0.875. Only the sample varies: Agresti-Coull rate (27 + z^2/2) /
    # (30 + z^2) = 0.85459, variance 0.75^2 x 0.85459 x 0.14541 / 30 x (1 - 30/300) = 0.0020969,
    # half-width 1.96 x sqrt(0.0020969) = 0.08975.
    mutation = _mutation()
    full = mutation.Stratum(caught=80, run=100, mutants=100)
    sampled = mutation.Stratum(caught=27, run=30, mutants=300)
    score, low, high = mutation.estimate([full, sampled])
    assert score == pytest.approx(0.875)
    assert (low, high) == (pytest.approx(0.78525, abs=1e-5), pytest.approx(0.96475, abs=1e-5))
    # Every module run in full: the score is exact, not an estimate.
    assert mutation.estimate([full]) == (pytest.approx(0.8), pytest.approx(0.8), pytest.approx(0.8))


def _ranks():  # type: ignore[no-untyped-def]
    _mutation()  # puts the checkout on the path, as the script does
    import importlib

    return importlib.import_module("bench.mutation_ranks")


def test_a_mutants_function_is_read_from_mutmuts_mangled_name() -> None:
    function_of = _ranks().function_of
    assert function_of("adaptis.worker.runtime.executor.xǁExecutorǁ_sync_tied__mutmut_25") == "Executor._sync_tied"
    assert function_of("adaptis.worker.runtime.executor.xǁExecutorǁ__init____mutmut_105") == "Executor.__init__"
    assert function_of("adaptis.worker.state.checkpoint.x__tied_alias__mutmut_3") == "_tied_alias"
    assert function_of("adaptis.worker.state.checkpoint.x_load_checkpoint__mutmut_12") == "load_checkpoint"


def test_the_cross_rank_map_names_functions_and_tests_that_exist() -> None:
    import importlib
    import operator

    for module, tests_of in _ranks().CROSS_RANK.items():
        code = importlib.import_module(module.removesuffix(".py").replace("/", "."))
        for function, tests in tests_of.items():
            assert callable(operator.attrgetter(function)(code)), f"{module}: {function}"
            for test in tests:
                path, _, name = test.partition("::")
                assert f"def {name.partition('[')[0]}(" in (ROOT / path).read_text(), test
