"""Rewrite the stored loss curves from the current code, or record them for another machine:

    .venv/bin/python -m tests.numerics.regenerate [NAME ...]        (default: every curve)
    .venv/bin/python -m tests.numerics.regenerate --add-machine

The first form rewrites the reference set (``tests/assets/losses/``) and its ``machine.json``,
and deletes every other machine's set (a numeric change makes them stale; each machine records
its set again with ``--add-machine``). It is legitimate only for an intended numeric change (a
new initialisation, model detail, data order or PyTorch version): commit the new files with the
reason in the message; never to make a failing test pass without knowing why the losses moved.

``--add-machine`` records every curve on this machine into ``machines/<key>/`` when its
fingerprint matches no stored set, and only if every curve's first steps (``COMPARABLE_STEPS``)
are within ``CURVE_RTOL`` of the reference set (a bigger difference is not the machine: find out
what it is). See docs/testing.md, "Numerics regression suite".
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

from tests.numerics.curves import (
    ASSETS,
    COMPARABLE_STEPS,
    CURVE_RTOL,
    CURVES,
    curve_path,
    deviation,
    machine_key,
    run_curve,
    set_for,
)
from tests.numerics.machine import fingerprint


def _run_all(names: list[str]) -> dict[str, str]:
    texts = {}
    for name in names:
        with tempfile.TemporaryDirectory(prefix=f"curve_{name}_") as folder:
            texts[name] = run_curve(name, Path(folder))
    return texts


def _write(curve_set: Path, machine: dict, texts: dict[str, str]) -> None:
    curve_set.mkdir(parents=True, exist_ok=True)
    (curve_set / "machine.json").write_text(json.dumps(machine, indent=1, sort_keys=True) + "\n")
    for name, text in texts.items():
        path = curve_path(name, curve_set)
        old = path.read_text() if path.exists() else None
        path.write_text(text)
        print(f"{path}: {'unchanged' if old == text else 'written'} ({len(text.splitlines())} steps)")


def add_machine() -> int:
    machine = fingerprint()
    existing = set_for(machine)
    if existing is not None:
        print(f"error: this machine's fingerprint already has a set: {existing}", file=sys.stderr)
        return 2
    texts = _run_all(list(CURVES))
    too_far = []
    for name, text in texts.items():
        steps = COMPARABLE_STEPS[name]
        worst, step = deviation(text, curve_path(name).read_text(), steps)
        print(f"{name}: largest deviation from the reference set in its first {steps} steps {worst:.1e} (step {step})")
        if worst > CURVE_RTOL:
            too_far.append(name)
    if too_far:
        print(
            f"error: {', '.join(too_far)} deviate more than {CURVE_RTOL:.0e} from the reference set: that is not "
            f"a machine difference; nothing written",
            file=sys.stderr,
        )
        return 1
    _write(ASSETS / "machines" / machine_key(machine), machine, texts)
    return 0


def main(argv: list[str]) -> int:
    from graph_trainer.config_loading import normalize_flags

    if normalize_flags(argv) == ["--add_machine"]:  # either spelling, as every flag
        return add_machine()
    names = argv or list(CURVES)
    unknown = [n for n in names if n not in CURVES]
    if unknown:
        print(
            f"error: unknown curve(s) {', '.join(unknown)}; curves: {', '.join(CURVES)} (or --add-machine alone)",
            file=sys.stderr,
        )
        return 2
    machine = fingerprint()
    reference = ASSETS / "machine.json"
    if reference.exists() and set(names) != set(CURVES) and json.loads(reference.read_text()) != machine:
        print(
            "error: the reference set was recorded on another machine fingerprint: regenerate every curve "
            "(no names) so that the set stays one machine's",
            file=sys.stderr,
        )
        return 2
    _write(ASSETS, machine, _run_all(names))
    stale = ASSETS / "machines"
    if stale.is_dir():
        shutil.rmtree(stale)
        print(
            f"{stale}: removed (other machines' sets are stale after a regeneration; record them again with "
            f"--add-machine on those machines)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
