"""The gpu suite: ONE GPU, one process per case: numerics on the debug models, speed and memory on real shapes."""

from __future__ import annotations

from suites.cases import (
    DEEPSEEK_DEBUG,
    INDUCTOR_FLAGS,
    Case,
    ac_flags,
    batch,
)

# ---- gpu: ONE GPU, one process per case. Numerics: graph vs eager and run-to-run, bitwise, on
# the debug models; on CUDA that holds only with deterministic kernels (the attention backward
# is not run-to-run deterministic otherwise). Speed and memory: real flavors cut to a few layers,
# bf16 compute with fp32 master weights; the table shows their tok/s, MFU and peak memory.
_DETERMINISTIC = ["--debug.deterministic", "True"]
_REAL_SHAPES = [
    "--training.mixed_precision_param",
    "bfloat16",
    "--training.warmup_steps",
    "2",
    "--metrics.log_freq",
    "1",
]


def _bitwise_cases(name: str, config: str) -> list[Case]:
    graph = Case(f"{name}_graph", 1, _DETERMINISTIC, config=config)
    return [
        graph,
        Case(f"{name}_eager", 1, [*_DETERMINISTIC, "--compile.mode", "eager"], same_as=graph.name, config=config),
        Case(f"{name}_graph_again", 1, _DETERMINISTIC, same_as=graph.name, config=config),
    ]


GPU_CASES = (
    _bitwise_cases("llama3_debug", "configs/llama3_debug.toml")
    + _bitwise_cases("deepseek_debug", DEEPSEEK_DEBUG)
    # each memory policy on a real 8B block: peak memory and tok/s (the configs' 8 loss chunks)
    + [
        Case(
            f"llama3_8b_4layers_bf16_ac_{mode}",
            1,
            ["--model.n_layers", "4", "--training.seq_len", "8192", *batch(1), *_REAL_SHAPES, *ac_flags(mode)],
            config="configs/llama3_8b.toml",
        )
        for mode in ("none", "selective", "full")
    ]
    + [
        Case(
            "deepseek16b_4layers_bf16",
            1,
            ["--model.n_layers", "4", "--training.seq_len", "4096", *batch(2), "--parallelism.ep", "1", *_REAL_SHAPES],
            config="configs/deepseek_v3_16b.toml",
        )
    ]
    # the backends on the same shapes (the configs' memory policy): tok/s, MFU, peak memory, first step
    + [
        Case(
            f"llama3_8b_4layers_bf16_inductor_{scope}",
            1,
            [
                "--model.n_layers",
                "4",
                "--training.seq_len",
                "8192",
                *batch(1),
                *_REAL_SHAPES,
                *INDUCTOR_FLAGS,
                "--compile.inductor_scope",
                scope,
            ],
            config="configs/llama3_8b.toml",
        )
        for scope in ("regional", "full")
    ]
    + [
        Case(
            f"deepseek16b_4layers_bf16_inductor_{scope}",
            1,
            [
                "--model.n_layers",
                "4",
                "--training.seq_len",
                "4096",
                *batch(2),
                "--parallelism.ep",
                "1",
                *_REAL_SHAPES,
                *INDUCTOR_FLAGS,
                "--compile.inductor_scope",
                scope,
            ],
            config="configs/deepseek_v3_16b.toml",
        )
        for scope in ("regional", "full")
    ]
)
