"""Checkpoint manifests by hand (``graph_trainer.checkpoint.manifest``).

python -m graph_trainer.cli.manifest verify DIR...   # exit 1 if any folder fails its manifest
python -m graph_trainer.cli.manifest seal DIR...     # write the manifest of a checkpoint saved before
                                                     # manifests existed (only one you trust)
"""

from __future__ import annotations

import sys

from graph_trainer.checkpoint.manifest import seal, verify_folder


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("verify", "seal"):
        print("usage: python -m graph_trainer.cli.manifest verify|seal DIR...", file=sys.stderr)
        return 2
    failed = 0
    for folder in argv[1:]:
        if argv[0] == "seal":
            manifest = seal(folder)
            print(f"{folder}: sealed {len(manifest['files'])} files")
            continue
        problem = verify_folder(folder)
        print(f"{folder}: {problem or 'OK'}")
        failed += problem is not None
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
