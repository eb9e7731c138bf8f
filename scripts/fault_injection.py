"""Kill a training job during checkpoint saves and damage its checkpoints, in a loop; check it never
loses a complete checkpoint and never loads a damaged one.

    .venv/bin/python scripts/fault_injection.py OUT [--runs 14] [--steps 24] [--seed 0] [--nproc 1]

One reference job (``--steps`` steps, uninterrupted) gives the losses every step must have. Then the
same job (a checkpoint every step, default resume: ``checkpoint.load_step -1``) is started ``--runs``
times in ``OUT/job``. Before a start, with probability ``--corrupt``, bytes are flipped in (or cut
from) a random file of a complete checkpoint, mostly the newest, the one the resume would load.
While a job runs it is killed with SIGKILL (every process at once, as a crashed node) at a random
moment during a save, except in the last run, which must finish. Everything is drawn from
``random.Random(seed)``, so a run of the script is reproducible up to the timing of the kills.

Checked after every run, and counted:

* lost complete checkpoints: a ``step-N`` that verified before the run (and was not damaged by
  this script) no longer verifies, or is gone, after it;
* corrupt loads: the job resumed from a damaged checkpoint, or wrote any loss that differs from
  the reference (resuming is bitwise, so a damaged state that slipped through would show there);
* detected corruptions: damaged checkpoints the job named ("fails verification") and set aside;
  the others stay on disk, fail ``graph_trainer.checkpoint.manifest`` verification and are never loaded.

The exit code is 1 if any loss or corrupt load happened, or the last run did not finish.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from graph_trainer.checkpoint.manifest import verify_folder  # noqa: E402
from graph_trainer.config_loading import normalize_flags  # noqa: E402
from suites import debug_job  # noqa: E402

JOB = [*debug_job(), "--compile.mode", "eager", "--metrics.log_freq", "1", "--checkpoint.interval", "1"]
JOB += ["--checkpoint.keep_latest_k", "0"]
"""The debug LLaMA-3 in eager mode (no trace: starts fast), saving every step (74 MB per save) and
keeping every one: a checkpoint that disappears is a lost one."""


def command(nproc: int, folder: str, steps: int) -> list[str]:
    args = [os.path.join(ROOT, "train.py"), *JOB, "--job.dump_folder", folder, "--training.steps", str(steps)]
    if nproc == 1:
        return [sys.executable, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *args]


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_all(proc: subprocess.Popen) -> None:
    """SIGKILL the job and every process it started (torchrun's workers run in sessions of their own)."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def step_dirs(root: str) -> dict[int, str]:
    if not os.path.isdir(root):
        return {}
    return {int(m.group(1)): os.path.join(root, n) for n in os.listdir(root) if (m := re.match(r"^step-(\d+)$", n))}


def verified(root: str) -> set[int]:
    return {s for s, path in step_dirs(root).items() if verify_folder(path) is None}


def saving(root: str, leftovers: set[str] = frozenset()) -> bool:
    """Whether a save is in progress (a tmp folder other than the leftovers the job found at its start)."""
    return os.path.isdir(root) and any(".tmp-" in n and n not in leftovers for n in os.listdir(root))


def damage(rng: random.Random, path: str) -> str:
    """Flip 1-8 bytes at random offsets of a random file of the checkpoint, or cut it; returns what."""
    files = sorted(os.listdir(path))
    name = rng.choice(files)
    target = os.path.join(path, name)
    size = os.path.getsize(target)
    if size == 0 or rng.random() < 0.2:
        os.truncate(target, rng.randrange(size) if size else 0)
        return f"{name}: cut to fewer bytes"
    with open(target, "r+b") as f:
        for _ in range(rng.randint(1, 8)):
            offset = rng.randrange(size)
            f.seek(offset)
            byte = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([byte ^ rng.randint(1, 255)]))
    return f"{name}: bytes flipped"


def read_losses(folder: str) -> dict[int, str]:
    path = os.path.join(folder, "losses.txt")
    if not os.path.isfile(path):
        return {}
    out = {}
    for line in open(path, encoding="utf-8").read().splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit():
            out[int(parts[0])] = parts[1]
    return out


