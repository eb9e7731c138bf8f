"""Job configuration: the documented dataclass sections of one job (where their paths point on disk:
``graph_trainer.config_paths``).

A job is one ``JobConfig`` with the sections ``job, model, training, parallelism, compile, float8,
activation_checkpoint, metrics, validation, profiling, checkpoint, comm, debug``. Every field says
what it does; a field with a fixed set of values is a ``Literal`` (``python train.py --help`` lists
the choices, and ``graph_trainer.config_loading`` refuses any other value, from TOML or the command
line, with one line). Reading a TOML file and the command line is ``graph_trainer.config_loading``;
checks that involve several fields, the model or the world size are ``graph_trainer.validation``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from graph_trainer.graph.ops import ATTENTION_FORWARD_OP_NAMES, MATMUL_OP_NAMES

Device = Literal["auto", "cpu", "cuda"]
ModelName = Literal["llama3", "deepseek_v3", "qwen3", "qwen3_moe"]
"""The keys of ``models.registry.MODEL_SPECS`` (a test holds the two equal)."""
Dtype = Literal["float32", "bfloat16", "float16"]
DecayType = Literal["linear", "sqrt", "cosine", "constant"]
ReshardAfterForward = Literal["default", "always", "never"]
FsdpCollectives = Literal["default", "per_microbatch", "per_step"]
AsyncMode = Literal["disabled", "async"]
ChunkDim = Literal["batch", "seq"]
CompileMode = Literal["graph", "eager"]
Backend = Literal["none", "inductor"]
InductorScope = Literal["regional", "full"]
AcMode = Literal["none", "selective", "full"]
AttentionMask = Literal["causal", "block_causal"]
SelectiveMatmuls = Literal["all", "every_other"]
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]
PipelineSchedule = Literal["1F1B", "GPipe", "Interleaved1F1B", "ZBVZeroBubble"]
Float8Recipe = Literal["none", "tensorwise", "rowwise", "rowwise_with_gw_hp"]
"""torchao's float8 training recipes by name (``Float8LinearConfig.from_recipe_name``), and 'none'."""
SimulatedDevice = Literal["none", "h100", "h200", "h100_hbm2e_500w", "cpu"]
"""'none' and the keys of ``graph_trainer.analysis.devices.DEVICES`` (a test holds them equal)."""

SELECTIVE_OPS = [*MATMUL_OP_NAMES, *ATTENTION_FORWARD_OP_NAMES]
"""``activation_checkpoint.selective_ops`` by default: matmuls, grouped and scaled matmuls, attention."""


@dataclass
class Job:
    config_file: str = ""
    """TOML file holding the job; other flags override its values."""
    dump_folder: str = "./outputs"
    """Folder for logs, TensorBoard events, the per-step loss file and checkpoints."""
    description: str = ""
    """Free text shown at the start of the run."""
    device: Device = "auto"
    """Device type: 'auto' (cuda when available, else cpu), 'cpu' or 'cuda'."""


@dataclass
class Model:
    name: ModelName = "llama3"
    """Model family (``models/registry.py``)."""
    flavor: str = "debugmodel"
    """Size of the model within its family (e.g. 'debugmodel', '8B', '70B', '405B'); 'hf': the shapes
    ``config.json`` of the Hugging Face folder ``checkpoint.initial_load_hf`` describes (any LLaMA-3,
    DeepSeek-V3, Qwen3 or Qwen3-MoE architecture, tied embeddings included; logged at start)."""
    n_layers: int = 0
    """Transformer blocks to build: 0 = the flavor's; N = the flavor's shapes with only N blocks
    (e.g. to measure a real block's speed and memory on one GPU). Logs, MFU and the memory estimate use N."""
    max_seq_len: int = 0
    """Positions the rotary table covers (training.seq_len at most this): 0 = the flavor's; N = the
    flavor with N (e.g. Llama 3.1's 131072 for long-context training; no weight depends on it)."""


