"""Metrics: loss file, log cadence, throughput/MFU arithmetic, TensorBoard, helpers."""

import logging
import math
import os

import pytest
import torch

from graph_trainer.errors import ConfigError
from graph_trainer.loop.metrics import (
    ForwardBackwardTimer,
    MetricsLogger,
    peak_flops_per_device,
    peak_memory_bytes,
    rate,
    setup_logging,
)

CPU = torch.device("cpu")


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


class ListHandler(logging.Handler):
    """Keeps the formatted messages it receives."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def capture():
    log = logging.getLogger("test_metrics.capture")
    log.setLevel(logging.DEBUG)
    log.propagate = False
    handler = ListHandler()
    log.addHandler(handler)
    yield log, handler
    log.removeHandler(handler)


def make(tmp_path, log, *, rank=0, log_freq=1, tb=False, peak=None, clock=None, **kw):
    return MetricsLogger(
        dump_folder=str(tmp_path / "dump"),
        log_freq=log_freq,
        enable_tensorboard=tb,
        rank=rank,
        device=CPU,
        flops_per_token=6_000,
        peak_flops=peak,
        logger=log,
        clock=clock or FakeClock(),
        **kw,
    )


def test_losses_file_round_trips_exactly(tmp_path, capture):
    log, _ = capture
    losses = [10.123456789012345, 1 / 3, 2.5e-17, 7.0, float(torch.tensor(0.1, dtype=torch.float32))]
    with make(tmp_path, log, log_freq=100) as m:
        for step, loss in enumerate(losses, start=1):
            m.record_step(step=step, loss=loss, grad_norm=1.0, lr=1e-3, ntokens=8, step_time_s=0.1)
    text = (tmp_path / "dump" / "losses.txt").read_text()
    assert text == "".join(f"{s} {loss!r}\n" for s, loss in enumerate(losses, start=1))
    for line, loss in zip(text.splitlines(), losses, strict=True):
        assert float(line.split()[1]) == loss


def test_losses_truncated_by_default_and_appended_on_resume(tmp_path, capture):
    log, _ = capture
    with make(tmp_path, log) as m:
        m.record_step(step=1, loss=5.0, grad_norm=1.0, lr=1e-3, ntokens=8, step_time_s=0.1)
    with make(tmp_path, log) as m:
        m.record_step(step=1, loss=4.0, grad_norm=1.0, lr=1e-3, ntokens=8, step_time_s=0.1)
    assert (tmp_path / "dump" / "losses.txt").read_text() == "1 4.0\n"
    with make(tmp_path, log, append_losses=True) as m:
        m.record_step(step=2, loss=3.0, grad_norm=1.0, lr=1e-3, ntokens=8, step_time_s=0.1)
    assert (tmp_path / "dump" / "losses.txt").read_text() == "1 4.0\n2 3.0\n"


def test_log_cadence_and_line_format(tmp_path, capture):
    log, handler = capture
    logged = []
    with make(tmp_path, log, log_freq=4) as m:
        for step in range(1, 11):
            out = m.record_step(step=step, loss=6.0, grad_norm=1.2345, lr=8e-4, ntokens=16, step_time_s=0.5)
            if out is not None:
                logged.append(step)
    assert logged == [1, 4, 8]
    assert [line.split(" | ")[0] for line in handler.lines] == ["step 1", "step 4", "step 8"]
    line = handler.lines[-1]
    assert "loss 6.000000 | grad_norm 1.2345 | lr 8.00e-04 | tok/s/dev " in line
    assert "| mfu n/a |" in line and "GiB (peak rss)" in line and line.endswith("step 0.500s")


def test_throughput_and_mfu_arithmetic(tmp_path, capture):
    log, handler = capture
    clock = FakeClock(1000.0)
    peak, fpt, ntok, ndev = 2e7, 6_000, 4096, 2
    m = make(tmp_path, log, log_freq=3, peak=peak, clock=clock, num_devices_per_replica=ndev)
    m.flops_per_token = fpt

    # Step 1: its window is the step itself (call time minus step_time_s).
    clock.now += 2.0
    out = m.record_step(step=1, loss=9.0, grad_norm=2.0, lr=1e-4, ntokens=ntok, step_time_s=1.5)
    tps = ntok / 1.5 / ndev
    assert out["tokens_per_sec_per_device"] == pytest.approx(tps)
    assert out["mfu_percent"] == pytest.approx(100 * fpt * tps / peak)
    assert "tok/s/dev 1,365 | mfu 40.96%" in handler.lines[-1]

    # Steps 2 and 3: the window runs from step 1's call to step 3's call.
    clock.now += 0.7
    assert m.record_step(step=2, loss=8.0, grad_norm=2.0, lr=1e-4, ntokens=ntok, step_time_s=0.6) is None
    clock.now += 0.9
    out = m.record_step(step=3, loss=7.0, grad_norm=2.0, lr=1e-4, ntokens=ntok, step_time_s=0.8)
    tps = 2 * ntok / (0.7 + 0.9) / ndev
    assert out["tokens_per_sec_per_device"] == pytest.approx(tps)
    assert out["mfu_percent"] == pytest.approx(100 * fpt * tps / peak)
    assert set(out) == {
        "loss",
        "grad_norm",
        "lr",
        "tokens_per_sec_per_device",
        "mfu_percent",
        "memory_gib",
        "step_time_s",
    }
    assert out["loss"] == 7.0 and out["step_time_s"] == 0.8
    assert out["memory_gib"] == pytest.approx(peak_memory_bytes(CPU) / 2**30, rel=0.1)
    m.close()


def test_rates_below_100_keep_three_significant_digits():
    # (a first step that compiles for minutes moves under one token a second: not "0")
    printed = [rate(x) for x in (1365.4, 100.0, 99.94, 43.21, 0.4267, 0.0)]
    assert printed == ["1,365", "100", "99.9", "43.2", "0.427", "0"]


def test_mfu_absent_without_peak(tmp_path, capture):
    log, handler = capture
    with make(tmp_path, log, peak=None) as m:
        out = m.record_step(step=1, loss=1.0, grad_norm=1.0, lr=1.0, ntokens=8, step_time_s=0.25)
    assert "mfu_percent" not in out
    assert "| mfu n/a |" in handler.lines[-1]


def test_nonzero_rank_writes_nothing_but_returns_metrics(tmp_path, capture):
    log, handler = capture
    with make(tmp_path, log, rank=1, tb=True, peak=1e12) as m:
        out = m.record_step(step=1, loss=3.0, grad_norm=1.0, lr=1e-3, ntokens=8, step_time_s=0.5)
        m.log_event("trace", graph_nodes=10)
    assert not (tmp_path / "dump").exists()
    assert out["loss"] == 3.0 and out["tokens_per_sec_per_device"] == pytest.approx(16.0)
    assert "mfu_percent" in out
    assert all(not line.startswith("trace") for line in handler.lines)


def test_tensorboard_events(tmp_path, capture):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log, handler = capture
    losses = {1: 5.5, 2: 5.25, 4: 4.75}
    with make(tmp_path, log, log_freq=2, tb=True) as m:
        m.log_event("trace", trace_seconds=1.5, graph_nodes=1234, collectives={"all_reduce": 3}, mode="graph")
        for step in range(1, 5):
            m.record_step(step=step, loss=losses.get(step, 5.0), grad_norm=1.0, lr=1e-3, ntokens=8, step_time_s=0.1)
            if step % 2 == 0:
                m.record_validation(step, loss=step / 4, perplexity=math.exp(step / 4), seconds=0.5)
    assert handler.lines[-1] == "validation step 4 | loss 1.000000 | perplexity 2.7183 | 0.500s"
    assert (
        handler.lines[0] == "trace | trace_seconds 1.5 | graph_nodes 1,234 | collectives {all_reduce: 3} | mode graph"
    )
    tb_dir = tmp_path / "dump" / "tb"
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tb_dir))
    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss", "grad_norm", "lr", "tokens_per_sec_per_device", "memory_gib", "step_time_s"} <= tags
    assert "mfu_percent" not in tags  # unknown peak on CPU
    assert {"setup/trace_seconds", "setup/graph_nodes", "setup/collectives/all_reduce"} <= tags
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(s, pytest.approx(loss)) for s, loss in losses.items()]
    assert [(e.step, e.value) for e in acc.Scalars("setup/graph_nodes")] == [(0, 1234.0)]
    assert [(e.step, e.value) for e in acc.Scalars("validation/loss")] == [(2, 0.5), (4, 1.0)]
    assert [e.step for e in acc.Scalars("validation/perplexity")] == [2, 4]


def test_json_lines_hold_logged_steps_and_events(tmp_path, capture):
    import json

    log, handler = capture
    with make(tmp_path, log, log_freq=2, json_lines=True) as m:
        m.log_event("trace", trace_seconds=1.5, collectives={"all_reduce": 3}, mode="graph")
        m.record_event("memory estimate", peak_bytes=1 << 30, count=torch.tensor(7))
        for step in range(1, 4):
            m.record_step(
                step=step,
                loss=5.0 - step,
                grad_norm=1.0,
                lr=1e-3,
                ntokens=8,
                step_time_s=0.1,
                **({"forward_backward_s": 0.075} if step == 2 else {}),
            )
    records = [json.loads(line) for line in (tmp_path / "dump" / "metrics.jsonl").read_text().splitlines()]
    assert records[0] == {"event": "trace", "trace_seconds": 1.5, "collectives": {"all_reduce": 3}, "mode": "graph"}
    assert records[1] == {"event": "memory estimate", "peak_bytes": 1 << 30, "count": 7}
    assert [r["step"] for r in records[2:]] == [1, 2]  # the logged steps only
    assert records[3]["loss"] == 3.0 and records[3]["forward_backward_s"] == 0.075
    assert "forward_backward_s" not in records[2]
    assert not any(line.startswith("memory estimate") for line in handler.lines)  # record_event is JSON only
    with make(tmp_path, log, json_lines=True, append_losses=True) as m:  # a resumed run appends
        m.record_step(step=4, loss=1.0, grad_norm=1.0, lr=1e-3, ntokens=8, step_time_s=0.1)
    assert len((tmp_path / "dump" / "metrics.jsonl").read_text().splitlines()) == 5


def test_no_json_lines_unless_asked(tmp_path, capture):
    with make(tmp_path, capture[0]) as m:
        m.record_event("memory estimate", peak_bytes=1)
        m.record_step(step=1, loss=1.0, grad_norm=1.0, lr=1.0, ntokens=1, step_time_s=1.0)
    assert not (tmp_path / "dump" / "metrics.jsonl").exists()


def test_forward_backward_timer_sums_blocks_until_popped_on_cpu(monkeypatch):
    import graph_trainer.loop.metrics as metrics

    clock = iter([10.0, 10.5, 20.0, 20.25, 30.0, 31.0])
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    timer = ForwardBackwardTimer(CPU)
    for _ in range(2):
        with timer:
            pass
    first = timer.pop_seconds()
    with timer:
        pass
    assert (first, timer.pop_seconds(), timer.pop_seconds()) == (0.75, 1.0, 0.0)


def test_close_is_idempotent_and_final(tmp_path, capture):
    log, _ = capture
    m = make(tmp_path, log, tb=True)
    m.close()
    m.close()
    with pytest.raises(RuntimeError):
        m.record_step(step=1, loss=1.0, grad_norm=1.0, lr=1.0, ntokens=1, step_time_s=1.0)


def test_invalid_log_freq(tmp_path, capture):
    with pytest.raises(ConfigError):
        make(tmp_path, capture[0], log_freq=0)


def test_peak_flops_per_device():
    assert peak_flops_per_device(CPU, None) is None
    assert peak_flops_per_device(CPU, 0.0) is None
    assert peak_flops_per_device(CPU, 123.5) == pytest.approx(123.5e12)
    with pytest.raises(ConfigError):
        peak_flops_per_device(CPU, -1.0)


def test_peak_memory_bytes_cpu():
    before = peak_memory_bytes(CPU)
    assert isinstance(before, int) and before > 1 << 20  # a Python process with torch exceeds 1 MiB
    assert peak_memory_bytes(CPU) >= before


def test_setup_logging_idempotent_and_rank_levels():
    log = setup_logging(0)
    n = len(log.handlers)
    assert setup_logging(0) is log and len(log.handlers) == n
    assert log.name == "graph_trainer" and log.isEnabledFor(logging.INFO) and not log.propagate
    # Ours, not whatever capture handler pytest attached to the logger in an earlier test.
    handler = next(h for h in log.handlers if getattr(h, "_graph_trainer_handler", False))
    record = logging.LogRecord("graph_trainer", logging.INFO, __file__, 1, "hello", None, None)
    text = handler.format(record)
    assert text.startswith("[rank0] ") and text.endswith(" INFO hello")

    setup_logging(1)
    assert len(log.handlers) == n
    assert not log.isEnabledFor(logging.INFO) and log.isEnabledFor(logging.WARNING)
    assert handler.format(record).startswith("[rank1] ")
    setup_logging(1, logging.DEBUG)
    assert log.isEnabledFor(logging.DEBUG)
    setup_logging(0)  # leave the default for other tests
    assert log.isEnabledFor(logging.INFO)