def run_job(cmd: list[str], log: str, root: str, kill: bool, rng: random.Random, timeout: float) -> dict:
    """Start the job; if ``kill``, SIGKILL it at a random moment of its 1st-3rd save."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    leftovers = set(os.listdir(root)) if os.path.isdir(root) else set()  # the job removes these first
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
        start, killed, during_save = time.monotonic(), False, False
        saves_to_skip, was_saving = rng.randint(0, 2), False
        delay = rng.uniform(0.0, 0.3)
        while proc.poll() is None:
            if time.monotonic() - start > timeout:
                kill_all(proc)
                raise SystemExit(f"job did not finish in {timeout} s: see {log}")
            now_saving = saving(root, leftovers)
            if kill and now_saving and not was_saving:  # a save has just begun
                if saves_to_skip == 0:
                    time.sleep(delay)
                    during_save = saving(root, leftovers)
                    kill_all(proc)
                    killed = True
                    proc.wait()
                    break
                saves_to_skip -= 1
            was_saving = now_saving
            time.sleep(0.002)
    return {"code": proc.wait(), "killed": killed, "during_save": during_save}


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line (the module docstring is its help)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--runs", type=int, default=14)
    parser.add_argument("--steps", type=int, default=24, help="long enough that only the last run finishes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--corrupt", type=float, default=0.5, help="chance of damaging a checkpoint before a start")
    parser.add_argument("--timeout", type=float, default=600)
    return parser.parse_args(normalize_flags(argv))


def run_reference(opts: argparse.Namespace, rng: random.Random) -> dict[int, str]:
    """Run the job once, uninterrupted, in ``OUT/reference``: its losses are the ones every run
    must write. Exits if it fails or misses a step."""
    reference_dir = os.path.join(opts.out, "reference")
    ref = run_job(
        command(opts.nproc, reference_dir, opts.steps),
        os.path.join(opts.out, "reference.log"),
        os.path.join(reference_dir, "checkpoint"),
        False,
        rng,
        opts.timeout,
    )
    reference = read_losses(reference_dir)
    if ref["code"] != 0 or sorted(reference) != list(range(1, opts.steps + 1)):
        raise SystemExit(f"the reference job failed: see {opts.out}/reference.log")
    return reference


COUNTED = (
    "runs",
    "kills",
    "kills during a save",
    "corruptions",
    "detected at resume",
    "leftovers cleaned",
    "lost complete checkpoints",
    "corrupt loads",
    "loss mismatches",
)
"""The figures counted over the runs, in the report's order."""


@dataclass
class Campaign:
    """The runs of one invocation: its options, random source and reference losses, the job's
    folders, and what the runs so far have counted, noted and left damaged."""

    opts: argparse.Namespace
    rng: random.Random
    reference: dict[int, str]
    job: str
    """The folder every run of the job writes to (``OUT/job``)."""
    root: str
    """Its checkpoint folder."""
    figures: dict[str, int | bool] = field(default_factory=lambda: dict.fromkeys(COUNTED, 0))
    damaged: dict[int, str] = field(default_factory=dict)
    """Step -> what was done to it, while its ``step-N`` folder exists."""
    events: list[str] = field(default_factory=list)
    finished: bool = False
    """Whether the last run finished with the reference losses."""


def one_round(campaign: Campaign, run: int) -> None:
    """Maybe damage a checkpoint, start the job (killed during a save unless this is the last run),
    then check what it did."""
    opts = campaign.opts
    last = run == opts.runs - 1
    damage_a_checkpoint(campaign, run)
    before = verified(campaign.root) - set(campaign.damaged)
    log = os.path.join(opts.out, f"run{run:02d}.log")
    cmd = command(opts.nproc, campaign.job, opts.steps)
    result = run_job(cmd, log, campaign.root, not last, campaign.rng, opts.timeout)
    check_run(campaign, run, before, log, result, last)


def damage_a_checkpoint(campaign: Campaign, run: int) -> None:
    """With probability ``--corrupt``, once two undamaged complete checkpoints exist, damage one:
    the newest (the one a resume loads) 3 times in 4, else any. A damage that leaves the files as
    saved is noted but not counted."""
    rng, root, damaged = campaign.rng, campaign.root, campaign.damaged
    good = verified(root) - set(damaged)
    if not (len(good) >= 2 and rng.random() < campaign.opts.corrupt):
        return
    newest = max(good)
    step = newest if rng.random() < 0.75 else rng.choice(sorted(good))
    what = damage(rng, step_dirs(root)[step])
    if verify_folder(step_dirs(root)[step]) is None:
        campaign.events.append(f"run {run}: step-{step} {what}, still identical to what was saved: not counted")
    else:
        damaged[step] = what
        campaign.figures["corruptions"] += 1
        campaign.events.append(f"run {run}: damaged step-{step} ({what})")


