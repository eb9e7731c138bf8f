"""The cpu suite's Qwen3 cases (the suite runs them after ``suites.cpu``'s and the context-parallel ones):
Qwen3 dense and Qwen3-MoE, 2 blocks (pipelines: 4), on every layout the other families run, each
graph case bitwise its eager twin and within the usual bounds of one process on the same global
batch (``CLOSE_RTOL`` on losses, ``GRAD_RTOL`` on step-1 gradients; accumulation and pipelines
``ACCUMULATION_RTOL``; HSDP ``HSDP_RTOL``; FP8 with other scales than the one process's the float8
bounds)."""

from __future__ import annotations

from suites.cases import (
    ACCUMULATION_RTOL,
    FLOAT8_GRAD_RTOL,
    FLOAT8_RTOL,
    HSDP_RTOL,
    QWEN3_DEBUG,
    QWEN3_MOE_DEBUG,
    Case,
    batch,
    ep_overlap_cases,
    layout_cases,
)

_TP2 = ["--parallelism.tp", "2"]
_EP2 = ["--parallelism.ep", "2"]
_GLOBAL_4 = ["--training.global_batch_size", "4"]
_GLOBAL_8 = ["--training.global_batch_size", "8"]
_4_BLOCKS = ["--model.n_layers", "4"]


def _pp(schedule: str) -> list[str]:
    """Two pipeline ranks (the interleaved and zero-bubble schedules: two stages each), 4 blocks, the
    global batch of 8 as microbatches of 2."""
    return [*_4_BLOCKS, "--parallelism.pp", "2", "--parallelism.pp_schedule", schedule, *_GLOBAL_8]


