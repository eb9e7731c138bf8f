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
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from graph_trainer.analysis.memory import StepMemoryEstimate, estimate_step_memory
from graph_trainer.build import build_job_model, build_layout, pass_context, stage_modules
from graph_trainer.checkpoint.checkpointer import Checkpointer
from graph_trainer.checkpoint.hf import load_hf_weights, open_hf_weights
from graph_trainer.compiler.chain import apply_memory_policy, apply_passes, compile_graph
from graph_trainer.compiler.passes.runner import PassRunner
from graph_trainer.compiler.tracer import GraphStep, TracedStep, eager_step
from graph_trainer.config import JobConfig
from graph_trainer.data.loader import build_dataloader
from graph_trainer.data.tokenizer import build_tokenizer
from graph_trainer.distributed import comm
from graph_trainer.distributed.parallel_dims import ParallelDims, average_over_dp, dp_rank, pp_group, sum_over_dp
from graph_trainer.loop.grad_record import gather_record, merge_over, record_path, save_record
from graph_trainer.loop.guards import check_step
from graph_trainer.loop.metrics import MetricsLogger, peak_flops_per_device, setup_logging
from graph_trainer.loop.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_
from graph_trainer.loop.preflight import check_model_state_fits, check_step_fits
from graph_trainer.pipelining.step import PipelineStep
from graph_trainer.pipelining.timeline import rank_memory, stage_cost
from graph_trainer.torch_compat import cpu_backend
from graph_trainer.validation import check_device, resolve_device
from models.registry import MODEL_SPECS, model_args

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
    if world_size > 1 and not dist.is_initialized():
        # CPU: gloo with one worker thread per group (torch_compat.cpu_backend says why)
        dist.init_process_group(
            backend="nccl" if kind == "cuda" else cpu_backend(),
            device_id=device if kind == "cuda" else None,
            timeout=comm.init_timeout(cfg),
        )
    return DistInfo(rank, local_rank, world_size, device)


def _set_determinism(cfg: JobConfig) -> None:
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


