"""What a case and a suite are, the bounds cases are held to, the flags each case's job gets
(``job_args``), and the helpers the tables (``cpu``, ``h100``, ``gpu``) are written with.

A case names a layout (processes and flags) and optionally the case it must equal bitwise
(``same_as``) or stay close to (``close_to``, within ``rtol``); a suite gives its cases a config,
flags and a step count (see ``integration_tests.py`` for what a passing case means).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CLOSE_RTOL = 1e-4
"""Bound on the relative deviation of a ``close_to`` case's losses from its one-process reference."""
HSDP_RTOL = 1e-6
"""Bound on the relative deviation of the HSDP 2x2 losses from one process: the reduce-scatter over
``dp_shard`` then the all-reduce of the shard over ``dp_replicate`` sum each element in two steps
(measured deviations: docs/performance.md)."""
ACCUMULATION_RTOL = 1e-6
"""Bound on the relative deviation of gradient accumulation's losses (``training.global_batch_size``:
M microbatches per step) from one process on the global batch in one pass: the same per-token
losses and gradient contributions, summed per microbatch then across microbatches instead of
in one sum (measured deviations: docs/performance.md; causes: docs/numerics.md)."""
REDUCE_ONCE_RTOL = 1e-6
"""Bound on the relative deviation of the losses with weights resident per step (gradients summed over
the microbatches, then over the ranks) from the same job reducing every microbatch (over the ranks,
then the microbatches): one sum in two orders (docs/numerics.md)."""
INDUCTOR_RTOL = 5e-6
"""Bound on the relative deviation of losses compiled by Inductor (``--compile.backend inductor``)
from the op-by-op graph of the same job, fp32 on CPU: fusion rounds differently, and other CPUs'
vector widths change Inductor's reduction loops. The measured deviations this bound covers (20
steps of both debug models, both scopes; the cpu suite's jobs) are in docs/performance.md and their
causes in docs/numerics.md."""


@dataclass(frozen=True)
class Case:
    name: str
    nproc: int
    args: list[str]
    same_as: str = ""
    """Name of an earlier case whose per-step losses this one must equal bitwise."""
    close_to: str = ""
    """Name of an earlier case whose losses this one must match within ``rtol``, where only the
    order of the gradient sums differs: one process on the same global batch, or the same layout
    without a bucketing pass over more than 2 ranks (a bucketed all-reduce sums in another rank
    order); or, with ``rtol`` ``INDUCTOR_RTOL``, the same job run op by op (Inductor's fusion
    rounds differently)."""
    rtol: float = CLOSE_RTOL
    """The bound of a ``close_to`` comparison on the losses (``CLOSE_RTOL`` by default)."""
    grad_rtol: float = 0.0
    """The bound of a ``close_to`` comparison on the step-1 gradients; 0: ``GRAD_RTOL``."""
    config: str = ""
    """Job config of this case; empty: the suite's."""
    dry_run_only: bool = False
    """A layout of a cluster (hundreds of GPUs): only the dry run checks it (traced on the fake
    process group, its step simulated); a run on one node skips it."""

    @property
    def eager(self) -> bool:
        return "eager" in self.args

    @property
    def references(self) -> list[str]:
        return [r for r in (self.same_as, self.close_to) if r]


GRAD_RTOL = 1e-5
"""Bound on the relative deviation of a ``close_to`` case's step-1 gradients (global norm, each
parameter's norm, each parameter's sample) from its one-process reference: only the order of the
gradient sums differs (measured deviations: docs/performance.md). A doubled gradient deviates by 1."""
GRAD_RECORD_STEP = 1
FLOAT8_RTOL = 3e-3
"""Bound on the losses of an FP8 layout whose scales differ from its one-process FP8 reference
(docs/numerics.md, "FP8 linears"): over 5 steps the measured deviations are 8.7e-4 (tensorwise,
FSDP2 x TP2) and 2.2e-4 (rowwise, DeepSeek-V3 TP2 x EP2)."""
FLOAT8_GRAD_RTOL = 0.25
"""Bound on such a layout's step-1 gradients (largest relative deviation of a norm or a sampled
entry): measured 8.2e-2 (tensorwise: e4m3/e5m2 rounding with other scales) and 1.6e-2
(rowwise); a doubled gradient deviates by 1."""


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


