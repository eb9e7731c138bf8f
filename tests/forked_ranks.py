"""Run a multi-process CPU job as torchrun does, without each rank importing torch again.

Every rank of a torchrun job imports torch, torch._dynamo and the trainer (seconds of CPU each),
and torchrun's agent imports torch too: on the 2-core CI machine that start-up is a large part of
a short gloo job. Here one server process (multiprocessing's forkserver, started on first use)
imports them once (``PRELOAD``); each job's launcher is forked from it, and forks the job's ranks,
so every rank starts with them imported and runs ``SCRIPT`` as ``__main__`` with ``sys.argv =
[SCRIPT, *ARGS]``, in a process that has run nothing before.

What a rank sees is torchrun's contract for one node: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``/``MASTER_PORT``, and the rendezvous store is
the launcher's (``TORCHELASTIC_USE_AGENT_STORE``, as under torchrun): the launcher opens a TCPStore
on a free port after forking the ranks (so they fork from a process with one thread) and hands each
the port through a pipe, so jobs side by side never race for a port. The job's stdout and stderr
come back as ``subprocess.run`` returns them.

Failures as under torchrun: when a rank exits non-zero the launcher stops the others (SIGTERM,
then SIGKILL) and the job exits with that rank's code; ranks die with their launcher
(``PR_SET_PDEATHSIG``), so a job stopped at its timeout leaves no rank waiting on a collective.

Only for CPU jobs in tests: a CUDA job must not fork after torch initialised CUDA, and users (and
the GPU suites) run torchrun. tests/test_launch.py checks that a job's losses and gradients are
bitwise the same under both.
"""

from __future__ import annotations

import ctypes
import datetime
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time

PRELOAD = (
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch._functorch.aot_autograd",
    "torch._inductor.config",
    "torch.fx.experimental.proxy_tensor",
    "tyro",
    "graph_trainer.config_loading",
    "graph_trainer.validation",
    "graph_trainer.loop.preflight",
    "graph_trainer.trainer",
    "graph_trainer.compiler.chain",
)
"""What every job imports at start-up: imported once, by the server every job's launcher is forked from."""

STOP_GRACE_SECONDS = 5.0
"""How long the other ranks get to leave after SIGTERM once one rank failed."""

_PR_SET_PDEATHSIG = 1


def _rank_environment(rank: int, nproc: int, port: int) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }


def _run_rank(rank: int, nproc: int, port_pipe: int, argv: list[str]) -> None:
    """In the forked child: wait for the store's port, become rank ``rank``, run the script; never returns."""
    code = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == 1:  # the launcher died before prctl took effect
            os._exit(1)
        with os.fdopen(port_pipe) as pipe:
            port = int(pipe.read())
        os.environ.update(_rank_environment(rank, nproc, port))
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        try:
            runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, int | None):
                print(e.code, file=sys.stderr)
        import atexit

        atexit._run_exitfuncs()  # what interpreter exit runs (logging's flush among them)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _fork_ranks(nproc: int, argv: list[str]) -> tuple[dict[int, int], list[int]]:
    """Fork the ranks; each waits on a pipe for the port. Returns {pid: rank} and the pipes' write ends."""
    ranks, writers = {}, []
    for rank in range(nproc):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(write_end)
            for w in writers:
                os.close(w)
            _run_rank(rank, nproc, read_end, argv)
        os.close(read_end)
        ranks[pid] = rank
        writers.append(write_end)
    return ranks, writers


def _stop(pids: list[int]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        while pids and time.monotonic() < deadline:
            pid, _ = os.waitpid(-1, os.WNOHANG)
            if pid:
                pids = [p for p in pids if p != pid]
            else:
                time.sleep(0.05)
        if not pids:
            return


def launch(nproc: int, argv: list[str]) -> int:
    """Run ``argv`` (a script and its arguments) on ``nproc`` forked ranks; the job's exit code."""
    ranks, writers = _fork_ranks(nproc, argv)
    from torch.distributed import TCPStore

    store = TCPStore(
        "127.0.0.1", 0, nproc, is_master=True, timeout=datetime.timedelta(seconds=1800), wait_for_workers=False
    )
    for w in writers:
        os.write(w, str(store.port).encode())
        os.close(w)
    while ranks:
        pid, status = os.wait()
        ranks.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            _stop(list(ranks))
            return code if code > 0 else 128 - code
    return 0


def _job_process(nproc: int, argv: list[str], env: dict[str, str], cwd: str, logs: tuple[str, str]) -> None:
    """The launcher of one job, forked from the preloaded server: stdout and stderr to ``logs``,
    exits with the job's code."""
    os.environ.clear()
    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun sets it
    import torch

    # A new process takes its intra-op thread count from OMP_NUM_THREADS at its first op; the
    # server imported torch under its own environment, so say it again (it changes sums' order).
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    os.chdir(cwd)
    for stream, path in zip((1, 2), logs, strict=True):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, stream)
        os.close(fd)
    sys.exit(launch(nproc, argv))


_server = None


def _server_context():
    """The forkserver every job's launcher is forked from, started on first use with ``PRELOAD`` imported."""
    global _server
    if _server is None:
        _server = multiprocessing.get_context("forkserver")
        _server.set_forkserver_preload([*PRELOAD, __name__])
    return _server


def run_job(nproc: int, argv: list[str], env: dict[str, str], cwd: str, timeout: float) -> subprocess.CompletedProcess:
    """Run ``argv`` on ``nproc`` forked ranks with environment ``env`` in ``cwd``; its output as
    ``subprocess.run(..., capture_output=True, text=True)`` returns it. Raises
    ``subprocess.TimeoutExpired`` (the job stopped) after ``timeout`` seconds, as that does."""
    with tempfile.TemporaryDirectory(prefix="forked_job_") as folder:
        logs = (os.path.join(folder, "stdout"), os.path.join(folder, "stderr"))
        job = _server_context().Process(target=_job_process, args=(nproc, list(argv), dict(env), cwd, logs))
        job.start()
        job.join(timeout)
        if job.exitcode is None:
            job.kill()  # its ranks die with it (PR_SET_PDEATHSIG)
            job.join()
            raise subprocess.TimeoutExpired(argv, timeout, output=_read(logs[0]), stderr=_read(logs[1]))
        code = job.exitcode if job.exitcode >= 0 else 128 - job.exitcode
        return subprocess.CompletedProcess(argv, code, stdout=_read(logs[0]), stderr=_read(logs[1]))


def _read(path: str) -> str:
    if not os.path.exists(path):
        return ""
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()
