"""Import-linter contract types of our own (registered in ``pyproject.toml``, run by ``lint-imports``).

``private_modules_only_through``: the modules of ``importers`` may import a private module of
``package`` (one whose dotted name has a part starting with ``_``, e.g. ``torch._inductor`` or
``torch.distributed._functional_collectives``) only if they are one of ``allowed_importers`` (or
inside one of them: a package allows its modules).
Import-linter's own contracts cannot say this: a module expression cannot match "every module
whose name starts with an underscore". The package must be one of the root packages, so its
modules are in the graph. ``ignore_imports`` lists exceptions (each with its reason, in the
contract's comment). What it cannot see: a private module reached as an attribute of a public
one (``torch._ops.OpOverload`` after ``import torch``); ``torch_compat`` is where those live too,
and review is what keeps them there.
"""

from __future__ import annotations

import grimp
from importlinter import Contract, ContractCheck, fields, output
from importlinter.application import contract_utils
from importlinter.domain import helpers


def is_private(module: str) -> bool:
    """Whether a dotted module name has a part starting with ``_`` (not a ``__dunder__`` part)."""
    return any(part.startswith("_") and not part.endswith("__") for part in module.split("."))


class PrivateModulesOnlyThrough(Contract):
    type_name = "private_modules_only_through"

    importers = fields.ListField(subfield=fields.ModuleExpressionField())
    package = fields.StringField()
    allowed_importers = fields.ListField(subfield=fields.ModuleExpressionField())
    ignore_imports = fields.SetField(subfield=fields.ImportExpressionField(), required=False)

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        removal = contract_utils.remove_ignored_imports_and_report(
            graph=graph, ignore_imports=self.ignore_imports, unmatched_alerting=contract_utils.AlertLevel.ERROR
        )
        package = str(self.package)
        importers = {m.name for m in helpers.module_expressions_to_modules(graph, self.importers, as_packages=True)}
        allowed = {
            m.name for m in helpers.module_expressions_to_modules(graph, self.allowed_importers, as_packages=True)
        }
        illegal = []
        for importer in sorted(importers - allowed):
            for imported in sorted(graph.find_modules_directly_imported_by(importer)):
                if (imported == package or imported.startswith(package + ".")) and is_private(imported):
                    lines = [d["line_number"] for d in graph.get_import_details(importer=importer, imported=imported)]
                    illegal.append((importer, imported, lines))
        return ContractCheck(
            kept=not illegal,
            warnings=list(removal.warnings),
            ignored_import_count=removal.ignored_import_count,
            metadata={"illegal": illegal},
        )

    def render_broken_contract(self, check: ContractCheck) -> None:
        output.print_error(f"Private modules of {self.package} imported outside {self.allowed_importers}:", bold=False)
        output.new_line()
        for importer, imported, lines in check.metadata["illegal"]:
            output.print_error(f"- {importer} -> {imported} (l.{', '.join(map(str, lines))})", bold=False)
        output.new_line()
