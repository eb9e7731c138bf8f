"""Long-job reliability (issue 18), one section per numbered item: NaN, corrupt checkpoints, crafted
checkpoints, fresh starts beside checkpoints, flag spelling, stuck ranks, bad inputs, leftovers.

Most cases run one eager process in this process (a step is ~0.3 s); the ones that need a real
exit code, a resource limit or several ranks run ``train.py`` (under torchrun for the latter).
``scripts/fault_injection.py`` kills and corrupts in a loop; these tests pin each behaviour.
Modules added for issue 18 are imported inside the tests that use them, so that this file also
runs against the code before it (each behavioural test then fails on the behaviour).
"""

from __future__ import annotations

import builtins
import contextlib
import json
import logging
import os
import pickle
import re
import resource
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from graph_trainer.checkpoint import Checkpointer, complete_steps
from graph_trainer.config_loading import load_config
from graph_trainer.validation import validate_config
from graph_trainer.errors import ConfigError
from graph_trainer.trainer import Trainer
from tests.conftest import ROOT
from tests.launch import FAST_ARGS, read_losses, run_torchrun

EAGER = [*FAST_ARGS, "--compile.mode", "eager"]
DEBUG_TOML = os.path.join(ROOT, "configs", "llama3_debug.toml")


def _trainer(folder, *args) -> Trainer:
    cfg = load_config([*EAGER, "--job.dump_folder", str(folder), *args])
    validate_config(cfg)
    return Trainer(cfg)


def _train_py(*args, preexec_fn=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout, preexec_fn=preexec_fn,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT})


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


