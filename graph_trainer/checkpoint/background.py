"""One checkpoint save finishing on a thread while training goes on (``checkpoint.async_mode async``).

``BackgroundSave(finish, what)`` starts ``finish()`` (the rest of a save: wait for DCP's writes,
hash, seal, retention) on a daemon thread. ``wait(timeout)`` blocks until it is done, or at most
``timeout`` seconds, and says which (True: done); once done it raises what ``finish`` raised (a
``JobError`` on every rank when the save failed: ``finish`` agrees over its own process group),
once; later calls return True at once. ``done`` says whether ``finish`` has returned or raised.

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
        # Waiting is on an event the thread sets last, not on Thread.join: a join interrupted by a
        # signal handler's exception (SIGTERM, Ctrl-C) marks a thread that is still running as
        # stopped (CPython 3.11's threading), and the save would look done.
        self._finished = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(finish,), name=f"checkpoint {what}", daemon=True)
        self._thread.start()

    def _run(self, finish: Callable[[], object]) -> None:
        try:
            finish()
        except BaseException as e:  # handed to wait(), on the training thread
            self._error = e
        finally:
            self._finished.set()

    @property
    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the save is done (True), or ``timeout`` seconds have passed with it still
        running (False); once done, raise its error (once). An exception while waiting (a signal
        handler's) leaves it running and not done."""
        if not self._finished.wait(timeout):
            return False
        error, self._error = self._error, None
        if error is not None:
            raise error
        return True


__all__ = ["BackgroundSave"]
