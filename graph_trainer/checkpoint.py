"""Distributed checkpoints with ``torch.distributed.checkpoint`` (DCP): save, find, check, resume.

Contract
--------
``Checkpointer.save(step, ...)`` writes ``<root>/step-<N>`` where ``<root>`` is ``checkpoint.folder``
(relative to ``job.dump_folder`` unless absolute; all ranks must see it). All ranks write into
``step-<N>.tmp-<token>`` (token chosen by rank 0), agree that every write succeeded, and hash what
they wrote; rank 0 writes ``manifest.json`` last (``graph_trainer.manifest``: size and SHA-256 of
every file of every rank) and renames the folder to ``step-<N>`` (atomically replacing an existing
one: ``atomic_files.replace_dir``). Only folders named exactly ``step-<N>`` holding ``manifest.json``
count as checkpoints, so a crashed save is never found. A state with a non-finite tensor is never
saved (``guards.check_state``). An I/O failure on any rank (full disk, read-only folder) is one
``JobError`` on every rank; the temporary folder is removed and the earlier checkpoints are untouched.
A checkpoint folder holds:

* DCP files (``.metadata``, ``*.distcp``): every tensor, under flat keys
  ``model.<fqn>`` (the parameter, or a persistent buffer such as a MoE ``expert_bias``) and ``optim.<fqn>.<exp_avg|exp_avg_sq|step>`` (AdamW state).
  ``<fqn>`` is the clean name (``graph_trainer.build.clean_fqn``), not SimpleFSDP's
  ``...parametrizations.<name>.original``. Sharded parameters and their moments are saved as
  DTensors, i.e. as pieces of the global tensor, so DCP reshards on load: a checkpoint written
  at one layout (FSDP, HSDP, FSDPxTP) loads at any other, or in one process. ``.metadata`` is
  read with ``graph_trainer.safe_metadata`` (only checkpoint classes are unpickled), never plain pickle.
* ``metadata.json`` (rank 0): model name and flavor, step, parallel degrees, world size, and every
  parameter's clean FQN and global shape. It is checked before the model is built (name and
  flavor) and again against the built model (names and shapes), so a wrong checkpoint fails with a
  ``ConfigError`` naming what differs rather than a DCP traceback.
* ``train_state.json`` (rank 0): the step, the LR scheduler's state and the data loader's state
  (``TokenBatchLoader.state_dict()``: a global stream position, identical on all ranks and valid
  under any dp degree).
* ``rng-rank<R>.pt`` (each rank): that rank's torch CPU RNG state (and CUDA RNG on cuda), read with
  ``weights_only=True``. RNG streams belong to a rank of a layout, so they are restored only at the
  same world size.
* ``manifest.json``: see above.

``Checkpointer.resolve_load_step()`` runs first: rank 0 removes what interrupted saves left
(``atomic_files.clean_leftovers``), then picks what to resume (``checkpoint.load_step``: -1 the
newest checkpoint that verifies, 0 none, N exactly step-N, else ``ConfigError`` listing the
available steps). Verifying (``manifest``, split over the ranks) comes before anything is loaded:
with -1 a checkpoint that fails is reported, renamed ``step-<N>.corrupt-<token>`` and the next
older one tried; with N it is a ``ConfigError`` naming the file. A run that would leave checkpoints
of another run beside its own (load_step 0 in a folder holding checkpoints, or load_step N with
later steps there) is refused unless ``checkpoint.move_aside``. Every decision is rank 0's,
broadcast, so all ranks resume from the same step. ``load`` restores everything in place before
the first step: the AdamW state (created lazily by AdamW) is created here with AdamW's layout, so
the restored step counts drive bias correction exactly as if training had not stopped. The
learning rate is recomputed from the *current* config at the restored step. Resuming is bitwise
identical to not stopping when the layout is unchanged.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import uuid
import warnings
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from graph_trainer import manifest
from graph_trainer.atomic_files import clean_leftovers, move_aside, replace_dir, write_text_atomic
from graph_trainer.build import clean_fqn
from graph_trainer.comm import agree
from graph_trainer.config import JobConfig
from graph_trainer.errors import ConfigError, JobError
from graph_trainer.guards import check_state
from graph_trainer.safe_metadata import load_dcp_metadata, metadata_path, safe_reader
from graph_trainer.torch_compat import dcp_storage_files

logger = logging.getLogger("graph_trainer")

FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")
_ADAMW_STATE = ("exp_avg", "exp_avg_sq", "step")


def checkpoint_root(cfg: JobConfig) -> str:
    folder = cfg.checkpoint.folder
    return folder if os.path.isabs(folder) else os.path.join(cfg.job.dump_folder, folder)


def _steps_with(root: str, present: str, absent: str | None = None) -> list[int]:
    if not os.path.isdir(root):
        return []
    steps = []
    for name in os.listdir(root):
        match = _STEP_DIR.match(name)
        if (match and os.path.isfile(os.path.join(root, name, present))
                and not (absent and os.path.exists(os.path.join(root, name, absent)))):
            steps.append(int(match.group(1)))
    return sorted(steps)


def complete_steps(root: str) -> list[int]:
    """Steps of the complete checkpoints in ``root``, ascending (tmp / half-written folders excluded)."""
    # The exact name marks a finished save (rank 0 renames only after every rank wrote), and the
    # manifest is written last before that rename; step-N folders without one are not ours, or older.
    return _steps_with(root, manifest.MANIFEST_FILE)


def unsealed_steps(root: str) -> list[int]:
    """Steps of checkpoints without a manifest (saved by a graph_trainer before manifests existed)."""
    return _steps_with(root, "metadata.json", absent=manifest.MANIFEST_FILE)


def param_shapes(model: torch.nn.Module) -> dict[str, list[int]]:
    """Clean FQN -> global shape (a DTensor's ``shape`` is the global one)."""
    return {clean_fqn(n): list(p.shape) for n, p in model.named_parameters()}


def tensor_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, create: bool) -> dict:
    """The flat DCP state: parameters, persistent buffers and AdamW state, keyed by clean FQN.

    ``create`` fills in AdamW's lazily created state the way ``torch.optim.AdamW`` would (zeros
    shaped/placed like the parameter, a CPU float32 scalar step), so DCP can load into it before
    the first step and AdamW then uses it as it is.
    """
    if any(g.get("amsgrad") for g in optimizer.param_groups):
        raise ConfigError("checkpointing supports AdamW without amsgrad")
    state: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        fqn = clean_fqn(name)
        # detach: DCP loads by copying in place, which autograd forbids on a leaf requiring grad.
        state[f"model.{fqn}"] = param.detach()
        opt = optimizer.state[param]
        if not opt and create:
            opt["step"] = torch.zeros((), dtype=torch.float32)
            opt["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            opt["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        missing = [k for k in _ADAMW_STATE if k not in opt]
        if missing:
            raise RuntimeError(f"optimizer state of {fqn} lacks {missing}; save only after a step")
        for key in _ADAMW_STATE:
            state[f"optim.{fqn}.{key}"] = opt[key]
    # Persistent buffers are training state too (e.g. a MoE layer's load-balancing expert_bias);
    # non-persistent ones (RoPE tables, per-step counters) are recomputed or reset.
    persistent = set(model.state_dict(keep_vars=True))
    for name, buffer in model.named_buffers():
        if name in persistent:
            state[f"model.{name}"] = buffer
    return state


def _diff(saved: dict[str, list[int]], expected: dict[str, list[int]]) -> str:
    """One-line description of how two {name: shape} maps differ ('' when equal)."""
    def some(names: list[str]) -> str:
        return ", ".join(names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")

    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    shapes = [f"{k} {saved[k]} vs {expected[k]}" for k in sorted(set(saved) & set(expected))
              if list(saved[k]) != list(expected[k])]
    parts = [f"missing {some(missing)}" if missing else "",
             f"unexpected {some(unexpected)}" if unexpected else "",
             f"shape (checkpoint vs model) {some(shapes)}" if shapes else ""]
    return "; ".join(p for p in parts if p)


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())  # durable before rank 0's rename declares the checkpoint complete


def _steps(steps: list[int]) -> str:
    return ", ".join(f"step-{s}" for s in steps)


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read checkpoint file {path}: {e}") from None


@contextmanager
def _single_process_ok():
    """DCP warns on every single-process save/load that it 'assumes' no_dist; we ask for it explicitly."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")
        yield


class Checkpointer:
    """Saves and restores the training state of one job; see the module docstring."""

    def __init__(self, cfg: JobConfig, rank: int, world_size: int, degrees: dict[str, int],
                 device: torch.device):
        self.cfg = cfg
        self.root = checkpoint_root(cfg)
        self.rank = rank
        self.world_size = world_size
        self.degrees = dict(degrees)
        self.device = device
        self.distributed = dist.is_available() and dist.is_initialized()

    def step_dir(self, step: int) -> str:
        return os.path.join(self.root, f"step-{step}")

    def should_save(self, step: int, last_step: int) -> bool:
        interval = self.cfg.checkpoint.interval
        return interval > 0 and (step % interval == 0 or step == last_step)

    def _on_rank0(self, fn):
        """Run ``fn`` on rank 0 only and give every rank its result (or its one-line error), so that all
        ranks take the same decision and none waits in a collective the others skipped."""
        if not self.distributed:
            try:
                return fn()
            except OSError as e:
                raise JobError(f"checkpoint folder {self.root}: {e.strerror or e}: {e.filename}") from None
        box: list = [None]
        if self.rank == 0:
            try:
                box[0] = ("ok", fn())
            except ConfigError as e:
                box[0] = ("config", str(e))
            except (JobError, OSError) as e:
                box[0] = ("job", str(e) if isinstance(e, JobError) else
                          f"checkpoint folder {self.root}: {e.strerror or e}: {e.filename}")
            except Exception as e:  # unblock the other ranks, then fail loudly here
                dist.broadcast_object_list([("crash", repr(e))], src=0)
                raise
        dist.broadcast_object_list(box, src=0)
        kind, value = box[0]
        if kind == "config":
            raise ConfigError(value)
        if kind == "job":
            raise JobError(value)
        if kind == "crash":
            raise RuntimeError(f"rank 0 failed while reading checkpoints: {value}")
        return value

    def _gather(self, obj) -> list:
        if not self.distributed:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    # ------------------------------------------------------------------------------ resume

    def _scan(self) -> tuple[list[int], list[int], list[str]]:
        """(rank 0) Clean leftovers of interrupted saves; list sealed and unsealed checkpoints."""
        try:
            done = clean_leftovers(self.root)
        except OSError as e:  # a read-only folder a job only resumes from: the leftovers are never read
            done = [f"cannot remove what interrupted saves left ({e.strerror or e}); ignored"]
        return complete_steps(self.root), unsealed_steps(self.root), done

    def _check_model(self, step: int) -> None:
        """(rank 0) The checkpoint's format and model are this run's (its metadata.json already verified)."""
        meta = _read_json(os.path.join(self.step_dir(step), "metadata.json"))
        if meta.get("format") != FORMAT_VERSION:
            raise ConfigError(f"checkpoint {self.step_dir(step)} has format {meta.get('format')!r}; "
                              f"this build reads format {FORMAT_VERSION}")
        model = self.cfg.model
        saved = (meta.get("model", {}).get("name"), meta.get("model", {}).get("flavor"))
        if saved != (model.name, model.flavor):
            raise ConfigError(
                f"checkpoint {self.step_dir(step)} holds model {saved[0]} flavor {saved[1]} but this run "
                f"builds {model.name} flavor {model.flavor}; use checkpoint.load_step = 0 or another "
                f"checkpoint.folder to start fresh")

    def _check_index(self, step: int, files: dict) -> None:
        """(rank 0) DCP's index unpickles with only checkpoint classes (else ConfigError: crafted or
        foreign) and every file it refers to is in the manifest."""
        path = self.step_dir(step)
        unlisted = sorted(dcp_storage_files(load_dcp_metadata(metadata_path(path))) - set(files))
        if unlisted:
            raise ConfigError(f"checkpoint {path}: DCP's index refers to {unlisted[0]}, which its manifest does "
                              f"not list")

    def _verify(self, step: int) -> str | None:
        """Check ``step-<step>`` against its manifest on all ranks (each hashes a share); None when it is
        exactly what was saved, else one line naming the first file that is not. A checkpoint of another
        model, or whose index holds anything but checkpoint classes, raises ConfigError instead."""
        path = self.step_dir(step)

        def head():  # cheap checks first, so a wrong checkpoint fails fast
            saved, problem = manifest.read(path)
            problem = problem or manifest.check_listing(path, saved)
            problem = problem or (manifest.check_files(path, saved, ["metadata.json"])
                                  if "metadata.json" in saved["files"] else "metadata.json is missing")
            if problem:
                return None, problem
            self._check_model(step)
            return saved, None

        saved, problem = self._on_rank0(head)
        if problem:
            return problem
        sizes = {name: entry["size"] for name, entry in saved["files"].items() if name != "metadata.json"}
        mine = manifest.balance(sizes, self.world_size)[self.rank]
        problems = [p for p in self._gather(manifest.check_files(path, saved, mine)) if p]
        if problems:
            return problems[0]
        self._on_rank0(lambda: self._check_index(step, saved["files"]))
        return None

    def _writes_beside(self) -> bool:
        """Whether this run adds to the checkpoint folder, or keeps its losses.txt beside it."""
        dump = os.path.realpath(self.cfg.job.dump_folder)
        return self.cfg.checkpoint.interval > 0 or os.path.realpath(self.root).startswith(dump + os.sep)

    def _refuse_or_move_aside(self, chosen: int | None, others: list[int], unsealed: list[int]) -> None:
        """Other runs' checkpoints would stay beside this run's: refuse, or move them aside (move_aside)."""
        want = self.cfg.checkpoint.load_step
        names = _steps(others)
        if not self.cfg.checkpoint.move_aside:
            hint = "pass --checkpoint.move_aside True to move them into " \
                   f"{os.path.normpath(self.root)}.aside-<time>/, or use another checkpoint.folder"
            if want == 0:
                raise ConfigError(f"checkpoint.load_step = 0 starts fresh, but {self.root} holds checkpoints ({names}) "
                                  f"of an earlier run, which a later resume would mix with this one; resume them "
                                  f"(checkpoint.load_step -1), or {hint} (losses.txt too)")
            if want > 0:
                raise ConfigError(f"checkpoint.load_step = {want} continues step-{want}, but {self.root} also holds "
                                  f"later steps ({names}) of the run it abandons, which a later resume would pick "
                                  f"up; {hint}")
            raise ConfigError(f"{self.root} holds checkpoints without {manifest.MANIFEST_FILE} "
                              f"({_steps(sorted(set(others) & set(unsealed)))}): saved before graph_trainer wrote "
                              f"manifests, or not by graph_trainer, so they cannot be verified; seal one you trust "
                              f"with `python -m graph_trainer.manifest seal <folder>`, or {hint}")
        losses = os.path.join(self.cfg.job.dump_folder, "losses.txt")
        aside = self._on_rank0(lambda: move_aside(self.root, [f"step-{s}" for s in others], losses,
                                                  keep_losses=chosen is not None))
        self._warn("checkpoint.move_aside: moved %s%s into %s", names,
                   " and losses.txt" if chosen is None else " and a copy of losses.txt", aside)

    def _quarantine(self, failed: list[tuple[int, str]]) -> None:
        """(all ranks) Rename checkpoints that failed verification, so no later resume finds them."""
        def rename():
            token = uuid.uuid4().hex[:8]
            try:
                for step, _ in failed:
                    os.rename(self.step_dir(step), f"{self.step_dir(step)}.corrupt-{token}")
            except OSError as e:  # read-only: every later resume verifies (and skips) them again
                return f"cannot rename them ({e.strerror or e}); they stay, and fail verification again"
            return "renamed " + ", ".join(f"step-{s} to step-{s}.corrupt-{token}" for s, _ in failed)

        self._warn("%s (kept for inspection; never loaded)", self._on_rank0(rename))

    def _warn(self, *args) -> None:
        """A warning about a decision every rank shares: rank 0 logs it."""
        if self.rank == 0:
            logger.warning(*args)

    def resolve_load_step(self) -> int | None:
        """The step to resume from (None: start fresh), verified. Call it before building the model."""
        want = self.cfg.checkpoint.load_step
        start = time.perf_counter()
        sealed, unsealed, cleaned = self._on_rank0(self._scan)
        for line in cleaned:
            logger.info("checkpoint folder %s: %s", self.root, line)
        chosen, failed = None, []
        if want > 0:
            if want not in sealed:
                legacy = f" (step-{want} has no {manifest.MANIFEST_FILE}: saved before manifests; seal it with " \
                         f"`python -m graph_trainer.manifest seal` if you trust it)" if want in unsealed else ""
                raise ConfigError(
                    f"checkpoint.load_step = {want}: no complete checkpoint step-{want} in {self.root}; "
                    f"available steps: {', '.join(map(str, sealed)) or 'none'}{legacy}")
            problem = self._verify(want)
            if problem:
                raise ConfigError(f"checkpoint {self.step_dir(want)} fails verification: {problem}; nothing was "
                                  f"loaded")
            chosen = want
        elif want == -1:
            for step in reversed(sealed):
                problem = self._verify(step)
                if problem is None:
                    chosen = step
                    break
                failed.append((step, problem))
                self._warn("checkpoint %s fails verification: %s", self.step_dir(step), problem)
            if failed and chosen is None:
                raise ConfigError(
                    f"no checkpoint in {self.root} verifies ({'; '.join(f'step-{s}: {p}' for s, p in failed)}); "
                    f"nothing was loaded. Restore them, or start fresh with checkpoint.load_step 0 and "
                    f"checkpoint.move_aside True")
        others = [s for s in sorted(set(sealed) | set(unsealed))
                  if s not in dict(failed) and (chosen is None or s > chosen)]
        if others and self._writes_beside():
            self._refuse_or_move_aside(chosen, others, unsealed)
        if failed:
            self._quarantine(failed)
            self._warn("resuming from %s, the newest checkpoint that verifies", self.step_dir(chosen))
        if chosen is not None:
            logger.info("resuming from checkpoint %s (step %d), verified in %.2fs", self.step_dir(chosen), chosen,
                        time.perf_counter() - start)
        elif want == -1 and os.path.isdir(self.root):
            logger.info("no complete checkpoint in %s; starting from step 1", self.root)
        return chosen

    def load(self, step: int, model, optimizer, scheduler, dataloader) -> None:
        """Restore model, AdamW, LR schedule, data position and RNG in place from ``step-<step>``
        (verified by ``resolve_load_step``)."""
        start = time.perf_counter()
        path = self.step_dir(step)
        meta = _read_json(os.path.join(path, "metadata.json"))
        problem = _diff(meta.get("params", {}), param_shapes(model))
        if problem:
            raise ConfigError(f"checkpoint {path} does not fit {self.cfg.model.name} "
                              f"{self.cfg.model.flavor}: {problem}")
        state = tensor_state(model, optimizer, create=True)
        # metadata.json describes parameters only; DCP's own index must also hold every optimizer
        # key with the right global shape, otherwise dcp.load fails with a long planner traceback.
        saved = load_dcp_metadata(metadata_path(path)).state_dict_metadata
        problem = _diff({k: list(v.size) for k, v in saved.items() if isinstance(v, TensorStorageMetadata)},
                        {k: list(v.shape) for k, v in state.items()})
        if problem:
            raise ConfigError(f"checkpoint {path} does not fit this run's model/optimizer state: {problem}")
        with _single_process_ok():
            agree(lambda: dcp.load(state, storage_reader=safe_reader(path), no_dist=not self.distributed),
                  f"cannot load checkpoint {path}")

        train_state = _read_json(os.path.join(path, "train_state.json"))
        counts = {float(optimizer.state[p]["step"]) for p in optimizer.state}
        if train_state.get("step") != step or counts != {float(step)}:
            raise ConfigError(f"checkpoint {path} is inconsistent: it is step {step} but records step "
                              f"{train_state.get('step')} and AdamW step counts {sorted(counts)}")
        dataloader.load_state_dict(train_state["dataloader"])
        sched = dict(train_state["scheduler"])
        # The checkpoint gives the schedule's position; its shape (peak lr, warmup, decay over
        # training.steps) comes from this run's config, so extending a run re-plans the decay.
        sched["base_lrs"] = list(scheduler.base_lrs)
        scheduler.load_state_dict(sched)
        if scheduler.last_epoch != step:
            raise ConfigError(f"checkpoint {path} is inconsistent: LR schedule at {scheduler.last_epoch}, not {step}")
        # Re-enter the restored position through step() so the optimizer's lr is this config's lr.
        scheduler.last_epoch -= 1
        scheduler.step()

        if int(meta.get("world_size", -1)) == self.world_size:
            rng_path = os.path.join(path, f"rng-rank{self.rank}.pt")
            rng = agree(lambda: torch.load(rng_path, weights_only=True), f"checkpoint {path}")
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and self.device.type == "cuda":
                torch.cuda.set_rng_state(rng["cuda"], self.device)
        else:
            logger.info("checkpoint was written by %s ranks, this run has %d: RNG states not restored",
                        meta.get("world_size"), self.world_size)
        if self.rank == 0:
            self._trim_losses(step)
        logger.info("loaded checkpoint %s in %.2fs", path, time.perf_counter() - start)

    def _trim_losses(self, step: int) -> None:
        """Drop ``losses.txt`` lines after ``step`` (left by a longer earlier run) before appending;
        atomically, so a crash leaves the old file or the trimmed one."""
        path = os.path.join(self.cfg.job.dump_folder, "losses.txt")
        if not os.path.isfile(path):
            return
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
        kept = [line for line in lines if not (line[:1].isdigit() and int(line.split()[0]) > step)]
        if len(kept) != len(lines):
            write_text_atomic(path, "".join(kept))

    # ------------------------------------------------------------------------------ save

    def _write_state(self, tmp: str, step: int, state: dict, model, scheduler, dataloader):
        """(all ranks) Every file of the checkpoint but the manifest; returns DCP's index."""
        with _single_process_ok():
            index = dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), no_dist=not self.distributed)
        rng = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        with open(os.path.join(tmp, f"rng-rank{self.rank}.pt"), "wb") as f:
            torch.save(rng, f)
            f.flush()
            os.fsync(f.fileno())
        if self.rank == 0:
            _write_json(os.path.join(tmp, "train_state.json"), {
                "step": step, "scheduler": scheduler.state_dict(), "dataloader": dataloader.state_dict()})
            _write_json(os.path.join(tmp, "metadata.json"), {
                "format": FORMAT_VERSION, "model": {"name": self.cfg.model.name, "flavor": self.cfg.model.flavor},
                "step": step, "degrees": self.degrees, "world_size": self.world_size,
                "params": param_shapes(model)})
        return index

    def _seal(self, tmp: str, final: str, hashed: list[dict], index) -> None:
        """(rank 0) Check every rank's files are there, write the manifest, make the folder ``step-<N>``."""
        present = manifest.folder_files(tmp)
        files = {name: entry for share in hashed for name, entry in share.items()}
        for name in sorted(set(present) - set(files)):  # written by no rank we know of: hash it here
            files[name] = manifest.file_entry(os.path.join(tmp, name))
        missing = sorted((set(files) | dcp_storage_files(index)) - set(present))
        if missing:
            raise JobError(f"{missing[0]} is not in {tmp}: a rank's write did not reach the shared folder")
        manifest.write(tmp, manifest.build(files))
        replace_dir(tmp, final)

    def save(self, step: int, model, optimizer, scheduler, dataloader) -> str:
        """Write ``step-<step>`` atomically (all ranks call this); returns its path."""
        start = time.perf_counter()
        final = self.step_dir(step)
        state = tensor_state(model, optimizer, create=False)
        check_state(step, state)
        # One token for all ranks so they write into the same tmp folder; unique per attempt so a
        # leftover from a crashed save is never mixed with this one.
        token = self._on_rank0(lambda: uuid.uuid4().hex[:8])
        tmp = f"{final}.tmp-{token}"
        what = f"cannot save checkpoint {final}"
        try:
            agree(lambda: os.makedirs(tmp) if self.rank == 0 else None, what)
            index = agree(lambda: self._write_state(tmp, step, state, model, scheduler, dataloader), what)
            written = time.perf_counter()
            # every rank's files are in tmp now (agree gathered from all): hash our own share
            mine = agree(lambda: {n: manifest.file_entry(os.path.join(tmp, n)) for n in
                                  manifest.save_share(manifest.folder_files(tmp), self.rank, self.world_size)}, what)
            hashed = self._gather(mine)
            agree(lambda: self._seal(tmp, final, hashed, index) if self.rank == 0 else None, what)
        except JobError as e:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)  # never a checkpoint; the earlier ones are untouched
            raise JobError(f"{e} (earlier checkpoints are intact)") from None
        logger.info("saved checkpoint %s in %.2fs (manifest: %.2fs)", final, time.perf_counter() - start,
                    time.perf_counter() - written)
        return final