@contextlib.contextmanager
def _warnings():
    """The graph_trainer logger's WARNING lines while inside (it does not propagate to pytest)."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler = Keep(logging.WARNING)
    log = logging.getLogger("graph_trainer")
    log.addHandler(handler)
    try:
        yield lines
    finally:
        log.removeHandler(handler)


@contextlib.contextmanager
def _immutable(path):
    """``path`` read-only even for root (``chattr +i``), or skip where the file system cannot."""
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory):
    """An eager one-process run of 3 steps saving every step: step-1..3 and its losses.txt."""
    folder = tmp_path_factory.mktemp("three_steps")
    _trainer(folder, "--training.steps", "3", "--checkpoint.interval", "1").train()
    return folder


def _copy(three_steps, tmp_path):
    job = tmp_path / "job"
    shutil.copytree(three_steps, job)
    return job


# ------------------------------------------------------------------ 1. NaN is never detected

@pytest.mark.parametrize("field, value", [
    ("training.weight_decay", "inf"), ("training.eps", "inf"), ("training.lr", "nan"), ("training.beta2", "nan"),
    ("training.max_norm", "inf"), ("training.min_lr_ratio", "nan"), ("metrics.peak_tflops", "inf"),
    ("comm.timeout_seconds", "inf"),
])
def test_non_finite_hyper_parameters_are_rejected(field, value):
    with pytest.raises(ConfigError) as info:
        validate_config(load_config([f"--{field}", value]))
    assert str(info.value) == f"{field} = {float(value)} must be a finite number"


def test_check_step_names_the_step_and_the_first_non_finite_parameter():
    from graph_trainer.errors import NonFiniteError
    from graph_trainer.guards import check_step

    good = torch.nn.Parameter(torch.ones(3))
    bad = torch.nn.Parameter(torch.tensor([1.0, float("inf")]))
    named = [("layers.0.parametrizations.weight.original", good), ("layers.1.weight", bad)]
    check_step(7, 2.5, 1.0, named)  # finite: nothing happens
    with pytest.raises(NonFiniteError) as info:
        check_step(7, float("nan"), 1.0, named)
    assert str(info.value).startswith("step 7: non-finite loss nan; first non-finite parameter: layers.1.weight ")
    bad.data.fill_(1.0)
    good.grad = torch.tensor([0.0, float("nan"), 0.0])
    with pytest.raises(NonFiniteError, match=r"^step 8: non-finite gradient norm nan; first non-finite gradient: "
                                             r"layers\.0\.weight;"):
        check_step(8, 2.5, float("nan"), named)


def _saved_tensors_finite(step_dir) -> bool:
    import torch.distributed.checkpoint as dcp

    from graph_trainer.safe_metadata import load_dcp_metadata, metadata_path, safe_reader

    index = load_dcp_metadata(metadata_path(str(step_dir))).state_dict_metadata
    state = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in index.items()}
    dcp.load(state, storage_reader=safe_reader(str(step_dir)), no_dist=True)
    return all(bool(torch.isfinite(t).all()) for t in state.values())


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to load in a single process")
def test_huge_learning_rate_stops_the_job_before_any_non_finite_checkpoint(tmp_path):
    result = _train_py(*EAGER, "--job.dump_folder", str(tmp_path), "--training.steps", "6",
                       "--checkpoint.interval", "1", "--training.lr", "1e6")
    assert result.returncode == 1, result.stderr
    errors = _errors(result.stderr)
    assert len(errors) == 1 and result.stderr.rstrip().endswith(errors[0]), result.stderr
    match = re.match(r"error: step (\d+): (non-finite (loss|gradient norm) .*; first non-finite (parameter|gradient): "
                     r"\S+|the state to checkpoint is not finite)", errors[0])
    assert match, errors[0]
    step = int(match.group(1))
    saved = complete_steps(str(tmp_path / "checkpoint"))
    assert saved == list(range(1, step)) or saved == list(range(1, step + 1))[:-1]
    assert all(_saved_tensors_finite(tmp_path / "checkpoint" / f"step-{s}") for s in saved)
    losses = read_losses(tmp_path)
    assert [s for s, _ in losses] == list(range(1, step + (0 if "non-finite" in errors[0] else 1)))
    assert all(torch.isfinite(torch.tensor(v)) for _, v in losses)


# ------------------------------------------------------------------ 2. corrupt checkpoints load silently

def _flip(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        data = f.read(4)
        f.seek(os.path.getsize(path) // 2)
        f.write(bytes(b ^ 0xFF for b in data))


def _edit_a_hash(path):
    text = open(path).read()
    at = text.index('"sha256": "') + len('"sha256": "')
    open(path, "w").write(text[:at] + ("0" if text[at] != "0" else "1") + text[at + 1:])


CORRUPTIONS = {
    "flip": ("__0_0.distcp", _flip),
    "truncate": ("__0_0.distcp", lambda p: os.truncate(p, os.path.getsize(p) // 2)),
    "empty": ("__0_0.distcp", lambda p: os.truncate(p, 0)),
    "missing": ("__0_0.distcp", os.remove),
    "metadata": (".metadata", _flip),
    "manifest": ("manifest.json", _edit_a_hash),
}


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_corrupt_checkpoint_is_named_and_the_newest_good_one_resumes_bitwise(tmp_path, three_steps, kind):
    job = _copy(three_steps, tmp_path)
    name, damage = CORRUPTIONS[kind]
    damage(job / "checkpoint" / "step-3" / name)
    with pytest.raises(ConfigError) as info:  # asked for exactly that step: one line naming the file
        _trainer(job, "--training.steps", "3", "--checkpoint.load_step", "3")
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"checkpoint {job / 'checkpoint' / 'step-3'} fails "
                                                       f"verification: ") and name in message, message
    reference = (job / "losses.txt").read_text()
    with _warnings() as warned:
        trainer = _trainer(job, "--training.steps", "3", "--checkpoint.interval", "1")
    assert trainer.step == 2
    assert any(w.startswith(f"checkpoint {job / 'checkpoint' / 'step-3'} fails verification: ") and name in w
               for w in warned), warned
    assert f"resuming from {job / 'checkpoint' / 'step-2'}, the newest checkpoint that verifies" in warned
    trainer.train()
    assert (job / "losses.txt").read_text() == reference  # step 3 again, bitwise: nothing corrupt was loaded
    assert complete_steps(str(job / "checkpoint")) == [1, 2, 3]
    assert [p for p in os.listdir(job / "checkpoint") if p.startswith("step-3.corrupt-")]  # kept, renamed


def test_no_checkpoint_that_verifies_is_refused_and_nothing_moves(tmp_path, three_steps):
    job = _copy(three_steps, tmp_path)
    for step in (1, 2, 3):
        _flip(job / "checkpoint" / f"step-{step}" / "__0_0.distcp")
    with pytest.raises(ConfigError, match=r"^no checkpoint in .* verifies \(step-3: __0_0.distcp differs"):
        _trainer(job, "--training.steps", "4")
    assert sorted(os.listdir(job / "checkpoint")) == ["step-1", "step-2", "step-3"]


def test_checkpoints_without_a_manifest_are_not_loaded_until_sealed(tmp_path, three_steps):
    # Saved before manifests existed (or by something else): they cannot be verified, so never loaded
    # unverified; sealing one you trust makes it loadable.
    job = _copy(three_steps, tmp_path)
    for step in (1, 2, 3):
        os.remove(job / "checkpoint" / f"step-{step}" / "manifest.json")
    with pytest.raises(ConfigError, match=r"holds checkpoints without manifest.json \(step-1, step-2, step-3\)"):
        _trainer(job, "--training.steps", "4")
    _seal(job / "checkpoint" / "step-3")
    assert _trainer(job, "--training.steps", "4").step == 3


def test_manifest_cli_verifies_and_seals(tmp_path, three_steps, capsys):
    from graph_trainer import manifest

    job = _copy(three_steps, tmp_path)
    step = str(job / "checkpoint" / "step-3")
    assert manifest.main(["verify", step]) == 0
    _flip(os.path.join(step, "__0_0.distcp"))
    assert manifest.main(["verify", step]) == 1
    assert "__0_0.distcp differs from what was saved" in capsys.readouterr().out


# ------------------------------------------------------------------ 3. resuming runs code from the folder

def _seal(folder) -> None:
    """Rewrite the manifest of a checkpoint folder as it is now (before issue 18 there was none)."""
    try:
        from graph_trainer import manifest
    except ImportError:
        return
    manifest.seal(str(folder))


def test_crafted_metadata_is_refused_with_one_line_and_nothing_runs(tmp_path, three_steps):
    job = _copy(three_steps, tmp_path)
    step = job / "checkpoint" / "step-3"
    marker = tmp_path / "ran"

    class Payload:  # what a crafted .metadata holds: a call to run at unpickling time
        def __reduce__(self):
            return exec, (f"open({str(marker)!r}, 'w').close()",)

    (step / ".metadata").write_bytes(pickle.dumps(Payload()))
    _seal(step)  # whoever can write the folder can write a matching manifest too
    with pytest.raises(ConfigError) as info:
        _trainer(job, "--training.steps", "4")
    assert str(info.value) == (f"{step / '.metadata'} refers to builtins.exec, which checkpoint metadata never "
                               f"holds; refusing to load it (nothing in it was run). Only load checkpoints you or "
                               f"your jobs wrote")
    assert not marker.exists()
    pickle.loads((step / ".metadata").read_bytes())  # what DCP's reader does with it: the code runs
    assert marker.exists()


def test_non_tensor_entries_are_refused(tmp_path):
    # DCP reads a non-tensor entry back with torch.load(weights_only=False); graph_trainer never saves one.
    import torch.distributed.checkpoint as dcp

    from graph_trainer.safe_metadata import UnsafeCheckpointError, load_dcp_metadata

    with pytest.warns(UserWarning):
        dcp.save({"w": torch.ones(2), "extra": {"a": 1}}, storage_writer=dcp.FileSystemWriter(str(tmp_path)),
                 no_dist=True)
    with pytest.raises(UnsafeCheckpointError, match="BytesStorageMetadata"):
        load_dcp_metadata(str(tmp_path / ".metadata"))


# ------------------------------------------------------------------ 4. a fresh start mixes runs

def test_fresh_start_beside_checkpoints_is_refused_or_moves_them_aside(tmp_path, three_steps):
    job = _copy(three_steps, tmp_path)
    root = job / "checkpoint"
    fresh = ("--training.steps", "2", "--checkpoint.interval", "1", "--checkpoint.load_step", "0", "--training.seed", "7")
    with pytest.raises(ConfigError) as info:
        _trainer(job, *fresh)
    assert str(info.value).startswith(f"checkpoint.load_step = 0 starts fresh, but {root} holds checkpoints "
                                      f"(step-1, step-2, step-3) of an earlier run")
    with pytest.raises(ConfigError, match=r"^checkpoint.load_step = 1 continues step-1, but .* later steps "
                                          r"\(step-2, step-3\)"):
        _trainer(job, "--training.steps", "2", "--checkpoint.interval", "1", "--checkpoint.load_step", "1")
    assert complete_steps(str(root)) == [1, 2, 3]
    old_losses = (job / "losses.txt").read_text()

    _trainer(job, *fresh, "--checkpoint.move_aside", "True").train()
    assert complete_steps(str(root)) == [1, 2]
    aside, = [job / p for p in os.listdir(job) if p.startswith("checkpoint.aside-")]
    assert sorted(os.listdir(aside)) == ["losses.txt", "step-1", "step-2", "step-3"]
    assert (aside / "losses.txt").read_text() == old_losses  # nothing lost
    new_losses = read_losses(job)
    assert [s for s, _ in new_losses] == [1, 2]  # losses.txt describes this run only
    assert new_losses[1][1] != float(old_losses.splitlines()[1].split()[1])
    # The next default run continues this run (step 2), not the old run's step 3.
    assert _trainer(job, "--training.steps", "3", "--training.seed", "7").step == 2


# ------------------------------------------------------------------ 5. --job.config-file is ignored

@pytest.mark.parametrize("argv", [
    ["--job.config-file", DEBUG_TOML], [f"--job.config-file={DEBUG_TOML}"], ["--job.config_file", DEBUG_TOML],
])
def test_config_file_flag_in_either_spelling(argv):
    cfg = load_config([*argv, "--training.local-batch-size", "3"])
    assert (cfg.training.steps, cfg.training.seq_len, cfg.training.local_batch_size) == (40, 128, 3)


def test_every_entry_point_accepts_either_spelling(tmp_path, capsys):
    from graph_trainer.config_loading import normalize_flags

    assert normalize_flags(["--a-b.c-d", "x-y", "--e-f=g-h", "-1", "--"]) == ["--a_b.c_d", "x-y", "--e_f=g-h", "-1", "--"]
    from graph_trainer import analyze

    assert analyze.main(["--device-memory-gib", "lots"]) == 2  # read as --device_memory_gib, before any tracing
    assert "--device_memory_gib 'lots' is not a number" in capsys.readouterr().err
    import integration_tests

    assert integration_tests.main([str(tmp_path), "--suite", "cpu", "--list", "--test-name", "single_graph"]) == 0
    assert capsys.readouterr().out.startswith("single_graph: 1 proc")


# ------------------------------------------------------------------ 6. a stuck rank hangs the job

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
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(ROOT, "train.py"), *EAGER, "--job.dump_folder", str(tmp_path), "--training.steps", "100000",
           "--comm.timeout_seconds", "3"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT})
    try:
        deadline = time.monotonic() + 240
        while not ((tmp_path / "losses.txt").is_file() and len(read_losses(tmp_path)) >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "slow"
            time.sleep(0.2)
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
    assert line is not None and re.match(r"error: rank 0: step \d+: a collective waited more than 3 s "
                                         r"\(comm.timeout_seconds / comm.init_timeout_seconds\) for another rank", line)
    assert 3 <= reported - stopped < 3 + 10, reported - stopped  # the timeout, plus at most a step
    assert proc.returncode != 0
    # torchrun then SIGTERMs the stopped rank, which acts on it only when continued: torchrun
    # SIGKILLs it after its 30 s grace. (A rank stuck but not stopped dies of the SIGTERM at once.)
    assert ended - reported < 30 + 15


# ------------------------------------------------------------------ 7. tracebacks instead of one line

def _bad_input(case: str, tmp) -> tuple[list[str], str]:
    """(train.py arguments, expected start of the error line) for one bad input."""
    out = ["--job.dump_folder", str(tmp / "out")]
    a_file = tmp / "a_file"
    a_file.write_text("x")
    if case == "non_utf8_config":
        (tmp / "job.toml").write_bytes(b"[training]\nsteps = 3 # caf\xe9\n")
        return ["--job.config_file", str(tmp / "job.toml"), *out], f"error: {tmp / 'job.toml'} is not UTF-8 text"
    if case == "dump_folder_is_a_file":
        return [*EAGER, "--job.dump_folder", str(a_file)], f"error: job.dump_folder = '{a_file}' is a file, not a folder"
    if case == "checkpoint_folder_is_a_file":
        return ([*EAGER, *out, "--checkpoint.folder", str(a_file), "--checkpoint.interval", "1"],
                f"error: checkpoint.folder = '{a_file}' is a file, not a folder")
    if case == "graph_dump_folder_is_a_file":
        return ([*EAGER, *out, "--compile.dump_graphs", str(a_file)],
                f"error: compile.dump_graphs = '{a_file}' is a file, not a folder")
    if case == "huge_num_threads":
        return [*EAGER, *out, "--debug.num_threads", "1000000000"], "error: debug.num_threads = 1000000000 is more than"
    if case == "huge_batch":
        return ([*EAGER, *out, "--training.local_batch_size", "1000000000"],
                "error: training.local_batch_size = 1000000000 with seq_len 64 needs at least")
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["non_utf8_config", "dump_folder_is_a_file", "checkpoint_folder_is_a_file",
                                  "graph_dump_folder_is_a_file", "huge_num_threads", "huge_batch"])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, case):
    import train

    args, expected = _bad_input(case, tmp_path)
    assert train.main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), lines


def test_folder_that_is_not_writable_is_one_line_exit_2(tmp_path, capsys):
    import train

    locked = tmp_path / "locked"
    locked.mkdir()
    with _immutable(locked):
        assert train.main([*EAGER, "--job.dump_folder", str(locked / "out")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"error: cannot create job.dump_folder = '{locked / 'out'}': Operation not permitted"]


def test_read_only_checkpoint_folder_during_a_save_is_one_job_error(tmp_path):
    from graph_trainer.errors import JobError

    trainer = _trainer(tmp_path, "--training.steps", "2", "--checkpoint.interval", "1")
    root = tmp_path / "checkpoint"
    root.mkdir(exist_ok=True)
    with _immutable(root), pytest.raises(JobError) as info:
        trainer.train()
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"cannot save checkpoint {root / 'step-1'}: Operation not "
                                                      f"permitted"), message
    assert message.endswith("(earlier checkpoints are intact)")
    assert os.listdir(root) == [] and [s for s, _ in read_losses(tmp_path)] == [1]


def _small_files():
    # A full disk, as far as this process can tell: any file grows to 4 MiB at most (EFBIG, not SIGXFSZ).
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, 4 << 20))


def test_disk_full_during_a_save_is_one_line_exit_1_and_nothing_is_lost(tmp_path):
    result = _train_py(*EAGER, "--job.dump_folder", str(tmp_path), "--training.steps", "2",
                       "--checkpoint.interval", "1", preexec_fn=_small_files)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    errors = _errors(result.stderr)
    assert errors == [result.stderr.strip().splitlines()[-1]]
    assert errors[0].startswith(f"error: cannot save checkpoint {tmp_path / 'checkpoint' / 'step-1'}: File too large")
    assert os.listdir(tmp_path / "checkpoint") == []  # the half-written save is gone
    assert [s for s, _ in read_losses(tmp_path)] == [1]  # what the job did is kept


def _timed_stderr(cmd) -> tuple[list[tuple[float, str]], float, int]:
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT})
    lines = [(time.monotonic(), line.rstrip("\n")) for line in proc.stderr]
    proc.wait(timeout=120)
    return lines, time.monotonic(), proc.returncode


def test_config_error_under_torchrun_is_the_first_line_and_the_reports_cause(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(ROOT, "train.py"), *EAGER, "--job.dump_folder", str(tmp_path), "--training.steps", "-1"]
    lines, ended, code = _timed_stderr(cmd)
    text = "\n".join(line for _, line in lines)
    assert code == 1
    assert lines[0][1] == "error: training.steps = -1 must be >= 1", text
    assert [line for _, line in lines if line.startswith("error: ")] == [lines[0][1]]  # one process reported it
    root_cause = text.split("Root Cause")[-1]
    assert re.findall(r"exitcode\s*:\s*(-?\d+)", root_cause) == ["2"], text
    assert "traceback : error: training.steps = -1 must be >= 1" in root_cause, text
    assert ended - lines[0][0] < 5, text  # torchrun's report follows at once


@pytest.mark.filterwarnings("ignore:.*assuming the intent")
def test_nan_under_torchrun_stops_every_rank_with_one_line(tmp_path):
    result = run_torchrun(2, os.path.join(ROOT, "train.py"), *EAGER, "--job.dump_folder", str(tmp_path),
                          "--training.steps", "6", "--checkpoint.interval", "1", "--training.lr", "1e6", check=False)
    assert result.returncode == 1
    errors = _errors(result.stderr)
    assert len(errors) == 1 and re.match(r"error: step \d+: (non-finite|the state to checkpoint)", errors[0]), errors
    # The only traceback is torchrun's own (its failure report), after our line.
    assert result.stderr.count("Traceback") == 1 and result.stderr.index(errors[0]) < result.stderr.index("Traceback")
    root_cause = result.stderr.split("Root Cause")[-1]
    assert re.findall(r"exitcode\s*:\s*(-?\d+)", root_cause) == ["1"]
    assert all(_saved_tensors_finite(tmp_path / "checkpoint" / f"step-{s}")
               for s in complete_steps(str(tmp_path / "checkpoint")))


# ------------------------------------------------------------------ 8. leftovers, re-saves, losses.txt

def test_leftovers_of_interrupted_saves_are_cleaned_at_the_next_start(tmp_path, three_steps):
    job = _copy(three_steps, tmp_path)
    root = job / "checkpoint"
    shutil.copytree(root / "step-3", root / "step-4.tmp-0badc0de")  # a save killed before its rename
    os.rename(root / "step-3", root / "step-3.old-cafe0123")  # a replacement killed between its renames
    trainer = _trainer(job, "--training.steps", "3")
    assert sorted(os.listdir(root)) == ["step-1", "step-2", "step-3"]
    assert trainer.step == 3


class _Killed(Exception):
    """The process dies here (raised by a patched file-system call)."""


def test_resaving_a_step_is_atomic(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path, "--training.steps", "1", "--checkpoint.interval", "1")
    trainer.train()
    final = tmp_path / "checkpoint" / "step-1"
    renames = []
    real_rename = os.rename

    def rename(src, dst):  # the process is killed at the third rename of the run
        renames.append((src, dst))
        if len(renames) == 3:
            raise _Killed
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    for _ in range(2):  # save the same step again, twice: step-1 is never missing, and always complete
        trainer.checkpointer.save(1, trainer.model, trainer.optimizer, trainer.scheduler, trainer.dataloader)
        assert complete_steps(str(final.parent)) == [1]
    assert sorted(os.listdir(final.parent)) == ["step-1"]


def test_replace_dir_fallback_is_recovered_at_the_next_start(tmp_path, monkeypatch):
    from graph_trainer.atomic_files import clean_leftovers, replace_dir

    root = tmp_path / "checkpoint"
    (root / "step-1").mkdir(parents=True)
    (root / "step-1" / "f").write_text("old")
    (root / "step-1.tmp-1234abcd").mkdir()
    (root / "step-1.tmp-1234abcd" / "f").write_text("new")
    real_rename = os.rename

    def rename(src, dst):
        real_rename(src, dst)
        if ".old-" in str(dst):
            raise _Killed("between the two renames")

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(_Killed):  # a file system without RENAME_EXCHANGE: two renames
        replace_dir(str(root / "step-1.tmp-1234abcd"), str(root / "step-1"), exchange=lambda a, b: False)
    monkeypatch.setattr(os, "rename", real_rename)
    assert not (root / "step-1").exists()
    done = clean_leftovers(str(root))
    assert sorted(os.listdir(root)) == ["step-1"] and (root / "step-1" / "f").read_text() == "old"
    assert any(d.startswith("restored step-1 from step-1.old-") for d in done)


def test_losses_are_trimmed_atomically(tmp_path, three_steps, monkeypatch):
    job = _copy(three_steps, tmp_path)
    cfg = load_config([*EAGER, "--job.dump_folder", str(job)])
    checkpointer = Checkpointer(cfg, 0, 1, {}, torch.device("cpu"))
    before = (job / "losses.txt").read_text()
    real_open = builtins.open

    class FullDisk:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, _):
            raise OSError(28, "No space left on device")

        writelines = write

    def open_(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        return FullDisk(f) if "w" in mode and str(path).startswith(str(job)) else f

    monkeypatch.setattr(builtins, "open", open_)
    with pytest.raises(OSError):
        checkpointer._trim_losses(1)
    monkeypatch.setattr(builtins, "open", real_open)
    assert (job / "losses.txt").read_text() == before  # the old file, whole
    assert sorted(p for p in os.listdir(job) if p.startswith("losses")) == ["losses.txt"]
    checkpointer._trim_losses(1)
    assert (job / "losses.txt").read_text() == before.splitlines(keepends=True)[0]
