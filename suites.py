"""The end-to-end suites' case tables: every case of ``integration_tests.py`` (the runner) and of
its ``--dry-run`` (``integration_dry_run.py``), the bounds they are held to, and the flags each
case's job gets (``job_args``). Both runners import this module; it imports neither.

A case names a layout (processes and flags) and optionally the case it must equal bitwise
(``same_as``) or stay close to (``close_to``, within ``rtol``); a suite gives its cases a config,
flags and a step count (see ``integration_tests.py`` for what a passing case means).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.abspath(__file__))

CLOSE_RTOL = 1e-4
"""Bound on the relative deviation of a ``close_to`` case's losses from its one-process reference."""
INDUCTOR_RTOL = 5e-6
"""Bound on the relative deviation of losses compiled by Inductor (``--compile.backend inductor``)
from the op-by-op graph of the same job, fp32 on CPU: fusion rounds differently. Measured over
20 steps: LLaMA-3 debug 1.4e-7 (regional and full, asserted in tests/test_backend.py), DeepSeek-V3
debug 7.0e-7 (full) and 4.6e-6 (regional, grown from 1.4e-7 after step 13: README); the cpu
suite's 10-step jobs stay below 2e-7. Other CPUs' vector widths change Inductor's reduction loops."""


@dataclass(frozen=True)
class Case:
    name: str
    nproc: int
    args: list[str]
    same_as: str = ""
    """Name of an earlier case whose per-step losses this one must equal bitwise."""
    close_to: str = ""
    """Name of an earlier case (one process, same global batch) whose losses this one must
    match within ``rtol``: only the order of the gradient sums differs (or, with ``rtol``
    ``INDUCTOR_RTOL``, the same job run op by op: Inductor's fusion rounds differently)."""
    rtol: float = CLOSE_RTOL
    """The bound of a ``close_to`` comparison on the losses (``CLOSE_RTOL`` by default)."""
    config: str = ""
    """Job config of this case; empty: the suite's."""

    @property
    def eager(self) -> bool:
        return "eager" in self.args

    @property
    def references(self) -> list[str]:
        return [r for r in (self.same_as, self.close_to) if r]


GRAD_RTOL = 1e-5
"""Bound on the relative deviation of a ``close_to`` case's step-1 gradients (global norm, each
parameter's norm, each parameter's sample) from its one-process reference. Measured on the cpu
suite: at most 1.3e-6 (FSDP=4 and HSDP 2x2, whose 4-rank sums order terms most differently),
2-rank layouts 0.8e-7 to 3.4e-7. A doubled gradient deviates by 1."""
GRAD_RECORD_STEP = 1


@dataclass(frozen=True)
class Suite:
    config: str
    overrides: list[str]
    """Flags every case gets (before its own); ``--training.steps`` is added from ``steps``."""
    steps: int
    cases: list[Case] = field(default_factory=list)
    gpus: bool = False
    """Needs one CUDA device per process."""
    timeout: float = 900
    report_speed: bool = False
    """The table shows each case's tok/s, MFU and peak memory at its last step."""
    record_grads: bool = False
    """Every job writes its step-``GRAD_RECORD_STEP`` gradient record, and comparisons check it."""
    dry_run_overrides: list[str] = field(default_factory=list)


def _layout_cases(layouts: dict[str, tuple[int, list[str], str]], config: str = "") -> list[Case]:
    """A graph case and its eager twin per layout: (processes, args, one-process reference)."""
    cases = []
    for name, (nproc, args, reference) in layouts.items():
        cases.append(Case(f"{name}_graph", nproc, args, close_to=reference, config=config))
        # Eager mode keeps every activation (it rejects a checkpointing mode a config may set); the
        # policy changes no value, so the graph case is still bitwise its eager twin.
        cases.append(Case(f"{name}_eager", nproc, [*args, "--compile.mode", "eager", "--activation_checkpoint.mode",
                                                   "none"], same_as=f"{name}_graph", config=config))
    return cases


BUCKETING = {
    # case-name suffix: --compile.passes
    "tbb": "transformer_block_bucketing",
    "auto": "auto_bucketing",
    "tbb_auto": "transformer_block_bucketing,auto_bucketing",
}


def _pass_cases(layouts: dict[str, tuple[int, list[str], str]], names: list[str], config: str = "",
                passes: dict[str, str] = BUCKETING) -> list[Case]:
    """For each named layout and pass list, a graph case bitwise the layout's graph without passes."""
    return [Case(f"{name}_{suffix}", layouts[name][0], [*layouts[name][1], "--compile.passes", pass_list],
                 same_as=f"{name}_graph", config=config)
            for name in names for suffix, pass_list in passes.items()]


