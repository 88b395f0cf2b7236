"""Mutation score of AdaPtis's core modules (issue 18): a benchmark, not part of CI.

Run by ``make mutation`` (which installs mutmut, pinned in constraints.txt, into the venv on
demand): ``--quick --cross-rank``, every core module in under an hour on this project's 2-core
machines (``QUICK``: every mutant of the cheap modules, a seeded sample of the costly ones),
with the score of the whole estimated from the samples; ``make mutation FULL=1`` runs every
mutant (hours: bench/RESULTS.md has each module's full figures).

Each module is mutated on its own, in a scratch copy of the working tree, against the fast unit
tests that cover it (never ``tests/integration``, never ``slow``): mutmut reads its
configuration from the ``pyproject.toml`` of the directory it runs in and writes ``mutants/``
there, so a scratch copy per module keeps the checkout clean and lets each module have its own
test selection. mutmut then runs, for each mutant, only the tests that reached the mutated
function.

    python bench/mutation.py --quick --cross-rank             # what `make mutation` runs
    python bench/mutation.py                                  # every mutant of every module (hours)
    python bench/mutation.py adaptis/operator/resources/status.py       # some modules
    python bench/mutation.py --jobs 1 --out /tmp/mutation     # fewer parallel test processes
    python bench/mutation.py adaptis/worker/runtime/executor.py --sample 80 --seed 1   # a random sample

``--sample N`` runs a seeded random sample of N of each module's M mutants (by name, with
mutmut) where a full run costs too much: it prints "sample of N of M" and the score's 95 %
Wilson interval. A sampled mutant whose function no selected test reaches counts as not
caught, as in a full run.

``--cross-rank`` (worker modules, bench/mutation_ranks.py): the mutants mutmut's run left
alive are run again against the module's multi-process gloo tests with the mutant active in
every rank (mutmut's run never reaches ranks in processes of their own); the "ranks" column
counts those caught so. ``--reuse`` takes the scratch copy an earlier run left in ``--out``
(same ``--sample``/``--seed``), copies the working tree's tests in, runs only its survivors
again, then the cross-rank step if asked:

    python bench/mutation.py adaptis/worker/runtime/executor.py --sample 160 --seed 18 --cross-rank
    python bench/mutation.py adaptis/worker/runtime/executor.py --sample 160 --seed 18 --reuse --cross-rank

Prints one line per module (killed, of which across ranks, survived, other, score) and
writes each module's surviving mutants, as diffs, to ``<out>/<module>.survivors.txt``; then
the mutants run in all, and the score of all the modules' mutants estimated from them.
Measured (bench/RESULTS.md, "Mutation score"): ``make mutation`` in 31 minutes on the 2-core
vm, quiet (3141 of the 6172 mutants); every module in full or on a large sample, module by
module, over several sessions (hours each for the scheduler, the search, reconcile and the
executor on the shared cores).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: `bench` imports

from bench.mutation_ranks import CAUGHT_ACROSS_RANKS, CROSS_RANK, cross_rank  # noqa: E402

#: Core module -> the fast unit tests that cover it.
MODULES: dict[str, tuple[str, ...]] = {
    # Every planner test reaches simulate(); these check its timeline independently
    # (dependencies, transfers, memory, overlaps), what it adds after the pipeline (the
    # reductions and optimizer step) and what a recomputed stage costs.
    "adaptis/planner/simulator.py": (
        "tests/planner/test_planner_properties.py", "tests/planner/test_planner_simulator.py",
        "tests/planner/test_planner_zero_bubble.py", "tests/planner/test_planner_timeline.py",
        "tests/planner/test_planner_post_pipeline.py", "tests/planner/test_planner_recompute.py",
    ),
    # The scheduler's own tests and the search's, which schedule every candidate (the rest of
    # the planner suite reaches it only through the search, and the benchmarks' tests take
    # minutes under mutmut).
    "adaptis/planner/scheduler.py": (
        "tests/planner/test_planner_schedule_rules.py", "tests/planner/test_planner_scheduler.py",
        "tests/planner/test_planner_search.py", "tests/planner/test_planner_time_limit.py",
    ),
    # The search's own tests, its time limit, the value test (the joint search itself, not the
    # baseline fallback, beats every baseline by a stated margin), screening (the large-problem
    # path: estimates, then confirm), the W tail (the other patterns' climbs) and the search's
    # accounts (admission, confirming, counting, deadlines): ~20 s in all.
    "adaptis/planner/search.py": (
        "tests/planner/test_planner_search.py", "tests/planner/test_planner_time_limit.py",
        "tests/planner/test_planner_value.py", "tests/planner/test_planner_screening.py",
        "tests/planner/test_planner_w_tail.py", "tests/planner/test_planner_search_accounts.py",
    ),
    # The partition's own tests, the baselines' and the properties' partition tests. (Every
    # plan starts from a partition, so the whole planner suite reaches it: under mutmut each
    # survivor would re-run all of it, a minute each on the shared 2 cores.)
    "adaptis/planner/partition.py": (
        "tests/planner/test_planner_partition.py",
        "tests/planner/test_planner_baselines.py::test_megatron_partition_pins_embedding_and_head_and_spreads_the_remainder_first",
        "tests/planner/test_planner_baselines.py::test_megatron_partition_with_fewer_body_layers_than_stages_splits_all_layers",
        "tests/planner/test_planner_baselines.py::test_balanced_partition_is_optimal_by_brute_force",
        "tests/planner/test_planner_baselines.py::test_balanced_partition_moves_layers_off_a_heavy_head",
        "tests/planner/test_planner_properties.py::test_balanced_partition_is_never_worse_than_megatron",
        "tests/planner/test_planner_properties.py::test_spread_partition_keeps_the_bottleneck_and_evens_the_rest",
        "tests/planner/test_planner_properties.py::test_spread_partition_leaves_no_idle_tail",
    ),
    # Its own tests and those of its time limit, memory fallback, bound and recomputation (~8 s;
    # properties, search and the CLI plan by name too, but each survivor would re-run them all).
    "adaptis/planner/strategies.py": (
        "tests/planner/test_planner_strategies.py", "tests/planner/test_planner_time_limit.py",
        "tests/planner/test_planner_feasibility.py", "tests/planner/test_planner_bounds.py",
        "tests/planner/test_planner_recompute_search.py",
    ),
    # The mesh tests read the placement a data-parallel plan's status lists (replicas, pods).
    "adaptis/operator/resources/status.py": (
        "tests/operator/test_operator_status.py", "tests/operator/test_operator_reconcile.py",
        "tests/worker/test_worker_termination.py", "tests/operator/test_operator_mesh.py",
    ),
    "adaptis/operator/scheduling/capacity.py": (
        "tests/operator/test_operator_capacity_ledger.py", "tests/operator/test_operator_capacity.py",
        "tests/operator/test_operator_placement.py",
    ),
    # Every test that runs reconcile passes against the fake cluster (the plan runner's tests
    # wait on planner processes: the same passes, seconds slower); the Hugging Face config's
    # tests are the only ones of a job waiting for its ConfigMap, the adaptation tests (~3 s)
    # the only users of the arguments the reconciler hands its Adapter.
    "adaptis/operator/control/reconcile.py": (
        "tests/operator/test_operator_reconcile.py", "tests/operator/test_operator_reconcile_paths.py",
        "tests/operator/test_operator_adaptation.py", "tests/operator/test_operator_reconcile_edges.py",
        "tests/operator/test_operator_capacity.py", "tests/operator/test_operator_hf_config.py",
        "tests/operator/test_operator_children.py", "tests/operator/test_operator_handlers.py",
        "tests/operator/test_operator_placement.py", "tests/operator/test_operator_pod_security.py",
        "tests/operator/test_operator_profiler_pods.py", "tests/operator/test_operator_validation.py",
    ),
    "adaptis/operator/control/workqueue.py": ("tests/operator/test_operator_workqueue.py",),
    "adaptis/operator/resources/validation.py": ("tests/operator/test_operator_validation.py",),
    "adaptis/worker/runtime/executor.py": ("tests/worker/test_worker_executor.py",),
    "adaptis/worker/runtime/components.py": ("tests/worker/test_worker_components.py",),
    # Split from the executor: the multi-rank decisions, pure functions checked in one process.
    "adaptis/worker/runtime/ownership.py": ("tests/worker/test_worker_ownership.py",),
    # The in-process tests: test_worker_checkpoint.py's others run ranks in processes of
    # their own, which mutmut's mutants never reach (and would cost a minute a mutant).
    "adaptis/worker/state/checkpoint.py": (
        "tests/worker/test_worker_checkpoint_files.py", "tests/worker/test_worker_named_state.py",
    ),
    "adaptis/worker/state/named_state.py": ("tests/worker/test_worker_named_state.py",),
    # The scraping tests' ranks are processes of their own, which mutmut's mutants never reach:
    # the in-process tests of the same contract, and the one scraping test that runs in process.
    "adaptis/worker/run/metrics.py": (
        "tests/worker/test_worker_metrics_registry.py",
        "tests/worker/test_worker_metrics.py::test_last_step_gauges_appear_with_the_first_step",
    ),
}

#: ``--quick``: how many mutants of each module to run (None: all), sized from what a mutant
#: cost in a first quick run (2026-12-01, 2-core vm, load 1.3-2.1: 16 min for 1692 mutants)
#: so that ``make mutation`` ends within the hour even on a busier machine (31 minutes measured
#: on a quiet one): every mutant where one costs under half a second, a sample where the tests
#: take a second or more a mutant (the scheduler's and the search's schedule whole problems,
#: the work queue's wait on threads) or where survivors go on to the multi-process tests
#: (executor, checkpoint). A sample's score is an estimate: its 95 % interval is printed with it.
QUICK: dict[str, int | None] = {
    "adaptis/planner/simulator.py": None,
    "adaptis/planner/scheduler.py": 150,
    "adaptis/planner/search.py": 150,
    "adaptis/planner/partition.py": 160,
    "adaptis/planner/strategies.py": None,
    "adaptis/operator/resources/status.py": None,
    "adaptis/operator/scheduling/capacity.py": None,
    "adaptis/operator/control/reconcile.py": 240,
    "adaptis/operator/control/workqueue.py": 60,
    "adaptis/operator/resources/validation.py": None,
    "adaptis/worker/runtime/executor.py": 60,
    "adaptis/worker/runtime/components.py": None,
    "adaptis/worker/runtime/ownership.py": None,
    "adaptis/worker/state/checkpoint.py": 120,
    "adaptis/worker/state/named_state.py": None,
    "adaptis/worker/run/metrics.py": None,
}

#: Modules whose tests run torch (its thread pools make a plain fork unsafe): mutmut's fork
#: server, which starts a fresh interpreter per mutant (tens of seconds each on 2 shared cores).
#: The metrics tests only import torch, so a plain fork is safe there and ~30x faster.
FORKSERVER = {"adaptis/worker/runtime/executor.py", "adaptis/worker/runtime/components.py",
              "adaptis/worker/state/checkpoint.py",
              "adaptis/worker/runtime/ownership.py"}

#: mutmut's exit-code names that count as caught: the tests failed, or the mutant hung or
#: crashed its test process (mutmut's "timeout" and "segfault").
CAUGHT = {"killed", "timeout", "segfault", *CAUGHT_ACROSS_RANKS}


def mutmut_config(module: str, tests: tuple[str, ...], *, also_copy: list[str]) -> str:
    """The ``[tool.mutmut]`` table for one module (appended to the scratch pyproject)."""
    isolation = "forkserver" if module in FORKSERVER else "fork"
    return (
        "\n[tool.mutmut]\n"
        'source_paths = ["adaptis"]\n'
        # mutmut runs the tests inside mutants/, which holds only the sources and tests/ unless
        # told: some tests read bench/, examples/, docs/ ...
        f"also_copy = {json.dumps(also_copy)}\n"
        f"only_mutate = [{json.dumps(module)}]\n"
        f"pytest_add_cli_args_test_selection = {json.dumps(list(tests))}\n"
        'pytest_add_cli_args = ["-m", "not integration and not slow", "-p", "no:cacheprovider"]\n'
        f'process_isolation = "{isolation}"\n'
        # A mutant that hangs (a loop that never ends) is stopped after (its tests' CPU time +
        # 5 s) x 10 CPU seconds, not mutmut's (time + 1 s) x 30: on 2 shared cores the default
        # made each hanging partition mutant cost minutes. Either way it counts as caught.
        "timeout_multiplier = 5.0\n"
        "timeout_constant = 5.0\n"
        "use_git_change_detection = false\n"
    )


def scratch_copy(dest: Path) -> None:
    """The working tree's tracked and untracked, not ignored, files (uncommitted edits too)."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT, check=True, capture_output=True,
    ).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def run_module(*, module: str, tests: tuple[str, ...], out: Path, jobs: int, sample: int | None = None,
               seed: int = 0, ranks: bool = False, reuse: bool = False) -> tuple[Counter[str], int]:
    """Mutate one module (all its mutants, or a seeded sample of ``sample`` of them), then with
    ``ranks`` run what survived against its multi-process tests (bench/mutation_ranks.py);
    returns the count of each status over the mutants run, and how many mutants the module has.
    ``reuse``: the scratch copy a previous run of the same module (and sample) left in ``out``,
    with the working tree's tests copied in, and only that run's survivors run again (mutmut
    finds the new tests and which functions they reach)."""
    stem = module.replace("/", ".")
    work = out / stem
    mutmut = Mutmut(work=work, log=out / f"{stem}.log")
    rerun = False
    if reuse:
        if not (work / "mutants" / "mutmut-stats.json").exists():
            raise SystemExit(f"--reuse: no mutmut run of {module} in {work}; run it without --reuse first")
        # Survivors are run again only if the tests changed since (mutmut's results are
        # otherwise the same). mutmut copies tests/ into mutants/ on each run; the cross-rank
        # step runs in mutants/.
        rerun = _digest(ROOT / "tests") != _digest(work / "tests")
        for dest in (work / "tests", work / "mutants" / "tests"):
            shutil.copytree(ROOT / "tests", dest, dirs_exist_ok=True)
    else:
        if work.exists():
            shutil.rmtree(work)
        work.mkdir(parents=True)
        scratch_copy(work)
        also_copy = sorted(p.name for p in work.iterdir() if p.name not in {"adaptis", "tests"})
        with (work / "pyproject.toml").open("a") as f:
            f.write(mutmut_config(module, tests, also_copy=also_copy))
    unreached: list[str] = []
    if sample is None:
        if not reuse:
            mutmut.run(jobs=jobs)
        elif rerun:
            again = sorted(n for n, s in mutmut.statuses().items() if s == "survived")
            if again:  # (no names would run every mutant)
                mutmut.run(jobs=jobs, names=again)
        everything = mutmut.statuses()
        statuses = everything
    else:
        # A first run with a filter that matches no mutant generates the mutants and records
        # which tests reach which function, then stops: the names to sample from.
        if not reuse:
            mutmut.run(jobs=jobs, names=[f"{stem[:-3]}.no_such_function__mutmut_0"], expect_failure=True)
        everything = mutmut.statuses()
        chosen = sorted(random.Random(seed).sample(sorted(everything), min(sample, len(everything))))
        # mutmut cannot be handed a mutant whose function no test reaches (it looks its tests
        # up and fails): such a mutant is not caught, as in a full run.
        reached = mutmut.reached_functions()
        run = [n for n in chosen if n.partition("__mutmut_")[0] in reached]
        unreached = [n for n in chosen if n not in run]
        if reuse and rerun:
            run_now = mutmut.statuses()
            again = [n for n in run if run_now[n] == "survived"]
            if again:
                mutmut.run(jobs=jobs, names=again)
        elif run and not reuse:
            mutmut.run(jobs=jobs, names=run)
        now = mutmut.statuses()
        statuses = {n: now[n] for n in run} | dict.fromkeys(unreached, "no tests")
    if ranks and module in CROSS_RANK:
        # Not the "not checked" of a run stopped early: those never met the unit tests.
        left = sorted(n for n, s in statuses.items() if s in {"survived", "no tests"})
        statuses |= cross_rank(module=module, work=work, mutants=left, log=out / f"{stem}.ranks.log")
    survivors = sorted(n for n, s in statuses.items() if s not in CAUGHT)
    with (out / f"{stem}.survivors.txt").open("w") as f:
        for name in survivors:
            f.write(mutmut.show(name) if name not in unreached else f"# {name}: no unit tests\n")
            f.write("\n")
    return Counter(statuses.values()), len(everything)


