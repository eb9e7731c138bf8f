"""What the table benchmarks (``vs_torchtitan_h100``, ``long_context``) share: choosing rows by name
from ``--rows``, and writing the printed table as JSON."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any


def chosen_rows(spec: str, rows: Sequence[Any]) -> list[Any] | None:
    """The rows (objects with a ``name``) that ``spec`` names, comma-separated, in table order (all of
    them for an empty ``spec``); None after one error line on stderr when it names an unknown row."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = sorted(set(names) - {r.name for r in rows})
    if unknown:
        print(f"error: unknown rows {unknown}; choose from {[r.name for r in rows]}", file=sys.stderr)
        return None
    return [r for r in rows if not names or r.name in names]


def write_json(path: str | None, table: list[dict]) -> None:
    """``table`` as indented JSON at ``path`` (nothing when None)."""
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(table, f, indent=1)
            f.write("\n")
