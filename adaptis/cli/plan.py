"""``adaptis plan FILE``: plan a pipeline for a planning problem and compare the strategies.

The CLI face of :mod:`adaptis.planner.strategies`. Reads the contract's problem file
(docs/problem.md), runs one strategy (``--strategy``, default ``adaptis``) or all
of them (``--compare``), and prints either exactly the contract's JSON (``--json``: nothing
else on stdout) or an aligned table. ``--save-plan`` writes the chosen strategy's plan (with
``--compare`` and no ``--strategy``: adaptis's) and ``--timeline`` draws it. A search that
runs longer than about a second shows one updating progress line on a terminal's stderr (a
log line when it ends otherwise). Bad input is one line per fault and exit status 2; a
requested strategy (default adaptis, with ``--compare`` too) that has no plan fitting in memory
is exit status 1 after the report, with the memory it needs per device on stderr. With
``--gpus N --global-batch B`` it searches the layouts of N GPUs instead
(:mod:`adaptis.cli.plan_layout`).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from adaptis.api.errors import SpecError
from adaptis.api.plan import STRATEGY_NAMES, Comparison, StrategyResult
from adaptis.api.problem import Problem, load_problem

__all__ = ["ProgressLine", "format_table", "register", "run"]

log = logging.getLogger(__name__)

# Exit statuses scripts can branch on (also in the --help epilog): 0 the requested strategy
# (default adaptis, also under --compare) has a plan that fits; 1 it has none (the table or
# JSON is still printed, stderr says how much memory it would need); 2 bad usage or input,
# including a strategy that cannot apply to the problem at all (too few layers): a CLIError,
# which adaptis.cli.main turns into 2 as for every verb.
EXIT_OK, EXIT_INFEASIBLE = 0, 1
_EPILOG = ("exit status: 0 the requested strategy (default adaptis; with --compare too) has a "
           "plan that fits; 1 it is infeasible (the report is still printed; stderr says the "
           "memory it needs per device); 2 bad usage or input")

# The CLI's planning deadline unless --time-limit says otherwise: 64 devices x 512
# microbatches plan in about 5 s of CPU (bench/RESULTS.md, "Planner scale"), so only far
# larger problems reach it, and they still get a plan (the best found so far) instead of a
# wait of unknown length. The operator passes spec.planner.timeLimitSeconds instead.
DEFAULT_TIME_LIMIT_S = 60.0

# Searches shorter than this show no progress at all: a flicker helps no one.
_PROGRESS_AFTER_S = 1.0
_REDRAW_EVERY_S = 0.1


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "plan", help="plan a pipeline for a problem file and compare strategies",
        description=__doc__.splitlines()[0], epilog=_EPILOG,
    )
    p.add_argument("problem", metavar="FILE", help="planning problem, YAML or JSON (the contract's input)")
    p.add_argument("--compare", action="store_true", help="run every strategy of the contract")
    p.add_argument("--strategy", choices=STRATEGY_NAMES, default=None,
                   help="the strategy to plan with (default adaptis); with --compare: the one "
                        "--save-plan and --timeline use")
    p.add_argument("--json", action="store_true", help="print the contract's JSON, nothing else")
    p.add_argument("--save-plan", metavar="PLAN.json", type=Path,
                   help="write the chosen strategy's plan (replayable; what the workers run)")
    p.add_argument("--timeline", metavar="OUT.png|OUT.svg", type=Path,
                   help="draw the chosen plan as a per-device timeline")
    p.add_argument("--time-limit", metavar="SECONDS", type=_seconds, default=DEFAULT_TIME_LIMIT_S,
                   help="stop planning after about this long and keep the best plan found so "
                        "far (or the best baseline); the report says when it was cut short "
                        f"(default {DEFAULT_TIME_LIMIT_S:g}; 'none': no limit)")
    from adaptis.cli.plan_layout import add_arguments

    add_arguments(p)  # --gpus N --global-batch B: the layout search (adaptis.cli.plan_layout)
    p.set_defaults(func=run)


class ProgressLine:
    """The ``on_progress(evals, budget, best)`` callback of the search, shown on ``stream``.

    On a terminal: one line redrawn in place once the search has run ``_PROGRESS_AFTER_S``,
    erased when it ends. Elsewhere (a pipe, a CI log): nothing while running, one log
    line at the end if the search was long enough to care.
    """

    def __init__(self, *, stream: TextIO, time_unit: str,
                 clock: Callable[[], float] = time.monotonic, tty: bool | None = None) -> None:
        self._stream = stream
        self._unit = time_unit
        self._clock = clock
        self._tty = stream.isatty() if tty is None else tty
        self._t0 = clock()
        self._drawn_at = -math.inf
        self._shown = False
        self._last: tuple[int, int, float] | None = None

    # planner.strategies.Progress: the search calls it positionally (evals, budget, best).
    def __call__(self, evals: int, budget: int, best: float) -> None:  # noqa: PLR0917 - Progress's signature
        self._last = (evals, budget, best)
        now = self._clock()
        if not self._tty or now - self._t0 < _PROGRESS_AFTER_S or now - self._drawn_at < _REDRAW_EVERY_S:
            return
        self._drawn_at = now
        self._shown = True
        self._stream.write(f"\r\033[Ksearching: {self._text(now)}")
        self._stream.flush()

    def _text(self, now: float) -> str:
        evals, budget, best = self._last or (0, 0, math.inf)
        shown = "none yet" if math.isinf(best) else f"{_num(best)} {self._unit}"
        return f"{evals}/{budget} candidates, best {shown}, {now - self._t0:.1f} s"

    def finish(self) -> None:
        now = self._clock()
        if self._shown:
            self._stream.write("\r\033[K")
            self._stream.flush()
        if not self._tty and self._last is not None and now - self._t0 >= _PROGRESS_AFTER_S:
            log.info("search done: %s", self._text(now))


# --- formatting -------------------------------------------------------------------------------
def _num(x: float) -> str:
    """About five significant digits without an exponent for the sizes times come in."""
    if abs(x) >= 100:
        return f"{x:,.1f}"
    if abs(x) >= 1:
        return f"{x:.3f}"
    return f"{x:.4g}"


def _first_reason(reason: str | None) -> str:
    """The first of a reason's ``; ``-separated parts (the JSON keeps them all)."""
    parts = (reason or "no reason given").split("; ")
    return parts[0] + (f" (and {len(parts) - 1} more)" if len(parts) > 1 else "")