def _digest(tests: Path) -> str:
    """One hash of every file under ``tests`` (names and bytes)."""
    h = hashlib.sha256()
    for path in sorted(p for p in tests.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        h.update(str(path.relative_to(tests)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


@dataclass(frozen=True)
class Mutmut:
    """mutmut's command line in one module's scratch copy."""

    work: Path
    log: Path

    def _call(self, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # mutants/ must come first
        exe = str(Path(sys.executable).with_name("mutmut"))
        return subprocess.run([exe, *args], cwd=self.work, env=env, text=True, check=False, **kwargs)

    def run(self, *, jobs: int, names: list[str] | None = None, expect_failure: bool = False) -> None:
        with self.log.open("a") as log:
            ran = self._call("run", "--max-children", str(jobs), *(names or []),
                             stdout=log, stderr=subprocess.STDOUT)
        generated = any((self.work / "mutants").rglob("*.meta"))
        if (ran.returncode != 0) != expect_failure or not generated:
            # Typically a test that fails or cannot be collected inside mutants/ before any mutant.
            raise SystemExit(f"{self.work.name}: mutmut run exited {ran.returncode}; see {self.log}")

    def statuses(self) -> dict[str, str]:
        """Every mutant of the module -> its status ("not checked" before it is run)."""
        listing = self._call("results", "--all", "true", capture_output=True).stdout
        return {
            name.strip(): status.strip()
            for name, _, status in (line.rpartition(":") for line in listing.splitlines())
            if name.strip()
        }

    def reached_functions(self) -> set[str]:
        """The mutated functions some selected test reaches (mutmut's own record)."""
        stats = json.loads((self.work / "mutants" / "mutmut-stats.json").read_text())
        return {name for name, tests in stats["tests_by_mangled_function_name"].items() if tests}

    def show(self, name: str) -> str:
        return self._call("show", name, capture_output=True).stdout


def wilson(caught: int, n: int, *, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion ``caught / n`` (95 % for z = 1.96): unlike
    the normal approximation it stays inside [0, 1] and is honest near 100 %."""
    if n == 0:
        return 0.0, 1.0
    p = caught / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="*", help="core modules to mutate (default: all)")
    parser.add_argument("--jobs", type=int, default=2, help="parallel test processes")
    parser.add_argument("--out", type=Path, default=Path("/tmp/adaptis-mutation"))
    parser.add_argument("--sample", type=int, default=None, metavar="N",
                        help="run a random sample of N mutants of each module (default: all)")
    parser.add_argument("--quick", action="store_true",
                        help="each module's share in QUICK (all mutants of the cheap ones, a sample of the "
                             "costly ones): every core module within the hour on 2 cores")
    parser.add_argument("--seed", type=int, default=None,
                        help="the samples' random seed (default: a fresh one, printed; give it again to repeat "
                             "a run or --reuse it): a fixed seed would, run after run, measure the mutants the "
                             "tests were last improved against")
    parser.add_argument("--cross-rank", action="store_true",
                        help="re-run a worker module's survivors against its multi-process tests "
                             f"({', '.join(CROSS_RANK)})")
    parser.add_argument("--reuse", action="store_true",
                        help="the scratch copies a previous run (same --out, --sample, --seed) left: its "
                             "survivors only, run again with the working tree's tests (and --cross-rank)")
    args = parser.parse_args(argv)
    unknown = [m for m in args.modules if m not in MODULES]
    if unknown:
        parser.error(f"modules: {', '.join(unknown)} not among the core modules: {', '.join(MODULES)}")
    if args.sample is not None and args.sample < 1:
        parser.error(f"--sample: {args.sample}; give the number of mutants to run, at least 1")
    if args.sample is not None and args.quick:
        parser.error("--sample and --quick: give one (--quick takes each module's sample from QUICK)")
    sampled = args.sample is not None or args.quick
    if args.seed is None:
        if args.reuse and sampled:
            parser.error("--reuse of a sampled run: give its --seed (the run printed it)")
        args.seed = random.SystemRandom().randrange(1, 1_000_000)
    if sampled:
        print(f"samples drawn with --seed {args.seed}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    print(f"{'module':34} {'killed':>6} {'ranks':>5} {'survived':>8} {'other':>5} {'score':>6} {'time':>6}")
    strata: list[Stratum] = []
    total: Counter[str] = Counter()
    for module in args.modules or list(MODULES):
        sample = QUICK[module] if args.quick else args.sample
        start = time.monotonic()
        counts, mutants = run_module(module=module, tests=MODULES[module], out=args.out, jobs=args.jobs,
                                     sample=sample, seed=args.seed, ranks=args.cross_rank, reuse=args.reuse)
        print(_row(module, counts, seconds=time.monotonic() - start), flush=True)
        total += counts
        stratum = Stratum(caught=sum(counts[s] for s in CAUGHT), run=sum(counts.values()), mutants=mutants)
        strata.append(stratum)
        if sample is not None:
            low, high = wilson(stratum.caught, stratum.run)
            print(f"  sample of {stratum.run} of {mutants} mutants (seed {args.seed}): "
                  f"95 % Wilson interval {100 * low:.0f}-{100 * high:.0f} %", flush=True)
    print(_row("all (mutants run)", total, seconds=time.monotonic() - began))
    score, low, high = estimate(strata)
    print(f"all {sum(s.mutants for s in strata)} mutants, each module weighted by its count: "
          f"{100 * score:.1f} % (95 % interval {100 * low:.1f}-{100 * high:.1f} %)")
    return 0


@dataclass(frozen=True)
class Stratum:
    """One module's run: mutants caught, mutants run (all of them, or a sample), mutants it has."""

    caught: int
    run: int
    mutants: int


def estimate(strata: list[Stratum], *, z: float = 1.96) -> tuple[float, float, float]:
    """The score of all the modules' mutants together, from each module's run (a stratified
    sample): each module's rate weighted by its share of the mutants, and a 95 % interval from
    the sampled modules' variances (none from a module run in full; the finite-population
    correction for a sample that is a large part of its module; the Agresti-Coull rate in the
    variance, so a sample that caught everything still has some)."""
    total = sum(s.mutants for s in strata)
    if total == 0 or any(s.run == 0 for s in strata):
        return 0.0, 0.0, 1.0
    score = sum(s.mutants / total * s.caught / s.run for s in strata)
    variance = 0.0
    for s in strata:
        if s.run >= s.mutants:
            continue
        rate = (s.caught + z * z / 2) / (s.run + z * z)
        variance += (s.mutants / total) ** 2 * rate * (1 - rate) / s.run * (1 - s.run / s.mutants)
    half = z * math.sqrt(variance)
    return score, max(0.0, score - half), min(1.0, score + half)


def _row(name: str, counts: Counter[str], *, seconds: float | None) -> str:
    """killed: every caught mutant; ranks: those of them caught only by the cross-rank step."""
    caught = sum(counts[s] for s in CAUGHT)
    ranks = sum(counts[s] for s in CAUGHT_ACROSS_RANKS)
    survived = counts["survived"]
    other = sum(counts.values()) - caught - survived  # no tests, skipped, not checked
    score = f"{100 * caught / (caught + survived + other):.0f} %" if counts else "-"
    took = f"{seconds:.0f} s" if seconds is not None else ""
    return f"{name:34} {caught:6} {ranks:5} {survived:8} {other:5} {score:>6} {took:>6}"


if __name__ == "__main__":
    sys.exit(main())
