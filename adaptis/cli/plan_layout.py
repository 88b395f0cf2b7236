"""``adaptis plan FILE --gpus N --global-batch B``: the best data x pipeline x tensor layouts
of a GPU budget, by predicted step.

The CLI face of :mod:`adaptis.planner.layout`, reached through ``adaptis plan``
(:mod:`adaptis.cli.plan` registers the options and hands over when ``--gpus`` is given;
without it ``adaptis plan`` is unchanged). Prints the top layouts (``--top``, default 5) as an
aligned table, or with ``--json`` only the search's JSON. Exit status 0 when a layout fits,
1 when every layout is over memory (the reasons on stderr), 2 for bad usage or input.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from adaptis.api.problem import Problem

if TYPE_CHECKING:
    from adaptis.planner.layout import LayoutSearch

__all__ = ["add_arguments", "format_layouts", "run_layouts"]

EXIT_OK, EXIT_INFEASIBLE = 0, 1
# Options of the pipeline-only mode that mean nothing across layouts.
_SINGLE_PLAN_ONLY = ("compare", "strategy", "save_plan", "timeline")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return value


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(_positive(part) for part in text.split(",") if part.strip())


def _widths(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"{part!r}: write NAME=WIDTH, e.g. heads=32,kv_heads=8")
        out[key.strip()] = _positive(value)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The layout search's options of ``adaptis plan``."""
    g = p.add_argument_group("layout search (--gpus): choose R x P x T and the microbatching")
    g.add_argument("--gpus", metavar="N", type=_positive, default=None,
                   help="search the data x pipeline x tensor layouts of N GPUs of the problem's "
                        "device kind (its count, microbatches, data_parallel and "
                        "tensor_parallel are then chosen, not read)")
    g.add_argument("--global-batch", metavar="B", type=_positive, default=None,
                   help="sequences a step, over all replicas (required with --gpus)")
    g.add_argument("--min-gpus", metavar="N", type=_positive, default=None,
                   help="also consider layouts of fewer GPUs, down to this many")
    g.add_argument("--microbatch-sizes", metavar="M,M,...", type=_sizes, default=None,
                   help="microbatch sizes to try, in sequences (default every divisor of a "
                        "replica's batch up to 16)")
    g.add_argument("--profiled-microbatch", metavar="SIZE", type=_positive, default=1,
                   help="sequences a microbatch of the problem's profile holds (default 1); "
                        "times and activations scale linearly from it")
    g.add_argument("--seq-len", metavar="TOKENS", type=_positive, default=None,
                   help="tokens a sequence, for tokens/s (default: sequences/s only)")
    g.add_argument("--tensor-widths", metavar="NAME=W,...", type=_widths, default=None,
                   help="widths a tensor degree must divide (heads, kv_heads, vocabulary, MLP)")
    g.add_argument("--top", metavar="K", type=_positive, default=5,
                   help="layouts to show (and keep exact under pruning; default 5)")
    g.add_argument("--layout-time-limit", metavar="SECONDS", type=float, default=10.0,
                   help="the joint search's time limit for each layout searched (default 10)")
    g.add_argument("--exhaustive", action="store_true",
                   help="search every layout that fits its memory floor (no bound pruning)")


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f}"


def format_layouts(result: LayoutSearch, *, top: int) -> str:
    """The human view: one aligned row per layout, fastest first, then the search's counts."""
    unit = result.time_unit
    rate_head = "tokens/s" if any(r.tokens_per_s is not None for r in result.ranked) else "seq/s"
    head = ["#", "GPUs", "R", "P", "T", "m", "M", f"step ({unit})", rate_head, "peak mem GB",
            "bubble", "why not first"]
    rows = []
    for i, r in enumerate(result.ranked[:top], 1):
        lay = r.layout
        rate = r.tokens_per_s if r.tokens_per_s is not None else r.sequences_per_s
        rows.append([str(i), str(lay.gpus), str(lay.data_parallel), str(lay.pipeline), str(lay.tensor),
                     str(lay.microbatch_size), str(lay.microbatches), f"{r.step_time:,.3f}",
                     f"{rate:,.0f}" if rate >= 100 else f"{rate:.3g}", _gb(max(r.peak_memory_bytes)),
                     f"{100 * r.bubble_ratio:.1f}%", r.reason or "(best)"])
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(head)]

    def line(cells: list[str]) -> str:
        last = len(cells) - 1
        return "  ".join(c.ljust(w) if i == last else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

    floor = sum(not r.searched for r in result.refused)
    title = (f"{result.name or 'problem'}: {result.gpus} GPUs, {result.global_batch} sequences a step: "
             f"{result.enumerated} layouts, {floor} refused by their memory floor, {result.searched} "
             f"searched, {result.pruned} pruned by their step bound ({result.seconds:.1f} s)")
    out = [title, "", line(head), line(["-" * w for w in widths]), *(line(r) for r in rows)]
    if result.refused:
        first = result.refused[0]
        out += ["", f"{len(result.refused)} layouts refused over memory, e.g. "
                f"{first.layout.label()}: {first.reason}"]
    return "\n".join(out)


def run_layouts(args: argparse.Namespace, problem: Problem) -> int:
    """``adaptis plan FILE --gpus N ...``: search, print, and the exit status."""
    from adaptis.cli import CLIError
    from adaptis.planner.errors import LayoutError
    from adaptis.planner.layout import search_layouts

    if not args.layout_time_limit > 0:
        raise CLIError(f"--layout-time-limit: {args.layout_time_limit}: give a positive number of seconds")
    if args.global_batch is None:
        raise CLIError("--gpus: give --global-batch B too (sequences a step, over all replicas)")
    clash = [f"--{name.replace('_', '-')}" for name in _SINGLE_PLAN_ONLY
             if getattr(args, name, None) not in (None, False)]
    if clash:
        raise CLIError(f"--gpus: {', '.join(clash)} plan one layout; drop them, or drop --gpus")
    try:
        result = search_layouts(
            problem, gpus=args.gpus, global_batch=args.global_batch, min_gpus=args.min_gpus,
            microbatch_sizes=args.microbatch_sizes, tensor_widths=args.tensor_widths,
            profiled_microbatch=args.profiled_microbatch, sequence_length=args.seq_len,
            keep=args.top, per_layout_s=args.layout_time_limit, exhaustive=args.exhaustive,
        )
    except LayoutError as err:
        flag = {"gpus": "--gpus", "global_batch": "--global-batch", "min_gpus": "--min-gpus",
                "microbatch_sizes": "--microbatch-sizes", "tensor_widths": "--tensor-widths",
                "devices": f"{args.problem}: devices"}.get(err.argument, err.argument)
        raise CLIError(f"{flag}: {str(err).split(': ', 1)[1]}") from None
    if args.json:
        doc = result.payload()
        doc["layouts"] = doc["layouts"][: args.top]
        print(json.dumps(doc, indent=2), flush=True)
    else:
        print(format_layouts(result, top=args.top), flush=True)
    if result.best is None:
        reason = result.refused[0].reason if result.refused else "no layout was searched"
        print(f"adaptis plan: no layout of {args.gpus} GPUs fits in memory: {reason}", file=sys.stderr)
        return EXIT_INFEASIBLE
    return EXIT_OK
