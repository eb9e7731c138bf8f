"""Distributed checkpoints with ``torch.distributed.checkpoint`` (DCP): save, find, check, resume.

Contract
--------
``Checkpointer.save(step, ...)`` writes ``<root>/step-<N>`` where ``<root>`` is ``checkpoint.folder``
(relative to ``job.dump_folder`` unless absolute; all ranks must see it). All ranks write into ``step-<N>.tmp-<token>``
(token chosen by rank 0); after a barrier rank 0 renames it to ``step-<N>``. Only folders named
exactly ``step-<N>`` that hold ``metadata.json`` count as checkpoints, so a half-written (crashed)
save is never found. A checkpoint folder holds:

* DCP files (``.metadata``, ``*.distcp``): every tensor, under flat keys
  ``model.<fqn>`` (the parameter, or a persistent buffer such as a MoE ``expert_bias``) and ``optim.<fqn>.<exp_avg|exp_avg_sq|step>`` (AdamW state).
  ``<fqn>`` is the clean name (``graph_trainer.build.clean_fqn``), not SimpleFSDP's
  ``...parametrizations.<name>.original``. Sharded parameters and their moments are saved as
  DTensors, i.e. as pieces of the global tensor, so DCP reshards on load: a checkpoint written
  at one layout (FSDP, HSDP, FSDPxTP) loads at any other, or in one process.
* ``metadata.json`` (rank 0): model name and flavor, step, parallel degrees, world size, and every
  parameter's clean FQN and global shape. It is checked before the model is even built (name and
  flavor) and again against the built model (names and shapes), so a wrong checkpoint fails with a
  ``ConfigError`` naming what differs rather than a DCP traceback.
* ``train_state.json`` (rank 0): the step, the LR scheduler's state and the data loader's state
  (``TokenBatchLoader.state_dict()``: a global stream position, identical on all ranks and valid
  under any dp degree).
* ``rng-rank<R>.pt`` (each rank): that rank's torch CPU RNG state (and CUDA RNG on cuda). RNG
  streams belong to a rank of a layout, so they are restored only at the same world size.

``Checkpointer.resolve_load_step()`` picks what to resume (``checkpoint.load_step``: -1 latest
complete checkpoint if any, 0 none, N exactly step-N, else ``ConfigError`` listing the available
steps); rank 0 decides and broadcasts so every rank resumes from the same step. ``load`` restores
everything in place before the first step: the AdamW state (created lazily by AdamW) is created
here with AdamW's layout, so the restored step counts drive bias correction exactly as if training
had not stopped. The learning rate is recomputed from the *current* config at the restored step.
Resuming is bitwise identical to not stopping when the layout is unchanged.
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

from graph_trainer.build import clean_fqn
from graph_trainer.config import JobConfig
from graph_trainer.errors import ConfigError

logger = logging.getLogger("graph_trainer")

FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")
_ADAMW_STATE = ("exp_avg", "exp_avg_sq", "step")


def checkpoint_root(cfg: JobConfig) -> str:
    folder = cfg.checkpoint.folder
    return folder if os.path.isabs(folder) else os.path.join(cfg.job.dump_folder, folder)


def complete_steps(root: str) -> list[int]:
    """Steps of the complete checkpoints in ``root``, ascending (tmp / half-written folders excluded)."""
    if not os.path.isdir(root):
        return []
    steps = []
    for name in os.listdir(root):
        match = _STEP_DIR.match(name)
        # The exact name marks a finished save (rank 0 renames only after every rank wrote);
        # requiring metadata.json too skips step-N folders this module did not write.
        if match and os.path.isfile(os.path.join(root, name, "metadata.json")):
            steps.append(int(match.group(1)))
    return sorted(steps)


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
        """Run ``fn`` on rank 0 only and give every rank its result (or its ConfigError), so that all
        ranks take the same decision and none waits in a collective the others skipped."""
        if not self.distributed:
            return fn()
        box: list = [None]
        if self.rank == 0:
            try:
                box[0] = ("ok", fn())
            except ConfigError as e:
                box[0] = ("error", str(e))
            except Exception as e:  # unblock the other ranks, then fail loudly here
                dist.broadcast_object_list([("crash", repr(e))], src=0)
                raise
        dist.broadcast_object_list(box, src=0)
        kind, value = box[0]
        if kind == "error":
            raise ConfigError(value)
        if kind == "crash":
            raise RuntimeError(f"rank 0 failed while reading checkpoints: {value}")
        return value

    # ------------------------------------------------------------------------------ resume

    def resolve_load_step(self) -> int | None:
        """The step to resume from (None: start fresh). Cheap: call it before building the model."""
        want = self.cfg.checkpoint.load_step

        def decide() -> int | None:
            if want == 0:
                return None
            steps = complete_steps(self.root)
            if want == -1 and not steps:
                return None
            step = steps[-1] if want == -1 else want
            if step not in steps:
                raise ConfigError(
                    f"checkpoint.load_step = {want}: no complete checkpoint step-{want} in {self.root}; "
                    f"available steps: {', '.join(map(str, steps)) or 'none'}")
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
            return step

        step = self._on_rank0(decide)
        if step is not None:
            logger.info("resuming from checkpoint %s (step %d)", self.step_dir(step), step)
        elif want == -1 and os.path.isdir(self.root):
            logger.info("no complete checkpoint in %s; starting from step 1", self.root)
        return step

    def load(self, step: int, model, optimizer, scheduler, dataloader) -> None:
        """Restore model, AdamW, LR schedule, data position and RNG in place from ``step-<step>``."""
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
        try:
            saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        except Exception as e:
            raise ConfigError(f"cannot read the DCP index of checkpoint {path}: {e}") from None
        problem = _diff({k: list(v.size) for k, v in saved.items() if isinstance(v, TensorStorageMetadata)},
                        {k: list(v.shape) for k, v in state.items()})
        if problem:
            raise ConfigError(f"checkpoint {path} does not fit this run's model/optimizer state: {problem}")
        with _single_process_ok():
            dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=not self.distributed)

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
            if not os.path.isfile(rng_path):
                raise ConfigError(f"checkpoint {path} lacks {os.path.basename(rng_path)}")
            rng = torch.load(rng_path, weights_only=True)
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
        """Drop ``losses.txt`` lines after ``step`` (left by a longer earlier run) before appending."""
        path = os.path.join(self.cfg.job.dump_folder, "losses.txt")
        if not os.path.isfile(path):
            return
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
        kept = [line for line in lines if not (line[:1].isdigit() and int(line.split()[0]) > step)]
        if len(kept) != len(lines):
            with open(path, "w", encoding="utf-8") as f:
                f.writelines(kept)

    # ------------------------------------------------------------------------------ save

    def save(self, step: int, model, optimizer, scheduler, dataloader) -> str:
        """Write ``step-<step>`` atomically (all ranks call this); returns its path."""
        start = time.perf_counter()
        final = self.step_dir(step)
        # One token for all ranks so they write into the same tmp folder; unique per attempt so a
        # leftover from a crashed save is never mixed with this one.
        token = self._on_rank0(lambda: uuid.uuid4().hex[:8])
        tmp = f"{final}.tmp-{token}"
        os.makedirs(tmp, exist_ok=True)
        with _single_process_ok():
            dcp.save(tensor_state(model, optimizer, create=False), storage_writer=dcp.FileSystemWriter(tmp),
                     no_dist=not self.distributed)
        rng = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        torch.save(rng, os.path.join(tmp, f"rng-rank{self.rank}.pt"))
        if self.rank == 0:
            _write_json(os.path.join(tmp, "train_state.json"), {
                "step": step, "scheduler": scheduler.state_dict(), "dataloader": dataloader.state_dict()})
            _write_json(os.path.join(tmp, "metadata.json"), {
                "format": FORMAT_VERSION, "model": {"name": self.cfg.model.name, "flavor": self.cfg.model.flavor},
                "step": step, "degrees": self.degrees, "world_size": self.world_size,
                "params": param_shapes(model)})
        if self.distributed:
            dist.barrier()  # every rank's files are in tmp before it becomes the checkpoint
        if self.rank == 0:
            old = None
            if os.path.exists(final):  # re-saving a step (resumed from an earlier one): replace it
                old = f"{final}.old-{token}"
                os.rename(final, old)
            os.rename(tmp, final)
            if old:
                shutil.rmtree(old)
        if self.distributed:
            dist.barrier()  # nobody lists or loads checkpoints before the rename is visible
        logger.info("saved checkpoint %s in %.2fs", final, time.perf_counter() - start)
        return final
