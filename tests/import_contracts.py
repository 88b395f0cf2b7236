"""An import contract import-linter has no type for: no submodule of an external package.

Read by ``lint-imports`` (``contract_types`` in pyproject.toml's ``[tool.importlinter]``) beside
the built-in contracts, and so checked by ``tests/test_layers.py`` and ``make lint``.
import-linter squashes an external package into its top level (``torch``), so its forbidden
contract can keep a room off torch but not off ``torch.distributed``; this contract reads the
import lines themselves. A source module breaks it when it, or any of our modules it imports
directly or not, imports a forbidden submodule (``import torch.distributed``,
``from torch.distributed import ...``, ``from torch import distributed``).
"""

from __future__ import annotations

import re
from typing import Any

from importlinter import Contract, ContractCheck, fields, output

__all__ = ["ForbiddenSubmodulesContract"]


class ForbiddenSubmodulesContract(Contract):
    """``source_modules`` (with their subpackages) must not reach ``forbidden_modules``,
    dotted names of external submodules such as ``torch.distributed``."""

    type_name = "forbidden_submodules"

    source_modules = fields.ListField(subfield=fields.StringField())
    forbidden_modules = fields.ListField(subfield=fields.StringField())

    def check(self, graph: Any, verbose: bool) -> ContractCheck:
        root = self.session_options["root_packages"][0]
        sources: set[str] = set()
        for module in self.source_modules:  # type: ignore[attr-defined]
            sources |= {module} | graph.find_descendants(module)
        reached = set(sources)
        for module in sources:
            reached |= {m for m in graph.find_upstream_modules(module) if m.split(".")[0] == root}
        violations = []
        for forbidden in self.forbidden_modules:  # type: ignore[attr-defined]
            top, _, rest = forbidden.partition(".")
            parent, _, last = forbidden.rpartition(".")
            line = re.compile(rf"(?:^|\s)(?:import|from)\s+{re.escape(forbidden)}\b"
                              rf"|from\s+{re.escape(parent)}\s+import\s+.*\b{re.escape(last)}\b")
            for importer in sorted(reached):
                if not rest or top not in graph.find_modules_directly_imported_by(importer):
                    continue
                for detail in graph.get_import_details(importer=importer, imported=top):
                    if line.search(detail["line_contents"]):
                        violations.append((importer, detail["line_number"], detail["line_contents"]))
        return ContractCheck(kept=not violations, metadata={"violations": violations})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for importer, line_number, contents in check.metadata["violations"]:
            output.print_error(f"{importer}:{line_number}: {contents}", bold=False)
            output.new_line()
