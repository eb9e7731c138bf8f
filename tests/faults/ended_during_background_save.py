"""``train.py`` that ends while the background checkpoint save of step ``SEAL_STEP`` is in flight:
its tensors written and hashed, its manifest not yet written.

``END_BY``:

- ``failure``: the next step's loss is taken as NaN, so the finite-loss guard ends the job with
  its one-line error; the save's thread holds the sealing until then, and a second more, so that
  a job that leaves without waiting for the save is gone before it is sealed;
- ``SIGTERM``: the save's thread sends SIGTERM to its own process, then seals a second later (a
  process that dies on the signal never seals it).

Every rank runs the same script; only rank 0 seals. ``tests/checkpoint/test_async_save.py`` runs
this in place of ``train.py`` with ``--checkpoint.async_mode async``.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from graph_trainer import trainer  # noqa: E402
from graph_trainer.checkpoint import manifest  # noqa: E402

LONGEST_HOLD_S = 120.0
"""How long the save waits for the training thread's error at most (a job that never meets it)."""

_failed = threading.Event()
_check_step = trainer.check_step
_write = manifest.write


def _check_step_failing_after_the_save(step: int, loss: float, *args, **kwargs):
    if os.environ["END_BY"] == "failure" and step == int(os.environ["SEAL_STEP"]) + 1:
        loss = float("nan")
    try:
        return _check_step(step, loss, *args, **kwargs)
    except Exception:
        _failed.set()
        raise


def _write_late(folder: str, data) -> None:
    if os.path.basename(folder).startswith(f"step-{os.environ['SEAL_STEP']}.tmp-"):
        if os.environ["END_BY"] == "SIGTERM":
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            _failed.wait(LONGEST_HOLD_S)
        time.sleep(1.0)
    _write(folder, data)


trainer.check_step = _check_step_failing_after_the_save
manifest.write = _write_late

if __name__ == "__main__":
    import train

    sys.exit(train.main())
