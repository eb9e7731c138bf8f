"""One checkpoint save finishing on a thread while training goes on (``checkpoint.async_mode async``).

``BackgroundSave(finish, what)`` starts ``finish()`` (the rest of a save: wait for DCP's writes,
hash, seal, retention) on a daemon thread. ``wait()`` blocks until it is done and raises what it
raised (a ``JobError`` on every rank when the save failed: ``finish`` agrees over its own process
group), once; later calls return at once. ``done`` says whether the thread has ended.

The thread is a daemon: a process that dies while it runs leaves a ``step-<N>.tmp-<token>``
folder without a manifest, which is never a checkpoint and which the next start removes
(``atomic_files.clean_leftovers``); the previous checkpoint stays the newest complete one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class BackgroundSave:
    """``finish`` running on a thread (module docstring)."""

    def __init__(self, finish: Callable[[], object], what: str):
        self.what = what
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(finish,), name=f"checkpoint {what}", daemon=True)
        self._thread.start()

    def _run(self, finish: Callable[[], object]) -> None:
        try:
            finish()
        except BaseException as e:  # handed to wait(), on the training thread
            self._error = e

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        """Block until the save is done; raise its error (once)."""
        self._thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error


__all__ = ["BackgroundSave"]