@dataclass
class Training:
    steps: int = 10
    """Number of optimizer steps to run (>= 1; 0 only converts checkpoint.initial_load_hf into a step-0
    checkpoint)."""
    local_batch_size: int = 8
    """Sequences per data-parallel rank per microbatch (one forward and backward)."""
    global_batch_size: int = 0
    """Sequences per optimizer step over all data-parallel ranks. 0: local_batch_size x the
    data-parallel degree (one microbatch per step). A multiple M of that runs M microbatches per
    rank per step and sums their gradients before one clip, AdamW update and schedule step
    (gradient accumulation); the loss is the mean over all tokens of the global batch."""
    seq_len: int = 256
    """Tokens per sequence; at most the model's max_seq_len (model.max_seq_len)."""
    attention_mask: AttentionMask = "causal"
    """'causal': a token attends to every earlier token of its sequence, across the packed documents'
    boundaries (torchtitan's default); 'block_causal': only to earlier tokens of its own document, the
    documents as the loader packed them (models/sequence.py; docs/parallelism.md says when to choose it)."""
    positions_per_document: bool = False
    """With block_causal: each document's rotary positions start at 0 (else a token's position is its
    index in the sequence)."""
    lr: float = 8e-4
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    warmup_steps: int = 2
    """Linear warmup over this many steps: step k (1-based) trains at lr * k / warmup_steps (cut to
    training.steps, with a warning). The schedule is torchtitan's (warmup, stable, decay), value for value."""
    decay_ratio: float = 1.0
    """Warmup-stable-decay: the decay takes the last round(steps * decay_ratio) steps (at most those
    after warmup), the lr stays at its peak between warmup and decay. 1.0: the decay starts right
    after warmup (torchtitan's decay_ratio None); 0.2 decays over the last fifth. Refused with decay_type 'constant'."""
    decay_type: DecayType = "linear"
    """The decay's shape, from lr towards lr * min_lr_ratio: 'linear', 'sqrt' (1 - sqrt(progress)),
    'cosine', or 'constant' (no decay: the peak lr after warmup)."""
    min_lr_ratio: float = 0.0
    """The floor of the decay, as a fraction of lr (0 <= ratio <= 1); torchtitan's min_lr_factor.
    Refused with decay_type 'constant' (no decay)."""
    max_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping (the norm is still logged)."""
    seed: int = 42
    """Seeds weight initialisation and the synthetic dataset; the same seed gives the same run."""
    dataset: str = "synthetic"
    """'synthetic' (built in, no download), a local .json/.jsonl/.parquet/.txt file or folder, or a
    Hugging Face hub name."""
    dataset_split: str = "train"
    """Split of a Hugging Face dataset (of the synthetic corpus: another name draws its documents
    from a seed of their own; 'train' is the corpus of training.seed)."""
    dataset_subset: str = ""
    """A hub dataset's subset (its configuration name, such as 'en' of allenai/c4); '' for none."""
    dataset_streaming: bool = False
    """Read a file or hub dataset as a stream (datasets' streaming mode: nothing downloaded or
    converted ahead, rows read in order) instead of a memory-mapped table; the same batches either
    way. Resuming reads the stream again up to the saved document (without tokenizing it)."""
    dataset_shards: int = 1
    """Split the documents into this many shards (document i in shard i % shards), each packed into
    its own token stream and giving an equal part of every batch; a data-parallel rank reads and
    tokenizes only the shards its rows come from. 1: every rank tokenizes the whole stream and the
    batches do not depend on the data-parallel degree; the data-parallel degree (or a multiple):
    each rank tokenizes only its own documents. Must divide local_batch_size x data-parallel degree;
    the batches depend on it, so a resume keeps it (graph_trainer/data/loader.py)."""
    text_field: str = "text"
    """Column holding the document text in a Hugging Face dataset."""
    tokenizer_path: str = ""
    """Path to a Hugging Face tokenizer.json; empty means the built-in byte-level tokenizer."""
    loss_chunks: int = 1
    """Compute the output projection and cross-entropy in this many blocks of tokens (graph_trainer/loss.py);
    in graph mode each block's logits are recomputed in backward, so the loss region holds ~1/N of its
    memory (for one more output matmul). The loss matches the unchunked one to an ulp (bitwise unless a
    block is a row or two); later steps agree to float rounding."""
    mixed_precision_param: Dtype = "float32"
    """Dtype parameters are cast to for compute, on every layout (SimpleFSDP casts before the all-gather;
    without data parallelism a cast parametrization does it): float32, bfloat16 or float16. The
    optimizer keeps float32 master weights either way."""
    gc_freq: int = 50
    """Python's automatic garbage collection is off while training, and every rank collects its
    young generations before the first step and after every gc_freq-th step, so no rank pauses for
    a collection at a moment the others do not (they would wait for it in the next collective).
    0 leaves automatic collection on. torchtitan's option and default."""
    mixed_precision_reduce: Dtype = "float32"
    """Dtype gradients are reduced in across data-parallel ranks: float32, bfloat16 or float16
    (no effect without data parallelism: nothing is reduced)."""