# ---- Qwen3 dense: QK-norm, head_dim 64 of a 256-wide stream, GQA 8:4; the QK norms' weights
# replicated over tp and their gradients summed there (models/qwen3/parallelize.py).
_REFERENCES = [
    Case("qwen3_single_b4", 1, batch(4), config=QWEN3_DEBUG),
    Case("qwen3_single_b8", 1, batch(8), config=QWEN3_DEBUG),
    Case("qwen3_4l_single_b8", 1, [*_4_BLOCKS, *batch(8)], config=QWEN3_DEBUG),
]
_LAYOUTS = {
    "qwen3_single": (1, [], ""),
    "qwen3_fsdp2": (2, [], "qwen3_single_b4"),
    "qwen3_hsdp2x2": (4, ["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2"], "qwen3_single_b8"),
    "qwen3_ddp2": (2, ["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "1"], "qwen3_single_b4"),
    "qwen3_tp2": (2, _TP2, "qwen3_single_graph"),  # sequence parallel (the default with tp)
    "qwen3_fsdp2xtp2": (4, _TP2, "qwen3_single_b4"),
    # the output projection tied to the embedding (as the small Qwen3 sizes), split over the vocabulary
    "qwen3_tied_fsdp2xtp2": (4, [*_TP2, "--model.flavor", "debugmodel_tied"], "qwen3_tied_single_b4"),
    "qwen3_cp2": (2, ["--parallelism.cp", "2"], "qwen3_single_graph"),
}
_PIPELINES = {
    "qwen3_pp2_1f1b": (2, _pp("1F1B"), "qwen3_4l_single_b8"),
    "qwen3_pp2xtp2_interleaved": (4, [*_pp("Interleaved1F1B"), *_TP2], "qwen3_4l_single_b8"),
    "qwen3_pp2xfsdp2_zbv": (4, _pp("ZBVZeroBubble"), "qwen3_4l_single_b8"),
}
_TIED_REFERENCE = Case("qwen3_tied_single_b4", 1, ["--model.flavor", "debugmodel_tied", *batch(4)], config=QWEN3_DEBUG)
# FP8 linears (tensorwise): on FSDP2 x TP2 the scales are over each rank's tokens and tp slices, not
# the one process's (docs/numerics.md, "FP8 linears"): within the float8 bounds.
_FLOAT8 = ["--float8.recipe_name", "tensorwise"]
_FLOAT8_REFERENCE = Case("qwen3_float8_single_b4", 1, [*_FLOAT8, *batch(4)], config=QWEN3_DEBUG)
_FLOAT8_LAYOUTS = {"qwen3_float8_fsdp2xtp2": (4, [*_FLOAT8, *_TP2], "qwen3_float8_single_b4")}

# ---- Qwen3-MoE: every block a MoE of 8 experts, top-2, no shared expert, no load-balancing state.
_MOE_REFERENCES = [Case("qwen3_moe_single_b4", 1, batch(4), config=QWEN3_MOE_DEBUG)]
_MOE_LAYOUTS = {
    "qwen3_moe_fsdp2": (2, [], "qwen3_moe_single_b4"),
    "qwen3_moe_ep2": (2, _EP2, "qwen3_moe_single_b4"),
    "qwen3_moe_fsdp2xep2": (4, [*_EP2, *batch(1)], "qwen3_moe_single_b4"),
    # sequence parallel with the experts split over the two tp ranks, each routing its own tokens
    "qwen3_moe_tp2xep2": (4, [*_TP2, *_EP2], "qwen3_moe_single_b4"),
}
_MOE_ACCUMULATING = {
    "qwen3_moe_pp2xep2": (4, [*_EP2, "--parallelism.pp", "2", *batch(1), *_GLOBAL_4], "qwen3_moe_single_b4"),
}
# The routed experts in float8 too (rowwise_with_gw_hp, the recipe of DeepSeek-V3's float8 expert
# cases: scales per token row and per weight row, so FSDP2 x EP2's are the one process's). The
# reference accumulates the same 1-sample microbatches (suites.cpu says why a matmul's row count
# matters under float8); losses and step-1 gradients within the usual bounds.
_FLOAT8_EXPERTS = ["--float8.recipe_name", "rowwise_with_gw_hp", "--float8.convert_routed_experts"]
_MOE_FLOAT8_REFERENCE = Case(
    "qwen3_moe_float8_experts_single_accum4", 1, [*_FLOAT8_EXPERTS, *batch(1), *_GLOBAL_4], config=QWEN3_MOE_DEBUG
)
_MOE_FLOAT8_LAYOUTS = {
    "qwen3_moe_float8_experts_fsdp2xep2": (
        4,
        [*_FLOAT8_EXPERTS, *_EP2, *batch(1)],
        "qwen3_moe_float8_experts_single_accum4",
    ),
}

CPU_QWEN3_CASES = (
    _REFERENCES
    + [_TIED_REFERENCE, _FLOAT8_REFERENCE]
    + layout_cases(_LAYOUTS, QWEN3_DEBUG, rtols={"qwen3_hsdp2x2": HSDP_RTOL})
    + layout_cases(_PIPELINES, QWEN3_DEBUG, rtols=dict.fromkeys(_PIPELINES, ACCUMULATION_RTOL))
    + [Case("qwen3_pp2_gpipe", 2, _pp("GPipe"), same_as="qwen3_pp2_1f1b_graph", config=QWEN3_DEBUG)]
    + layout_cases(
        _FLOAT8_LAYOUTS,
        QWEN3_DEBUG,
        rtols=dict.fromkeys(_FLOAT8_LAYOUTS, FLOAT8_RTOL),
        grad_rtols=dict.fromkeys(_FLOAT8_LAYOUTS, FLOAT8_GRAD_RTOL),
    )
    + _MOE_REFERENCES
    + layout_cases(_MOE_LAYOUTS, QWEN3_MOE_DEBUG)
    + layout_cases(_MOE_ACCUMULATING, QWEN3_MOE_DEBUG, rtols=dict.fromkeys(_MOE_ACCUMULATING, ACCUMULATION_RTOL))
    + ep_overlap_cases(
        _MOE_LAYOUTS, [("qwen3_moe_ep2", "moe_seq", ""), ("qwen3_moe_tp2xep2", "blocks", "")], QWEN3_MOE_DEBUG
    )
    + [_MOE_FLOAT8_REFERENCE]
    + layout_cases(_MOE_FLOAT8_LAYOUTS, QWEN3_MOE_DEBUG)
)