def _batch(n: int) -> list[str]:
    return ["--training.local_batch_size", str(n)]


# ---- cpu: the debug models on gloo. Every layout trains 2 sequences per data-parallel rank;
# its reference is one process on the same global batch ("single_graph" is the one at 2).
_CPU_REFERENCES = [Case(f"single_b{n}", 1, _batch(n)) for n in (4, 8)]
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
# Keeping the gathered parameters for backward (no re-gather) is bitwise re-gathering them.
# (Eager mode has no graph to reshard, so this has no eager twin.)
_CPU_KEEP_PARAMS = [Case("fsdp2_keep_params", 2, ["--parallelism.fsdp_reshard_after_forward", "never"],
                         same_as="fsdp2_graph")]
_DEEPSEEK = "configs/deepseek_v3_debug.toml"
_CPU_DEEPSEEK_REFERENCES = [Case("deepseek_single_b4", 1, _batch(4), config=_DEEPSEEK)]
_CPU_DEEPSEEK_LAYOUTS = {
    "deepseek_fsdp2": (2, [], "deepseek_single_b4"),
    "deepseek_ep2": (2, ["--parallelism.ep", "2"], "deepseek_single_b4"),
    "deepseek_fsdp2xep2": (4, ["--parallelism.ep", "2", *_batch(1)], "deepseek_single_b4"),
}

# ---- ep_overlap: the chunked graph in traced order ("chunked", compile.ep_overlap.reorder False)
# is within float rounding of the unchunked run; the scheduled one must equal it bitwise (with
# the same FSDP passes). Whole blocks need an even local batch (2); the MoE-only selection
# chunks the sequence, so FSDP2xEP2 keeps its local batch of 1.
EP_OVERLAP = {
    # case-name part: ep_overlap settings
    "blocks": ["--compile.ep_overlap.module_fqn", "layers.*", "--compile.ep_overlap.chunk_dim", "batch"],
    "moe_seq": ["--compile.ep_overlap.module_fqn", "layers.*.moe", "--compile.ep_overlap.chunk_dim", "seq"],
    "moe_batch": ["--compile.ep_overlap.module_fqn", "layers.*.moe", "--compile.ep_overlap.chunk_dim", "batch"],
}


def _ep_overlap_cases(layouts: dict[str, tuple[int, list[str], str]], plan: list[tuple[str, str, str]],
                      config: str) -> list[Case]:
    """Per (layout, selection, FSDP passes): the chunked reference and the scheduled case bitwise equal to it."""
    cases = []
    for layout, selection, fsdp_passes in plan:
        nproc, args, reference = layouts[layout]
        passes = ",".join(p for p in ("ep_overlap", fsdp_passes) if p)
        short = {v: k for k, v in BUCKETING.items()}
        name = f"{layout}_ep_overlap_{selection}" + (f"_{short[fsdp_passes]}" if fsdp_passes else "")
        chunked = Case(f"{name}_chunked", nproc, [*args, *EP_OVERLAP[selection], "--compile.passes", passes,
                                                  "--compile.ep_overlap.reorder", "False"],
                       close_to=reference, config=config)
        cases += [chunked, Case(name, nproc, [*args, *EP_OVERLAP[selection], "--compile.passes", passes],
                                same_as=chunked.name, config=config)]
    return cases


CPU_EP_OVERLAP_CASES: list[Case] = _ep_overlap_cases(_CPU_DEEPSEEK_LAYOUTS, [
    ("deepseek_ep2", "blocks", "transformer_block_bucketing,auto_bucketing"),
    ("deepseek_ep2", "moe_batch", ""),
    ("deepseek_fsdp2xep2", "moe_seq", "transformer_block_bucketing"),
], _DEEPSEEK)

# ---- the memory policy (activation checkpointing) and the chunked loss: bitwise the same
# graph without them, with the passes they must compose with.
def _ac(mode: str) -> list[str]:
    return ["--activation_checkpoint.mode", mode]


