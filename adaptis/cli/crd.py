"""``adaptis crd``: print the AdaPtisJob CustomResourceDefinition generated from the api models.

``adaptis crd > crds/adaptis.io_adaptisjobs.yaml`` regenerates the checked-in file; ``--check
FILE`` exits 1 when FILE differs from what the models generate (CI's drift check).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "crd",
        help="print the AdaPtisJob CustomResourceDefinition",
        description="Print the AdaPtisJob CRD (YAML) generated from adaptis.api.job.",
    )
    parser.add_argument("-o", "--output", type=Path, help="write to this file instead of stdout")
    parser.add_argument(
        "--check", type=Path, metavar="FILE", help="exit 1 if FILE differs from the generated CRD"
    )
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from adaptis.api.crd import crd_yaml

    text = crd_yaml()
    if args.check is not None:
        try:
            current = args.check.read_text()
        except OSError as err:
            print(f"adaptis crd: cannot read {args.check}: {err.strerror}", file=sys.stderr)
            return 2
        if current != text:
            print(f"adaptis crd: {args.check} is out of date; run `adaptis crd -o {args.check}`",
                  file=sys.stderr)
            return 1
        return 0
    if args.output is not None:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    return 0
