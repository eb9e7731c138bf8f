"""Rewrite the stored loss curves from the current code:

    .venv/bin/python -m tests.numerics.regenerate [NAME ...]     (default: every curve)

Legitimate only for an intended numeric change (a new initialisation, model detail, data order
or PyTorch version): commit the new files with the reason in the message. Never to make a
failing test pass without knowing why the losses moved. See README, "Integration suites".
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from tests.numerics.curves import CURVES, curve_path, run_curve


def main(argv: list[str]) -> int:
    names = argv or list(CURVES)
    unknown = [n for n in names if n not in CURVES]
    if unknown:
        print(f"error: unknown curve(s) {', '.join(unknown)}; curves: {', '.join(CURVES)}", file=sys.stderr)
        return 2
    for name in names:
        with tempfile.TemporaryDirectory(prefix=f"curve_{name}_") as folder:
            text = run_curve(name, Path(folder))
        path = curve_path(name)
        old = path.read_text() if path.exists() else None
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"{path}: {'unchanged' if old == text else 'written'} ({len(text.splitlines())} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
