"""A stuck rank never hangs the job: a rank that stops answering ends the job within the collective
timeout (``comm.timeout_seconds``), with one line."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

from tests.conftest import ROOT
from tests.launch import read_losses
from tests.reliability.helpers import EAGER


def _children(parent: int) -> list[int]:
    """Pids whose parent is ``parent`` (torchrun's workers run in sessions of their own)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == parent:
                    found.append(int(pid))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _worker_pid(torchrun: int, rank: int) -> int | None:
    """The pid of torchrun's worker of ``rank``."""
    for pid in _children(torchrun):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return pid
    return None


def test_stopped_rank_ends_the_job_with_one_line_within_the_timeout(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        os.path.join(ROOT, "train.py"),
        *EAGER,
        "--job.dump_folder",
        str(tmp_path),
        "--training.steps",
        "100000",
        "--comm.timeout_seconds",
        "3",
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT},
    )
    try:
        deadline = time.monotonic() + 240
        seen, seen_at, step_gap = 0, None, 0.0  # step_gap: the longest wait for a new loss line
        while seen < 3:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "slow"
            time.sleep(0.2)
            count = len(read_losses(tmp_path)) if (tmp_path / "losses.txt").is_file() else 0
            if count > seen:
                now = time.monotonic()
                step_gap = max(step_gap, now - seen_at) if seen_at is not None else 0.0
                seen, seen_at = count, now
        pid = _worker_pid(proc.pid, 1)
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        line, reported = None, None
        for text in proc.stderr:
            if text.startswith("error: "):
                line, reported = text.strip(), time.monotonic()
                break
        proc.wait(timeout=120)
        ended = time.monotonic()
    finally:  # whatever happened, no worker outlives the test
        for p in [*_children(proc.pid), proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
    assert line is not None and re.match(
        r"error: rank 0: step \d+: a collective waited more than 3 s "
        r"\(comm.timeout_seconds / comm.init_timeout_seconds\) for another rank",
        line,
    )
    # Rank 0's clock starts when it enters the collective rank 1 never joins, which can be up to a
    # step before the stop (the gap between loss lines bounds a step, polling included).
    assert 3 - step_gap - 0.2 <= reported - stopped < 3 + 10, (reported - stopped, step_gap)
    assert proc.returncode != 0
    # torchrun then SIGTERMs the stopped rank, which acts on it only when continued: torchrun
    # SIGKILLs it after its 30 s grace. (A rank stuck but not stopped dies of the SIGTERM at once.)
    assert ended - reported < 30 + 15
