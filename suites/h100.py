"""The h100 suite: real flavors (and the debug DeepSeek) on NCCL, 8 GPUs (4 for some cases); CI runs its dry run."""

from __future__ import annotations

from suites.cases import (
    BUCKETING,
    DEEPSEEK_DEBUG,
    INDUCTOR_FLAGS,
    INDUCTOR_FULL_FLAGS,
    LLAMA3_DEBUG,
    Case,
    ac_flags,
    ep_overlap_cases,
    layout_cases,
    pass_cases,
)

# ---- h100: real flavors (and the debug DeepSeek) on NCCL. No one-process references at these
# sizes: numerics are graph vs eager and graph vs graph + pass, bitwise.
_8B_LAYOUTS = {
    "fsdp8": (8, [], ""),
    "hsdp2x4": (8, ["--parallelism.dp_replicate", "2"], ""),
    "fsdp4xtp2": (8, ["--parallelism.tp", "2"], ""),
    # context parallel: every sequence in 4 chunks over 2 ranks, keys and values all-gathered
    "fsdp4xcp2": (8, ["--parallelism.cp", "2"], ""),
    # FP8 linears at the 8B's shapes (torchao's tensorwise recipe, the output projection in bf16)
    "fsdp8_float8": (8, ["--float8.recipe_name", "tensorwise"], ""),
}
# DDP of the 8B does not fit an H100 (fp32 weights, gradients and AdamW state: 16 bytes per
# parameter on every rank): DDP runs the debug LLaMA-3 on 8 GPUs, per parameter and bucketed.
# Over 8 ranks a bucketed all-reduce sums each element in another rank order than the
# per-parameter one (docs/numerics.md): the bucketed cases are close to, not bitwise, the plain one.
_DDP8 = ["--parallelism.dp_replicate", "8", "--parallelism.dp_shard", "1"]
_DEBUG_DDP_CASES = layout_cases({"debug_ddp8": (8, _DDP8, "")}, LLAMA3_DEBUG) + [
    Case(
        f"debug_ddp8_{suffix}",
        8,
        [*_DDP8, "--compile.passes", passes],
        close_to="debug_ddp8_graph",
        config=LLAMA3_DEBUG,
    )
    for suffix, passes in BUCKETING.items()
]
# The debug DeepSeek-V3 on 4 GPUs (FSDP=4, each rank holds half the experts), cut to 3 of its 6 blocks
# as in the cpu suite (1 dense + 2 MoE: consecutive MoE blocks; every check is per block), which
# halves its traces in the CI dry run.
_DEEPSEEK_DEBUG_LAYOUTS = {
    "deepseek_debug_fsdp4xep2": (4, ["--model.n_layers", "3", "--parallelism.ep", "2"], ""),
}
# 16B on 8 GPUs: EP=8 (the config's), and FSDP x TP x EP: TP=2 and dp_shard=4 for the dense
# weights, split into EP=2 x FSDP=2 for the experts (sharded over both EP and FSDP). Another EP=2
# layout without TP takes the same expert path and would add ~2 minutes of 16B tracing to the CI
# dry run. The 16B model with fp32 AdamW state (16 bytes per parameter) does not fit 4 GPUs of 80 GB.
_16B_LAYOUTS = {
    "deepseek16b_fsdp8xep8": (8, [], ""),
    "deepseek16b_fsdp4xtp2xep2": (8, ["--parallelism.tp", "2", "--parallelism.ep", "2"], ""),
}
H100_EP_OVERLAP_CASES: list[Case] = ep_overlap_cases(
    _DEEPSEEK_DEBUG_LAYOUTS,
    [
        ("deepseek_debug_fsdp4xep2", "blocks", "transformer_block_bucketing"),
        ("deepseek_debug_fsdp4xep2", "moe_seq", ""),
    ],
    DEEPSEEK_DEBUG,
) + ep_overlap_cases(
    # ep_overlap's chunks and schedule are per block: the 16B's shapes under TP x EP on 4 of its
    # blocks (the dense one and 3 MoE), which saves the CI dry run 5 minutes of tracing and passes.
    {"deepseek16b_4l_fsdp4xtp2xep2": (8, ["--model.n_layers", "4", *_16B_LAYOUTS["deepseek16b_fsdp4xtp2xep2"][1]], "")},
    [("deepseek16b_4l_fsdp4xtp2xep2", "blocks", "transformer_block_bucketing")],
    "configs/deepseek_v3_16b.toml",
)
# The 8B and 16B configs document selective (8B) and full (16B) checkpointing with 8 loss chunks:
# every other mode is bitwise those.
H100_MEMORY_POLICY_CASES = [
    Case("fsdp8_ac_none", 8, ac_flags("none"), same_as="fsdp8_graph"),
    Case("fsdp8_ac_full_tbb", 8, [*ac_flags("full"), "--compile.passes", BUCKETING["tbb"]], same_as="fsdp8_graph"),
    Case(
        "deepseek16b_fsdp8xep8_ac_selective",
        8,
        ac_flags("selective"),
        same_as="deepseek16b_fsdp8xep8_graph",
        config="configs/deepseek_v3_16b.toml",
    ),
]
# Inductor on 8 GPUs: the regional cut keeps the passes' schedule (checked by the dry run), and a
# bucketing pass stays bitwise under it; no op-by-op reference (bf16 fusion rounds differently).
H100_INDUCTOR_CASES = [
    Case("fsdp8_inductor", 8, INDUCTOR_FLAGS),
    Case("fsdp8_inductor_tbb", 8, [*INDUCTOR_FLAGS, "--compile.passes", BUCKETING["tbb"]], same_as="fsdp8_inductor"),
    Case("fsdp8_inductor_full", 8, INDUCTOR_FULL_FLAGS),
    Case("deepseek16b_fsdp8xep8_inductor", 8, INDUCTOR_FLAGS, config="configs/deepseek_v3_16b.toml"),
]


