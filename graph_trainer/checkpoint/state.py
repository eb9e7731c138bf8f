"""What a checkpoint holds, and how it maps onto the model, AdamW, the LR schedule, the data loader and the RNG.

``graph_trainer.checkpoint.checkpointer`` decides where and when a checkpoint is written and which one is
loaded; this module writes each file of a checkpoint folder and restores the training state from it.

Contract
--------
A checkpoint folder holds:

* DCP files (``.metadata``, ``*.distcp``): every tensor, under flat keys ``model.<fqn>`` (the
  parameter, or a persistent buffer such as a MoE ``expert_bias``) and
  ``optim.<fqn>.<exp_avg|exp_avg_sq|step>`` (AdamW state). ``<fqn>`` is the clean name
  (``graph_trainer.distributed.simple_fsdp.clean_fqn``), not SimpleFSDP's ``...parametrizations.<name>.original``.
  Sharded parameters and their moments are saved as DTensors, i.e. as pieces of the global
  tensor, so DCP reshards on load: a checkpoint written at one layout (FSDP, HSDP, FSDPxTP) loads
  at any other, or in one process. ``.metadata`` is read with ``graph_trainer.checkpoint.safe_metadata``
  (only checkpoint classes are unpickled), never plain pickle. It holds the tensors' index only
  (``CheckpointWriter``: not the folder the save wrote into nor a save id), so the same state
  saved twice, blocking or in the background, into any folder, is the same bytes.
* ``metadata.json`` (rank 0): model name and flavor, step, parallel degrees, world size, and every
  parameter's clean FQN and global shape. It is checked before the model is built (name and
  flavor) and again against the built model (names and shapes), so a wrong checkpoint fails with a
  ``ConfigError`` naming what differs rather than a DCP traceback.
* ``train_state.json`` (rank 0): the step, the LR scheduler's state and the data loader's state
  (every shard's stream position, merged from the ranks' ``TokenBatchLoader.state_dict()``; valid
  under any dp degree the number of shards divides).
* ``rng-rank<R>.pt`` (each rank): that rank's torch CPU RNG state (and CUDA RNG on cuda), read with
  ``weights_only=True``. RNG streams belong to a rank of a layout, so they are restored only at the
  same world size. The trainer seeds the generators with ``training.seed`` (no step draws from
  them), so two runs of one command write the same bytes here too.
* ``manifest.json``: the size and SHA-256 of every other file, written last (``graph_trainer.checkpoint.manifest``).

Loading restores everything in place before the first step: the AdamW state (created lazily by
AdamW) is created here with AdamW's layout, so the restored step counts drive bias correction
exactly as if training had not stopped. The learning rate is recomputed from the *current* config
at the restored step. Resuming is bitwise identical to not stopping when the layout is unchanged.
"""

from __future__ import annotations

import errno
import json
import os
import warnings
from concurrent.futures import Future
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from graph_trainer.checkpoint.safe_metadata import load_dcp_metadata, metadata_path, safe_reader
from graph_trainer.config import Model
from graph_trainer.data.loader import merge_states
from graph_trainer.distributed.comm import agree
from graph_trainer.distributed.simple_fsdp import clean_fqn
from graph_trainer.errors import ConfigError, one_line, some_names

FORMAT_VERSION = 1
_ADAMW_STATE = ("exp_avg", "exp_avg_sq", "step")


def param_shapes(model: torch.nn.Module, distributed: bool = False) -> dict[str, list[int]]:
    """Clean FQN -> global shape (a DTensor's ``shape`` is the global one) of the job's model:
    ``distributed``, the union over every rank's (a pipeline rank holds only its stages'
    parameters; a collective every rank joins)."""
    shapes = {clean_fqn(n): list(p.shape) for n, p in model.named_parameters()}
    if not distributed:
        return shapes
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, shapes)
    return {name: shape for rank_shapes in every for name, shape in rank_shapes.items()}


