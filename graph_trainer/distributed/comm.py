"""Collective timeouts, and ranks agreeing on a failure instead of waiting for each other forever.

* ``init_timeout(cfg)``: the ``timeout`` given to ``init_process_group`` (``comm.init_timeout_seconds``).
  Only the world group gets it: the groups a device mesh creates start with torch's default
  (measured: docs/performance.md), so the trainer calls ``set_timeout`` with it once the mesh
  exists. It lasts until the first step has finished: ranks may reach their first collective far
  apart (building, loading and verifying a checkpoint, tracing).
* ``set_timeout(seconds)``: that timeout on every process group of this process; after the first
  step, ``comm.timeout_seconds``.
  On gloo a collective that waits longer raises on the waiting rank ("Timed out waiting ... for
  recv"), which ``failure_message`` turns into one line; NCCL's watchdog aborts the process itself.
* ``first_per_node(key, fn)``: every rank runs ``fn``; of the ranks on one host holding the same
  ``key``, the lowest runs it first and the others after it (one barrier, under the timeout in
  force), so that they find its result in a cache on the host.
* ``agree(fn, what)``: every rank runs ``fn``; an ``OSError`` or ``JobError`` on any rank becomes the
  same ``JobError`` on all, after one ``all_gather_object``, and a ``ConfigError`` the same
  ``ConfigError`` (a setting only one rank acts on, as rank 0's W&B run). Without it, a rank whose
  write failed would leave while the others wait in the next collective until the timeout.
"""

from __future__ import annotations

import contextlib
import socket
from datetime import timedelta

import torch.distributed as dist

from graph_trainer.errors import ConfigError, JobError
from graph_trainer.torch_compat import process_groups, set_group_timeout

_TIMEOUT_MARKERS = ("timed out", "timeout")
_PEER_GONE_MARKERS = ("connection closed by peer", "connection reset by peer", "broken pipe")


def init_timeout(cfg) -> timedelta:
    return timedelta(seconds=cfg.comm.init_timeout_seconds)


def set_timeout(seconds: float) -> None:
    """Every process group of this process waits at most ``seconds`` in a collective from now on."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    for group in process_groups():
        set_group_timeout(group, timedelta(seconds=seconds))


def failure_message(e: BaseException, timeout_s: float) -> str | None:
    """One line for a collective that failed because another rank stopped answering or left (None:
    not such a failure)."""
    text = str(e).lower()
    if any(m in text for m in _TIMEOUT_MARKERS):
        return (
            f"a collective waited more than {timeout_s:g} s (comm.timeout_seconds / comm.init_timeout_seconds) "
            f"for another rank: one is stuck, stopped or far slower ({str(e).splitlines()[0][-120:]})"
        )
    if any(m in text for m in _PEER_GONE_MARKERS):
        return f"another rank left during a collective ({str(e).splitlines()[0][-120:]})"
    return None


@contextlib.contextmanager
def collective_failures(where, timeout_s):
    """Turn a timed-out or broken collective inside the block into a one-line ``JobError`` of this rank.

    ``where`` and ``timeout_s`` are callables (read when the failure happens: the step, and the
    timeout in force)."""
    try:
        yield
    except RuntimeError as e:
        message = failure_message(e, timeout_s())
        if message is None:
            raise
        raise JobError(f"{where()}: {message}", every_rank=False) from None


def describe_io_error(e: BaseException) -> str:
    """One line for an I/O failure, also when DCP wrapped it (``CheckpointException``, one entry per rank)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, (inner, _trace) = sorted(failures.items())[0]
        return describe_io_error(inner)
    if isinstance(e, OSError):
        where = f": {e.filename}" if e.filename else ""
        return f"{e.strerror or e}{where}"
    return f"{type(e).__name__}: {e}".splitlines()[0]


def _is_checkpoint_exception(e: BaseException) -> bool:
    from torch.distributed.checkpoint.api import CheckpointException

    return isinstance(e, CheckpointException)


def leaders(keys: list[tuple[str, str]]) -> list[bool]:
    """Per rank, given every rank's (host, key): whether it is the lowest rank of its (host, key)."""
    first: dict[tuple[str, str], int] = {}
    for rank, host_key in enumerate(keys):
        first.setdefault(host_key, rank)
    return [first[host_key] == rank for rank, host_key in enumerate(keys)]


def first_per_node(key: str, fn):
    """``fn()`` on every rank, in two waves: the lowest rank of each (host, ``key``) first, then,
    after a barrier on the world group, every other rank. Returns ``fn``'s result and, per rank,
    whether it ran in the first wave. Every rank must call it at the same point of its program (it
    gathers the keys, then waits in one barrier); without a process group, ``fn`` runs at once."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return fn(), [True]
    keys: list = [None] * dist.get_world_size()
    dist.all_gather_object(keys, (socket.gethostname(), key))
    first = leaders(keys)
    if not first[dist.get_rank()]:
        dist.barrier()
    result = fn()
    if first[dist.get_rank()]:
        dist.barrier()
    return result, first


def agree(fn, what: str, group=None):
    """Run ``fn`` on every rank (of ``group``, default all); if it failed on any with an I/O error (or
    a ``JobError``), raise the same ``JobError`` ("<what>: <the first failure>") on every rank; if
    with a ``ConfigError``, that one where it was raised and on the others the same message naming
    its rank (the first failure decides which). Returns ``fn``'s result."""
    result, problem, own_config_error = None, None, None
    try:
        result = fn()
    except ConfigError as e:
        problem, own_config_error = ("config", str(e)), e
    except (OSError, JobError) as e:
        problem = ("job", str(e) if isinstance(e, JobError) else describe_io_error(e))
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if not _is_checkpoint_exception(e):
            raise
        problem = ("job", describe_io_error(e))
    distributed = dist.is_available() and dist.is_initialized()
    problems = [problem]
    if distributed:
        problems = [None] * dist.get_world_size(group)
        dist.all_gather_object(problems, problem, group=group)
    failed = [(rank, p) for rank, p in enumerate(problems) if p]
    if not failed:
        return result
    rank, (kind, message) = failed[0]
    where = f" (on rank {rank})" if distributed else ""
    if kind == "config":
        if own_config_error is not None and problem == failed[0][1]:
            raise own_config_error
        raise ConfigError(message + where)
    raise JobError(f"{what}: {message}{where}")
