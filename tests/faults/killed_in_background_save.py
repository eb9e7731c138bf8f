"""``train.py`` whose process is killed (SIGKILL) while a background checkpoint save is sealing
the step given by ``KILL_AT_STEP``: its tensors written, its manifest not yet, training already
past it. ``tests/checkpoint/test_async_save.py`` runs this in place of ``train.py`` with
``--checkpoint.async_mode async``.
"""

from __future__ import annotations

import os
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from graph_trainer.checkpoint import manifest  # noqa: E402

_write = manifest.write


def _write_or_die(folder: str, data) -> None:
    if os.path.basename(folder).startswith(f"step-{os.environ['KILL_AT_STEP']}.tmp-"):
        os.kill(os.getpid(), signal.SIGKILL)
    _write(folder, data)


manifest.write = _write_or_die

if __name__ == "__main__":
    import train

    sys.exit(train.main())