def check_run(campaign: Campaign, run: int, before: set[int], log: str, result: dict, last: bool) -> None:
    """Count what one run did (kills, damage detected, loads of damaged checkpoints, complete
    checkpoints lost, losses unlike the reference's) from its log and folders, and note it."""
    figures, damaged = campaign.figures, campaign.damaged
    figures["runs"] += 1
    figures["kills"] += result["killed"]
    figures["kills during a save"] += result["during_save"]
    text = open(log, encoding="utf-8", errors="replace").read()
    figures["leftovers cleaned"] += text.count("(an interrupted save)")
    detected = {int(s) for s in re.findall(r"checkpoint \S*step-(\d+) fails verification", text)}
    resumed = [int(s) for s in re.findall(r"resuming from checkpoint \S+ \(step (\d+)\)", text)]
    for step in sorted(detected & set(damaged)):
        figures["detected at resume"] += 1
        del damaged[step]  # renamed step-N.corrupt-*: no longer a checkpoint
    if resumed and resumed[0] in damaged:
        figures["corrupt loads"] += 1
        campaign.events.append(f"run {run}: RESUMED FROM DAMAGED step-{resumed[0]}")
    after = verified(campaign.root)
    lost = sorted(before - after)
    figures["lost complete checkpoints"] += len(lost)
    losses = read_losses(campaign.job)
    wrong = sorted(s for s, v in losses.items() if campaign.reference.get(s) != v)
    figures["loss mismatches"] += bool(wrong)
    # A save that replaced a damaged step (after a fallback) healed it.
    for step in [s for s in damaged if s in after]:
        del damaged[step]
    how = " (killed during a save)" if result["during_save"] else " (killed)" if result["killed"] else ""
    campaign.events.append(
        f"run {run}: exit {result['code']}{how}, "
        f"resumed from {resumed[0] if resumed else 'scratch'}, detected {sorted(detected) or 'none'}, "
        f"checkpoints {sorted(after)}"
        + (f", LOST {lost}" if lost else "")
        + (f", WRONG LOSSES at {wrong}" if wrong else "")
    )
    if last:
        steps = list(range(1, campaign.opts.steps + 1))
        campaign.finished = result["code"] == 0 and sorted(losses) == steps and not wrong


def report(campaign: Campaign, began: float) -> int:
    """Print the runs' notes and figures; returns the exit code: 1 if a complete checkpoint was
    lost, a damaged one loaded, a loss differed or the last run did not finish."""
    opts, figures = campaign.opts, campaign.figures
    root = campaign.root
    still_damaged = {s: verify_folder(p) for s, p in step_dirs(root).items() if s in campaign.damaged}
    figures["corruptions never loaded, still refused by verification"] = sum(
        p is not None for p in still_damaged.values()
    )
    figures["last run finished with the reference losses"] = campaign.finished
    figures["wall time s"] = round(time.monotonic() - began)
    print(f"seed {opts.seed}, {opts.runs} runs of {opts.steps} steps, {opts.nproc} process(es) each")
    print("\n".join(campaign.events))
    print(json.dumps(figures, indent=1))
    failed = (
        figures["lost complete checkpoints"]
        or figures["corrupt loads"]
        or figures["loss mismatches"]
        or not campaign.finished
    )
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    """Run the reference job, then ``--runs`` rounds of damage, start and kill; report them."""
    opts = parse_args(argv)
    rng = random.Random(opts.seed)
    began = time.monotonic()
    os.makedirs(opts.out, exist_ok=False)
    reference = run_reference(opts, rng)
    job = os.path.join(opts.out, "job")
    campaign = Campaign(opts, rng, reference, job, os.path.join(job, "checkpoint"))
    for run in range(opts.runs):
        one_round(campaign, run)
    return report(campaign, began)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
