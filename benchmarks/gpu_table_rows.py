"""The rows of the one-GPU table (``benchmarks.gpu_table``): what each trains and with which flags.

A row is one ``train.py`` job in a process of its own (the chunked row: ``benchmarks.chunked_job``,
which is ``train.py`` plus ep_overlap's chunking). Real rows (one H100, 80 GB) run the shapes of
the gpu suite (``suites/gpu.py``): LLaMA-3 8B cut to 4 blocks at 1x8192 and DeepSeek-V3 16B cut
to 4 blocks at 2x4096 with expert parallelism 1, bf16 compute over fp32 master weights, the
configs' 8 loss chunks. Smoke rows (``--smoke``, CPU) are the same rows on the debug flavors cut
to 2 blocks at 2x64 tokens, in fp32 and one loss chunk: bf16 matmuls on a CPU without bf16 units
are about ten times slower than fp32, 8 loss chunks of 16 tokens triple a step there, and both
are the trainer's concern (its own tests), not the table's.

Which rows, and why these (the whole grid does not fit the 10-minute budget: each Inductor row
compiles for tens of seconds on the H100 machine, each op-by-op row takes about 30 s from
process start to its last step):

- LLaMA-3 op by op in each memory policy (none, selective, full): what the policy costs in
  speed and saves in memory, measured against the estimate;
- LLaMA-3 under Inductor, regional and full, both with the 8B config's selective policy: the
  backends against the op-by-op selective row (one axis changed at a time);
- DeepSeek-V3 op by op with the 16B config's full policy, with and without ep_overlap's
  chunking (its default selection: whole blocks holding a MoE, split along the batch). ep_overlap
  itself refuses expert parallelism 1 (one process has no all_to_all to hide), and its model
  preparation selects only modules holding an expert-parallel MoE; so the chunked row installs
  the same chunking (``graph_trainer.distributed.chunking``) without the pass: the graph ep_overlap's chunked
  twin (``compile.ep_overlap.reorder = false``) would trace, minus the all_to_alls. It measures
  what chunking costs on one GPU, the part of ep_overlap one process can show.

- FP8 linears (``float8.recipe_name``, the output projection kept in bf16): LLaMA-3 op by op
  with selective recomputation in tensorwise (what the casts cost unfused, and the simulator's
  scaled-matmul class against the device), and under Inductor full in tensorwise and rowwise
  against the bf16 full row (the speed-up torchao's recipes give once the casts are fused).

No row names a user pass: every one needs several processes (bucketing needs data parallelism,
ep_overlap expert parallelism), so a one-process job refuses them at validation whatever the
torch version. A row whose job is refused (exit code 2) is recorded with the job's error line.
Full Inductor runs last: its compile is the longest and least certain, so a budget cut costs the
fewest other rows.
"""

from __future__ import annotations

from dataclasses import dataclass

OP_BY_OP, REGIONAL, FULL = "op by op", "Inductor regional", "Inductor full"
_BACKEND_FLAGS = {
    OP_BY_OP: ["--compile.backend", "none"],
    REGIONAL: ["--compile.backend", "inductor", "--compile.inductor_scope", "regional"],
    FULL: ["--compile.backend", "inductor", "--compile.inductor_scope", "full"],
}
_BACKEND_NAMES = {OP_BY_OP: "graph", REGIONAL: "regional", FULL: "full"}
CHUNKING_FLAGS = ["--compile.ep_overlap.module_fqn", "layers.*", "--compile.ep_overlap.chunk_dim", "batch"]
"""ep_overlap's default selection and chunk dimension, given explicitly (the chunked row's)."""


@dataclass(frozen=True)
class Shape:
    """A model cut to a size, and the flags that make it."""

    label: str
    """What it trains, in words (the table's model column)."""
    args: tuple[str, ...]
    """Config file and flags (``--job.config_file`` first)."""
    tokens_per_step: int


