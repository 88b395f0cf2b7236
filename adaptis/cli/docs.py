"""``adaptis docs``: write the format references (docs/problem.md, docs/job.md) from the models.

``adaptis docs`` regenerates the checked-in files under ``docs/``; ``--check`` exits 1 naming
every file that differs from what the models generate (the tests run it, as for ``adaptis crd``).
The rendering itself lives in :mod:`adaptis.api.reference`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "docs",
        help="write the problem and AdaPtisJob references",
        description="Write docs/problem.md and docs/job.md, generated from the api models.",
    )
    parser.add_argument(
        "directory", nargs="?", type=Path, default=Path("docs"),
        help="where the files go (default: docs)",
    )
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if a file is out of date"
    )
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from adaptis.api.reference import REFERENCES

    stale: list[Path] = []
    for name, render in REFERENCES.items():
        path = args.directory / name
        text = render()
        if args.check:
            try:
                current = path.read_text()
            except OSError:
                current = None
            if current != text:
                stale.append(path)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        where = "" if args.directory == Path("docs") else f" {args.directory}"
        for path in stale:
            print(f"adaptis docs: {path} is out of date; run `adaptis docs{where}`",
                  file=sys.stderr)
        return 1
    return 0
