"""The training loop: build -> trace (first step) -> run the graph -> clip -> AdamW -> schedule.

``Trainer(cfg)`` builds everything from a validated ``JobConfig`` (``graph_trainer.build``);
``Trainer.train()`` runs ``training.steps`` steps and returns the per-step losses. In
``compile.mode = "graph"`` the forward and backward of a microbatch are the traced GraphModule
(``graph_trainer.compiler.tracer.GraphStep``) after the compile chain (``graph_trainer.compiler.chain``:
memory policy, passes, backend); in ``"eager"`` they are the same model run directly (``eager_step``), the
numerics baseline.

Starting weights: a checkpoint of the job's own (resumed, ``graph_trainer.checkpoint.checkpointer``), else a
Hugging Face folder (``checkpoint.initial_load_hf``: checked before building, read last in
``__init__``, after the memory checks, into parameters left uninitialised;
``graph_trainer.checkpoint.hf``), else the seeded random initialisation. ``training.steps`` 0 with
a folder only converts it: ``train()`` writes ``step-0`` and returns.

Pipeline parallel (``parallelism.pp`` > 1): the microbatches of a step go through the pipeline
schedule instead of the loop below (``graph_trainer.pipelining.step.PipelineStep``: this rank's
stages, traced per stage in graph mode, each stage graph through the same memory policy, passes
and backend); the last stage's loss is shared with every pipeline rank, and the gradient norm adds
the stages' parts over the pipeline group.

Gradient accumulation (``training.global_batch_size``): an optimizer step runs the layout's
``microbatches`` (M) forward-and-backward passes on consecutive batches of the data loader, each
scaled by 1 / (data-parallel degree x M), and sums their gradients in microbatch order into the
first one's gradient tensors (graph and eager alike, so graph == eager holds bitwise), before
one clip, AdamW update and schedule step. Under SimpleFSDP every microbatch's backward
reduce-scatters its gradients, so what accumulates is the local shard (docs/parallelism.md says
why, with the cost model's figures). The logged loss is the mean of the M microbatch losses
averaged over the data-parallel ranks: every microbatch has the same number of tokens, all of
them counted, so that is the mean over the global batch's tokens.

Before the first step (graph mode, once traced) the trainer logs the estimated peak memory per
rank and, with ``metrics.simulate_device``, the step the analysis simulator predicts for the graph
it will run; every step it records the device time of the forward, loss and backward
(``loop.gradients``). With ``metrics.json_lines`` all of it also goes to
``<dump_folder>/metrics.jsonl`` (``loop.metrics``).

Validation (``validation.enable``): after the update of step 1 and of every ``validation.freq``-th
step, the loss and perplexity of held-out batches, forward only (``loop.held_out``), before that
step's checkpoint is written.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from graph_trainer.build import JobLayout, build_job_model, build_layout
from graph_trainer.checkpoint.atomic_files import write_text_atomic
from graph_trainer.checkpoint.checkpointer import Checkpointer
from graph_trainer.checkpoint.hf import HFWeights, load_hf_weights, open_hf_weights
from graph_trainer.config import JobConfig
from graph_trainer.config_loading import changed_fields, config_to_toml
from graph_trainer.data.loader import build_dataloader
from graph_trainer.data.tokenizer import build_tokenizer, document_start
from graph_trainer.distributed import comm
from graph_trainer.distributed.parallel_dims import (
    ParallelDims,
    average_over_dp,
    dp_rank,
    pp_group,
    sum_of_routing_counts,
)
from graph_trainer.errors import JobError
from graph_trainer.loop.gc_schedule import scheduled_collection
from graph_trainer.loop.grad_record import gather_record, merge_over, record_path, save_record
from graph_trainer.loop.gradients import StepPreparation, build_gradients
from graph_trainer.loop.guards import check_step
from graph_trainer.loop.held_out import HeldOutLoss
from graph_trainer.loop.metrics import ForwardBackwardTimer, MetricsLogger, peak_flops_per_device, setup_logging
from graph_trainer.loop.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_
from graph_trainer.loop.preflight import check_model_state_fits
from graph_trainer.loop.profiling import step_profiling
from graph_trainer.torch_compat import cpu_backend
from graph_trainer.validation import check_device, resolve_device
from models.float8 import check_scaled_mm
from models.registry import HF_FLAVOR, MODEL_SPECS

logger = logging.getLogger("graph_trainer")


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: rank, world size and its device."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device


def setup_distributed(cfg: JobConfig) -> DistInfo:
    """Read torchrun's environment, choose the device and start the process group if needed."""
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    check_device(cfg.job.device)
    kind = resolve_device(cfg.job.device)
    if kind == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if cfg.float8.recipe_name != "none":
        check_scaled_mm(device)
    if world_size > 1 and not dist.is_initialized():
        # CPU: gloo with one worker thread per group (torch_compat.cpu_backend says why)
        dist.init_process_group(
            backend="nccl" if kind == "cuda" else cpu_backend(),
            device_id=device if kind == "cuda" else None,
            timeout=comm.init_timeout(cfg),
        )
    return DistInfo(rank, local_rank, world_size, device)


