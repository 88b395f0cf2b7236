"""The package's type errors may only go away: mypy on adaptis/ against scripts/mypy-baseline.txt.

Part of `make lint` (docs/contributing.md), after `mypy --strict` on adaptis/api and
adaptis/planner, which must be clean. This runs plain mypy (pyproject's `[tool.mypy]`) on the
whole package and counts its errors per file and error code:

- a count above the baseline's (or a file or code the baseline does not list) fails, printing
  the errors of that file and code: fix them;
- a count below the baseline's fails too, saying which: the baseline is a ratchet, so shrink it
  (the same command with `--update`) in the commit that fixed them;
- equal counts pass.

Files under a `--strict-path` (adaptis/api, adaptis/planner) are left out: `mypy --strict`
checks them, and must find nothing (its `# type: ignore`s may look unused to plain mypy).

`--update` rewrites the baseline from the current errors but refuses when the total grew: moving
code between files moves its entries, fixing removes them, nothing adds one. (Without a baseline
file it writes the first one.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASELINE = REPO / "scripts" / "mypy-baseline.txt"
DEFAULT_CACHE = Path(os.environ.get("ADAPTIS_LINT_CACHE", Path.home() / ".cache" / "adaptis" / "lint")) / "mypy"
HEADER = (
    "# mypy errors per file and code that `make lint` still tolerates (scripts/mypy_baseline.py).\n"
    "# It may only shrink: fix errors, then rerun `make lint`'s mypy_baseline.py line with --update.\n"
)

Key = tuple[str, str]  # (file, error code)


@dataclass(frozen=True)
class Error:
    """One mypy error, as mypy's JSON output reports it."""

    file: str
    line: int
    code: str
    message: str

    @property
    def key(self) -> Key:
        return (self.file, self.code)


def parse_errors(output: str) -> list[Error]:
    """The errors in mypy's `--output json` (one object a line; notes are not errors)."""
    errors = []
    for line in output.splitlines():
        if not line.startswith("{"):
            continue
        entry = json.loads(line)
        if entry.get("severity") != "error":
            continue
        errors.append(Error(file=entry["file"], line=int(entry["line"]), code=entry.get("code") or "misc",
                            message=entry["message"]))
    return errors


def read_baseline(text: str) -> Counter[Key]:
    """`<count> <file> [<code>]` lines; `#` starts a comment."""
    counts: Counter[Key] = Counter()
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 3 or not parts[0].isdigit() or not (parts[2].startswith("[") and parts[2].endswith("]")):
            raise SystemExit(f"baseline line {number}: expected `<count> <file> [<code>]`, got {raw!r}")
        counts[(parts[1], parts[2][1:-1])] = int(parts[0])
    return counts


def render_baseline(counts: Counter[Key]) -> str:
    body = "".join(f"{n} {file} [{code}]\n" for (file, code), n in sorted(counts.items()) if n)
    return HEADER + body


@dataclass(frozen=True)
class Comparison:
    """Where the current errors differ from the baseline."""

    grown: dict[Key, tuple[int, int]]  # key -> (baseline, now), now > baseline
    shrunk: dict[Key, tuple[int, int]]  # key -> (baseline, now), now < baseline

    @property
    def clean(self) -> bool:
        return not self.grown and not self.shrunk


def compare(baseline: Counter[Key], current: Counter[Key]) -> Comparison:
    keys = set(baseline) | set(current)
    grown = {k: (baseline[k], current[k]) for k in keys if current[k] > baseline[k]}
    shrunk = {k: (baseline[k], current[k]) for k in keys if current[k] < baseline[k]}
    return Comparison(grown=grown, shrunk=shrunk)


def run_mypy(*, cache_dir: Path, targets: list[str], strict: bool) -> list[Error]:
    flags = ["--strict"] if strict else []
    command = [sys.executable, "-m", "mypy", *flags, "--cache-dir", str(cache_dir), "--output", "json", *targets]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
    if proc.returncode not in (0, 1):  # 2: mypy itself failed (bad config, crash)
        raise SystemExit(f"mypy failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return parse_errors(proc.stdout)


def report(comparison: Comparison, errors: list[Error]) -> str:
    lines = []
    for key, (was, now) in sorted(comparison.grown.items()):
        lines.append(f"mypy: {key[0]} [{key[1]}]: {now} errors, the baseline allows {was}; fix these:")
        lines += [f"  {e.file}:{e.line}: {e.message}  [{e.code}]" for e in errors if e.key == key]
    for key, (was, now) in sorted(comparison.shrunk.items()):
        lines.append(f"mypy: {key[0]} [{key[1]}]: {now} errors, the baseline says {was}: "
                     "shrink it (rerun this command with --update)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--update", action="store_true", help="rewrite the baseline (refused if the total grew)")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="mypy's cache (default: %(default)s)")
    parser.add_argument("--baseline", type=Path, default=BASELINE, help="the baseline file (default: %(default)s)")
    parser.add_argument("--strict", action="store_true", help="run mypy --strict")
    parser.add_argument("--strict-path", action="append", default=[],
                        help="leave out the errors under this path (checked by mypy --strict); repeatable")
    parser.add_argument("targets", nargs="*", default=["adaptis"], help="what mypy checks (default: adaptis)")
    args = parser.parse_args(argv)
    baseline_file: Path = args.baseline.resolve()

    errors = run_mypy(cache_dir=args.cache_dir, targets=args.targets, strict=args.strict)
    strict_paths = tuple(p.rstrip("/") + "/" for p in args.strict_path)
    errors = [e for e in errors if not e.file.startswith(strict_paths)] if strict_paths else errors
    current = Counter(e.key for e in errors)
    baseline = read_baseline(baseline_file.read_text()) if baseline_file.exists() else Counter()
    if args.update:
        if baseline_file.exists() and current.total() > baseline.total():
            print(report(compare(baseline, current), errors), file=sys.stderr)
            print(f"mypy: {current.total()} errors, the baseline has {baseline.total()}: fix the new ones "
                  "instead of adding them to the baseline", file=sys.stderr)
            return 1
        baseline_file.write_text(render_baseline(current))
        print(f"mypy: baseline written: {current.total()} errors (was {baseline.total()})")
        return 0
    comparison = compare(baseline, current)
    if not comparison.clean:
        print(report(comparison, errors), file=sys.stderr)
        return 1
    print(f"mypy: {current.total()} errors, as the baseline allows ({baseline_file.relative_to(REPO)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