def _speedup(adaptis: StrategyResult | None, other: StrategyResult, *, step: bool = False) -> str:
    """``other``'s time over adaptis's: of the step where the search minimised the step."""
    ours = None if adaptis is None else adaptis.step_time if step else adaptis.iteration_time
    theirs = other.step_time if step else other.iteration_time
    if adaptis is None or not adaptis.feasible or not ours:
        return "-"
    if not other.feasible or theirs is None:
        return "-"
    return f"{theirs / ours:.2f}x"


def format_table(comparison: Comparison, *, problem: Problem) -> str:
    """The human view of a comparison: one aligned row per strategy, then notes."""
    unit = comparison.time_unit
    adaptis = comparison.strategies.get("adaptis")
    with_speedup = adaptis is not None and len(comparison.strategies) > 1
    head = ["strategy", "feasible", f"iteration ({unit})", "bubble", "stages", "peak mem GB", "search s"]
    if with_speedup:
        head.insert(4, "adaptis speedup")
    # The whole step (all-reduce, optimizer) only where it differs from the pipeline.
    with_step = any(r.post_pipeline_time for r in comparison.strategies.values())
    if with_step:
        head.insert(3, f"step ({unit})")
    rows: list[list[str]] = []
    notes: list[str] = []
    for name, r in comparison.strategies.items():
        row = [
            name,
            "yes" if r.feasible else "no",
            "-" if r.iteration_time is None else _num(r.iteration_time),
            "-" if r.bubble_ratio is None else f"{100 * r.bubble_ratio:.1f}%",
            "-" if r.stages is None else str(r.stages),
            "-" if not r.peak_memory_bytes else f"{max(r.peak_memory_bytes) / 1e9:.1f}",
            "-" if r.search_seconds is None else f"{r.search_seconds:.2f}",
        ]
        if with_speedup:
            row.insert(4, "-" if name == "adaptis" else _speedup(adaptis, r, step=problem.scores_step))
        if with_step:
            row.insert(3, "-" if r.step_time is None else _num(r.step_time))
        rows.append(row)
        if not r.feasible:
            notes.append(f"note: {name} is infeasible: {_first_reason(r.reason)}")
        if r.cut_short:
            notes.append(f"note: {name} was cut short by --time-limit: {r.cut_short}")
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]

    def line(cells: list[str]) -> str:
        # Names left, figures right: columns of numbers read best right-aligned.
        pairs = enumerate(zip(cells, widths, strict=False))
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in pairs)

    layers = len(problem.expanded_layers())
    replicas = f" x {problem.data_parallel} replicas" if problem.data_parallel > 1 else ""
    title = (f"{comparison.name or 'problem'}: {layers} layers, {problem.device_count} devices"
             f"{replicas}, {problem.microbatches} microbatches")
    out = [title, "", line(head), line(["-" * w for w in widths]), *(line(r) for r in rows), ""]
    bound = f"lower bound: {_num(comparison.lower_bound)} {unit}"
    if adaptis is not None and adaptis.feasible and adaptis.iteration_time and comparison.lower_bound > 0:
        bound += f" (adaptis at {adaptis.iteration_time / comparison.lower_bound:.3f}x of it)"
    out.append(bound)
    if problem.scores_step:
        why = (f"data_parallel {problem.data_parallel}" if problem.objective == "auto"
               else "objective: step")
        out.append(f"objective: the step ({why}): adaptis minimised the iteration plus the "
                   "all-reduce it does not hide plus the optimizer; the speedup is of the step")
    out += notes
    return "\n".join(out)