@dataclass
class Parallelism:
    dp_replicate: int = 1
    """Data-parallel replicas (DDP when alone, HSDP together with dp_shard > 1)."""
    dp_shard: int = -1
    """Data-parallel shards (FSDP); -1 takes whatever the world size leaves after the other degrees."""
    tp: int = 1
    """Tensor-parallel degree."""
    sequence_parallel: bool = True
    """With tp > 1: the residual stream between the tensor-parallel regions (norms, residual adds,
    the hidden state a pipeline stage sends) is split over the tp ranks along the sequence, each
    region gathers its input and reduce-scatters its output (Megatron's sequence parallel; what
    torchtitan always does with tp). training.seq_len must then be a multiple of tp. False: every
    tp rank holds the whole sequence and the regions all-reduce their outputs."""
    ep: int = 1
    """Expert-parallel degree (MoE models only)."""
    cp: int = 1
    """Context-parallel degree: each sequence is split over this many ranks, two chunks each (one early,
    one late, so causal attention costs every rank the same), keys and values all-gathered over them
    for attention (docs/parallelism.md). training.seq_len must be a multiple of 2 x cp (x tp under
    sequence parallel). The dense models (llama3, qwen3) only."""
    fsdp_reshard_after_forward: ReshardAfterForward = "default"
    """'always': backward re-gathers parameters instead of keeping them from forward; 'never': keep them;
    'default': re-gather all but the final norm's and output projection's, which the backward
    reads first (a re-gather there would wait with nothing to overlap; torchtitan's default keeps
    them too). Acts on microbatches that gather their weights (fsdp_collectives per_microbatch)."""
    fsdp_collectives: FsdpCollectives = "default"
    """When SimpleFSDP gathers weights and reduces gradients. 'per_microbatch': each microbatch
    gathers the weights it computes with and reduces its gradients; 'per_step': the weights are
    gathered once, before the step's first microbatch, and kept until the last one's backward,
    and their gradients are summed over the microbatches in mixed_precision_reduce and reduced
    once (graph_trainer/distributed/resident.py: more memory, fewer collectives); 'default':
    per_step under pp > 1 (as torchtitan's and Megatron's pipelines), per_microbatch otherwise."""
    pp: int = 1
    """Pipeline-parallel degree: the transformer blocks are split into stages over this many ranks
    (the outermost mesh dim; data, tensor and expert parallelism run inside each stage)."""
    pp_schedule: PipelineSchedule = "1F1B"
    """'1F1B' and 'GPipe': one stage per rank; 'Interleaved1F1B': two stages per rank (stage s on
    rank s % pp); 'ZBVZeroBubble': two stages per rank in a V, backward split into input- and
    weight-gradient halves that fill the bubbles (graph_trainer/pipelining/schedule.py)."""
    pp_microbatches: int = 0
    """Microbatches per step through the pipeline (each of training.local_batch_size sequences);
    0: as many as training.global_batch_size makes (one without it). Set, it makes the global batch
    local_batch_size x data-parallel degree x pp_microbatches; global_batch_size must then be 0 or that
    (with pp = 1 it sets the gradient-accumulation microbatches the same way)."""
    pp_stage_blocks: str = ""
    """How many transformer blocks each pipeline stage holds, comma-separated in stage order (e.g.
    '3,3,2'; one number per stage, adding up to the model's blocks); '': balanced by each block's
    cost, the last stage's output projection counted (graph_trainer/pipelining/stages.py)."""