_CHUNKED_LOSS = ["--training.loss_chunks", "4"]
CPU_MEMORY_POLICY_CASES = [
    *[Case(f"fsdp2_ac_{mode}_tbb", 2, [*_ac(mode), "--compile.passes", BUCKETING["tbb"]], same_as="fsdp2_graph")
      for mode in ("selective", "full")],
    *[Case(f"fsdp2xtp2_ac_{mode}", 4, [*_CPU_LAYOUTS["fsdp2xtp2"][1], *_ac(mode)], same_as="fsdp2xtp2_graph")
      for mode in ("selective", "full")],
    # the chunked loss is within rounding of one process (it sums the output weight's gradient per chunk)
    Case("fsdp2_loss_chunks4", 2, _CHUNKED_LOSS, close_to="single_b4"),
    Case("fsdp2_loss_chunks4_eager", 2, [*_CHUNKED_LOSS, "--compile.mode", "eager"], same_as="fsdp2_loss_chunks4"),
    Case("fsdp2_loss_chunks4_ac_selective", 2, [*_CHUNKED_LOSS, *_ac("selective")], same_as="fsdp2_loss_chunks4"),
]
CPU_DEEPSEEK_MEMORY_POLICY_CASES = [
    *[Case(f"deepseek_ep2_ac_{mode}", 2, [*_CPU_DEEPSEEK_LAYOUTS["deepseek_ep2"][1], *_ac(mode)],
           same_as="deepseek_ep2_graph", config=_DEEPSEEK) for mode in ("selective", "full")],
    Case("deepseek_ep2_ep_overlap_moe_batch_ac_full", 2,
         [*_CPU_DEEPSEEK_LAYOUTS["deepseek_ep2"][1], *EP_OVERLAP["moe_batch"], "--compile.passes", "ep_overlap",
          *_ac("full")], same_as="deepseek_ep2_ep_overlap_moe_batch_chunked", config=_DEEPSEEK),
]

# ---- the Inductor backend: within INDUCTOR_RTOL of the op-by-op graph. Under the regional scope
# every value-preserving pass keeps its promise, bitwise the compiled job without it: the passes
# that move only collectives (bucketing) and ep_overlap, which moves compute across collectives,
# so its regions hold other sets of ops than its chunked twin's (an op's value does not depend on
# its region: graph_trainer/backend.py, "Numerics"). The memory policy under Inductor is checked by
# tests/test_backend.py (every recomputed matmul survives; bitwise too when measured, not a suite
# case: 30 s of CI).
_INDUCTOR = ["--compile.backend", "inductor"]
_INDUCTOR_FULL = [*_INDUCTOR, "--compile.inductor_scope", "full"]
_EP2 = _CPU_DEEPSEEK_LAYOUTS["deepseek_ep2"][1]
_MOE_BATCH_OVERLAP = [*_EP2, *EP_OVERLAP["moe_batch"], "--compile.passes", "ep_overlap"]
CPU_INDUCTOR_CASES = [
    Case("fsdp2_inductor", 2, _INDUCTOR, close_to="fsdp2_graph", rtol=INDUCTOR_RTOL),
    *[Case(f"fsdp2_inductor_{suffix}", 2, [*_INDUCTOR, "--compile.passes", BUCKETING[suffix]], same_as="fsdp2_inductor")
      for suffix in ("tbb", "auto")],
    Case("fsdp2_inductor_full", 2, _INDUCTOR_FULL, close_to="fsdp2_graph", rtol=INDUCTOR_RTOL),
    Case("deepseek_ep2_inductor_full", 2, [*_EP2, *_INDUCTOR_FULL], close_to="deepseek_ep2_graph",
         rtol=INDUCTOR_RTOL, config=_DEEPSEEK),
    # DeepSeek-V3 regional: the chunked twin compiled (unchunked it repeats this check: 70 s of CI)
    Case("deepseek_ep2_ep_overlap_moe_batch_chunked_inductor", 2,
         [*_MOE_BATCH_OVERLAP, "--compile.ep_overlap.reorder", "False", *_INDUCTOR],
         close_to="deepseek_ep2_ep_overlap_moe_batch_chunked", rtol=INDUCTOR_RTOL, config=_DEEPSEEK),
    Case("deepseek_ep2_ep_overlap_moe_batch_inductor", 2, [*_MOE_BATCH_OVERLAP, *_INDUCTOR],
         same_as="deepseek_ep2_ep_overlap_moe_batch_chunked_inductor", config=_DEEPSEEK),
]

CPU_CASES = (
    _CPU_REFERENCES + _layout_cases(_CPU_LAYOUTS) + _CPU_KEEP_PARAMS
    + _pass_cases(_CPU_LAYOUTS, ["fsdp2", "hsdp2x2", "fsdp2xtp2"])
    + _CPU_DEEPSEEK_REFERENCES + _layout_cases(_CPU_DEEPSEEK_LAYOUTS, _DEEPSEEK)
    + _pass_cases(_CPU_DEEPSEEK_LAYOUTS, ["deepseek_ep2", "deepseek_fsdp2xep2"], _DEEPSEEK)
    + CPU_EP_OVERLAP_CASES + CPU_MEMORY_POLICY_CASES + CPU_DEEPSEEK_MEMORY_POLICY_CASES + CPU_INDUCTOR_CASES
)