def _set_determinism(cfg: JobConfig) -> None:
    # No step draws from torch's global generators (initialisation and data have generators of
    # their own), but a checkpoint holds their states (rng-rank<R>.pt): seeded, two runs of one
    # job write the same bytes there, where torch would start each process at a random seed.
    torch.manual_seed(cfg.training.seed)
    if cfg.debug.num_threads > 0:
        torch.set_num_threads(cfg.debug.num_threads)
    if cfg.debug.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def _describe(dims: ParallelDims) -> str:
    parts = [f"{k}={v}" for k, v in dims.as_dict().items() if v > 1]
    return ", ".join(parts) + f" ({dims.fsdp_mode or 'no data parallel'})" if parts else "none (1 process)"


CONFIG_FILE = "config.toml"
"""Every field of the job's config, written to its dump folder: ``--job.config_file`` reruns it."""


def _record_config(cfg: JobConfig) -> None:
    """Log what the job sets (its fields that differ from the defaults) and write every field to
    ``<dump_folder>/config.toml`` (a resumed run writes its own over the earlier run's)."""
    path = os.path.join(cfg.job.dump_folder, CONFIG_FILE)
    try:
        os.makedirs(cfg.job.dump_folder, exist_ok=True)
        write_text_atomic(path, config_to_toml(cfg))
    except OSError as e:
        raise JobError(f"cannot write {path}: {e.strerror or e}") from None
    logger.info("config (what differs from the defaults): %s", " ".join(changed_fields(cfg)) or "the defaults")
    logger.info("config: every field in %s (--job.config_file %s reruns it)", path, path)


def job_dataloader(cfg: JobConfig, layout: JobLayout, held_out: bool = False):
    """This rank's training batches, or with ``held_out`` its validation batches (``[validation]``:
    its dataset, or the training one, and its split): its share of the global batch by its
    data-parallel rank (``dp_rank`` of the layout's mesh)."""
    t, v = cfg.training, cfg.validation
    own = held_out and v.dataset != ""  # validation's own dataset, else the training one
    dataset = v.dataset if own else t.dataset
    return build_dataloader(
        dataset=dataset,
        subset=v.dataset_subset if own else t.dataset_subset,
        streaming=t.dataset_streaming and dataset != "synthetic",
        shards=t.dataset_shards,
        tokenizer=build_tokenizer(t.tokenizer_path),
        seq_len=t.seq_len,
        local_batch_size=t.local_batch_size,
        dp_rank=dp_rank(layout.mesh, layout.dims),
        dp_degree=layout.dims.dp_size,
        seed=t.seed,
        vocab_size=layout.model_args.vocab_size,
        dataset_split=v.split if held_out else t.dataset_split,
        text_field=t.text_field,
        setting="validation.dataset" if own else "training.dataset",
        split_setting="validation.split" if held_out else "training.dataset_split",
    )


