"""Compare two gradient records (``graph_trainer.loop.grad_record``) by hand.

    python -m graph_trainer.cli.grad_record RECORD REFERENCE [--rtol R]

Prints the global norms, the largest relative deviation and every difference; exit code 0 when
they agree (bitwise with ``--rtol 0``, the default), 1 when they differ, 2 when a file cannot be read.
"""

from __future__ import annotations

import argparse
import sys

from graph_trainer.loop.grad_record import compare_records, load_record


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("record")
    parser.add_argument("reference")
    parser.add_argument("--rtol", type=float, default=0.0, help="relative tolerance; 0 (default): bitwise")
    opts = parser.parse_args(argv)
    try:
        record, reference = load_record(opts.record), load_record(opts.reference)
    except (OSError, RuntimeError) as e:
        print(f"error: cannot read a gradient record: {e}", file=sys.stderr)
        return 2
    problems, worst = compare_records(record, reference, opts.rtol)
    print(
        f"{len(record['params'])} parameters, global norm {record['norm']:.9g} vs {reference['norm']:.9g}, "
        f"largest relative deviation {worst:.1e}"
    )
    for p in problems:
        print(f"  {p}")
    print("DIFFER" if problems else ("bitwise equal" if worst == 0 else f"within rtol {opts.rtol:.0e}"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
