"""The cpu suite's context-parallel and document-masking cases (the suite runs them after ``suites.cpu``'s).
Their references are cases of ``suites.cpu``: ``single_graph`` (one process, 2 sequences),
``single_b4`` and ``single_4l_b8`` (4 blocks, 8 sequences, the pipeline cases' reference)."""

from __future__ import annotations

from suites.cases import ACCUMULATION_RTOL, DEEPSEEK_DEBUG, Case, ac_flags, batch, layout_cases

# (suites.cpu's pp2_1f1b: 4 blocks, the global batch of 8 as microbatches of 2 through 2 stages)
_PIPELINE = ["--model.n_layers", "4", "--parallelism.pp", "2", "--parallelism.pp_schedule", "1F1B"]
_PIPELINE += ["--training.global_batch_size", "8"]

# ---- context parallel: every sequence split over 2 cp ranks (two chunks each, one early and one
# late), keys and values all-gathered for attention; cp does not change the data-parallel degree, so
# each layout's reference is one process on its data-parallel ranks' global batch. Document masking
# (block_causal) against one process with the same mask; each document's rotary positions from 0
# (positions_per_document) match the sequence's positions to rounding, RoPE being relative and the
# mask keeping every query inside its document. Graph == eager bitwise for each.
_CP2 = ["--parallelism.cp", "2"]
_BLOCK_CAUSAL = ["--training.attention_mask", "block_causal"]
_CPU_CONTEXT_PARALLEL_LAYOUTS = {
    "cp2": (2, _CP2, "single_graph"),
    "cp2xfsdp2": (4, [*_CP2, "--parallelism.dp_shard", "2"], "single_b4"),
    "cp2xtp2": (4, [*_CP2, "--parallelism.tp", "2"], "single_graph"),
    # HSDP: 2 replicas, each sharding its weights over its 2 cp ranks (hybrid_shard over dp_shard x cp)
    "replicate2xcp2": (4, [*_CP2, "--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "1"], "single_b4"),
    "pp2xcp2": (4, [*_PIPELINE, *_CP2], "single_4l_b8"),
    "block_causal": (1, _BLOCK_CAUSAL, ""),
    "cp2_block_causal": (2, [*_CP2, *_BLOCK_CAUSAL], "block_causal_graph"),
}
# DeepSeek-V3's attention (MLA: q/k and v of other head dims) with the document mask, 2 blocks (a
# dense and a MoE one), FSDP=2 against one process with the mask, and graph == eager bitwise
# (context parallel is refused for MLA).
_DEEPSEEK_2L_BLOCK_CAUSAL = ["--model.n_layers", "2", *_BLOCK_CAUSAL]
_DEEPSEEK_BLOCK_CAUSAL_SINGLE = Case(
    "deepseek_2l_block_causal_single_b4", 1, [*_DEEPSEEK_2L_BLOCK_CAUSAL, *batch(4)], config=DEEPSEEK_DEBUG
)
_DEEPSEEK_BLOCK_CAUSAL = {
    "deepseek_2l_fsdp2_block_causal": (2, _DEEPSEEK_2L_BLOCK_CAUSAL, _DEEPSEEK_BLOCK_CAUSAL_SINGLE.name)
}
CPU_CONTEXT_PARALLEL_CASES = (
    layout_cases(_CPU_CONTEXT_PARALLEL_LAYOUTS)
    + [_DEEPSEEK_BLOCK_CAUSAL_SINGLE]
    + layout_cases(_DEEPSEEK_BLOCK_CAUSAL, DEEPSEEK_DEBUG)
    + [
        # Full activation checkpointing recomputes the keys' and values' all-gather for backward (the
        # same gather of the same pieces): bitwise the run that saves them.
        Case("cp2_ac_full", 2, [*_CP2, *ac_flags("full")], same_as="cp2_graph"),
        # Gradient accumulation: the global batch of 4 as two microbatches of 2 through cp2.
        Case(
            "cp2_accum2", 2, [*_CP2, "--training.global_batch_size", "4"], close_to="single_b4", rtol=ACCUMULATION_RTOL
        ),
        Case(
            "cp2_block_causal_document_positions",
            2,
            [*_CP2, *_BLOCK_CAUSAL, "--training.positions_per_document"],
            close_to="block_causal_graph",
        ),
    ]
)
