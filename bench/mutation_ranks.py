"""The cross-rank step of bench/mutation.py (issue 18): a worker module's surviving mutants
against its multi-process gloo tests.

mutmut runs each mutant's selected tests in a process where that mutant is active, but the
worker's multi-rank tests run their ranks in spawned processes of their own (real gloo groups),
and a minute each is too much for every mutant of a module. So after mutmut's run, each mutant
that is not caught is run again, in the same scratch copy, against the module's named
multi-process tests (``CROSS_RANK``, the smallest cases that reach its cross-rank code), with
the mutant active in every rank:

- mutmut 3.8.1's trampolines pick the active mutant from the ``MUTANT_UNDER_TEST`` environment
  variable, which the spawned ranks (and any ``python -m adaptis`` a test starts) inherit;
- ``PYTHONPATH`` puts the scratch copy's ``mutants/`` tree first on every process's path (the
  venv's editable install is a meta-path finder consulted after ``sys.path``).

Before any mutant the step checks both, or stops: the tests pass with no mutant active (else
every survivor would count as caught), and fail with mutmut's ``fail`` sentinel active (every
trampoline raises then: proof the ranks run the mutated tree, not the checkout). A mutant whose
tests fail is "killed across ranks"; one that makes them run past the deadline (three times the
unmutated run, at least a minute more) or their ranks past the tests' own deadline, twice, the
second time with twice the deadline (the machine is shared and may be paused: a slow run is not
yet a hang), is "timeout across ranks". pytest's own errors (usage, collection) count as not
caught.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

_PARITY = "tests/worker/test_worker_parity.py::test_pipeline_step_equals_single_process[2-1f1b]"
_REPLICAS = "tests/worker/test_worker_data_parallel.py::test_replicas_train_as_one_process[adaptis-zero1]"
# The same run with the plan's ZeRO-0 case beside it: the state each replica's shard holds.
_SHARDS = "tests/worker/test_worker_data_parallel.py::test_zero1_shards_the_optimizer_state[adaptis]"
_IDLE = "tests/worker/test_worker_idle_ranks.py::test_idle_rank_plan_equals_single_process[idle-middle]"
_AGREE = "tests/worker/test_worker_checkpoint.py::test_resume_step_is_the_newest_every_rank_has"
_TIED_HF = "tests/worker/test_worker_reshard.py::test_a_tied_hugging_face_head_moves_off_its_embeddings_rank"
_BF16 = "tests/worker/test_worker_precision_ranks.py::test_bf16_tracks_fp32_reports_the_rate_and_resumes_the_same_curve"
_ZERO_RESHARD = "tests/worker/test_worker_reshard.py::test_zero_shards_reshard_to_one_replica_and_back"
_MOE = "tests/worker/test_worker_blocks_parity.py::test_pipelined_features_equal_the_reference[zb-h1]"

#: Worker module -> function (as ``Class.method`` or ``function``) -> the multi-process tests
#: that reach what it does across ranks, one case each where a file has many (their fixtures
#: spawn ranks only for the selected cases: worker_harness.selected_cases), fastest first. A
#: function not named here has nothing that only several ranks see: its survivors stay.
#: _PARITY: 2 ranks, the embedding and its tied head apart (the tied exchange, the pipeline
#: norm). _REPLICAS: 2 replicas x 2 ranks, ZeRO-1, clipping binding, 3 AdamW steps (the
#: reducer, the sharded optimizer, the replicas' loss, the norm over one pipeline); _SHARDS
#: adds its ZeRO-0 case (does each replica hold its share of the optimizer state). _IDLE: 3
#: ranks, the middle one idle. _AGREE: 3 ranks agreeing on the newest step each has.
#: _TIED_HF: a tied Hugging Face head moved off its embedding's rank by a new partition.
#: _BF16: 2 ranks in bf16 against fp32 (what crosses between ranks is bf16), both saving a
#: checkpoint every 4 steps into the same step directories, then resumed; ~15 s.
#: _MOE: 2 ranks of MoE blocks with a load-balancing loss against the one-process reference
#: (which adds that loss its own way), ~30 s.
#: _ZERO_RESHARD: ZeRO-1 on 2 replicas x 2 ranks saves (every rank writes its optimizer shard),
#: resumed on one replica and back.
CROSS_RANK: dict[str, dict[str, tuple[str, ...]]] = {
    "adaptis/worker/runtime/executor.py": {
        "Executor.__init__": (_PARITY, _IDLE, _REPLICAS, _SHARDS, _BF16, _MOE),
        "Executor.step": (_PARITY, _IDLE, _REPLICAS),
        "Executor._clip": (_PARITY, _REPLICAS),
        "Executor._runtime": (_PARITY, _IDLE, _MOE),
        "Executor._tie_embeddings": (_PARITY,),
        "Executor._sync_tied": (_PARITY,),
        "Executor._tied_weight": (_PARITY,),
        "Executor._head_weight": (_PARITY,),
    },
    "adaptis/worker/runtime/components.py": {
        "make_optimizer": (_REPLICAS, _SHARDS),
        "build_optimizer": (_REPLICAS, _SHARDS),
        "build_reducer": (_REPLICAS,),
    },
    "adaptis/worker/state/checkpoint.py": {
        "agree_resume_step": (_AGREE,),
        "save_checkpoint": (_BF16,),
        "savers": (_ZERO_RESHARD,),
        "_tied_alias": (_TIED_HF,),
        "load_checkpoint": (_TIED_HF,),
    },
}


def function_of(mutant: str) -> str:
    """``adaptis.worker.runtime.executor.xǁExecutorǁ_clip__mutmut_3`` -> ``Executor._clip``;
    ``...checkpoint.x__tied_alias__mutmut_1`` -> ``_tied_alias`` (mutmut's mangled names)."""
    mangled = mutant.rpartition("__mutmut_")[0].rpartition(".")[2]
    if mangled.startswith("xǁ"):
        return ".".join(mangled[2:].split("ǁ"))
    return mangled.removeprefix("x_")


#: The statuses this step gives a mutant it catches (bench/mutation.py counts them as caught).
CAUGHT_ACROSS_RANKS = {"killed across ranks", "timeout across ranks"}


@dataclass(frozen=True)
class RankTests:
    """One module's multi-process tests, run in a scratch copy's ``mutants/`` tree."""

    work: Path
    tests: tuple[str, ...]
    log: Path

    def run(self, *, mutant: str | None, timeout_s: float) -> tuple[str, float]:
        """("passed" | "failed" | "hang" | "timeout" | "error <exit code>", wall seconds) of one
        run; "hang": a test failed on its ranks' own deadline (worker_harness.run_ranks)."""
        env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "MUTANT_UNDER_TEST"}}
        env["PYTHONPATH"] = str(self.work / "mutants")
        if mutant is not None:
            env["MUTANT_UNDER_TEST"] = mutant
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
               "-m", "not integration and not slow", *self.tests]
        start = time.monotonic()
        offset = self.log.stat().st_size if self.log.exists() else 0
        with self.log.open("a") as log:
            log.write(f"\n=== {mutant or 'no mutant'} (deadline {timeout_s:.0f} s)\n")
            log.flush()
            # A session of its own: on the deadline, the ranks go with pytest.
            proc = subprocess.Popen(cmd, cwd=self.work / "mutants", env=env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return "timeout", time.monotonic() - start
            finally:
                _kill_leftovers(proc.pid)
        took = time.monotonic() - start
        # 1: a test failed; < 0: pytest itself died of a signal (a crashing mutant, as mutmut's
        # "segfault"). 2-5 are pytest's interrupted, internal, usage and no-tests errors.
        if code == 0:
            return "passed", took
        if code == 1 or code < 0:
            with self.log.open("rb") as log:
                log.seek(offset)
                hung = _HANG in log.read()
            return "hang" if hung else "failed", took
        return f"error {code}", took


#: How worker_harness.run_ranks reports ranks past its deadline: a hang, or a machine that was
#: paused (the lead's benchmarks SIGSTOP other work): tried again before it counts.
_HANG = b"ranks did not finish within"


def _kill_leftovers(pgid: int) -> None:
    """Ranks a finished pytest left behind (a test that failed mid-spawn)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def cross_rank(*, module: str, work: Path, mutants: list[str], log: Path) -> dict[str, str]:
    """Each of ``mutants`` (not caught by mutmut's run) whose function ``CROSS_RANK`` names,
    against that function's multi-process tests; returns the new status of those caught."""
    tests_of = CROSS_RANK[module]
    todo = [n for n in mutants if function_of(n) in tests_of]
    if not todo:
        return {}
    everything = tuple(dict.fromkeys(t for tests in tests_of.values() for t in tests))
    whole = RankTests(work=work, tests=everything, log=log)
    status, took = whole.run(mutant=None, timeout_s=3600)
    if status == "hang":
        status, took = whole.run(mutant=None, timeout_s=3600)
    if status != "passed":
        raise SystemExit(f"{module}: the cross-rank tests {status} with no mutant active; see {log}")
    # Three times the unmutated run of all of them, at least a minute more: a paused (shared)
    # machine must not turn a survivor into a "timeout".
    deadline = max(3 * took, took + 60)
    sentinel, _ = whole.run(mutant="fail", timeout_s=deadline)
    if sentinel in {"timeout", "hang"}:
        sentinel, _ = whole.run(mutant="fail", timeout_s=2 * deadline)
    if sentinel != "failed":
        raise SystemExit(f"{module}: the cross-rank tests {sentinel} with mutmut's 'fail' sentinel active: "
                         f"their ranks do not run the scratch copy's mutants; see {log}")
    print(f"  cross-rank: {len(todo)} of {len(mutants)} mutants, all tests unmutated {took:.0f} s, "
          f"deadline {deadline:.0f} s", flush=True)
    caught: dict[str, str] = {}
    for i, name in enumerate(todo, 1):
        tests = RankTests(work=work, tests=tests_of[function_of(name)], log=log)
        status, took = tests.run(mutant=name, timeout_s=deadline)
        if status in {"timeout", "hang"}:  # again, with more time: the machine may have been paused
            status, took = tests.run(mutant=name, timeout_s=2 * deadline)
        if status == "failed":
            caught[name] = "killed across ranks"
        elif status in {"timeout", "hang"}:
            caught[name] = "timeout across ranks"
        print(f"  cross-rank {i}/{len(todo)} {name}: {caught.get(name, status)} ({took:.0f} s)", flush=True)
    return caught
