"""The ``adaptis`` command: verbs follow kubectl (``plan``, ``run``, ``profile``, ``crd``, ...).

Each verb lives in its own module with ``register(subparsers)``; the module is imported only
when needed so that ``adaptis plan`` never imports torch or the Kubernetes client. Logging is
configured here, once; library code only logs.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from adaptis.api.errors import SpecError

# verb -> (module, one-line help). Modules import lazily: heavy dependencies stay optional.
VERBS: dict[str, tuple[str, str]] = {
    "plan": ("adaptis.cli.plan", "plan a pipeline for a problem file and compare strategies"),
    "run": ("adaptis.cli.run", "train an AdaPtisJob manifest locally (the embedded default)"),
    "worker": ("adaptis.cli.worker", "run one pipeline rank (the worker pods' entry point)"),
    "profile": ("adaptis.cli.profile", "profile layers or hardware into a planning problem"),
    "export": ("adaptis.cli.export", "write a Hugging Face job's checkpoint for from_pretrained"),
    "crd": ("adaptis.cli.crd", "print the AdaPtisJob CustomResourceDefinition"),
    "docs": ("adaptis.cli.docs", "write the problem and AdaPtisJob references (docs/)"),
    "operator": ("adaptis.cli.operator", "run the operator (kopf) against the current cluster"),
}


class CLIError(Exception):
    """A failure to report as one line and exit status 2."""


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="adaptis", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    verb = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_) in VERBS.items():
        if name == verb:
            try:
                importlib.import_module(module).register(sub)
            except ModuleNotFoundError as err:
                print(f"adaptis {name}: missing dependency {err.name!r}: "
                      f"install the extra that provides it (pip install 'adaptis[...]')",
                      file=sys.stderr)
                return 2
        else:
            sub.add_parser(name, help=help_, add_help=False)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING - 10 * min(args.verbose, 2),  # -v: info, -vv: debug
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return int(args.func(args) or 0)
    except (SpecError, CLIError) as err:
        print(f"adaptis {args.verb}: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"adaptis {args.verb}: interrupted", file=sys.stderr)
        return 130
