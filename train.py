"""Entry point: parse the config, build, trace, run passes, train.

    torchrun --nproc_per_node N train.py --job.config_file configs/llama3_debug.toml [--section.key value ...]

Failures the user can act on are one line on stderr (``error: ...``) and an exit code: 2 for the
configuration and what it points at (checked before anything is built where possible), 1 for a
job that failed while running (a file it could not write, a non-finite loss, a rank that stopped
answering). Other exceptions are bugs and keep their traceback.

Under torchrun: an error every rank meets alike (a config error, a checkpoint decision rank 0
broadcast, a non-finite loss) is reported by the first process of each node (``LOCAL_RANK`` 0),
which exits with the code; that node's other processes exit 0 at once, so torchrun's failure
report names one process, and its "traceback" field holds our line (written to torchrun's error
file, ``TORCHELASTIC_ERROR_FILE``). An error of one rank (a collective that timed out there) is
reported by that rank, prefixed ``rank R:``. Either way a multi-process job leaves with
``os._exit`` right after reporting: tearing the process group down could wait on a stuck peer.

SIGTERM (a scheduler preempting the job, torchrun stopping its workers) and SIGINT (Ctrl-C) raise
``Terminated`` in the main thread: the job leaves as on any one-line error, after giving a
background checkpoint save in flight ``checkpoint.finish_timeout_seconds`` to be sealed, with exit
code 128 + the signal's number. A second such signal ends the process at once.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time

from graph_trainer.errors import OneLineError, Terminated

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", 1))


def _fail(error: OneLineError) -> int:
    """Report ``error`` by the rules above; the exit code this process must end with."""
    reporter = not error.every_rank or int(os.environ.get("LOCAL_RANK", 0)) == 0
    if not reporter:
        return 0  # this node's first process reports the same error and fails the job
    rank = int(os.environ.get("RANK", 0))
    line = f"error: {'' if error.every_rank or _world_size() == 1 else f'rank {rank}: '}{error}"
    print(line, file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:  # torchrun shows its "message" in its failure report instead of a link to its docs
        try:
            with open(error_file, "w", encoding="utf-8") as f:  # the layout torchelastic's own @record writes
                json.dump(
                    {
                        "message": {
                            "message": line,
                            "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))},
                        }
                    },
                    f,
                )
        except OSError:
            pass
    return error.exit_code


def _leave(code: int) -> int:
    if _world_size() > 1:
        # Skip interpreter finalization (and, after an error, the process group's teardown, which
        # can wait on a stuck peer): gloo worker threads still holding work objects can abort the
        # process there ("terminate called without an active exception", seen rarely on loaded CPUs).
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _raise_terminated(signum: int, frame) -> None:
    for stop in STOP_SIGNALS:  # a second signal ends the process at once
        signal.signal(stop, signal.SIG_DFL)
    raise Terminated(signum)


def main(argv: list[str] | None = None) -> int:
    """Run the job (module docstring); its exit code. The stop signals' handlers are ours while it
    runs, and the previous ones again after (a caller in the same process keeps its own)."""
    previous = {stop: signal.signal(stop, _raise_terminated) for stop in STOP_SIGNALS}
    try:
        return _run(argv)
    finally:
        for stop, handler in previous.items():
            signal.signal(stop, handler)


def _run(argv: list[str] | None) -> int:
    from graph_trainer.loop.preflight import check_job

    try:
        cfg = check_job(argv, _world_size())
    except OneLineError as e:
        return _leave(_fail(e))

    import torch.distributed as dist

    from graph_trainer.distributed.comm import failure_message
    from graph_trainer.errors import JobError
    from graph_trainer.trainer import Trainer

    trainer = None
    try:
        trainer = Trainer(cfg)
        trainer.train()
        if dist.is_initialized():
            # Leave together: a rank tearing gloo down while its peer still talks to it
            # can abort the peer at exit ("terminate called without an active exception").
            dist.barrier()
    except OneLineError as e:  # found while building or running (checkpoint, a private API, I/O, NaN, ...)
        return _leave(_fail(e))
    except RuntimeError as e:  # a collective outside the steps (start-up, the final barrier)
        timeout = trainer.collective_timeout() if trainer else cfg.comm.init_timeout_seconds
        message = failure_message(e, timeout)
        if message is None:
            raise
        return _leave(_fail(JobError(message, every_rank=False)))
    if dist.is_initialized():
        dist.destroy_process_group()
    return _leave(0)


if __name__ == "__main__":
    sys.exit(main())