# --- the command ------------------------------------------------------------------------------
def _seconds(text: str) -> float | None:
    if text.strip().lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds (or 'none')")
    return value


def _load(path: str) -> Problem:
    """The problem, or a CLIError of one line per fault (YAML parse errors span several)."""
    from adaptis.cli import CLIError

    try:
        return load_problem(path)
    except SpecError as err:
        merged: list[str] = []
        for text in str(err).splitlines():
            if merged and not text.startswith("problem:"):
                merged[-1] += " " + " ".join(text.split())
            else:
                merged.append(text)
        raise CLIError("\n".join(merged)) from None


def _emit(text: str) -> None:
    """Print the report; a reader that stops early (``| head``) must not stop the plan being saved."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # Python's documented remedy: point stdout at devnull so the exit flush cannot fail too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def run(args: argparse.Namespace) -> int:
    from adaptis.cli import CLIError
    from adaptis.planner.costs import Costs
    from adaptis.planner.errors import PlannerError
    from adaptis.planner.strategies import compare, lower_bound, plan_strategy

    problem = _load(args.problem)
    if args.gpus is not None:
        from adaptis.cli.plan_layout import run_layouts

        return run_layouts(args, problem)
    chosen = args.strategy or "adaptis"
    progress = ProgressLine(stream=sys.stderr, time_unit=problem.time_unit)
    try:
        if args.compare:
            comparison, outcomes = compare(problem, on_progress=progress,
                                           time_limit_s=args.time_limit)
        else:
            outcome = plan_strategy(problem, chosen, on_progress=progress,
                                    time_limit_s=args.time_limit)
            outcomes = {chosen: outcome}
            comparison = Comparison(
                name=problem.name, time_unit=problem.time_unit,
                lower_bound=lower_bound(Costs.from_problem(problem)),
                strategies={chosen: outcome.result},
            )
    except PlannerError as err:
        raise CLIError(f"strategy {chosen}: {err}") from None
    finally:
        progress.finish()

    _emit(json.dumps(comparison.payload(), indent=2) if args.json else format_table(comparison, problem=problem))

    outcome = outcomes[chosen]
    if args.timeline is not None:
        if outcome.simulation is None:
            raise CLIError(f"--timeline: strategy {chosen} has no plan: {outcome.result.reason}")
        from adaptis.planner.timeline import draw_timeline

        try:
            draw_timeline(outcome.simulation, path=args.timeline,
                          title=f"{problem.name or Path(args.problem).stem}: {chosen}",
                          time_unit=problem.time_unit, plan=outcome.plan, problem=problem)
        except PlannerError as err:
            raise CLIError(str(err)) from None
        except OSError as err:
            raise CLIError(f"--timeline: cannot write {args.timeline}: {err.strerror}") from None
    if not outcome.result.feasible:
        # The report above is complete; the status is what a script branches on (1: nothing
        # of the requested strategy fits), and stderr says why in full, memory per device.
        unsaved = " (--save-plan: nothing written)" if args.save_plan is not None else ""
        print(f"adaptis plan: strategy {chosen} is infeasible: {outcome.result.reason}{unsaved}",
              file=sys.stderr)
        return EXIT_INFEASIBLE
    if args.save_plan is not None:
        if outcome.plan is None:
            raise CLIError(f"--save-plan: strategy {chosen} has no plan: {outcome.result.reason}")
        try:
            args.save_plan.parent.mkdir(parents=True, exist_ok=True)
            args.save_plan.write_text(outcome.plan.to_json() + "\n")
        except OSError as err:
            raise CLIError(f"--save-plan: cannot write {args.save_plan}: {err.strerror}") from None
        print(f"plan of {chosen} written to {args.save_plan}", file=sys.stderr)
    return EXIT_OK