def layout_cases(
    layouts: dict[str, tuple[int, list[str], str]],
    config: str = "",
    rtols: dict[str, float] | None = None,
    grad_rtols: dict[str, float] | None = None,
) -> list[Case]:
    """A graph case and its eager twin per layout: (processes, args, one-process reference);
    ``rtols`` / ``grad_rtols``: another bound than ``CLOSE_RTOL`` / ``GRAD_RTOL`` for some
    layouts' graph cases."""
    cases = []
    for name, (nproc, args, reference) in layouts.items():
        rtol, grad_rtol = (rtols or {}).get(name, CLOSE_RTOL), (grad_rtols or {}).get(name, 0.0)
        cases.append(
            Case(f"{name}_graph", nproc, args, close_to=reference, rtol=rtol, grad_rtol=grad_rtol, config=config)
        )
        # Eager mode keeps every activation (it rejects a checkpointing mode a config may set); the
        # policy changes no value, so the graph case is still bitwise its eager twin.
        cases.append(
            Case(
                f"{name}_eager",
                nproc,
                [*args, "--compile.mode", "eager", "--activation_checkpoint.mode", "none"],
                same_as=f"{name}_graph",
                config=config,
            )
        )
    return cases


BUCKETING = {
    # case-name suffix: --compile.passes
    "tbb": "transformer_block_bucketing",
    "auto": "auto_bucketing",
    "tbb_auto": "transformer_block_bucketing,auto_bucketing",
}


def pass_cases(
    layouts: dict[str, tuple[int, list[str], str]],
    names: list[str],
    config: str = "",
    passes: dict[str, str] = BUCKETING,
) -> list[Case]:
    """For each named layout and pass list, a graph case bitwise the layout's graph without passes."""
    return [
        Case(
            f"{name}_{suffix}",
            layouts[name][0],
            [*layouts[name][1], "--compile.passes", pass_list],
            same_as=f"{name}_graph",
            config=config,
        )
        for name in names
        for suffix, pass_list in passes.items()
    ]


def batch(n: int) -> list[str]:
    return ["--training.local_batch_size", str(n)]


DEEPSEEK_DEBUG = "configs/deepseek_v3_debug.toml"
LLAMA3_DEBUG = "configs/llama3_debug.toml"
QWEN3_DEBUG = "configs/qwen3_debug.toml"
QWEN3_MOE_DEBUG = "configs/qwen3_moe_debug.toml"
SMALL_CPU_JOB = [
    "--job.device",
    "cpu",
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "2",
    "--metrics.enable_tensorboard",
    "False",
]
"""A debug model's small job on the CPU (gloo, whatever GPUs the machine has): 2 x 64-token
batches, no TensorBoard; a step takes well under a second. The cpu suite, the tests' jobs and
the fault injection loop all start from it."""


def debug_job(config: str = LLAMA3_DEBUG) -> list[str]:
    """``config`` (relative to the repository, or absolute) as a ``SMALL_CPU_JOB``."""
    return ["--job.config_file", os.path.join(ROOT, config), *SMALL_CPU_JOB]


INDUCTOR_FLAGS = ["--compile.backend", "inductor"]
INDUCTOR_FULL_FLAGS = [*INDUCTOR_FLAGS, "--compile.inductor_scope", "full"]


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


def ep_overlap_cases(
    layouts: dict[str, tuple[int, list[str], str]],
    plan: list[tuple[str, str, str]],
    config: str,
    rtol: float = CLOSE_RTOL,
    grad_rtol: float = 0.0,
) -> list[Case]:
    """Per (layout, selection, FSDP passes): the chunked reference (within ``rtol`` of the layout's
    reference, its step-1 gradients within ``grad_rtol``: 0 is ``GRAD_RTOL``) and the scheduled
    case bitwise equal to it."""
    cases = []
    for layout, selection, fsdp_passes in plan:
        nproc, args, reference = layouts[layout]
        passes = ",".join(p for p in ("ep_overlap", fsdp_passes) if p)
        short = {v: k for k, v in BUCKETING.items()}
        name = f"{layout}_ep_overlap_{selection}" + (f"_{short[fsdp_passes]}" if fsdp_passes else "")
        chunked = Case(
            f"{name}_chunked",
            nproc,
            [*args, *EP_OVERLAP[selection], "--compile.passes", passes, "--compile.ep_overlap.reorder", "False"],
            close_to=reference,
            rtol=rtol,
            grad_rtol=grad_rtol,
            config=config,
        )
        cases += [
            chunked,
            Case(
                name,
                nproc,
                [*args, *EP_OVERLAP[selection], "--compile.passes", passes],
                same_as=chunked.name,
                config=config,
            ),
        ]
    return cases


def ac_flags(mode: str) -> list[str]:
    return ["--activation_checkpoint.mode", mode]


def job_args(suite: Suite, case: Case, extra: list[str] = ()) -> list[str]:
    """train.py flags of a case: its config, the suite's overrides, ``extra``, its own args."""
    record = ["--debug.grad_record_step", str(GRAD_RECORD_STEP)] if suite.record_grads else []
    return [
        "--job.config_file",
        os.path.join(ROOT, case.config or suite.config),
        *suite.overrides,
        "--training.steps",
        str(suite.steps),
        *record,
        *extra,
        *case.args,
    ]
