"""An import-linter contract type for a rule the built-in ones cannot say: "X is imported only here".

The built-in `forbidden` contract names who may *not* import a package, so a list of the others has to
be kept by hand, and a new module falls through it. `confined` names who *may*: every other importer,
today's or tomorrow's, breaks the contract. `just lint` uses it for the libraries that mark a layer's
edge: NATS (the bus's transports and the modules that wire a process to the bus), LMDB (the worker's
op log), aiohttp (the HTTP API), typer and rich (the CLI).

    [[tool.importlinter.contracts]]
    type = "confined"
    modules = ["typer", "rich"]
    allowed_importers = ["orchestrator.cli.**"]

A pattern is a module name, `pkg.*` (its direct children) or `pkg.**` (everything below it).
"""

from __future__ import annotations

import fnmatch
from typing import Any, cast

from importlinter import Contract, ContractCheck, fields, output


def _matches(module: str, pattern: str) -> bool:
    if pattern.endswith(".**"):
        base = pattern[:-3]
        return module == base or module.startswith(base + ".")
    if pattern.endswith(".*"):
        base = pattern[:-2]
        return module.startswith(base + ".") and "." not in module[len(base) + 1 :]
    return fnmatch.fnmatchcase(module, pattern)


class ConfinedContract(Contract):  # type: ignore[misc]  # import-linter's base class is untyped
    """External modules that only the allowed importers may import directly."""

    type_name = "confined"

    modules = fields.ListField(subfield=fields.StringField())
    allowed_importers = fields.ListField(subfield=fields.StringField())

    def _patterns(self) -> list[str]:
        return cast("list[str]", self.allowed_importers)  # once parsed, a field holds its value

    def check(self, graph: Any, verbose: bool) -> ContractCheck:
        found: list[dict[str, str]] = []
        for external in cast("list[str]", self.modules):
            for importer in sorted(graph.find_modules_that_directly_import(external)):
                if not any(_matches(importer, pattern) for pattern in self._patterns()):
                    details = graph.get_import_details(importer=importer, imported=external)
                    line = details[0]["line_number"] if details else "?"
                    found.append({"importer": importer, "imported": external, "line": str(line)})
        return ContractCheck(kept=not found, metadata={"found": found})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for row in check.metadata["found"]:
            output.print_error(
                f"{row['importer']} (line {row['line']}) imports {row['imported']}, which is confined to "
                + ", ".join(self._patterns())
            )
            output.new_line()