# ---- h100: real flavors (and the debug DeepSeek) on NCCL. No one-process references at these
# sizes: numerics are graph vs eager and graph vs graph + pass, bitwise.
_8B_LAYOUTS = {
    "fsdp8": (8, [], ""),
    "hsdp2x4": (8, ["--parallelism.dp_replicate", "2"], ""),
    "fsdp4xtp2": (8, ["--parallelism.tp", "2"], ""),
}
_DEEPSEEK_DEBUG_LAYOUTS = {  # 4 GPUs: FSDP=4, each rank holds half the experts
    "deepseek_debug_fsdp4xep2": (4, ["--parallelism.ep", "2"], ""),
}
# 16B on 8 GPUs: EP=8 (the config's) and EP=2 (experts sharded over both EP and FSDP); EP=4 takes
# the EP=2 code path and would add ~2 minutes of 16B tracing to the CI dry run. "fsdp8_ep2" is FSDP=8 for the dense weights and FSDP=4 x EP=2 for the experts:
# the 16B model with fp32 AdamW state (16 bytes per parameter) does not fit 4 GPUs of 80 GB.
# FSDP=2 x TP=2 x EP=2 is not here: tensor parallel is rejected for DeepSeek-V3 by config
# validation (MLA's shared rotary key needs a gradient all-reduce over tp); add it when it exists.
_16B_LAYOUTS = {
    "deepseek16b_fsdp8xep8": (8, [], ""),
    "deepseek16b_fsdp8_ep2": (8, ["--parallelism.ep", "2"], ""),
}
H100_EP_OVERLAP_CASES: list[Case] = (
    _ep_overlap_cases(_DEEPSEEK_DEBUG_LAYOUTS, [("deepseek_debug_fsdp4xep2", "blocks", "transformer_block_bucketing"),
                                                ("deepseek_debug_fsdp4xep2", "moe_seq", "")], _DEEPSEEK)
    + _ep_overlap_cases(_16B_LAYOUTS, [("deepseek16b_fsdp8_ep2", "blocks", "transformer_block_bucketing")],
                        "configs/deepseek_v3_16b.toml")
)
# The 8B and 16B configs document selective (8B) and full (16B) checkpointing with 8 loss chunks:
# every other mode is bitwise those.
H100_MEMORY_POLICY_CASES = [
    Case("fsdp8_ac_none", 8, _ac("none"), same_as="fsdp8_graph"),
    Case("fsdp8_ac_full_tbb", 8, [*_ac("full"), "--compile.passes", BUCKETING["tbb"]], same_as="fsdp8_graph"),
    Case("deepseek16b_fsdp8xep8_ac_selective", 8, _ac("selective"), same_as="deepseek16b_fsdp8xep8_graph",
         config="configs/deepseek_v3_16b.toml"),
]
# Inductor on 8 GPUs: the regional cut keeps the passes' schedule (checked by the dry run), and a
# bucketing pass stays bitwise under it; no op-by-op reference (bf16 fusion rounds differently).
H100_INDUCTOR_CASES = [
    Case("fsdp8_inductor", 8, _INDUCTOR),
    Case("fsdp8_inductor_tbb", 8, [*_INDUCTOR, "--compile.passes", BUCKETING["tbb"]], same_as="fsdp8_inductor"),
    Case("fsdp8_inductor_full", 8, _INDUCTOR_FULL),
    Case("deepseek16b_fsdp8xep8_inductor", 8, _INDUCTOR, config="configs/deepseek_v3_16b.toml"),
]
H100_CASES = (
    _layout_cases(_8B_LAYOUTS) + _pass_cases(_8B_LAYOUTS, ["fsdp8", "fsdp4xtp2"])
    + _layout_cases(_DEEPSEEK_DEBUG_LAYOUTS, _DEEPSEEK)
    + _pass_cases(_DEEPSEEK_DEBUG_LAYOUTS, ["deepseek_debug_fsdp4xep2"], _DEEPSEEK)
    + _layout_cases(_16B_LAYOUTS, "configs/deepseek_v3_16b.toml")
    + _pass_cases(_16B_LAYOUTS, ["deepseek16b_fsdp8_ep2"], "configs/deepseek_v3_16b.toml",
                  passes={"tbb": BUCKETING["tbb"]})
    + H100_EP_OVERLAP_CASES + H100_MEMORY_POLICY_CASES + H100_INDUCTOR_CASES
)