@dataclass
class EpOverlap:
    """Settings of the ``ep_overlap`` pass (``graph_trainer/compiler/passes/ep_overlap.py``); TOML table
    ``[compile.ep_overlap]``."""

    module_fqn: str = "layers.*"
    """Which modules run as two chunks: 'layers.*' (whole transformer blocks that hold a MoE) or
    'layers.*.moe' (the MoE layers only). A pattern of dot-separated parts, '*' matching one part."""
    chunk_dim: ChunkDim = "batch"
    """Dimension the chunks split: 'batch', or 'seq' (only when the selected modules are MoE layers)."""
    reorder: bool = True
    """False: chunk, but keep the traced order (the numerics reference the reordering must match bitwise)."""


@dataclass
class Compile:
    mode: CompileMode = "graph"
    """'graph': trace forward + loss + backward into one FX graph and run it; 'eager': run the model
    directly (the numerics baseline)."""
    passes: list[str] = field(default_factory=list)
    """The user's graph passes, run after the memory policy in the order given (comma- or
    space-separated, e.g. 'a,b'): transformer_block_bucketing, auto_bucketing, ep_overlap."""
    dump_graphs: str = ""
    """If set, a folder where the readable code of the graph is written before and after every pass
    (one subfolder rank<r> per process in multi-process jobs, inside one stage<s> per pipeline stage)."""
    ep_overlap: EpOverlap = field(default_factory=EpOverlap)
    """Settings of the ep_overlap pass."""
    backend: Backend = "none"
    """What runs the graph after the passes (``graph_trainer/compiler/backend.py``): 'none', op by op (the
    numerics reference); 'inductor', compiled by Inductor (not bitwise 'none': fusion rounds
    differently; graph mode only)."""
    inductor_scope: InductorScope = "regional"
    """With backend 'inductor': 'regional' compiles each transformer block's forward and backward
    (and the embedding, head and loss) on its own, leaving collectives, waits and the order the
    passes gave them untouched; 'full' compiles the whole step, collectives included, as one
    graph (Inductor may move them)."""
    cache_dir: str = ""
    """Folder of Inductor's on-disk caches, reused by the next start of the job ('': Inductor's
    default, $TORCHINDUCTOR_CACHE_DIR or /tmp/torchinductor_<user>)."""
    once_per_node: bool = True
    """With backend 'inductor' (not under pipeline parallel): of the ranks on one host whose graphs
    are the same (``compiler.backend.compile_key``), the lowest compiles first and the others wait,
    then load its result from Inductor's FX graph cache instead of compiling the same kernels side
    by side. Off: every rank compiles at once (on by default; without the FX graph cache it is off)."""