class Trainer:
    def __init__(self, cfg: JobConfig, dist_info: DistInfo | None = None):
        self.cfg = cfg
        self.dist = dist_info or setup_distributed(cfg)
        self.logger = setup_logging(self.dist.rank, getattr(logging, cfg.debug.log_level))
        _set_determinism(cfg)
        t = cfg.training
        spec = MODEL_SPECS[cfg.model.name]
        self.model_args = model_args(cfg.model)

        self.layout = build_layout(cfg, self.dist.world_size, self.dist.device.type)
        self.dims, self.mesh = self.layout.dims, self.layout.mesh
        comm.set_timeout(cfg.comm.init_timeout_seconds)  # the mesh's own groups start with torch's default
        # Decide what to resume before building anything, so a wrong checkpoint fails fast.
        self.checkpointer = Checkpointer(
            cfg, self.dist.rank, self.dist.world_size, self.dims.as_dict(), self.dist.device
        )
        resume_step = self.checkpointer.resolve_load_step()
        # Hugging Face weights to start from: the folder is checked against the flavor before building.
        hf_weights = None
        if cfg.checkpoint.initial_load_hf and resume_step is not None:
            logger.info("resuming step %d: checkpoint.initial_load_hf is not read", resume_step)
        elif cfg.checkpoint.initial_load_hf:
            hf_weights = open_hf_weights(cfg, self.model_args)
        # The data next, still before the model: a dataset or tokenizer that cannot be read fails fast.
        tokenizer = build_tokenizer(t.tokenizer_path)
        self.dataloader = build_dataloader(
            dataset=t.dataset,
            tokenizer=tokenizer,
            seq_len=t.seq_len,
            local_batch_size=t.local_batch_size,
            dp_rank=dp_rank(self.mesh, self.dims),
            dp_degree=self.dims.dp_size,
            seed=t.seed,
            vocab_size=self.model_args.vocab_size,
            dataset_split=t.dataset_split,
            text_field=t.text_field,
        )
        start = time.perf_counter()
        layers = f" ({cfg.model.n_layers} layers)" if cfg.model.n_layers else ""
        logger.info(
            "building %s %s%s on %s, parallelism %s, compute dtype %s ...",
            cfg.model.name,
            cfg.model.flavor,
            layers,
            self.dist.device,
            _describe(self.dims),
            t.mixed_precision_param,
        )
        self.model = build_job_model(
            cfg,
            self.layout,
            self.dist.device,
            self.model_args,
            check=lambda model: check_model_state_fits(cfg, model.parameters(), self.dist.device.type),
            init=hf_weights is None,  # the folder fills every parameter: no random draw to throw away
        )
        self.pass_context = pass_context(cfg, self.layout, self.model)
        self.params = [p for p in self.model.parameters()]
        n_params = sum(p.numel() for p in self.params)
        logger.info("model built in %.2fs: %s parameters", time.perf_counter() - start, f"{n_params:,}")
        # Each data-parallel rank averages over its own microbatch; gradients are summed over
        # ranks and microbatches (parallel.loss_scale).
        self.microbatches = self.layout.microbatches
        self.grad_scale = self.layout.loss_scale
        if self.microbatches > 1:
            logger.info(
                "global batch %d sequences: %d microbatches of %d per data-parallel rank (x%d ranks), "
                "gradients accumulated",
                self.microbatches * t.local_batch_size * self.dims.dp_size,
                self.microbatches,
                t.local_batch_size,
                self.dims.dp_size,
            )

        self.optimizer = build_optimizer(self.params, t)
        self.scheduler = build_lr_scheduler(self.optimizer, t)
        self.step = 0
        if resume_step is not None:
            self.checkpointer.load(resume_step, self.model, self.optimizer, self.scheduler, self.dataloader)
            self.step = resume_step
            if resume_step >= t.steps:
                logger.warning("checkpoint step %d >= training.steps %d: nothing left to train", resume_step, t.steps)
        self.metrics = MetricsLogger(
            dump_folder=cfg.job.dump_folder,
            log_freq=cfg.metrics.log_freq,
            enable_tensorboard=cfg.metrics.enable_tensorboard,
            rank=self.dist.rank,
            device=self.dist.device,
            flops_per_token=spec.flops_per_token(self.model_args, t.seq_len),
            peak_flops=peak_flops_per_device(self.dist.device, cfg.metrics.peak_tflops or None),
            num_devices_per_replica=self.dims.tp * self.dims.pp,
            logger=self.logger,
            append_losses=resume_step is not None,  # losses.txt continues the resumed run's file
        )
        self.pipeline, self.pp_group = self.layout.pipeline, pp_group(self.mesh, self.dims)
        if self.pipeline is not None:
            self._report_memory(None)  # (parameters, gradients, optimizer state; no stage graph estimate yet)
            self.pipeline_step = PipelineStep(
                self.pipeline,
                self.model,
                stage_modules(self.model, self.pipeline),
                self.pp_group,
                graph=cfg.compile.mode == "graph",
                hidden_dim=self.model_args.dim,
                hidden_dtype=self.layout.mp.param_dtype,
                loss_chunks=t.loss_chunks,
                grad_scale=self.grad_scale,
                post_trace=self._prepare_stage_graph,
                on_traced=self._check_pipeline_memory,
            )
        elif cfg.compile.mode == "graph":
            self.step_fn = GraphStep(
                self.model, t.loss_chunks, grad_scale=self.grad_scale, post_trace=self._prepare_graph
            )
        else:
            self._report_memory(None)
            self.step_fn = lambda tokens, labels: eager_step(
                self.model, tokens, labels, t.loss_chunks, grad_scale=self.grad_scale
            )
        # Last: the memory estimates above refuse a job that cannot fit before the folder is read.
        self.hf_bytes_read, self.hf_load_seconds = 0, 0.0
        if hf_weights is not None:
            start = time.perf_counter()
            self.hf_bytes_read = load_hf_weights(hf_weights, self.model, distributed=self.dist.world_size > 1)
            self.hf_load_seconds = time.perf_counter() - start
            logger.info(
                "loaded %s in %.2fs (this rank read %.1f MiB of it)",
                cfg.checkpoint.initial_load_hf,
                self.hf_load_seconds,
                self.hf_bytes_read / 2**20,
            )

    def _prepare_stage_graph(self, traced: TracedStep, stage: int) -> TracedStep:
        """``_prepare_graph`` for one pipeline stage's graph: the passes see that stage's modules."""
        module = self.pipeline_step.modules[stage]
        dumps = self.cfg.compile.dump_graphs and os.path.join(self.cfg.compile.dump_graphs, f"stage{stage}")
        return self._prepare_graph(traced, pass_context(self.cfg, self.layout, module), dumps, report_memory=False)

    def _prepare_graph(
        self, traced: TracedStep, context=None, dump_folder: str | None = None, report_memory: bool = True
    ) -> TracedStep:
        """The compile chain after tracing (``graph_trainer.compiler.chain``): memory policy, passes, backend."""
        self.metrics.log_event("trace", trace_seconds=traced.trace_seconds, graph_nodes=len(traced.gm.graph.nodes))
        dumps = self.cfg.compile.dump_graphs if dump_folder is None else dump_folder
        runner = PassRunner(context or self.pass_context, dumps)
        gm = apply_memory_policy(traced.gm, runner)
        gm = apply_passes(gm, runner)
        if report_memory:
            self._report_memory(gm.graph)
        deterministic = self.dist.device.type == "cpu" or self.cfg.debug.deterministic
        traced.gm, report = compile_graph(gm, self.cfg.compile, deterministic)
        if report.backend != "none":
            self.metrics.log_event(
                "compile",
                backend=report.backend,
                scope=report.scope,
                compile_seconds=report.seconds,
                regions=report.regions,
            )
        return traced

    def _check_pipeline_memory(self, step: PipelineStep) -> None:
        """``_report_memory`` of a pipeline rank once its stages are traced: its parameters, gradient
        buffer and optimizer state, and the activations its schedule keeps in flight
        (``pipelining.timeline.rank_memory``), before the first microbatch allocates them."""
        costs = {s: stage_cost(runner.graphs, step.traced[s]) for s, runner in step.runners.items()}
        self._report_memory(None, rank_memory(self.pipeline.plan, self.pipeline.rank, costs, self.optimizer))

    def _report_memory(self, graph, estimate: StepMemoryEstimate | None = None) -> None:
        """Log the estimated per-rank peak with its parts, and refuse the job before its first step
        when the largest over the ranks exceeds the device's memory (``preflight.check_step_fits``).
        ``graph`` None: eager mode (a lower bound), unless ``estimate`` is given."""
        if estimate is None:
            estimate = estimate_step_memory(graph, self.params, self.optimizer, microbatches=self.microbatches)
        logger.info("estimated memory per rank: %s", estimate.summary())
        peak = torch.tensor([float(estimate.peak_bytes)], dtype=torch.float64, device=self.dist.device)
        if self.dist.world_size > 1:  # the same decision on every rank: uneven shards differ a little
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        check_step_fits(self.cfg, estimate, int(peak.item()), self.dist.device.type)

    def accumulate_gradients(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, list]:
        """Forward and backward of each microbatch in turn; (the sum of their losses, the sum of
        their gradients). The first microbatch's gradients are the accumulation buffer: each later
        one is added into it in place and dropped, so at most one more set is alive at a time."""
        loss_sum, accumulated = None, None
        for tokens, labels in microbatches:
            tokens = tokens.to(self.dist.device, non_blocking=True)
            labels = labels.to(self.dist.device, non_blocking=True)
            loss, grads = self.step_fn(tokens, labels)
            if accumulated is None:
                loss_sum, accumulated = loss, list(grads)
                continue
            loss_sum = loss_sum + loss
            for acc, g in zip(accumulated, grads, strict=True):
                acc.add_(g)
            del grads
        return loss_sum, accumulated

    def _pipeline_gradients(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, list]:
        """``accumulate_gradients`` through the pipeline schedule (``graph_trainer.pipelining``): the
        last stage's loss sum is shared with every pipeline rank, so every rank logs and checks it."""
        device = self.dist.device
        moved = [(tok.to(device, non_blocking=True), lab.to(device, non_blocking=True)) for tok, lab in microbatches]
        loss_sum, grads = self.pipeline_step(moved)
        if loss_sum is None:
            loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        loss_sum = loss_sum.detach().clone()
        dist.all_reduce(loss_sum, group=self.pp_group)  # (one rank holds the last stage: the others add 0)
        return loss_sum, grads

    def train_step(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
        """One optimizer step on this rank's ``(tokens, labels)`` microbatches (module docstring);
        returns (the loss: the mean over the global batch's tokens, grad norm before clipping)."""
        if len(microbatches) != self.microbatches:  # the traced loss scale assumes this many
            raise ValueError(
                f"train_step got {len(microbatches)} microbatches; this job runs {self.microbatches} per step"
            )
        if self.pipeline is not None:
            loss_sum, grads = self._pipeline_gradients(microbatches)
        else:
            loss_sum, grads = self.accumulate_gradients(microbatches)
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
        check_step(self.step, loss, grad_norm, list(self.model.named_parameters()))  # before the update
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if hasattr(self.model, "update_expert_bias"):
            # MoE load balancing (outside the gradient): every rank sees the global counts,
            # so every rank applies the same bias update.
            self.model.update_expert_bias(lambda counts: sum_over_dp(counts, self.dims, self.mesh))
        return loss, grad_norm

    def train(self) -> list[float]:
        """Run the remaining steps; returns this run's losses in step order. A collective that times
        out (another rank stopped answering) ends it with a one-line ``JobError`` naming the step."""
        with comm.collective_failures(lambda: f"step {self.step}", self._collective_timeout):
            return self._train()

    def _collective_timeout(self) -> float:
        """The timeout in force: comm.init_timeout_seconds until this run's first step has finished."""
        c = self.cfg.comm
        return c.timeout_seconds if getattr(self, "_stepped", False) else c.init_timeout_seconds

    def _train(self) -> list[float]:
        t = self.cfg.training
        losses: list[float] = []
        data = iter(self.dataloader)
        if t.steps == 0 and self.step == 0:  # converting checkpoint.initial_load_hf (nothing else has 0 steps)
            self.checkpointer.save(
                0, self.model, self.optimizer, self.scheduler, self.dataloader, before_first_step=True
            )
        while self.step < t.steps:
            self.step += 1
            start = time.perf_counter()
            microbatches = [next(data) for _ in range(self.microbatches)]
            lr = self.scheduler.get_last_lr()[0]
            loss, grad_norm = self.train_step(microbatches)
            elapsed = time.perf_counter() - start
            if not losses:  # the first step of this run (step N+1 after resuming from step N)
                logger.info("first step (including trace, passes and compile) took %.2fs", elapsed)
                # Every rank has been through that step's collectives; from now on one that stops
                # answering for comm.timeout_seconds ends the job (graph_trainer.distributed.comm).
                comm.set_timeout(self.cfg.comm.timeout_seconds)
                self._stepped = True
            losses.append(loss)
            self.metrics.record_step(
                step=self.step,
                loss=loss,
                grad_norm=grad_norm,
                lr=lr,
                ntokens=sum(tokens.numel() for tokens, _ in microbatches),
                step_time_s=elapsed,
            )
            if self.checkpointer.should_save(self.step, t.steps):
                self.checkpointer.save(self.step, self.model, self.optimizer, self.scheduler, self.dataloader)
        self.metrics.close()
        return losses
