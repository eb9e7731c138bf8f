"""The cpu suite (CI): the debug models on gloo, 1 to 4 processes, every layout and pass."""

from __future__ import annotations

from suites.cases import (
    ACCUMULATION_RTOL,
    BUCKETING,
    DEEPSEEK_DEBUG,
    EP_OVERLAP,
    FLOAT8_GRAD_RTOL,
    FLOAT8_RTOL,
    HSDP_RTOL,
    INDUCTOR_FULL_FLAGS,
    INDUCTOR_RTOL,
    REDUCE_ONCE_RTOL,
    Case,
    ac_flags,
    batch,
    ep_overlap_cases,
    layout_cases,
    pass_cases,
)

# ---- cpu: the debug models on gloo, cut to CPU_BLOCKS blocks unless a case says otherwise.
# Every layout trains 2 sequences per data-parallel rank; its reference is one process on the
# same global batch ("single_graph" is the one at 2).
CPU_BLOCK_COUNT = 2
CPU_BLOCKS = ["--model.n_layers", str(CPU_BLOCK_COUNT)]
_CPU_REFERENCES = [Case(f"single_b{n}", 1, batch(n)) for n in (4, 8)]
_CPU_LAYOUTS = {
    "single": (1, [], ""),
    "fsdp2": (2, [], "single_b4"),
    "fsdp4": (4, [], "single_b8"),
    "hsdp2x2": (4, ["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2"], "single_b8"),
    "ddp2": (2, ["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "1"], "single_b4"),
    "tp2": (2, ["--parallelism.tp", "2"], "single_graph"),
    "fsdp2xtp2": (4, ["--parallelism.tp", "2"], "single_b4"),
    # bf16 compute on float32 master weights without a data-parallel dim (SimpleFSDP does not
    # cast here): graph vs eager only, bf16 rounding is no 1e-4 match for one process in fp32.
    "tp2_bf16": (2, ["--parallelism.tp", "2", "--training.mixed_precision_param", "bfloat16"], ""),
}
# Weights gathered once and kept for backward (no re-gather; one microbatch: its gradients reduced
# once too) are bitwise the weights each microbatch gathers and re-gathers for backward. (This
# also stands for fsdp_reshard_after_forward never, which keeps them from forward to backward in
# the microbatch's graph.)
# fsdp_reshard_after_forward always re-gathers the head's weights (norm, output) too, which the
# default keeps from forward.
_CPU_KEEP_PARAMS = [
    Case("fsdp2_per_step", 2, ["--parallelism.fsdp_collectives", "per_step"], same_as="fsdp2_graph"),
    Case("fsdp2_reshard_always", 2, ["--parallelism.fsdp_reshard_after_forward", "always"], same_as="fsdp2_graph"),
]
# Tensor parallel without sequence parallel (every tp rank holding the whole residual stream, the
# regions all-reducing their outputs): the tp layouts below run with it, both families.
_CPU_NO_SEQUENCE_PARALLEL = [
    Case("fsdp2xtp2_no_sp", 4, ["--parallelism.tp", "2", "--parallelism.no_sequence_parallel"], close_to="single_b4"),
    Case(
        "deepseek_2l_tp2_no_sp",
        2,
        ["--model.n_layers", "2", "--parallelism.tp", "2", "--parallelism.no_sequence_parallel", *batch(4)],
        close_to="deepseek_2l_single_b4",
        config=DEEPSEEK_DEBUG,
    ),
    # (with ep: the experts split over data-parallel shard ranks only, each tp rank routing every token)
    Case(
        "deepseek_2l_tp2xep2_no_sp",
        4,
        [
            "--model.n_layers",
            "2",
            "--parallelism.tp",
            "2",
            "--parallelism.ep",
            "2",
            "--parallelism.no_sequence_parallel",
        ],
        close_to="deepseek_2l_single_b4",
        config=DEEPSEEK_DEBUG,
    ),
]
# DeepSeek-V3's debug model cut to 3 of its 6 blocks (1 dense + 2 MoE: consecutive MoE blocks, as
# in 6), at half the CI time of its steps and trace (docs/performance.md, "Run times on the CPU").
_DEEPSEEK_3_LAYERS = ["--model.n_layers", "3"]
_CPU_DEEPSEEK_REFERENCES = [Case("deepseek_single_b4", 1, [*_DEEPSEEK_3_LAYERS, *batch(4)], config=DEEPSEEK_DEBUG)]
_CPU_DEEPSEEK_LAYOUTS = {
    "deepseek_fsdp2": (2, _DEEPSEEK_3_LAYERS, "deepseek_single_b4"),
    "deepseek_ep2": (2, [*_DEEPSEEK_3_LAYERS, "--parallelism.ep", "2"], "deepseek_single_b4"),
    "deepseek_fsdp2xep2": (4, [*_DEEPSEEK_3_LAYERS, "--parallelism.ep", "2", *batch(1)], "deepseek_single_b4"),
}

# DeepSeek-V3 tensor parallel, alone and with FSDP and EP, on the debug model cut to 2 layers
# (1 dense + 1 MoE: every split the plan makes, at half the CI time of 6 layers). Global batch 4.
_DEEPSEEK_2_LAYERS = ["--model.n_layers", "2"]
_CPU_DEEPSEEK_TP_REFERENCES = [
    Case("deepseek_2l_single_b4", 1, [*_DEEPSEEK_2_LAYERS, *batch(4)], config=DEEPSEEK_DEBUG)
]
_TP2 = [*_DEEPSEEK_2_LAYERS, "--parallelism.tp", "2"]
_CPU_DEEPSEEK_TP_LAYOUTS = {
    "deepseek_2l_tp2": (2, [*_TP2, *batch(4)], "deepseek_2l_single_b4"),
    "deepseek_2l_fsdp2xtp2": (4, _TP2, "deepseek_2l_single_b4"),
    "deepseek_2l_tp2xep2": (4, [*_TP2, "--parallelism.ep", "2"], "deepseek_2l_single_b4"),
}

# ---- gradient accumulation: the global batch of 8 (DeepSeek-V3: 4) as microbatches of the
# layout's local batch, against one process taking it in one pass, and graph == eager bitwise.
_GLOBAL_8 = ["--training.global_batch_size", "8"]
_CPU_ACCUMULATION_LAYOUTS = {
    "single_accum4": (1, _GLOBAL_8, "single_b8"),
    "fsdp2_accum2": (2, _GLOBAL_8, "single_b8"),
}
_CPU_DEEPSEEK_ACCUMULATION_LAYOUTS = {
    "deepseek_ep2_accum2": (
        2,
        [*_DEEPSEEK_3_LAYERS, "--parallelism.ep", "2", *batch(1), "--training.global_batch_size", "4"],
        "deepseek_single_b4",
    ),
}
# Weights resident per step under accumulation: gradients summed over the microbatches before the
# reduce-scatter instead of after (docs/numerics.md), graph == eager bitwise; the two orders against
# each other: pp2xfsdp2_zbv_per_microbatch below.
_PER_STEP = ["--parallelism.fsdp_collectives", "per_step"]
CPU_ACCUMULATION_CASES = (
    layout_cases(_CPU_ACCUMULATION_LAYOUTS, rtols=dict.fromkeys(_CPU_ACCUMULATION_LAYOUTS, ACCUMULATION_RTOL))
    + layout_cases(
        _CPU_DEEPSEEK_ACCUMULATION_LAYOUTS,
        DEEPSEEK_DEBUG,
        rtols=dict.fromkeys(_CPU_DEEPSEEK_ACCUMULATION_LAYOUTS, ACCUMULATION_RTOL),
    )
    + [
        Case("fsdp2_accum2_per_step", 2, [*_GLOBAL_8, *_PER_STEP], close_to="single_b8", rtol=ACCUMULATION_RTOL),
        Case(
            "fsdp2_accum2_per_step_eager",
            2,
            [*_GLOBAL_8, *_PER_STEP, "--compile.mode", "eager"],
            same_as="fsdp2_accum2_per_step",
        ),
    ]
)


# ---- pipeline parallel: the global batch of 8 (DeepSeek-V3: 4) as microbatches through 2 pipeline
# ranks, every schedule, against one process taking it in one pass; graph == eager bitwise per
# schedule; a bucketing pass (on the once-per-step gather and reduce graphs) bitwise its reference.
# With data parallelism the stages keep their weights for the step (fsdp_collectives default);
# gathering and reducing per microbatch instead is within REDUCE_ONCE_RTOL of it.
# Two stages per rank (interleaved, ZBV) make 4 stages: LLaMA's pipelines run 4 blocks, against
# one process with those 4 blocks.
_PIPELINE_BLOCKS = ["--model.n_layers", "4"]


def _pp(schedule: str) -> list[str]:
    return [*_PIPELINE_BLOCKS, "--parallelism.pp", "2", "--parallelism.pp_schedule", schedule, *_GLOBAL_8]


# Tensor parallel inside the stages: the interleaved schedule (two stages per rank) on Llama,
# 1F1B on DeepSeek-V3's 2 blocks (a dense stage, then a MoE stage whose tp ranks route their own
# tokens over an ep group of the two tp ranks). ZBV runs beside FSDP only
# (alone on 2 ranks it adds nothing the 4-rank case does not check).
_CPU_PIPELINE_REFERENCES = [Case("single_4l_b8", 1, [*_PIPELINE_BLOCKS, *batch(8)])]
_CPU_PIPELINE_LAYOUTS = {
    "pp2_1f1b": (2, _pp("1F1B"), "single_4l_b8"),
    "pp2xtp2_interleaved": (4, [*_pp("Interleaved1F1B"), "--parallelism.tp", "2"], "single_4l_b8"),
    "pp2xfsdp2_zbv": (4, _pp("ZBVZeroBubble"), "single_4l_b8"),
}
_CPU_DEEPSEEK_PIPELINE_LAYOUTS = {
    "deepseek_pp2xep2": (
        4,
        [*_DEEPSEEK_3_LAYERS, "--parallelism.ep", "2", "--parallelism.pp", "2", *batch(1)]
        + ["--training.global_batch_size", "4"],
        "deepseek_single_b4",
    ),
    "deepseek_2l_pp2xtp2xep2": (
        4,
        [*_TP2, "--parallelism.ep", "2", "--parallelism.pp", "2", *batch(1), "--training.global_batch_size", "4"],
        "deepseek_2l_single_b4",
    ),
}
CPU_PIPELINE_CASES = (
    _CPU_PIPELINE_REFERENCES
    + layout_cases(_CPU_PIPELINE_LAYOUTS, rtols=dict.fromkeys(_CPU_PIPELINE_LAYOUTS, ACCUMULATION_RTOL))
    + layout_cases(
        _CPU_DEEPSEEK_PIPELINE_LAYOUTS,
        DEEPSEEK_DEBUG,
        rtols=dict.fromkeys(_CPU_DEEPSEEK_PIPELINE_LAYOUTS, ACCUMULATION_RTOL),
    )
    + [
        Case("pp2_gpipe", 2, _pp("GPipe"), same_as="pp2_1f1b_graph"),
        Case(
            "pp2xfsdp2_zbv_per_microbatch",
            4,
            [*_pp("ZBVZeroBubble"), "--parallelism.fsdp_collectives", "per_microbatch"],
            close_to="pp2xfsdp2_zbv_graph",
            rtol=REDUCE_ONCE_RTOL,
        ),
        Case(
            "pp2xfsdp2_zbv_tbb",
            4,
            [*_pp("ZBVZeroBubble"), "--compile.passes", BUCKETING["tbb"]],
            same_as="pp2xfsdp2_zbv_graph",
        ),
    ]
)

# Each bucketing pass alone on the layouts below; the two composed (auto_bucketing on a graph already
# bucketed per block: value-preserving for the reasons each is) on Llama FSDP=2, and on DeepSeek-V3
# EP=2 with ep_overlap below; the h100 dry run checks the composition's collectives on every layout.
# (The composed case on the other layouts: about 2.5 minutes of CI, left out; DeepSeek FSDP=2 x EP=2
# ran it bitwise: docs/performance.md.)
SINGLE_PASSES = {k: v for k, v in BUCKETING.items() if k != "tbb_auto"}
# auto_bucketing alone runs bitwise on FSDP=2, DDP=2 (gradient all-reduces), DeepSeek-V3 EP=2 and
# FSDP=2 x EP=2 (all_to_all beside FSDP); on HSDP 2x2 and FSDP=2 x TP=2 only
# transformer_block_bucketing runs here (auto there: 70 s of CI). What auto_bucketing does with
# HSDP's reduce-scatter then all-reduce and with TP's all-reduces is checked for structure, not
# numerics: tests/compiler/passes/test_auto_bucketing.py and the h100 dry run (every layout).
BLOCK_BUCKETING = {"tbb": BUCKETING["tbb"]}

CPU_EP_OVERLAP_CASES: list[Case] = ep_overlap_cases(
    _CPU_DEEPSEEK_LAYOUTS,
    [
        ("deepseek_ep2", "blocks", "transformer_block_bucketing,auto_bucketing"),
        ("deepseek_ep2", "moe_batch", ""),
        ("deepseek_fsdp2xep2", "moe_seq", "transformer_block_bucketing"),
    ],
    DEEPSEEK_DEBUG,
) + ep_overlap_cases(  # (sequence parallel: each tp rank's chunks route its own tokens)
    _CPU_DEEPSEEK_TP_LAYOUTS, [("deepseek_2l_tp2xep2", "blocks", "")], DEEPSEEK_DEBUG
)
# The 671B's layout in small: a pipeline stage of MoE blocks with weights resident per step, tensor
# parallel with sequence parallel, each tp rank's sequence chunks exchanged over ep, recomputed in full.
_PP_TP_EP = _CPU_DEEPSEEK_PIPELINE_LAYOUTS["deepseek_2l_pp2xtp2xep2"]
CPU_PIPELINE_EP_OVERLAP_CASES: list[Case] = ep_overlap_cases(
    {"deepseek_2l_pp2xtp2xep2_ac_full": (_PP_TP_EP[0], [*_PP_TP_EP[1], *ac_flags("full")], _PP_TP_EP[2])},
    [("deepseek_2l_pp2xtp2xep2_ac_full", "moe_seq", "")],
    DEEPSEEK_DEBUG,
    rtol=ACCUMULATION_RTOL,
)

# ---- the memory policy (activation checkpointing) and the chunked loss: bitwise the same
# graph without them, with the passes they must compose with.
_CHUNKED_LOSS = ["--training.loss_chunks", "4"]
CPU_MEMORY_POLICY_CASES = [
    *[
        Case(f"fsdp2_ac_{mode}_tbb", 2, [*ac_flags(mode), "--compile.passes", BUCKETING["tbb"]], same_as="fsdp2_graph")
        for mode in ("selective", "full")
    ],
    Case("fsdp2xtp2_ac_full", 4, [*_CPU_LAYOUTS["fsdp2xtp2"][1], *ac_flags("full")], same_as="fsdp2xtp2_graph"),
    # the first block recomputed in full, the others selectively (activation_checkpoint.full_blocks)
    Case(
        "fsdp2xtp2_ac_selective_full_blocks1",
        4,
        [*_CPU_LAYOUTS["fsdp2xtp2"][1], *ac_flags("selective"), "--activation_checkpoint.full_blocks", "1"],
        same_as="fsdp2xtp2_graph",
    ),
    # the chunked loss is within rounding of one process (it sums the output weight's gradient per chunk)
    Case("fsdp2_loss_chunks4", 2, _CHUNKED_LOSS, close_to="single_b4"),
    Case("fsdp2_loss_chunks4_eager", 2, [*_CHUNKED_LOSS, "--compile.mode", "eager"], same_as="fsdp2_loss_chunks4"),
    Case("fsdp2_loss_chunks4_ac_selective", 2, [*_CHUNKED_LOSS, *ac_flags("selective")], same_as="fsdp2_loss_chunks4"),
    # loss parallel in row blocks: each block's logits split over the vocabulary, its maxima and sums
    # reduced over tp, the block's projection recomputed in backward from them
    Case("tp2_loss_chunks4", 2, [*_CPU_LAYOUTS["tp2"][1], *_CHUNKED_LOSS], close_to="single_graph"),
    Case(
        "tp2_loss_chunks4_eager",
        2,
        [*_CPU_LAYOUTS["tp2"][1], *_CHUNKED_LOSS, "--compile.mode", "eager"],
        same_as="tp2_loss_chunks4",
    ),
]
CPU_DEEPSEEK_MEMORY_POLICY_CASES = [
    *[
        Case(
            f"deepseek_ep2_ac_{mode}",
            2,
            [*_CPU_DEEPSEEK_LAYOUTS["deepseek_ep2"][1], *ac_flags(mode)],
            same_as="deepseek_ep2_graph",
            config=DEEPSEEK_DEBUG,
        )
        for mode in ("selective", "full")
    ],
    Case(
        "deepseek_ep2_ep_overlap_moe_batch_ac_full",
        2,
        [
            *_CPU_DEEPSEEK_LAYOUTS["deepseek_ep2"][1],
            *EP_OVERLAP["moe_batch"],
            "--compile.passes",
            "ep_overlap",
            *ac_flags("full"),
        ],
        same_as="deepseek_ep2_ep_overlap_moe_batch_chunked",
        config=DEEPSEEK_DEBUG,
    ),
]

# ---- the Inductor backend: within INDUCTOR_RTOL of the op-by-op graph, the full scope on DeepSeek-V3
# EP=2 cut to 2 blocks (a dense and a MoE one: compiling 3 took twice as long), whose graph holds
# FSDP's collectives and the all_to_alls; its op-by-op twin is itself checked against one process.
# LLaMA-3 under Inductor is tests/compiler/test_backend.py's numerics test (regional, one process,
# 10 steps, and a warm start bitwise); its FSDP=2 jobs repeated what that test and these check
# (regional 117 s, full 112 s of CI). A value-preserving pass under the regional scope is bitwise
# the compiled job without it, because no op's value depends on which region holds it
# (graph_trainer/compiler/backend.py, "Numerics"; tests/compiler/test_backend.py checks it op by op,
# and the dry run that the cut keeps every collective out of the regions and in order) and each pass
# is bitwise without Inductor here. Those jobs (transformer_block_bucketing on FSDP=2, ep_overlap on
# DeepSeek-V3 EP=2 under Inductor: bitwise; 105 s of CI) are left out of the suite. The memory
# policy under Inductor is checked by tests/compiler/test_backend.py (every recomputed matmul
# survives; bitwise too when measured, not a suite case: 30 s of CI).
_EP2_2_LAYERS = [*_DEEPSEEK_2_LAYERS, "--parallelism.ep", "2"]
CPU_INDUCTOR_CASES = [
    Case("deepseek_2l_ep2_graph", 2, _EP2_2_LAYERS, close_to="deepseek_2l_single_b4", config=DEEPSEEK_DEBUG),
    Case(
        "deepseek_2l_ep2_inductor_full",
        2,
        [*_EP2_2_LAYERS, *INDUCTOR_FULL_FLAGS],
        close_to="deepseek_2l_ep2_graph",
        rtol=INDUCTOR_RTOL,
        config=DEEPSEEK_DEBUG,
    ),
]

# ---- FP8 linears (``--float8.recipe_name``, torchao's float8 training): graph == eager bitwise
# for each recipe, each against one process with FP8 on the same global batch. Where the scales
# cannot be the one process's (docs/numerics.md, "FP8 linears": tensorwise and rowwise scales
# over each rank's tokens, rowwise scales over a tp rank's slice of a summed dim), within
# FLOAT8_RTOL / FLOAT8_GRAD_RTOL; the weight gradient in high precision on FSDP has the same
# scales, so it keeps the fp32 bounds.
_FLOAT8 = {r: ["--float8.recipe_name", r] for r in ("tensorwise", "rowwise", "rowwise_with_gw_hp")}
# DeepSeek-V3's routed experts in float8 too (rowwise_with_gw_hp): on one process, on FSDP2 x EP2
# and in a pipeline over FSDP2 (weights resident: the experts' casts once a step), whose experts'
# weights and tokens are split but whose scales are the one process's (per token row, per weight
# row). Their reference is one process accumulating the same 1-sample microbatches: a matmul over
# 64 rows rounds a row's last bits unlike one over 256, and a float8 cast can turn those bits into
# a float8 ulp, so only the same row counts keep the step-1 gradients within GRAD_RTOL (that one
# process against one pass: within the float8 bounds). The losses within FLOAT8_RTOL, as the
# reductions' last-bit differences in later steps' weights move values across float8 rounding
# boundaries (docs/numerics.md, "FP8 linears").
_FLOAT8_EXPERTS = [*_DEEPSEEK_2_LAYERS, *_FLOAT8["rowwise_with_gw_hp"], "--float8.convert_routed_experts"]
_ONE_SAMPLE_MICROBATCHES = [*batch(1), "--training.global_batch_size", "4"]
_FLOAT8_REFERENCES = [
    Case("float8_single_b4", 1, [*_FLOAT8["tensorwise"], *batch(4)]),
    Case("float8_gw_hp_single_b4", 1, [*_FLOAT8["rowwise_with_gw_hp"], *batch(4)]),
    Case("float8_gw_hp_4l_single_b4", 1, [*_FLOAT8["rowwise_with_gw_hp"], *_PIPELINE_BLOCKS, *batch(4)]),
    Case(
        "float8_gw_hp_4l_single_accum4",
        1,
        [*_FLOAT8["rowwise_with_gw_hp"], *_PIPELINE_BLOCKS, *_ONE_SAMPLE_MICROBATCHES],
        close_to="float8_gw_hp_4l_single_b4",
        rtol=FLOAT8_RTOL,
        grad_rtol=FLOAT8_GRAD_RTOL,
    ),
    Case(
        "deepseek_2l_float8_single_b4", 1, [*_DEEPSEEK_2_LAYERS, *_FLOAT8["rowwise"], *batch(4)], config=DEEPSEEK_DEBUG
    ),
    Case("deepseek_2l_float8_experts_single_b4", 1, [*_FLOAT8_EXPERTS, *batch(4)], config=DEEPSEEK_DEBUG),
    Case(
        "deepseek_2l_float8_experts_single_accum4",
        1,
        [*_FLOAT8_EXPERTS, *_ONE_SAMPLE_MICROBATCHES],
        close_to="deepseek_2l_float8_experts_single_b4",
        rtol=FLOAT8_RTOL,
        grad_rtol=FLOAT8_GRAD_RTOL,
        config=DEEPSEEK_DEBUG,
    ),
]
# Weights resident per step: each weight's casts run once a step for its two microbatches
# (compiler/hoist.py), on FSDP2 x TP2 (tensorwise: the amax all-reduced over tp) and in a pipeline
# (rowwise, weight gradient in high precision: the one process's scales). The pipeline's reference
# is one process accumulating the same 1-sample microbatches (within CLOSE_RTOL and GRAD_RTOL),
# itself within the float8 bounds of one pass: by step 5 the microbatches' last-bit differences
# in the updated weights round some float8 values the other way (docs/numerics.md, "FP8 linears").
_FLOAT8_LAYOUTS = {
    "float8_gw_hp_fsdp2": (2, _FLOAT8["rowwise_with_gw_hp"], "float8_gw_hp_single_b4"),
    "float8_fsdp2xtp2": (4, [*_FLOAT8["tensorwise"], "--parallelism.tp", "2"], "float8_single_b4"),
    "float8_fsdp2xtp2_accum2_per_step": (
        4,
        [*_FLOAT8["tensorwise"], "--parallelism.tp", "2", *_ONE_SAMPLE_MICROBATCHES, *_PER_STEP],
        "float8_single_b4",
    ),
    "float8_gw_hp_pp2xfsdp2_zbv": (
        4,
        [*_FLOAT8["rowwise_with_gw_hp"], *_PIPELINE_BLOCKS, "--parallelism.pp", "2"]
        + ["--parallelism.pp_schedule", "ZBVZeroBubble", *_ONE_SAMPLE_MICROBATCHES],
        "float8_gw_hp_4l_single_accum4",
    ),
}
_DEEPSEEK_FLOAT8_LAYOUTS = {
    "deepseek_2l_float8_experts_fsdp2xep2": (
        4,
        [*_FLOAT8_EXPERTS, "--parallelism.ep", "2", *batch(1)],
        "deepseek_2l_float8_experts_single_accum4",
    ),
    "deepseek_2l_float8_experts_pp2xfsdp2": (
        4,
        [*_FLOAT8_EXPERTS, "--parallelism.pp", "2", *_ONE_SAMPLE_MICROBATCHES],
        "deepseek_2l_float8_experts_single_accum4",
    ),
    "deepseek_2l_float8_dispatch_ep2": (
        2,
        [*_FLOAT8_EXPERTS, "--parallelism.ep", "2", "--float8.dispatch_in_float8", *batch(2)],
        "deepseek_2l_float8_experts_single_b4",
    ),
    "deepseek_2l_float8_tp2xep2": (
        4,
        [*_TP2, "--parallelism.ep", "2", *_FLOAT8["rowwise"]],
        "deepseek_2l_float8_single_b4",
    ),
}
_FLOAT8_OTHER_SCALES = [
    "float8_fsdp2xtp2",
    "float8_fsdp2xtp2_accum2_per_step",
    "deepseek_2l_float8_tp2xep2",
    "deepseek_2l_float8_dispatch_ep2",
]
_FLOAT8_SAME_SCALES = ["deepseek_2l_float8_experts_fsdp2xep2", "deepseek_2l_float8_experts_pp2xfsdp2"]
_FLOAT8_BOUNDS = dict.fromkeys(_FLOAT8_OTHER_SCALES + _FLOAT8_SAME_SCALES, FLOAT8_RTOL)
_FLOAT8_GRAD_BOUNDS = dict.fromkeys(_FLOAT8_OTHER_SCALES, FLOAT8_GRAD_RTOL)
# The weights gathered in float8 (cast on each shard with the whole weight's scale) are bitwise
# those cast after a gather in the parameter dtype, so the run is bitwise the same: graph (also
# bucketed per block, and by PyTorch's bucketer) and eager on FSDP2 x TP2; on HSDP with bf16
# parameters (the cast from fp32 master weights to bf16 before float8; the gradient's sum over
# replicas in the float8 gather's backward) against the same layout gathering in bf16.
_FLOAT8_ALL_GATHER = ["--float8.enable_fsdp_float8_all_gather"]
_FLOAT8_HSDP_BF16 = [
    *_FLOAT8["tensorwise"],
    *["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2"],
    *["--training.mixed_precision_param", "bfloat16"],
]
_CPU_FLOAT8_ALL_GATHER = [
    Case(
        f"float8_fsdp2xtp2_float8_all_gather{suffix}",
        4,
        [*_FLOAT8_LAYOUTS["float8_fsdp2xtp2"][1], *_FLOAT8_ALL_GATHER, *args],
        same_as="float8_fsdp2xtp2_graph",
    )
    for suffix, args in (
        ("", []),
        ("_tbb", ["--compile.passes", BUCKETING["tbb"]]),
        ("_auto", ["--compile.passes", BUCKETING["auto"]]),
        ("_eager", ["--compile.mode", "eager"]),
    )
] + [
    Case("float8_hsdp2x2_bf16", 4, _FLOAT8_HSDP_BF16),
    Case(
        "float8_hsdp2x2_bf16_float8_all_gather",
        4,
        [*_FLOAT8_HSDP_BF16, *_FLOAT8_ALL_GATHER],
        same_as="float8_hsdp2x2_bf16",
    ),
]
# The float8 dispatch with each MoE layer's sequence halves overlapped (the 671B config's pass):
# the scheduled graph bitwise its chunked twin, which is within the float8 bounds of one process.
_FLOAT8_DISPATCH_EP_OVERLAP = ep_overlap_cases(
    {"deepseek_2l_float8_dispatch_ep2": _DEEPSEEK_FLOAT8_LAYOUTS["deepseek_2l_float8_dispatch_ep2"]},
    [("deepseek_2l_float8_dispatch_ep2", "moe_seq", "")],
    DEEPSEEK_DEBUG,
    rtol=FLOAT8_RTOL,
    grad_rtol=FLOAT8_GRAD_RTOL,
)
CPU_FLOAT8_CASES = (
    _FLOAT8_REFERENCES
    + layout_cases(_FLOAT8_LAYOUTS, rtols=_FLOAT8_BOUNDS, grad_rtols=_FLOAT8_GRAD_BOUNDS)
    + _CPU_FLOAT8_ALL_GATHER
    + layout_cases(_DEEPSEEK_FLOAT8_LAYOUTS, DEEPSEEK_DEBUG, rtols=_FLOAT8_BOUNDS, grad_rtols=_FLOAT8_GRAD_BOUNDS)
    + _FLOAT8_DISPATCH_EP_OVERLAP
)

# An output projection tied to the embedding (``debugmodel_tied``: one parameter, two uses whose
# gradients add up; grouped-query attention, LLaMA 3.2's RoPE scaling): FSDP (each use gathered
# and its gradient reduce-scattered) and FSDP x TP (the vocabulary split once for both uses).
_TIED = ["--model.flavor", "debugmodel_tied"]
_CPU_TIED_CASES = [Case("tied_single_b4", 1, [*_TIED, *batch(4)])] + layout_cases(
    {
        "tied_fsdp2": (2, _TIED, "tied_single_b4"),
        "tied_fsdp2xtp2": (4, [*_TIED, "--parallelism.tp", "2"], "tied_single_b4"),
    }
)

CPU_CASES = (
    _CPU_REFERENCES
    + layout_cases(_CPU_LAYOUTS, rtols={"hsdp2x2": HSDP_RTOL})
    + _CPU_KEEP_PARAMS
    + pass_cases(_CPU_LAYOUTS, ["fsdp2"])
    + pass_cases(_CPU_LAYOUTS, ["ddp2"], passes=SINGLE_PASSES)
    + pass_cases(_CPU_LAYOUTS, ["hsdp2x2", "fsdp2xtp2"], passes=BLOCK_BUCKETING)
    + _CPU_DEEPSEEK_REFERENCES
    + layout_cases(_CPU_DEEPSEEK_LAYOUTS, DEEPSEEK_DEBUG)
    + pass_cases(_CPU_DEEPSEEK_LAYOUTS, ["deepseek_ep2"], DEEPSEEK_DEBUG, SINGLE_PASSES)
    + pass_cases(_CPU_DEEPSEEK_LAYOUTS, ["deepseek_fsdp2xep2"], DEEPSEEK_DEBUG, SINGLE_PASSES)
    + _CPU_DEEPSEEK_TP_REFERENCES
    + layout_cases(_CPU_DEEPSEEK_TP_LAYOUTS, DEEPSEEK_DEBUG)
    + _CPU_NO_SEQUENCE_PARALLEL
    + CPU_ACCUMULATION_CASES
    + CPU_PIPELINE_CASES
    + CPU_EP_OVERLAP_CASES
    + CPU_PIPELINE_EP_OVERLAP_CASES
    + CPU_MEMORY_POLICY_CASES
    + CPU_DEEPSEEK_MEMORY_POLICY_CASES
    + CPU_INDUCTOR_CASES
    + CPU_FLOAT8_CASES
    + _CPU_TIED_CASES
)