@dataclass
class Float8:
    """FP8 training of the models' linears (``models/float8.py``, torchao's float8 training);
    TOML table ``[float8]``."""

    recipe_name: Float8Recipe = "none"
    """'tensorwise': one dynamic scale per tensor (amax of the whole tensor), e4m3 operands, e5m2
    output gradients; 'rowwise': one scale per row of each operand along the summed dim, e4m3
    everywhere, scales rounded down to powers of 2; 'rowwise_with_gw_hp': rowwise, but the weight
    gradient computed in high precision (more accurate, slower). 'none': linears compute in the
    parameter dtype. Every recipe's three matmuls per linear run ``torch._scaled_mm``."""
    filter_fqns: list[str] = field(default_factory=list)
    """Linears to keep in high precision: those whose FQN contains one of these strings
    (comma-separated on the command line, e.g. ``attention.wq,attention.wk``); each must match a
    linear of the model. Linears with a dimension not divisible by 16 (per tensor-parallel rank)
    are always kept, as ``_scaled_mm`` requires."""
    convert_output: bool = False
    """Also compute the output projection (the vocabulary logits) in FP8; kept in high precision
    by default, as in torchtitan's and DeepSeek-V3's FP8 runs."""
    convert_router: bool = False
    """Also compute a MoE's router gate (``moe.router.gate``) in FP8; kept in high precision
    by default (its scores choose the experts)."""
    convert_routed_experts: bool = False
    """Also compute a MoE's routed experts in FP8: their forward and input-gradient matmuls
    with rowwise scales, one ``_scaled_mm`` per local expert, the weight gradient in high precision
    (``models/float8.py``). Needs recipe 'rowwise_with_gw_hp' (a float8 weight gradient of an
    expert would need its tokens padded to multiples of 16: not built)."""
    dispatch_in_float8: bool = False
    """Expert parallel's forward dispatch sends each routed expert its tokens in float8 (one byte
    per element and a float32 scale per row, instead of bf16's two bytes per element), as
    DeepSeek-V3 trained; the combine and the backward's exchanges keep the parameter dtype. The
    rows are cast as the experts cast them (one power-of-2 scale per row), so the experts' float8
    matmuls compute with the same values as without it; the weight gradients of their first
    matmuls (w1, w3), in high precision, read the rows as they arrived (float8, scaled back)
    instead of as they were sent. Needs convert_routed_experts and parallelism.ep > 1."""
    enable_fsdp_float8_all_gather: bool = False
    """SimpleFSDP gathers the float8 linears' weights in float8 (one byte per element instead of
    bf16's two): each rank casts its shard with the whole weight's scale (one small all-reduce of
    the amax per weight) before the all-gather. Bitwise the same run as without it. Needs recipe
    'tensorwise', parallelism.dp_shard > 1 and gathers per microbatch (fsdp_collectives)."""


@dataclass
class ActivationCheckpoint:
    """The memory policy (``graph_trainer/compiler/memory_policy/``); TOML table ``[activation_checkpoint]``."""

    mode: AcMode = "none"
    """'none': backward reads every activation it needs from forward; 'full': each transformer block
    keeps only its input and recomputes the rest in backward; 'selective': also keeps the outputs of
    ``selective_ops`` and recomputes only the cheap ops (norms, activations, RoPE). Losses are
    bitwise the same in every mode. Graph mode only."""
    selective_ops: list[str] = field(default_factory=lambda: list(SELECTIVE_OPS))
    """aten ops (names without overload, comma-separated on the command line) whose outputs
    'selective' saves; the default: matmuls (dense, grouped, scaled) and attention."""
    selective_matmuls: SelectiveMatmuls = "all"
    """With mode 'selective': which matmuls of ``selective_ops`` each block saves. 'all'; 'every_other':
    the 1st, 3rd, ... in forward order, the 2nd, 4th, ... recomputed (torchtitan's op-level policy)."""
    full_blocks: int = 0
    """How many transformer blocks of each pipeline stage (of the model, without pipeline
    parallel), its first ones by block index, recompute in full whatever ``mode`` says; the others
    follow ``mode`` ('selective' or 'none'). A step between two modes' memory and time, as
    Megatron's block recomputation (``--recompute-method block --recompute-num-layers``). 0: every
    block follows ``mode``."""


@dataclass
class Metrics:
    log_freq: int = 1
    """Log one line (and TensorBoard scalars) every this many steps; losses are written every step."""
    enable_tensorboard: bool = True
    """Write TensorBoard events under <dump_folder>/tb."""
    enable_wandb: bool = False
    """Also log the scalars to Weights & Biases, the resolved config as the run's config (rank 0; the
    optional wandb package; project $WANDB_PROJECT or 'graph_trainer', the run in <dump_folder>/wandb;
    WANDB_MODE=offline keeps it on disk; refused at start when wandb would not start the run:
    graph_trainer/loop/wandb_writer.py)."""
    peak_tflops: float = 0.0
    """Peak dense TFLOP/s of one device for MFU; 0 looks it up for CUDA devices and reports n/a on CPU."""
    json_lines: bool = False
    """Also write <dump_folder>/metrics.jsonl: one JSON object per logged step (its scalars) and per
    setup event (trace, compile, the memory estimate, the simulated step), for scripts that tabulate runs."""
    simulate_device: SimulatedDevice = "none"
    """Before the first step, simulate the graph the job will run (after the memory policy and passes,
    before the backend) on this device model of graph_trainer/analysis/devices.py and log its step time
    (graph mode, not pipeline stages); 'none': do not."""


