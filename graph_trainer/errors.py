"""Errors that reach the user as one line instead of a traceback.

Each carries the exit code ``train.py`` ends with and whether every rank raises it alike
(``every_rank``): a configuration mistake, or a decision rank 0 took and broadcast, is seen by
every rank, so one process per node reports it; a rank's own failure (a collective that timed
out on it) is reported by that rank.
"""

import signal


class OneLineError(Exception):
    """A failure the user can act on, reported as one line (``error: <message>``)."""

    exit_code = 1

    def __init__(self, message: str, *, every_rank: bool = True):
        super().__init__(message)
        self.every_rank = every_rank


class ConfigError(OneLineError):
    """A user error in the job configuration (or in what it points at: a dataset, a checkpoint);
    exit code 2."""

    exit_code = 2


class TorchCompatError(OneLineError):
    """The installed PyTorch lacks (or changed) a private API graph_trainer uses; reported as one
    line naming the API and the torch version, exit code 2 (see ``graph_trainer.torch_compat``)."""

    exit_code = 2


class JobError(OneLineError):
    """The job failed while running, for a reason outside the program: a file that cannot be
    written (full disk, read-only folder), a non-finite loss, a rank that stopped answering.
    Exit code 1."""

    exit_code = 1


class Terminated(OneLineError):
    """The process was asked to stop by a signal (SIGTERM: a scheduler's preemption or torchrun
    stopping its workers; SIGINT: Ctrl-C), raised in the main thread by ``train.py``'s handler so
    that the job leaves as it does on any one-line error. Exit code 128 + the signal's number, as a
    shell reports a process the signal ended."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.exit_code = 128 + signum


class NonFiniteError(JobError):
    """The loss, the gradient norm or the state to be saved is not finite (``graph_trainer.loop.guards``)."""


def require(ok: bool, message: str) -> None:
    """Raise ``ConfigError(message)`` unless ``ok``: one configuration check, one line."""
    if not ok:
        raise ConfigError(message)


def some_names(names, limit: int = 4) -> str:
    """The first ``limit`` of ``names`` (sorted) and how many more, for a one-line message."""
    names = sorted(names)
    return ", ".join(names[:limit]) + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def one_line(error: BaseException, limit: int = 300) -> str:
    """``error`` as one short line, for a message of ours that quotes a library's (``tokenizers``,
    ``datasets`` and others write messages of many lines)."""
    text = " ".join(f"{type(error).__name__}: {error}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