class Trainer:
    """One job's training loop (module docstring), built from a validated ``JobConfig``."""

    def __init__(self, cfg: JobConfig, dist_info: DistInfo | None = None):
        self.cfg = cfg
        self.dist = dist_info or setup_distributed(cfg)
        self.logger = setup_logging(self.dist.rank, getattr(logging, cfg.debug.log_level))
        _set_determinism(cfg)
        self.layout = build_layout(cfg, self.dist.world_size, self.dist.device.type)
        self.model_args, self.dims, self.mesh = self.layout.model_args, self.layout.dims, self.layout.mesh
        self.microbatches, self.grad_scale = self.layout.microbatches, self.layout.loss_scale
        self.pp_group = pp_group(self.mesh, self.dims)
        self.stepped = False  # whether this run has finished a step (``collective_timeout``)
        self.forward_backward_s: float | None = None
        """Device seconds of the last step's forward, loss and backward (None with a pipeline: its
        stages overlap)."""
        comm.set_timeout(cfg.comm.init_timeout_seconds)  # the mesh's own groups start with torch's default
        # Decide what to resume before building anything, so a wrong checkpoint fails fast.
        self.checkpointer = Checkpointer(
            cfg, self.dist.rank, self.dist.world_size, self.dims.as_dict(), self.dist.device
        )
        resume_step = self.checkpointer.resolve_load_step()
        if self.dist.rank == 0:  # (after a refusal to mix runs in the folder: that keeps the earlier config)
            _record_config(cfg)
        hf_weights = self._hf_weights_to_load(resume_step)
        # The data next, still before the model: a dataset or tokenizer that cannot be read fails fast.
        self.dataloader = job_dataloader(cfg, self.layout)
        held_out_loader = job_dataloader(cfg, self.layout, held_out=True) if cfg.validation.enable else None
        self.model = self._build_model(init=hf_weights is None)  # a folder fills every parameter
        self.params = list(self.model.parameters())
        self.optimizer = build_optimizer(self.params, cfg.training)
        self.scheduler = build_lr_scheduler(self.optimizer, cfg.training)
        self.step = self._resume(resume_step)
        # (agreed: rank 0 alone starts the W&B run, and a run wandb refuses stops every rank)
        self.metrics = comm.agree(lambda: self._metrics_logger(append_losses=resume_step is not None), "metrics")
        prep = StepPreparation(cfg, self.layout, self.model, self.optimizer, self.metrics, self.dist.device)
        self.timer = ForwardBackwardTimer(self.dist.device) if self.layout.pipeline is None else None
        self.gradients = build_gradients(prep, self.model_args.dim, self.timer)
        self.held_out = None
        if held_out_loader is not None:
            self.held_out = HeldOutLoss(cfg, self.layout, self.model, held_out_loader, self.dist.device)
        # Last: the memory checks above refuse a job that cannot fit before the folder is read.
        self.hf_bytes_read, self.hf_load_seconds = self._load_hf_weights(hf_weights)

    def _hf_weights_to_load(self, resume_step: int | None) -> HFWeights | None:
        """The Hugging Face folder to start from, checked against the flavor before building
        (``checkpoint.initial_load_hf``; not when resuming a checkpoint of the job's own)."""
        folder = self.cfg.checkpoint.initial_load_hf
        if folder and resume_step is not None:
            logger.info("resuming step %d: checkpoint.initial_load_hf is not read", resume_step)
        return open_hf_weights(self.cfg, self.model_args) if folder and resume_step is None else None

    def _build_model(self, init: bool) -> torch.nn.Module:
        """The job's model on this rank, its state checked against the device before it is allocated."""
        cfg, device, start = self.cfg, self.dist.device, time.perf_counter()
        layers = f" ({cfg.model.n_layers} layers)" if cfg.model.n_layers else ""
        model_name, dtype = f"{cfg.model.name} {cfg.model.flavor}{layers}", cfg.training.mixed_precision_param
        parallelism = _describe(self.dims)
        logger.info("building %s on %s, parallelism %s, compute dtype %s ...", model_name, device, parallelism, dtype)
        if cfg.model.flavor == HF_FLAVOR:
            logger.info("model from %s/config.json: %s", cfg.checkpoint.initial_load_hf, self.model_args)
        model = build_job_model(
            cfg,
            self.layout,
            device,
            check=lambda m: check_model_state_fits(cfg, m, device.type, self.layout.weights_per_step),
            init=init,
            document_start=self._document_start(),
        )
        n_params = sum(p.numel() for p in model.parameters())
        logger.info("model built in %.2fs: %s parameters", time.perf_counter() - start, f"{n_params:,}")
        if self.microbatches > 1:
            b, dp = cfg.training.local_batch_size, self.dims.dp_size
            logger.info(
                "global batch %d sequences: %d microbatches of %d per data-parallel rank (x%d ranks), "
                "gradients accumulated",
                *(self.microbatches * b * dp, self.microbatches, b, dp),
            )
        return model

    def _document_start(self) -> tuple[str, int] | None:
        """Where the packed documents start, for block_causal attention (None for causal)."""
        if self.cfg.training.attention_mask != "block_causal":
            return None
        return document_start(build_tokenizer(self.cfg.training.tokenizer_path))

    def _resume(self, resume_step: int | None) -> int:
        """Load the checkpoint to resume (``resolve_load_step``); the step it ends (0 without one)."""
        if resume_step is None:
            return 0
        self.checkpointer.load(resume_step, self.model, self.optimizer, self.scheduler, self.dataloader)
        if resume_step >= self.cfg.training.steps:
            logger.warning(
                "checkpoint step %d >= training.steps %d: nothing left to train", resume_step, self.cfg.training.steps
            )
        return resume_step

    def _metrics_logger(self, append_losses: bool) -> MetricsLogger:
        cfg = self.cfg
        return MetricsLogger(
            dump_folder=cfg.job.dump_folder,
            log_freq=cfg.metrics.log_freq,
            enable_tensorboard=cfg.metrics.enable_tensorboard,
            rank=self.dist.rank,
            device=self.dist.device,
            flops_per_token=MODEL_SPECS[cfg.model.name].flops_per_token(self.model_args, cfg.training.seq_len),
            peak_flops=peak_flops_per_device(self.dist.device, cfg.metrics.peak_tflops or None),
            num_devices_per_replica=self.dims.tp * self.dims.pp * self.dims.cp,  # (ranks sharing a batch)
            logger=self.logger,
            append_losses=append_losses,  # losses.txt continues the resumed run's file
            json_lines=cfg.metrics.json_lines,
            wandb_config=dataclasses.asdict(cfg) if cfg.metrics.enable_wandb else None,
            wandb_name=cfg.job.description,
        )

    def _load_hf_weights(self, hf_weights: HFWeights | None) -> tuple[int, float]:
        """Read the Hugging Face folder into the model (each rank its own shards); (bytes, seconds)."""
        if hf_weights is None:
            return 0, 0.0
        start = time.perf_counter()
        read = load_hf_weights(hf_weights, self.model, distributed=self.dist.world_size > 1)
        seconds = time.perf_counter() - start
        folder = self.cfg.checkpoint.initial_load_hf
        logger.info("loaded %s in %.2fs (this rank read %.1f MiB of it)", folder, seconds, read / 2**20)
        return read, seconds

    def train_step(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
        """One optimizer step on this rank's ``(tokens, labels)`` microbatches (module docstring);
        returns (the loss: the mean over the global batch's tokens, grad norm before clipping)."""
        if len(microbatches) != self.microbatches:  # the traced loss scale assumes this many
            raise ValueError(
                f"train_step got {len(microbatches)} microbatches; this job runs {self.microbatches} per step"
            )
        loss_sum, grads = self.gradients(microbatches)
        loss = loss_sum / len(microbatches) if len(microbatches) > 1 else loss_sum
        for p, g in zip(self.params, grads, strict=True):
            p.grad = g
        del grads
        record = None
        if self.step == self.cfg.debug.grad_record_step:  # before clipping scales them
            record = gather_record([(name, p.grad) for name, p in self.model.named_parameters()])
            if self.pp_group is not None:
                record = merge_over(record, self.pp_group)
        grad_norm = clip_grad_norm_(self.params, self.cfg.training.max_norm, self.pp_group)
        if record is not None and self.dist.rank == 0:
            record["norm"] = grad_norm.item()
            save_record(record, record_path(self.cfg.job.dump_folder, self.step))
        loss, grad_norm = average_over_dp(loss, self.dims).item(), grad_norm.item()
        # (the reads above waited for the graphs: their timing events are done)
        self.forward_backward_s = self.timer.pop_seconds() if self.timer is not None else None
        check_step(self.step, loss, grad_norm, list(self.model.named_parameters()))  # before the update
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if hasattr(self.model, "update_expert_bias"):
            # MoE load balancing (outside the gradient): every rank sees the global counts,
            # so every rank applies the same bias update.
            self.model.update_expert_bias(lambda counts: sum_of_routing_counts(counts, self.dims, self.mesh))
        return loss, grad_norm

    def train(self) -> list[float]:
        """Run the remaining steps; returns this run's losses in step order. A collective that times
        out (another rank stopped answering) ends it with a one-line ``JobError`` naming the step.
        However it ends, a background checkpoint save in flight is first given
        ``checkpoint.finish_timeout_seconds`` to be sealed (``_finish_saves``)."""
        with comm.collective_failures(lambda: f"step {self.step}", self.collective_timeout):
            try:
                losses = self._train()
                self._finish_saves(failing=False)
            except BaseException:
                self._finish_saves(failing=True)
                raise
        self.metrics.close()
        return losses

    def _finish_saves(self, failing: bool) -> None:
        """Wait up to ``checkpoint.finish_timeout_seconds`` for a background save in flight. At the
        end of training its failure, or its not being sealed in time, is the job's one-line error;
        while the job is already failing (``failing``: an error, SIGTERM) each is a warning, and
        the error that ends the job is the one reported."""
        pending = self.checkpointer.pending
        if pending is None:
            return
        seconds = self.cfg.checkpoint.finish_timeout_seconds
        if failing:
            logger.warning("the job is ending: waiting up to %gs for checkpoint %s to be sealed", seconds, pending.what)
        try:
            sealed = self.checkpointer.finish_pending(seconds)
        except Exception as e:
            if not failing:
                raise
            logger.warning("checkpoint %s was not completed: %s", pending.what, " ".join(str(e).split())[:300])
            return
        if not sealed:
            message = (
                f"checkpoint {pending.what} was not sealed within checkpoint.finish_timeout_seconds = "
                f"{seconds:g}: left unsealed (the next start removes it and resumes the newest complete checkpoint)"
            )
            if not failing:
                raise JobError(message)
            logger.warning("%s", message)

    def collective_timeout(self) -> float:
        """The timeout in force: comm.init_timeout_seconds until this run's first step has finished."""
        c = self.cfg.comm
        return c.timeout_seconds if self.stepped else c.init_timeout_seconds

    def _train(self) -> list[float]:
        t = self.cfg.training
        losses: list[float] = []
        data = iter(self.dataloader)
        if t.steps == 0 and self.step == 0:  # converting checkpoint.initial_load_hf (nothing else has 0 steps)
            self.checkpointer.save(
                0, self.model, self.optimizer, self.scheduler, self.dataloader, before_first_step=True
            )
        profiling = step_profiling(self.cfg, self.dist.rank, self.dist.device, self.step)
        with scheduled_collection(t.gc_freq) as after_step, profiling as profile_step:
            while self.step < t.steps:
                losses.append(self._run_step(data, first=not losses))
                if self.held_out is not None and self.held_out.due(self.step):
                    self.validate()
                profile_step(self.step)
                if self.checkpointer.should_save(self.step, t.steps):
                    self.checkpointer.save(self.step, self.model, self.optimizer, self.scheduler, self.dataloader)
                after_step(self.step)
        return losses

    def validate(self) -> tuple[float, float]:
        """The held-out loss and perplexity with the current weights (``loop.held_out``), recorded."""
        start = time.perf_counter()
        loss, perplexity = self.held_out()
        self.metrics.record_validation(self.step, loss, perplexity, time.perf_counter() - start)
        return loss, perplexity

    def _run_step(self, data, first: bool) -> float:
        """Take the next step's microbatches from ``data``, run the step, log it; its loss."""
        self.step += 1
        start = time.perf_counter()
        microbatches = [next(data) for _ in range(self.microbatches)]
        lr = self.scheduler.get_last_lr()[0]
        loss, grad_norm = self.train_step(microbatches)
        elapsed = time.perf_counter() - start
        if first:  # the first step of this run (step N+1 after resuming from step N)
            logger.info("first step (including trace, passes and compile) took %.2fs", elapsed)
            # Every rank has been through that step's collectives; from now on one that stops
            # answering for comm.timeout_seconds ends the job (graph_trainer.distributed.comm).
            comm.set_timeout(self.cfg.comm.timeout_seconds)
            self.stepped = True
        self.metrics.record_step(
            step=self.step,
            loss=loss,
            grad_norm=grad_norm,
            lr=lr,
            ntokens=sum(tokens.numel() for tokens, _ in microbatches),
            step_time_s=elapsed,
            forward_backward_s=self.forward_backward_s,
        )
        return loss
