"""Training metrics: the per-step loss file, periodic log lines, TensorBoard scalars.

What is measured, and how:

* ``losses.txt`` gets one ``"<step> <repr(loss)>"`` line for every step, flushed at
  once, so two runs can be compared bit for bit (``float(text) == loss``).
* Every ``log_freq`` steps (and at step 1) one INFO line summarises the step:
  loss, gradient norm, learning rate, throughput, MFU, peak memory, step time.
  The same numbers go to TensorBoard (``<dump_folder>/tb``) when enabled.
* Throughput is measured over a *window*: all steps recorded since the previous
  logged step, divided by the wall time the window covered (read from ``clock``).
  So it includes data loading and everything else the loop does between steps.
* MFU (model FLOPs utilisation) relates the model FLOPs that throughput implies
  to the device's peak dense FLOP/s; with no known peak (CPU) it is ``n/a``.
* ``forward_backward_s`` (when the trainer gives it): the seconds the step's forward, loss and
  backward took on the device (``ForwardBackwardTimer``), without clipping and the optimizer.
* With ``json_lines``, ``<dump_folder>/metrics.jsonl`` gets one JSON object a line, flushed at
  once: ``{"step": N, <the logged scalars>}`` for every logged step, ``{"event": <message>,
  <values>}`` for every ``log_event`` and ``record_event`` (the machine-readable twin of the
  log, for scripts that tabulate runs; non-finite numbers are written as NaN / Infinity).

Only rank 0 writes anything (files, TensorBoard); the other ranks compute the
same numbers, return them, and log them at DEBUG level only.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import resource
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from graph_trainer.errors import ConfigError

__all__ = [
    "ForwardBackwardTimer",
    "MetricsLogger",
    "peak_flops_per_device",
    "peak_memory_bytes",
    "rate",
    "setup_logging",
]

LOGGER_NAME = "graph_trainer"
"""Name of the project logger that :func:`setup_logging` configures."""

_GIB = float(1 << 30)


class _RankFormatter(logging.Formatter):
    """Formats records as ``[rank<r>] HH:MM:SS LEVEL message``."""

    def __init__(self, rank: int):
        super().__init__(f"[rank{rank}] %(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")


def setup_logging(rank: int, level: int = logging.INFO) -> logging.Logger:
    """Configure and return the project logger ``"graph_trainer"``.

    Rank 0 logs at ``level``. Other ranks log WARNING and above only, unless
    ``level`` is DEBUG (or lower), in which case every rank logs everything; this
    keeps multi-process output readable while still allowing per-rank debugging.

    Safe to call repeatedly: the logger owns exactly one handler of ours (writing to
    stderr), whose format and level are updated in place on later calls (e.g. once
    the real rank is known). The logger does not propagate to the root logger, so
    a root handler installed by another library cannot duplicate the lines.
    """
    log = logging.getLogger(LOGGER_NAME)
    if rank != 0 and level > logging.DEBUG:
        level = max(level, logging.WARNING)
    handler = next((h for h in log.handlers if getattr(h, "_graph_trainer_handler", False)), None)
    if handler is None:
        handler = logging.StreamHandler(sys.stderr)
        handler._graph_trainer_handler = True  # type: ignore[attr-defined]
        log.addHandler(handler)
    handler.setFormatter(_RankFormatter(rank))
    handler.setLevel(level)
    log.setLevel(level)
    log.propagate = False
    return log


def peak_flops_per_device(device: torch.device, configured_tflops: float | None) -> float | None:
    """Peak dense FLOP/s of one device, used as the MFU denominator.

    * ``configured_tflops`` (config ``metrics.peak_tflops``), when given and > 0,
      wins: it is returned converted to FLOP/s (``tflops * 1e12``). A value of 0 or
      None means "not configured"; a negative value is a :class:`ConfigError`.
    * On CUDA devices, torchtitan's table is consulted with the device's name
      (e.g. H100 SXM -> 989e12 bf16 dense). Note that table inspects ``lspci``
      first and falls back to the A100 figure for GPUs it does not know.
    * Anything else (CPU) has no meaningful peak: returns None, so MFU is "n/a".
    """
    if configured_tflops is not None:
        if configured_tflops < 0 or math.isnan(configured_tflops):
            raise ConfigError(f"metrics.peak_tflops must be >= 0, got {configured_tflops}")
        if configured_tflops > 0:
            return float(configured_tflops) * 1e12
    device = torch.device(device)
    if device.type == "cuda":
        # Imported here: importing torchtitan is slow and only needed on GPUs.
        from torchtitan.tools.utils import get_peak_flops

        return float(get_peak_flops(torch.cuda.get_device_name(device)))
    return None


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process on ``device``, in bytes.

    CUDA: the caching allocator's peak of allocated tensor memory
    (``torch.cuda.max_memory_allocated``). Otherwise: the process's peak resident
    set size from ``getrusage`` (reported in KiB on Linux, in bytes on macOS), which
    covers everything the process touched, not only tensors.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(maxrss) if sys.platform == "darwin" else int(maxrss) * 1024


class ForwardBackwardTimer:
    """Device time of the blocks run inside it (the step's forward, loss and backward), summed
    until ``pop_seconds()``; usable as a context manager once per block.

    On CUDA a block is timed by two CUDA events recorded on the current stream around it, so
    timing adds no synchronisation: ``pop_seconds`` reads them after the step has synchronised
    anyway (the trainer reads the loss back as a Python float after the last block). The time
    covers the stream from the first kernel the block launched to its last, idle gaps while the
    host launches kernels included. Elsewhere (the CPU runs ops synchronously) it is the wall
    time of each block.
    """

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self._start: Any = None
        self._events: list[tuple[Any, Any]] = []
        self._seconds = 0.0

    def __enter__(self) -> ForwardBackwardTimer:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._start, end))
        else:
            self._seconds += time.perf_counter() - self._start

    def pop_seconds(self) -> float:
        """Seconds of the blocks timed since the last call (waits for their last CUDA event)."""
        for start, end in self._events:
            end.synchronize()
            self._seconds += start.elapsed_time(end) / 1e3  # (milliseconds)
        seconds, self._seconds, self._events = self._seconds, 0.0, []
        return seconds


def _format_value(value: Any) -> str:
    """Human-readable rendering of one :meth:`MetricsLogger.log_event` value."""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, numbers.Integral):
        return f"{int(value):,}"
    if isinstance(value, numbers.Real):
        return f"{float(value):.4g}"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {_format_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def _numeric_scalars(name: str, value: Any) -> list[tuple[str, float]]:
    """(tag, number) pairs for TensorBoard; mappings are flattened as ``name/key``."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, numbers.Real):
        return [(name, float(value))]
    if isinstance(value, Mapping):
        pairs: list[tuple[str, float]] = []
        for key, sub in value.items():
            pairs.extend(_numeric_scalars(f"{name}/{key}", sub))
        return pairs
    return []


def _json_value(value: Any) -> Any:
    """What ``json.dumps`` writes for a value it has no rule for: a one-element tensor's number,
    else its text."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return str(value)


def rate(per_second: float) -> str:
    """A rate as the log prints it: whole numbers with thousands separators from 100 up, three
    significant digits below (a first step that compiles for minutes still shows what it did)."""
    return f"{per_second:,.0f}" if per_second >= 100 else f"{per_second:.3g}"


class MetricsLogger:
    """Records per-step training metrics; see the module docstring for the definitions.

    Rank 0 creates ``dump_folder``, the loss file ``<dump_folder>/losses.txt``
    (truncated unless ``append_losses``, which resumed runs should pass) and, when
    ``enable_tensorboard``, a TensorBoard writer in ``<dump_folder>/tb``. Other ranks
    create nothing. Use :meth:`close` (or a ``with`` block) when done.

    Args:
        dump_folder: Output folder of the job.
        log_freq: Log a line (and TensorBoard scalars) at step 1 and whenever
            ``step % log_freq == 0``; must be >= 1.
        enable_tensorboard: Write TensorBoard events (rank 0 only).
        rank: Global rank of this process.
        device: Training device; selects how peak memory is measured.
        flops_per_token: Model FLOPs (forward + backward) per trained token.
        peak_flops: Peak FLOP/s of one device (:func:`peak_flops_per_device`);
            None reports MFU as "n/a" and omits it from the scalars.
        num_devices_per_replica: Devices that jointly process the *same* tokens
            (e.g. the tensor-parallel group). Each rank passes the tokens of the
            batch it fed as ``ntokens``; dividing by this number attributes them
            to the devices that shared the work. 1 for pure data parallelism.
        logger: Where lines go; defaults to the ``"graph_trainer"`` logger.
        clock: Zero-argument time source in seconds (tests pass a fake one).
        append_losses: Append to an existing ``losses.txt`` (and ``metrics.jsonl``)
            instead of truncating.
        json_lines: Also write ``<dump_folder>/metrics.jsonl`` (module docstring).
        wandb_config: With a config (the job's, as a dict), also log to a W&B run
            (``loop.wandb_writer``, rank 0 only); None: no W&B.
        wandb_name: The W&B run's name ('' lets W&B choose).
    """

    def __init__(
        self,
        *,
        dump_folder: str,
        log_freq: int,
        enable_tensorboard: bool,
        rank: int,
        device: torch.device,
        flops_per_token: int,
        peak_flops: float | None,
        num_devices_per_replica: int = 1,
        logger: logging.Logger | None = None,
        clock: Callable[[], float] = time.perf_counter,
        append_losses: bool = False,
        json_lines: bool = False,
        wandb_config: dict[str, Any] | None = None,
        wandb_name: str = "",
    ):
        if log_freq < 1:
            raise ConfigError(f"metrics.log_freq must be >= 1, got {log_freq}")
        if num_devices_per_replica < 1:
            raise ValueError(f"num_devices_per_replica must be >= 1, got {num_devices_per_replica}")
        self.dump_folder = dump_folder
        """Output folder (written to by rank 0 only)."""
        self.log_freq = log_freq
        """Logging interval in steps."""
        self.rank = rank
        """Global rank of this process; only rank 0 writes."""
        self.device = torch.device(device)
        """Training device (selects the peak-memory measure)."""
        self.flops_per_token = flops_per_token
        """Model training FLOPs per token (MFU numerator per token)."""
        self.peak_flops = peak_flops if peak_flops and peak_flops > 0 else None
        """Peak FLOP/s of one device, or None when unknown (MFU "n/a")."""
        self.num_devices_per_replica = num_devices_per_replica
        """Devices that share the same tokens; divides the measured token rate."""
        self.logger = logger or logging.getLogger(LOGGER_NAME)
        """Destination of the log lines."""
        self.clock = clock
        """Time source in seconds."""
        self.losses_path = os.path.join(dump_folder, "losses.txt")
        """Path of the per-step loss file (only created on rank 0)."""
        self.tb_dir = os.path.join(dump_folder, "tb")
        """TensorBoard event folder (only created on rank 0 when enabled)."""
        self.json_path = os.path.join(dump_folder, "metrics.jsonl")
        """Path of the JSON-lines record (only created on rank 0 with ``json_lines``)."""

        self._window_start: float | None = None  # set by the first recorded step
        self._window_tokens = 0
        self._closed = False
        self._loss_file = None
        self._json_file = None
        self._writer = None
        self._wandb = None
        if rank == 0:
            os.makedirs(dump_folder, exist_ok=True)
            if wandb_config is not None:  # (first: a run wandb refuses to start leaves no files behind)
                from graph_trainer.loop.wandb_writer import WandbWriter

                self._wandb = WandbWriter(dump_folder, wandb_config, wandb_name)
            self._loss_file = open(self.losses_path, "a" if append_losses else "w", encoding="utf-8")
            if json_lines:
                self._json_file = open(self.json_path, "a" if append_losses else "w", encoding="utf-8")
            if enable_tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self._writer = SummaryWriter(log_dir=self.tb_dir)

    @property
    def writes(self) -> bool:
        """True on the rank that writes files and TensorBoard events (rank 0)."""
        return self.rank == 0

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("MetricsLogger is closed")

    def should_log(self, step: int) -> bool:
        """Whether ``step`` is a logged step: step 1 and every multiple of ``log_freq``."""
        return step == 1 or step % self.log_freq == 0

    def record_step(
        self,
        *,
        step: int,
        loss: float,
        grad_norm: float,
        lr: float,
        ntokens: int,
        step_time_s: float,
        forward_backward_s: float | None = None,
    ) -> dict[str, float] | None:
        """Record one finished training step; call it once per step, in order.

        Args:
            step: 1-based step number.
            loss: The step's loss (written to ``losses.txt`` with full precision).
            grad_norm: Total gradient norm before clipping.
            lr: Learning rate used by the step.
            ntokens: Tokens this rank fed to the model in this step (batch x sequence).
            step_time_s: Seconds the step itself took (shown as is).
            forward_backward_s: Device seconds of the step's forward, loss and backward
                (``ForwardBackwardTimer``), recorded as a scalar when given.

        Throughput on a logged step is ``sum(ntokens over the window) / window
        seconds / num_devices_per_replica``. The window starts at the previous
        logged step's call of this method; the very first window starts at the
        beginning of the first recorded step (its call time minus ``step_time_s``),
        so setup before the first step is not counted but its trace is. MFU in % is
        ``100 * flops_per_token * tokens_per_sec_per_device / peak_flops``.

        Returns:
            On logged steps the scalars logged (keys ``loss``, ``grad_norm``, ``lr``,
            ``tokens_per_sec_per_device``, ``mfu_percent`` when the peak is known,
            ``memory_gib``, ``step_time_s``, ``forward_backward_s`` when given), on every
            rank; None on other steps.
        """
        self._check_open()
        now = self.clock()
        loss = float(loss)
        if self._loss_file is not None:
            self._loss_file.write(f"{step} {loss!r}\n")
            self._loss_file.flush()
        if self._window_start is None:
            self._window_start = now - step_time_s
        self._window_tokens += int(ntokens)
        if not self.should_log(step):
            return None

        elapsed = now - self._window_start
        tokens_per_sec = self._window_tokens / elapsed / self.num_devices_per_replica if elapsed > 0 else math.nan
        self._window_start = now
        self._window_tokens = 0

        scalars: dict[str, float] = {
            "loss": loss,
            "grad_norm": float(grad_norm),
            "lr": float(lr),
            "tokens_per_sec_per_device": tokens_per_sec,
        }
        if self.peak_flops is not None:
            scalars["mfu_percent"] = 100.0 * self.flops_per_token * tokens_per_sec / self.peak_flops
        scalars["memory_gib"] = peak_memory_bytes(self.device) / _GIB
        scalars["step_time_s"] = float(step_time_s)
        if forward_backward_s is not None:
            scalars["forward_backward_s"] = float(forward_backward_s)

        self.logger.log(logging.INFO if self.writes else logging.DEBUG, self._step_line(step, scalars))
        self._write_json({"step": step, **scalars})
        self._add_scalars(scalars, step)
        return scalars

    def _add_scalars(self, scalars: dict[str, float], step: int) -> None:
        """``scalars`` at ``step`` in TensorBoard and W&B (where enabled)."""
        if self._writer is not None:
            for tag, value in scalars.items():
                self._writer.add_scalar(tag, value, global_step=step)
            self._writer.flush()
        if self._wandb is not None:
            self._wandb.add_scalars(scalars, step)

    def _step_line(self, step: int, scalars: dict[str, float]) -> str:
        """The log line of a logged step."""
        mfu = f"{scalars['mfu_percent']:.2f}%" if "mfu_percent" in scalars else "n/a"
        mem_kind = "peak alloc" if self.device.type == "cuda" else "peak rss"
        return (
            f"step {step} | loss {scalars['loss']:.6f} | grad_norm {scalars['grad_norm']:.4f} | "
            f"lr {scalars['lr']:.2e} | tok/s/dev {rate(scalars['tokens_per_sec_per_device'])} | mfu {mfu} | "
            f"mem {scalars['memory_gib']:.2f} GiB ({mem_kind}) | step {scalars['step_time_s']:.3f}s"
        )

    def record_validation(self, step: int, loss: float, perplexity: float, seconds: float) -> None:
        """Record the held-out loss measured after ``step`` (``loop.held_out``): one line
        ``validation step N | loss ... | perplexity ... | seconds``, a ``{"event": "validation", ...}``
        JSON line (the loss at full precision), and ``validation/loss`` and ``validation/perplexity``
        at ``step`` in TensorBoard and W&B (rank 0)."""
        self._check_open()
        if not self.writes:
            return
        self.logger.info(f"validation step {step} | loss {loss:.6f} | perplexity {perplexity:.4f} | {seconds:.3f}s")
        self._write_json(
            {"event": "validation", "step": step, "loss": loss, "perplexity": perplexity, "seconds": seconds}
        )
        self._add_scalars({"validation/loss": loss, "validation/perplexity": perplexity}, step)

    def log_event(self, message: str, **scalars: Any) -> None:
        """Log one-off information, e.g. ``log_event("trace", trace_seconds=3.2, graph_nodes=5120)``.

        Rank 0 logs one INFO line ``"<message> | name value | ..."``. Numeric values
        (and numeric values inside mappings, flattened as ``name/key``, e.g.
        collective counts by type) also go to TensorBoard as ``setup/<name>`` at
        step 0. Non-numeric values only appear in the line. Other ranks do nothing.
        """
        self._check_open()
        if not self.writes:
            return
        parts = [message] + [f"{name} {_format_value(value)}" for name, value in scalars.items()]
        self.logger.info(" | ".join(parts))
        self._write_json({"event": message, **scalars})
        if self._writer is not None:
            for name, value in scalars.items():
                for tag, number in _numeric_scalars(name, value):
                    self._writer.add_scalar(f"setup/{tag}", number, global_step=0)
            self._writer.flush()
        if self._wandb is not None:
            self._wandb.add_setup_scalars(dict(t for name, v in scalars.items() for t in _numeric_scalars(name, v)))

    def record_event(self, message: str, **values: Any) -> None:
        """Write ``{"event": message, **values}`` to ``metrics.jsonl`` only (rank 0, with
        ``json_lines``): the machine-readable twin of something logged in words elsewhere."""
        self._check_open()
        self._write_json({"event": message, **values})

    def _write_json(self, record: dict[str, Any]) -> None:
        if self._json_file is not None:
            self._json_file.write(json.dumps(record, default=_json_value) + "\n")
            self._json_file.flush()

    def close(self) -> None:
        """Flush and close the loss file, the JSON lines and the TensorBoard writer; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for f in (self._loss_file, self._json_file):
            if f is not None:
                f.close()
        self._loss_file = self._json_file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
