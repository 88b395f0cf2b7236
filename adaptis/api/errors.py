"""The api layer's error vocabulary: one exception that names the offending field.

Every loader of user input (a planning problem, a plan, an AdaPtisJob) turns pydantic's
``ValidationError`` into a :class:`SpecError` whose message is one line per problem, each
starting with the dotted path of the field (``layers[3].forward: ...``), so the CLI and the
operator can show it as it is.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

__all__ = ["SpecError", "field_path", "from_validation_error", "read_document"]

# Tags used by discriminated unions; pydantic puts them in the error location, users never
# wrote them, so they are dropped from the path shown.
_UNION_TAGS = frozenset({"layer-entry", "repeat-block", "identical-devices", "device-list"})


class SpecError(ValueError):
    """User input that does not follow the contract. ``fields`` are the dotted paths at fault."""

    def __init__(self, message: str, *, fields: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.fields: tuple[str, ...] = tuple(fields)


def field_path(loc: Iterable[Any]) -> str:
    """Render a pydantic location tuple as ``a.b[3].c``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _UNION_TAGS or part == "[key]" or str(part).startswith("function-"):
            # "[key]": pydantic's mark of a map's key (the message says it is the key)
            continue
        else:
            out += f".{part}" if out else str(part)
    return out or "<root>"


def from_validation_error(err: ValidationError, *, what: str) -> SpecError:
    """One line per error: ``<what>: <field>: <message> (got <input>)``."""
    lines: list[str] = []
    fields: list[str] = []
    for item in err.errors(include_url=False):
        path = field_path(item["loc"])
        fields.append(path)
        msg = item["msg"]
        if item["type"] == "extra_forbidden":
            msg = "unknown key (remove it or check its spelling)"
        elif item["type"] == "missing":
            msg = "required key is missing"
        given = item.get("input")
        shown = "" if item["type"] in {"missing", "extra_forbidden"} else f" (got {given!r:.60})"
        lines.append(f"{what}: {path}: {msg}{shown}")
    return SpecError("\n".join(lines), fields=fields)


def read_document(path: str | Path, *, what: str) -> Any:
    """The YAML (or, by suffix, JSON) document at ``path``; a missing file or bad syntax is a
    :class:`SpecError` starting with ``what``, like every other user-input error."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as err:
        raise SpecError(f"{what}: cannot read {p}: {err.strerror}") from None
    try:
        return json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError) as err:
        raise SpecError(f"{what}: {p} is not valid YAML/JSON: {' '.join(str(err).split())}") from None