def tensor_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, create: bool) -> dict:
    """The flat DCP state: parameters, persistent buffers and AdamW state, keyed by clean FQN.

    ``create`` fills in AdamW's lazily created state the way ``torch.optim.AdamW`` would (zeros
    shaped/placed like the parameter, a CPU float32 scalar step), so DCP can load into it before
    the first step and AdamW then uses it as it is.
    """
    if any(g.get("amsgrad") for g in optimizer.param_groups):
        raise ConfigError("checkpointing supports AdamW without amsgrad")
    tensors = model_tensors(model)
    state: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        fqn = clean_fqn(name)
        state[f"model.{fqn}"] = tensors.pop(fqn)  # each parameter beside its AdamW state, as DCP writes them
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
    state.update({f"model.{name}": buffer for name, buffer in tensors.items()})  # the persistent buffers
    return state


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters (detached) and persistent buffers, by clean FQN: what DCP loads in place."""
    # detach: DCP loads by copying in place, which autograd forbids on a leaf requiring grad.
    state = {clean_fqn(name): param.detach() for name, param in model.named_parameters()}
    # Persistent buffers are training state too (e.g. a MoE layer's load-balancing expert_bias);
    # non-persistent ones (RoPE tables, per-step counters) are recomputed or reset.
    persistent = set(model.state_dict(keep_vars=True))
    state.update({name: buffer for name, buffer in model.named_buffers() if name in persistent})
    return state


def shape_diff(saved: dict[str, list[int]], expected: dict[str, list[int]]) -> str:
    """One-line description of how two {name: shape} maps differ ('' when equal)."""
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    shapes = [
        f"{k} {saved[k]} vs {expected[k]}"
        for k in sorted(set(saved) & set(expected))
        if list(saved[k]) != list(expected[k])
    ]
    parts = [
        f"missing {some_names(missing, 3)}" if missing else "",
        f"unexpected {some_names(unexpected, 3)}" if unexpected else "",
        f"shape (checkpoint vs model) {some_names(shapes, 3)}" if shapes else "",
    ]
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
def single_process_ok():
    """DCP warns on every single-process save/load that it 'assumes' no_dist; we ask for it explicitly."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")
        yield


# ------------------------------------------------------------------------------ save


class CheckpointWriter(dcp.FileSystemWriter):
    """DCP's file writer, less the storage metadata it pickles into ``.metadata``: the folder it
    wrote into (a checkpoint's temporary folder, whose name is random) and a random save id, which
    DCP records for observability and reads back for nothing. Without them ``.metadata`` holds the
    tensors' index only, so two saves of the same state write the same bytes. (``storage_meta`` is
    optional in DCP's ``StorageWriter`` interface: its default is ``None``.)"""

    def storage_meta(self) -> None:
        return None


def save_tensors(folder: str, state: dict, distributed: bool):
    """(all ranks) The DCP files of ``state`` (``tensor_state``), ``.metadata`` among them."""
    with single_process_ok():
        dcp.save(state, storage_writer=CheckpointWriter(folder), no_dist=not distributed)


def start_saving_tensors(folder: str, state: dict, distributed: bool, group) -> Future:
    """(all ranks) ``save_tensors`` in the background: DCP's ``async_save`` copies ``state`` into host
    memory it owns before it returns (so later updates of the tensors do not reach the files),
    then writes the files on a thread of its own, coordinating over ``group``. The future is done
    when every file of this rank is written (its result: DCP's metadata)."""
    with single_process_ok():
        pending = dcp.async_save(
            state, storage_writer=CheckpointWriter(folder), process_group=group, no_dist=not distributed
        )
    return getattr(pending, "upload_completion", pending)  # (a response object when DCP splits staging off)


def save_rng(folder: str, rank: int, device: torch.device) -> None:
    """(each rank) ``rng-rank<rank>.pt``: the CPU RNG state, and the CUDA one on cuda."""
    rng = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    path = os.path.join(folder, f"rng-rank{rank}.pt")
    with open(path, "wb") as f:
        try:
            torch.save(rng, f)
        except RuntimeError as e:  # torch's zip writer says a short write (a full disk) this way
            raise OSError(errno.EIO, f"{one_line(e)} (writing {path})") from None
        f.flush()
        os.fsync(f.fileno())


def gathered_data_state(dataloader, distributed: bool) -> dict:
    """(all ranks) The data loader's state with every shard's position. A rank knows the positions
    of the shards it reads: with several shards and data-parallel ranks (then no rank reads them
    all) every rank's state is gathered and merged."""
    state = dataloader.state_dict()
    if not (distributed and state["shards"] > 1 and dataloader.dp_degree > 1):
        return state
    states: list = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    return merge_states(states)


def write_train_state(folder: str, step: int, scheduler, data_state: dict, lr_plan: dict[str, object]) -> None:
    """(rank 0) ``train_state.json``: the step, the LR scheduler's state, the settings its schedule
    was planned with (``loop.optim.lr_plan``) and the data position (``data_state``: every shard's)."""
    state = {"step": step, "scheduler": scheduler.state_dict(), "lr_plan": lr_plan}
    _write_json(os.path.join(folder, "train_state.json"), {**state, "dataloader": data_state})


def write_metadata(
    folder: str, step: int, model: dict, degrees: dict[str, int], world_size: int, shapes: dict[str, list[int]]
) -> None:
    """(rank 0) ``metadata.json``: format, the model (``models.registry.model_record``: name, flavor,
    and the ``config.json`` of flavor 'hf'), step, layout, parameter shapes."""
    _write_json(
        os.path.join(folder, "metadata.json"),
        {
            "format": FORMAT_VERSION,
            "model": model,
            "step": step,
            "degrees": degrees,
            "world_size": world_size,
            "params": shapes,
        },
    )