@dataclass
class Validation:
    """The loss on held-out data during training, forward only (graph_trainer/loop/held_out.py);
    torchtitan's section and names."""

    enable: bool = False
    """Compute the mean token loss and its perplexity (exp of it) on held-out batches at step 1 and
    every freq steps, after the step's update; logged ('validation step N | loss ... | perplexity
    ...'), in metrics.jsonl and TensorBoard / W&B as validation/loss and validation/perplexity.
    Every layout, pipelines included; the model runs op by op without autograd (no trace)."""
    freq: int = 10
    """Validate every this many steps (and at step 1)."""
    steps: int = 10
    """Batches of training.local_batch_size sequences per data-parallel rank in one validation: the
    first ones of the held-out stream, the same every time (under pipeline parallel, that many
    microbatches through the pipeline)."""
    dataset: str = ""
    """The held-out data, as training.dataset takes it; '' reads training.dataset (with its subset).
    Read as training.dataset_streaming and training.dataset_shards say. Training rows as held-out
    data: refused from the defaults (e.g. a local training.dataset), a warning when chosen here or
    in validation.split."""
    dataset_subset: str = ""
    """The subset of validation.dataset (a hub dataset's configuration name); '' for none."""
    split: str = "validation"
    """The held-out split: a Hugging Face split name (slices such as 'train[95%:]' work); a local
    file has no splits: any name reads all its rows (training.dataset_split 'train[:95%]' and this
    'train[95%:]' split them); of the synthetic corpus, documents drawn from a seed of their own for
    each split name other than 'train' (which is the training stream)."""


@dataclass
class Profiling:
    """torch.profiler traces and CUDA memory snapshots of chosen steps (graph_trainer/loop/profiling.py);
    torchtitan's section and names."""

    enable_profiling: bool = False
    """Record a torch.profiler trace of every profile_freq-th step (after 3 warm-up steps), one Chrome
    trace file per rank: <dump_folder>/<save_traces_folder>/iteration_<N>/rank<r>_trace.json (open in
    Perfetto or chrome://tracing). In graph mode every node of the graph that runs is a named range:
    '<module fqn>: <node name>' (an Inductor region is one node)."""
    profile_freq: int = 10
    """Trace (and snapshot) every this many steps; at most training.steps (else none would be)."""
    save_traces_folder: str = "profile_traces"
    """Folder of the traces, relative to job.dump_folder unless absolute."""
    enable_memory_snapshot: bool = False
    """CUDA only: record the allocator's history from the first step and write a snapshot every
    profile_freq steps, <dump_folder>/<save_memory_snapshot_folder>/iteration_<N>/rank<r>_memory_snapshot.pickle
    (open at pytorch.org/memory_viz). On CPU one warning says it is unavailable."""
    save_memory_snapshot_folder: str = "memory_snapshot"
    """Folder of the memory snapshots, relative to job.dump_folder unless absolute."""


