"""The operator writes condition types and reasons only through :mod:`adaptis.api.conditions`.

A scan of ``adaptis/operator``'s source (its syntax trees, not a grep): no ``.condition(...)``
call names its type as a string literal, no ``reason=`` argument or ``reason =`` class
attribute is one, and no Event tuple ``("Normal" | "Warning", <reason>, message)`` spells its
reason. A string the enums do not hold can then only come from outside (a kubelet's reason).
"""

from __future__ import annotations

import ast
from pathlib import Path

import adaptis.operator
from adaptis.api.conditions import ConditionType, Reason

_ROOT = Path(adaptis.operator.__file__).parent
_EVENT_TYPES = {"Normal", "Warning"}


def _literal(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _spelled(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, literal) of every condition type or reason written as a string in ``tree``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if (isinstance(func, ast.Attribute) and func.attr == "condition" and node.args
                    and (s := _literal(node.args[0])) is not None):
                found.append((node.lineno, s))
            found += [(k.value.lineno, s) for k in node.keywords
                      if k.arg == "reason" and (s := _literal(k.value)) is not None]
        elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "reason" for t in node.targets):
            if (s := _literal(node.value)) is not None:
                found.append((node.lineno, s))
        elif (isinstance(node, ast.Tuple) and len(node.elts) == 3
                and _literal(node.elts[0]) in _EVENT_TYPES and (s := _literal(node.elts[1])) is not None):
            found.append((node.lineno, s))
    return found


def test_no_operator_module_spells_a_condition_type_or_reason() -> None:
    spelled = [f"{path.relative_to(_ROOT)}:{line}: {text!r}"
               for path in sorted(_ROOT.rglob("*.py"))
               for line, text in _spelled(ast.parse(path.read_text(), filename=str(path)))]
    assert spelled == [], "use adaptis.api.conditions.ConditionType/Reason:\n" + "\n".join(spelled)


def test_the_scan_finds_what_it_looks_for() -> None:
    source = ('p.condition("Running", "True", reason=Reason.STARTING)\n'
              'p.condition(ConditionType.RUNNING, "True", reason="Starting")\n'
              'class E:\n    reason = "Oops"\n'
              'p.events.append(("Warning", "Oops", "m"))\n'
              'p.events.append(("Warning", Reason.DRIFT, "m"))\n')
    assert _spelled(ast.parse(source)) == [(1, "Running"), (2, "Starting"), (4, "Oops"), (5, "Oops")]


def test_the_vocabularies_hold_distinct_camel_case_words() -> None:
    for enum in (ConditionType, Reason):
        values = [m.value for m in enum]
        assert len(values) == len(set(values)), enum.__name__
        assert all(v[:1].isupper() and v.isalnum() for v in values), enum.__name__