# ------------------------------------------------------------------------------ load


def read_metadata(folder: str) -> dict:
    """``metadata.json`` of a checkpoint folder (ConfigError when it cannot be read)."""
    return _read_json(os.path.join(folder, "metadata.json"))


def check_model(folder: str, model_cfg: Model) -> None:
    """The checkpoint's format and model (name and flavor) are this run's, else ConfigError."""
    meta = read_metadata(folder)
    if meta.get("format") != FORMAT_VERSION:
        raise ConfigError(
            f"checkpoint {folder} has format {meta.get('format')!r}; this build reads format {FORMAT_VERSION}"
        )
    saved = (meta.get("model", {}).get("name"), meta.get("model", {}).get("flavor"))
    if saved != (model_cfg.name, model_cfg.flavor):
        raise ConfigError(
            f"checkpoint {folder} holds model {saved[0]} flavor {saved[1]} but this run "
            f"builds {model_cfg.name} flavor {model_cfg.flavor}; use checkpoint.load_step = 0 or another "
            f"checkpoint.folder to start fresh"
        )


def load_tensors(folder: str, meta: dict, model_cfg: Model, model, optimizer, distributed: bool) -> None:
    """(all ranks) Parameters, persistent buffers and AdamW state in place from the DCP files, after
    checking that ``metadata.json`` and DCP's index fit this run's model and optimizer (the job's
    whole model: pipeline ranks load their stages' part of a checkpoint any layout wrote)."""
    problem = shape_diff(meta.get("params", {}), param_shapes(model, distributed))
    if problem:
        raise ConfigError(f"checkpoint {folder} does not fit {model_cfg.name} {model_cfg.flavor}: {problem}")
    state = tensor_state(model, optimizer, create=True)
    # metadata.json describes parameters only; DCP's own index must also hold every optimizer
    # key with the right global shape, otherwise dcp.load fails with a long planner traceback.
    # (only what this rank loads: under pipeline parallelism the other stages' keys are not its)
    saved = load_dcp_metadata(metadata_path(folder)).state_dict_metadata
    problem = shape_diff(
        {k: list(v.size) for k, v in saved.items() if isinstance(v, TensorStorageMetadata) and k in state},
        {k: list(v.shape) for k, v in state.items()},
    )
    if problem:
        raise ConfigError(f"checkpoint {folder} does not fit this run's model/optimizer state: {problem}")
    with single_process_ok():
        agree(
            lambda: dcp.load(state, storage_reader=safe_reader(folder), no_dist=not distributed),
            f"cannot load checkpoint {folder}",
        )


def restore_train_state(folder: str, step: int, optimizer, scheduler, dataloader) -> dict[str, object]:
    """The data position and the LR schedule from ``train_state.json``, checked against ``step`` and
    the AdamW step counts just loaded; the learning rate is this run's config's at ``step``.
    Returns the settings the checkpoint's schedule was planned with ({} if it predates them)."""
    train_state = _read_json(os.path.join(folder, "train_state.json"))
    counts = {float(optimizer.state[p]["step"]) for p in optimizer.state}
    if train_state.get("step") != step or counts != {float(step)}:
        raise ConfigError(
            f"checkpoint {folder} is inconsistent: it is step {step} but records step "
            f"{train_state.get('step')} and AdamW step counts {sorted(counts)}"
        )
    dataloader.load_state_dict(train_state["dataloader"])
    sched = dict(train_state["scheduler"])
    # The checkpoint gives the schedule's position; its shape (peak lr, warmup, decay over
    # training.steps) comes from this run's config, so extending a run re-plans the decay.
    sched["base_lrs"] = list(scheduler.base_lrs)
    if "_step_count" in sched:  # the step() below counts a call: the count stays the checkpoint's
        sched["_step_count"] -= 1
    scheduler.load_state_dict(sched)
    if scheduler.last_epoch != step:
        raise ConfigError(f"checkpoint {folder} is inconsistent: LR schedule at {scheduler.last_epoch}, not {step}")
    # Re-enter the restored position through step() so the optimizer's lr is this config's lr.
    # (torch warns that the optimizer has not stepped yet: no schedule value is skipped here, the
    # position was set just above.)
    scheduler.last_epoch -= 1
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
        scheduler.step()
    return dict(train_state.get("lr_plan", {}))


def restore_rng(folder: str, rank: int, device: torch.device) -> None:
    """(each rank) This rank's RNG states from ``rng-rank<rank>.pt`` (only at the world size that saved them)."""
    rng_path = os.path.join(folder, f"rng-rank{rank}.pt")
    rng = agree(lambda: torch.load(rng_path, weights_only=True), f"checkpoint {folder}")
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], device)
