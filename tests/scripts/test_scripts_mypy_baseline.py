"""scripts/mypy_baseline.py: the baseline only shrinks (the comparison and the file format; mypy not run)."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("mypy_baseline", REPO / "scripts" / "mypy_baseline.py")
assert _spec and _spec.loader
mb = importlib.util.module_from_spec(_spec)
sys.modules["mypy_baseline"] = mb
_spec.loader.exec_module(mb)


def _json(file: str, line: int, code: str | None, severity: str = "error") -> str:
    return json.dumps({"file": file, "line": line, "column": 1, "message": "m", "hint": None,
                       "code": code, "severity": severity})


def test_parse_keeps_errors_only() -> None:
    out = "\n".join([_json("a.py", 3, "arg-type"), _json("a.py", 3, None, severity="note"),
                     _json("b.py", 9, None), "Found 2 errors in 2 files"])
    errors = mb.parse_errors(out)
    assert [(e.file, e.line, e.code) for e in errors] == [("a.py", 3, "arg-type"), ("b.py", 9, "misc")]


def test_growth_and_shrinkage_are_both_reported() -> None:
    baseline = Counter({("a.py", "arg-type"): 2, ("b.py", "misc"): 1})
    current = Counter({("a.py", "arg-type"): 3, ("c.py", "operator"): 1})
    cmp = mb.compare(baseline, current)
    assert cmp.grown == {("a.py", "arg-type"): (2, 3), ("c.py", "operator"): (0, 1)}
    assert cmp.shrunk == {("b.py", "misc"): (1, 0)}
    assert not cmp.clean
    assert mb.compare(baseline, Counter(baseline)).clean


def test_the_file_round_trips_and_bad_lines_name_themselves() -> None:
    counts = Counter({("adaptis/x.py", "arg-type"): 2, ("adaptis/a.py", "misc"): 1})
    text = mb.render_baseline(counts)
    assert text.splitlines()[-2:] == ["1 adaptis/a.py [misc]", "2 adaptis/x.py [arg-type]"]
    assert mb.read_baseline(text) == counts
    with pytest.raises(SystemExit, match="baseline line 2"):
        mb.read_baseline("# header\nadaptis/x.py 2\n")


def test_the_committed_baselines_parse() -> None:
    counts = mb.read_baseline((REPO / "scripts" / "mypy-baseline.txt").read_text())
    assert counts and all(n > 0 for n in counts.values())
    # api and planner are checked by `mypy --strict`, clean: the baseline never covers them.
    assert not [f for f, _code in counts if f.startswith(("adaptis/api/", "adaptis/planner/"))]