# Cluster layouts, checked by the dry run only (traced stage by stage at 512 and 256 ranks, the
# step simulated): the shipped 405B, 671B and Qwen3-235B-A22B configs, pipeline parallel with tensor
# and sequence parallel inside the stages, weights resident for the step (the 405B interleaved with
# selective checkpointing, each stage's first 2 blocks full; the 671B and 235B 1F1B with full
# checkpointing, experts over ep ranks that include the tp ranks), and the shipped Qwen3-32B's FSDP
# over 64 ranks. Other schedules and layouts were measured once (docs/performance.md);
# `graph_trainer.cli.analyze` gives any of them.
H100_PIPELINE_CASES = [
    Case("deepseek671b_pp8xtp2xfsdp16xep32_1f1b", 256, [], config="configs/deepseek_v3_671b.toml", dry_run_only=True),
    Case("llama3_405b_pp16xtp8xfsdp4_interleaved", 512, [], config="configs/llama3_405b.toml", dry_run_only=True),
    Case("qwen3_235b_pp8xtp2xfsdp16xep8_1f1b", 256, [], config="configs/qwen3_235b_a22b.toml", dry_run_only=True),
    Case("qwen3_32b_fsdp64", 64, [], config="configs/qwen3_32b.toml", dry_run_only=True),
]
H100_CASES = (
    layout_cases(_8B_LAYOUTS)
    # (auto_bucketing at 8B composed with block bucketing, as users run it: PyTorch's overlap
    # scheduler alone takes about 2 minutes on the 8B graph in the CI dry run; under TP and HSDP
    # block bucketing alone)
    + pass_cases(_8B_LAYOUTS, ["fsdp8"], passes={k: BUCKETING[k] for k in ("tbb", "tbb_auto")})
    + pass_cases(_8B_LAYOUTS, ["fsdp4xtp2"], passes={"tbb": BUCKETING["tbb"]})
    + pass_cases(_8B_LAYOUTS, ["hsdp2x4"], passes={"tbb": BUCKETING["tbb"]})
    + _DEBUG_DDP_CASES
    + layout_cases(_DEEPSEEK_DEBUG_LAYOUTS, DEEPSEEK_DEBUG)
    + pass_cases(_DEEPSEEK_DEBUG_LAYOUTS, ["deepseek_debug_fsdp4xep2"], DEEPSEEK_DEBUG)
    + layout_cases(_16B_LAYOUTS, "configs/deepseek_v3_16b.toml")
    + pass_cases(
        _16B_LAYOUTS, ["deepseek16b_fsdp4xtp2xep2"], "configs/deepseek_v3_16b.toml", passes={"tbb": BUCKETING["tbb"]}
    )
    + H100_EP_OVERLAP_CASES
    + H100_MEMORY_POLICY_CASES
    + H100_INDUCTOR_CASES
    + H100_PIPELINE_CASES
)