@dataclass
class Checkpoint:
    """Distributed checkpoints (torch.distributed.checkpoint); guarantees in graph_trainer/checkpoint/checkpointer.py,
    what a checkpoint holds in graph_trainer/checkpoint/state.py."""

    interval: int = 0
    """Save <folder>/step-<N> every this many steps and at the last step; 0 disables saving."""
    folder: str = "checkpoint"
    """Checkpoint folder, relative to job.dump_folder unless absolute; every rank must see the same
    folder."""
    load_step: int = -1
    """Resume from step-<N> (N >= 1, must exist and verify); -1 resumes from the newest checkpoint
    that verifies (an older one when the newest is corrupt, saying so), or starts fresh when the
    folder holds none; 0 starts fresh. Resuming continues at step N+1, appends to losses.txt and may
    use another parallel layout (tensors are resharded)."""
    initial_load_hf: str = ""
    """A Hugging Face model folder (config.json + *.safetensors, one file or sharded with
    model.safetensors.index.json) whose weights the job starts from when it resumes no checkpoint: checked against
    the flavor before anything is built, each rank reading only its shards (graph_trainer/checkpoint/hf.py).
    With training.steps 0 and checkpoint.interval > 0 the job only converts: it writes step-0 and stops."""
    keep_latest_k: int = 10
    """Keep the newest K complete checkpoints of the folder: once a save is complete, older step-<N>
    folders beyond K are deleted (each renamed away first, so none is ever half deleted and still
    found). 0 keeps every one. Only complete step-<N> folders are deleted: never the newest, never a
    save in progress, nothing else in the folder (corrupt-, aside- or other files). torchtitan's
    option and default; refused when set without checkpoint.interval (no saves, nothing to keep)."""
    async_mode: AsyncMode = "disabled"
    """'async': a save copies the state to host memory and returns; the files are written, hashed
    and sealed in the background (torch.distributed.checkpoint.async_save over a gloo group of its
    own) while training goes on. The next save, and the end of the job, wait for it; its failure
    is raised there. A kill before it is sealed leaves the previous checkpoint the newest.
    'disabled': a save blocks until sealed. torchtitan's option and default."""
    finish_timeout_seconds: float = 1800.0
    """With async_mode 'async': how long a job that is ending (its last step done, a one-line error,
    SIGTERM) waits for a save still in flight to be sealed. Past it the job ends without it (after
    the last step: a one-line error) and its unsealed folder is removed at the next start; the
    newest complete checkpoint stays the one resumed."""
    move_aside: bool = False
    """A run that would not continue the newest checkpoints of the folder (load_step 0 in a folder holding checkpoints,
    or load_step N with later steps there) is refused, so one folder and one losses.txt never mix two runs. True
    moves those checkpoints (and, starting fresh, losses.txt) into <folder>.aside-<time>/ instead, and starts."""


@dataclass
class Comm:
    """Collective timeouts (``init_process_group``'s ``timeout``, applied to every process group)."""

    init_timeout_seconds: float = 600.0
    """Longest wait for the other ranks from the start until the first step has finished (rendezvous, building,
    loading and verifying a checkpoint, tracing): ranks may reach their first collective far apart."""
    timeout_seconds: float = 300.0
    """Longest wait in any collective after the first step (steps, checkpoint saves): a rank that stops
    answering (stuck, stopped, deadlocked) ends the job with a one-line error after this long."""


@dataclass
class Debug:
    deterministic: bool = False
    """Call torch.use_deterministic_algorithms(True) (and the CUDA settings it needs)."""
    num_threads: int = 0
    """Intra-op CPU threads (torch.set_num_threads); 0 keeps torch's default."""
    log_level: LogLevel = "INFO"
    """Python logging level: DEBUG, INFO, WARNING or ERROR."""
    grad_record_step: int = 0
    """At this step (>= 1) write <dump_folder>/grad_record_step<N>.pt: the gradient norm before clipping and,
    per parameter, the norm and a fixed sample of the full (gathered) gradient, to compare layouts
    (graph_trainer/loop/grad_record.py); 0: off."""
    skip_memory_check: bool = False
    """Go on when the estimated memory per rank exceeds what the device has (a warning instead of the
    one-line refusal; graph_trainer/loop/preflight.py, "Memory")."""


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    metrics: Metrics = field(default_factory=Metrics)
    validation: Validation = field(default_factory=Validation)
    profiling: Profiling = field(default_factory=Profiling)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    comm: Comm = field(default_factory=Comm)
    debug: Debug = field(default_factory=Debug)