REAL_SHAPES = {
    "llama3": Shape(
        "Llama3-8B, 4 blocks, 1x8192, bf16",
        (
            *("--job.config_file", "configs/llama3_8b.toml", "--model.n_layers", "4"),
            *("--training.seq_len", "8192", "--training.local_batch_size", "1"),
            *("--training.mixed_precision_param", "bfloat16", "--training.loss_chunks", "8"),
        ),
        8192,
    ),
    "deepseek_v3": Shape(
        "DeepSeek-V3-16B, 4 blocks, 2x4096, bf16, EP 1",
        (
            *("--job.config_file", "configs/deepseek_v3_16b.toml", "--model.n_layers", "4"),
            *("--training.seq_len", "4096", "--training.local_batch_size", "2", "--parallelism.ep", "1"),
            *("--training.mixed_precision_param", "bfloat16", "--training.loss_chunks", "8"),
        ),
        8192,
    ),
}
SMOKE_SHAPES = {
    "llama3": Shape(
        "Llama3 debugmodel, 2 blocks, 2x64, fp32",
        (
            *("--job.config_file", "configs/llama3_debug.toml", "--model.n_layers", "2"),
            *("--training.seq_len", "64", "--training.local_batch_size", "2"),
        ),
        128,
    ),
    "deepseek_v3": Shape(
        "DeepSeek-V3 debugmodel, 2 blocks, 2x64, fp32, EP 1",
        (
            *("--job.config_file", "configs/deepseek_v3_debug.toml", "--model.n_layers", "2"),
            *("--training.seq_len", "64", "--training.local_batch_size", "2"),
        ),
        128,
    ),
}
PLAN = [
    # (shape, backend, activation checkpointing, chunked, float8 recipe), in run order
    ("llama3", OP_BY_OP, "none", False, "none"),
    ("llama3", OP_BY_OP, "selective", False, "none"),
    ("llama3", OP_BY_OP, "full", False, "none"),
    ("llama3", OP_BY_OP, "selective", False, "tensorwise"),
    ("llama3", REGIONAL, "selective", False, "none"),
    ("deepseek_v3", OP_BY_OP, "full", False, "none"),
    ("deepseek_v3", OP_BY_OP, "full", True, "none"),
    ("llama3", FULL, "selective", False, "none"),
    ("llama3", FULL, "selective", False, "tensorwise"),
    ("llama3", FULL, "selective", False, "rowwise"),
]
TIMEOUT_S = {OP_BY_OP: 150.0, REGIONAL: 300.0, FULL: 300.0}
"""Seconds a real row may run, from process start (wheels installed, caches cold)."""
SMOKE_TIMEOUT_S = 600.0
"""Seconds a smoke row may run: a loaded 2-core CPU compiles a debug model in about a minute."""


@dataclass(frozen=True)
class Row:
    name: str
    model: str
    backend: str
    """OP_BY_OP, REGIONAL or FULL."""
    ac: str
    """``activation_checkpoint.mode``."""
    chunked: bool
    """Run by ``benchmarks.chunked_job``: ep_overlap's chunking without the pass."""
    float8: str
    """``float8.recipe_name`` ('none': the linears in bf16)."""
    args: tuple[str, ...]
    """The job's flags, but for the output folder and the device (``gpu_table.job_command``)."""
    tokens_per_step: int
    timeout_s: float


def row_name(shape: str, backend: str, ac: str, chunked: bool, float8: str = "none") -> str:
    """E.g. 'llama3_graph_ac_none', 'deepseek_v3_chunked_graph_ac_full',
    'llama3_float8_tensorwise_full_ac_selective' (the same in both modes)."""
    fp8 = "" if float8 == "none" else f"_float8_{float8}"
    return f"{shape}{'_chunked' if chunked else ''}{fp8}_{_BACKEND_NAMES[backend]}_ac_{ac}"


def table_rows(smoke: bool, steps: int) -> list[Row]:
    """Every row of the table in run order, each job running ``steps`` steps."""
    shapes = SMOKE_SHAPES if smoke else REAL_SHAPES
    rows = []
    for shape_key, backend, ac, chunked, float8 in PLAN:
        shape = shapes[shape_key]
        args = (
            *shape.args,
            *_BACKEND_FLAGS[backend],
            *("--activation_checkpoint.mode", ac),
            *(CHUNKING_FLAGS if chunked else ()),
            *(("--float8.recipe_name", float8) if float8 != "none" else ()),
            *("--training.steps", str(steps), "--training.warmup_steps", "2"),
            *("--metrics.log_freq", "1", "--metrics.enable_tensorboard", "False", "--checkpoint.interval", "0"),
            *("--metrics.json_lines", "True", "--metrics.simulate_device", "h100"),
        )
        name = row_name(shape_key, backend, ac, chunked, float8)
        timeout = SMOKE_TIMEOUT_S if smoke else TIMEOUT_S[backend]
        label = shape.label + (", blocks chunked in 2 along the batch" if chunked else "")
        label += f", FP8 {float8} linears" if float8 != "none" else ""
        rows.append(Row(name, label, backend, ac, chunked, float8, args, shape.tokens_per_step, timeout))
    return rows


__all__ = ["FULL", "OP_BY_OP", "REGIONAL", "Row", "Shape", "row_name", "table_rows"]
