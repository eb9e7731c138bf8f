"""--metrics.enable_wandb (graph_trainer/loop/wandb_writer.py): a job's scalars and resolved config in
a W&B run, written offline and read back from the run's file; a job whose run wandb would not start
is refused before anything is built."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pytest

from graph_trainer.config_loading import load_config
from graph_trainer.errors import ConfigError
from graph_trainer.loop import preflight
from graph_trainer.loop.preflight import check_job
from graph_trainer.trainer import Trainer
from graph_trainer.validation import validate_config
from tests.launch import FAST_ARGS, read_losses

pytest.importorskip("wandb")  # (an optional dependency; CI installs it)


def wandb_records(path: Path) -> list:
    """The protobuf records of an offline W&B run file: after a 7-byte header (':W&B', magic,
    version), records in LevelDB's log format (32 KiB blocks; per piece a 4-byte checksum, a
    2-byte length, a type: 1 whole, 2 first, 3 middle, 4 last)."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, block, partial, pieces = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # (a block's tail too short for a header is padding)
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        payload, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            pieces.append(partial + payload if kind == 4 else payload)
        elif kind in (2, 3):
            partial = payload if kind == 2 else partial + payload
    records = []
    for piece in pieces:
        record = Record()
        record.ParseFromString(piece)
        records.append(record)
    return records


def _items(items) -> dict[str, object]:
    return {i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in items}


def _settled_records(run_file: Path, seconds: float = 30.0) -> list:
    """The run file's records once W&B's writer has written the last history row: on a loaded
    machine its service process may still be writing for a moment after ``finish`` returned (a
    CI run with other jobs beside it read only step 1's row)."""
    deadline = time.monotonic() + seconds
    while True:
        records = wandb_records(run_file)
        rows = [r for r in records if r.WhichOneof("record_type") == "history"]
        if any(r.history.step.num == 4 for r in rows) or time.monotonic() > deadline:
            return records
        time.sleep(0.5)


def test_the_run_holds_every_logged_step_and_the_resolved_config(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    args = [*FAST_ARGS, "--job.dump_folder", str(tmp_path), "--training.steps", "4", "--metrics.log_freq", "2"]
    validation = ["--validation.enable", "True", "--validation.freq", "2", "--validation.steps", "1"]
    cfg = load_config([*args, *validation, "--metrics.enable_wandb", "--job.description", "wandb test"])
    validate_config(cfg)
    Trainer(cfg).train()
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    records = _settled_records(run_file)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == "wandb test"
    config = _items(run.config.update)
    assert config["training"]["steps"] == 4 and config["metrics"]["enable_wandb"] is True
    assert config["model"]["name"] == cfg.model.name
    history = {r.history.step.num: _items(r.history.item) for r in records if r.WhichOneof("record_type") == "history"}
    losses = dict(read_losses(tmp_path))
    assert sorted(history) == [1, 2, 4]  # step 1 and every log_freq-th
    for step, scalars in history.items():
        assert scalars["loss"] == losses[step]  # the float itself (JSON keeps every digit)
        assert {"grad_norm", "lr", "tokens_per_sec_per_device", "memory_gib", "step_time_s"} <= set(scalars)
        assert scalars["validation/perplexity"] == pytest.approx(math.exp(scalars["validation/loss"]))
    summary = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary.update(_items(r.summary.update))
    assert summary["setup/trace_seconds"] > 0 and summary["setup/graph_nodes"] > 0


def test_without_the_package_the_job_is_refused_before_it_builds(monkeypatch):
    cfg = load_config([*FAST_ARGS, "--metrics.enable_wandb"])
    monkeypatch.setattr(preflight.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="metrics.enable_wandb = True needs the optional wandb package"):
        preflight.check_optional_packages(cfg)


@pytest.fixture
def fresh_machine(tmp_path, monkeypatch):
    """W&B as on a fresh machine: no WANDB_* variable, no API key, no .netrc, no settings file."""
    for name in [k for k in os.environ if k.startswith("WANDB_")] + ["NETRC"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.chdir(tmp_path)  # (wandb also reads ./wandb/settings)
    return tmp_path


def _wandb_job(folder) -> list[str]:
    return [*FAST_ARGS, "--metrics.enable_wandb", "--job.dump_folder", str(folder / "out")]


def test_online_without_an_api_key_is_one_line_before_anything_is_built(fresh_machine, monkeypatch, capsys):
    import train

    assert train.main(_wandb_job(fresh_machine)) == 2
    netrc = fresh_machine / "home" / ".netrc"
    assert capsys.readouterr().err.splitlines() == [
        "error: metrics.enable_wandb: W&B mode 'online' uploads the run, but wandb has no API key (WANDB_API_KEY, "
        f"or the entry `wandb login` writes in {netrc}); set one, or WANDB_MODE=offline to write the run to disk "
        "only (`wandb sync` uploads it later)"
    ]
    assert not (fresh_machine / "out" / "losses.txt").exists()
    # what wandb reads credentials from: its .netrc entry, the environment
    netrc.parent.mkdir()
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    check_job(_wandb_job(fresh_machine), 1)
    netrc.unlink()
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    check_job(_wandb_job(fresh_machine), 1)


@pytest.mark.parametrize("mode", ["offline", "disabled", "settings file"])
def test_a_mode_that_does_not_upload_needs_no_api_key(fresh_machine, monkeypatch, mode):
    if mode == "settings file":  # what `wandb offline` writes
        (fresh_machine / "wandb").mkdir()
        (fresh_machine / "wandb" / "settings").write_text("[default]\nmode = offline\n")
    else:
        monkeypatch.setenv("WANDB_MODE", mode)
    check_job(_wandb_job(fresh_machine), 1)


def test_a_mode_wandb_does_not_know_is_refused_naming_its_modes(fresh_machine, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offlne")
    with pytest.raises(ConfigError) as info:
        check_job(_wandb_job(fresh_machine), 1)
    assert str(info.value) == (
        "WANDB_MODE = 'offlne' is not a W&B mode (metrics.enable_wandb); choose one of: "
        "online, offline, shared, disabled, dryrun, run"
    )


def test_a_file_in_place_of_the_run_folder_is_refused(fresh_machine, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    (fresh_machine / "out").mkdir()
    (fresh_machine / "out" / "wandb").write_text("not a folder")
    with pytest.raises(ConfigError) as info:
        check_job(_wandb_job(fresh_machine), 1)
    assert str(info.value) == (
        f"metrics.enable_wandb's run folder = '{fresh_machine / 'out' / 'wandb'}' is a file, not a folder"
    )


def test_a_key_wandb_refuses_at_the_start_of_its_run_is_one_line_on_every_rank(fresh_machine):
    """A key of the wrong form passes the check before building (a key is there) and is refused by
    ``wandb.init`` on rank 0 only: both ranks of the job stop, exit 2, with wandb's reason in one
    line, instead of rank 0's traceback and rank 1 waiting in its next collective."""
    from tests.launch import run_forked
    from train import __file__ as train_py

    env = {k: os.environ[k] for k in ("HOME", "WANDB_CONFIG_DIR")} | {"WANDB_API_KEY": "abc"}
    argv = [*_wandb_job(fresh_machine), "--training.steps", "2"]
    result = run_forked(2, train_py, *argv, check=False, env=env, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: metrics.enable_wandb: wandb did not start the run: AuthenticationError: "
        "WANDB_API_KEY invalid: API key must have 40+ characters, has 3."
    ], result.stderr[-3000:]
    assert "Traceback" not in result.stderr and not (fresh_machine / "out" / "losses.txt").exists()