# ---- gpu: ONE GPU, one process per case. Numerics: graph vs eager and run-to-run, bitwise, on
# the debug models; on CUDA that holds only with deterministic kernels (the attention backward
# is not run-to-run deterministic otherwise). Speed and memory: real flavors cut to a few layers,
# bf16 compute with fp32 master weights; the table shows their tok/s, MFU and peak memory.
_DETERMINISTIC = ["--debug.deterministic", "True"]
_REAL_SHAPES = ["--training.mixed_precision_param", "bfloat16", "--training.warmup_steps", "2",
                "--metrics.log_freq", "1"]


def _bitwise_cases(name: str, config: str) -> list[Case]:
    graph = Case(f"{name}_graph", 1, _DETERMINISTIC, config=config)
    return [graph,
            Case(f"{name}_eager", 1, [*_DETERMINISTIC, "--compile.mode", "eager"], same_as=graph.name, config=config),
            Case(f"{name}_graph_again", 1, _DETERMINISTIC, same_as=graph.name, config=config)]


GPU_CASES = (
    _bitwise_cases("llama3_debug", "configs/llama3_debug.toml")
    + _bitwise_cases("deepseek_debug", _DEEPSEEK)
    # each memory policy on a real 8B block: peak memory and tok/s (the configs' 8 loss chunks)
    + [Case(f"llama3_8b_4layers_bf16_ac_{mode}", 1, ["--model.n_layers", "4", "--training.seq_len", "8192",
                                                     *_batch(1), *_REAL_SHAPES, *_ac(mode)],
            config="configs/llama3_8b.toml") for mode in ("none", "selective", "full")]
    + [Case("deepseek16b_4layers_bf16", 1, ["--model.n_layers", "4", "--training.seq_len", "4096", *_batch(2),
                                            "--parallelism.ep", "1", *_REAL_SHAPES],
            config="configs/deepseek_v3_16b.toml")]
    # the backends on the same shapes (the configs' memory policy): tok/s, MFU, peak memory, first step
    + [Case(f"llama3_8b_4layers_bf16_inductor_{scope}", 1,
            ["--model.n_layers", "4", "--training.seq_len", "8192", *_batch(1), *_REAL_SHAPES, *_INDUCTOR,
             "--compile.inductor_scope", scope], config="configs/llama3_8b.toml") for scope in ("regional", "full")]
    + [Case(f"deepseek16b_4layers_bf16_inductor_{scope}", 1,
            ["--model.n_layers", "4", "--training.seq_len", "4096", *_batch(2), "--parallelism.ep", "1",
             *_REAL_SHAPES, *_INDUCTOR, "--compile.inductor_scope", scope], config="configs/deepseek_v3_16b.toml")
       for scope in ("regional", "full")]
)

SUITES = {
    "cpu": Suite(
        config="configs/llama3_debug.toml",
        overrides=["--training.seq_len", "64", "--training.local_batch_size", "2", "--metrics.log_freq", "5",
                   "--metrics.enable_tensorboard", "False", "--checkpoint.interval", "0", "--job.device", "cpu"],
        steps=10,
        record_grads=True,
        cases=CPU_CASES,
    ),
    "h100": Suite(
        config="configs/llama3_8b.toml",
        # bitwise comparisons on CUDA need deterministic kernels (attention backward)
        overrides=["--metrics.log_freq", "5", "--checkpoint.interval", "0", "--job.device", "cuda",
                   "--debug.deterministic", "True"],
        steps=20,
        cases=H100_CASES,
        gpus=True,
        timeout=3600,
    ),
    "gpu": Suite(
        config="configs/llama3_debug.toml",
        overrides=["--metrics.log_freq", "5", "--checkpoint.interval", "0", "--job.device", "cuda",
                   "--metrics.enable_tensorboard", "False"],
        steps=10,
        cases=GPU_CASES,
        gpus=True,
        report_speed=True,
        timeout=1800,
    ),
}


def job_args(suite: Suite, case: Case, extra: list[str] = ()) -> list[str]:
    """train.py flags of a case: its config, the suite's overrides, ``extra``, its own args."""
    record = ["--debug.grad_record_step", str(GRAD_RECORD_STEP)] if suite.record_grads else []
    return ["--job.config_file", os.path.join(ROOT, case.config or suite.config), *suite.overrides,
            "--training.steps", str(suite.steps), *record, *extra, *case.args]
